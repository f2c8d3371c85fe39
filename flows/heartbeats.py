"""Flow runs whose process died are marked Crashed: a Prefect automation on missing flow-run heartbeats.

A process worker starts each flow run as its own process in its own session. If the worker alone dies, the flow
run goes on and reports its own final state. If the flow-run process dies with it (the machine, the container or
the pod is lost, an OOM kill), nothing is left to report: Prefect's server keeps the run ``Running`` for ever and
its retries never start. Every flow run emits a ``prefect.flow-run.heartbeat`` event every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (Prefect's default: 180); the automation installed here moves a
flow run that has started (or sent a heartbeat) and then sent neither a heartbeat nor a final state within
``within_s`` seconds to ``Crashed``, naming the silence. ``within_s`` must exceed the heartbeat frequency by a margin
(default 600 s for the default 180 s). Every flow run, on a worker or in-process, sends heartbeats unless they are
switched off: with ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` set to none, do not install the automation (it would
crash healthy runs longer than ``within_s``).

Install it once per Prefect server: ``python -m flows.heartbeats`` with ``PREFECT_API_URL`` set (idempotent:
an automation of the same name is replaced).
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

AUTOMATION_NAME = "faceops: crash flow runs without heartbeats"
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
DEFAULT_WITHIN_S = 600.0
# a heartbeat or any of these ends the wait for the next heartbeat
_ALIVE_OR_FINAL = ("prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                   "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed", "prefect.flow-run.Cancelling")


def crash_automation(within_s: float = DEFAULT_WITHIN_S) -> Any:
    """The automation (``AutomationCore``): a proactive trigger per flow run on a missing heartbeat, whose action
    sets the run ``Crashed``."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    if within_s < 30:
        raise ValueError(f"within_s={within_s}: must be at least 30 s (Prefect's smallest heartbeat interval)")
    # armed by the run's start as well as by each heartbeat: a process killed before its first heartbeat reached the
    # server is caught too
    trigger = EventTrigger(
        after={"prefect.flow-run.Running", "prefect.flow-run.heartbeat"}, expect=set(_ALIVE_OR_FINAL),
        for_each={"prefect.resource.id"},
        match={"prefect.resource.id": "prefect.flow-run.*"}, posture=Posture.Proactive, threshold=1,
        within=dt.timedelta(seconds=within_s))
    message = (f"no heartbeat from the flow run for {within_s:.0f} s: its process (and its worker) died; marked "
               "Crashed by the faceops heartbeat automation (flows/heartbeats.py)")
    return AutomationCore(name=AUTOMATION_NAME, description=__doc__.splitlines()[0], trigger=trigger,
                          actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)])


def ensure_crash_detection(within_s: float = DEFAULT_WITHIN_S) -> str:
    """Install the automation on the server at ``PREFECT_API_URL`` (replacing one of the same name); → its id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(old.id)
        return str(client.create_automation(crash_automation(within_s)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.heartbeats", description=__doc__.splitlines()[0])
    parser.add_argument("--within", type=float, default=DEFAULT_WITHIN_S,
                        help=f"seconds of silence before a run is Crashed (> {HEARTBEAT_ENV}; default %(default)s)")
    args = parser.parse_args(argv)
    print(f"installed automation {ensure_crash_detection(args.within)} '{AUTOMATION_NAME}'")


if __name__ == "__main__":
    main()
