"""Multi-node training through Ray: one process per node of a Lightning DDP run, placed and watched by Ray.

A stage such as ``train_fr@real`` runs on N nodes as N copies of its own command (``faceops stage NAME``), one per
node, each told its place the way Lightning reads it for a multi-node run: ``NODE_RANK``, and rank 0's
``MASTER_ADDR`` and ``MASTER_PORT``. Lightning then starts ``fr.devices`` processes on each node and joins them
into one DDP group (NCCL on GPUs, gloo on CPUs). Ray supplies what typing that on each node by hand did not:

- **placement**: a placement group of N bundles (``cpus`` and ``gpus`` each), ``STRICT_SPREAD`` over N machines
  (``pack=True`` puts them on one machine: a single-machine check of the launch, as the tests do);
- **rank 0's address**: the node of bundle 0 reports its IP and a free port before the others start;
- **watching**: the launcher waits for every node; a node whose command fails, or whose Ray worker dies (a machine
  lost), stops the others at once (their process groups are terminated, never left blocked in a collective) and
  :class:`LaunchError` names the node, its address and the end of its log.

Every node runs the command in ``root`` (the same path on every machine: the image's checkout, with the same
``params.yaml`` and the data pulled by DVC), with ``params.yaml``'s ``fr.num_nodes`` equal to N. Each node's output
goes to ``logs/launch/<stage>-node<k>.log`` under ``root`` on that node. A Ray cluster is joined at ``address``
(``RAY_ADDRESS``, ``ray://host:10001``, or ``auto`` on a cluster node); without one a local Ray instance starts.

The Prefect flow ``launch`` (``flows/launch.py``) and ``faceops launch`` call :func:`launch`. :func:`fan_out` runs
independent commands the same way, placed wherever they fit and watched alike: the sweep's trial workers
(``faceops sweep --ray``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ml.errors import ConfigError, FaceopsError

log = logging.getLogger(__name__)

__all__ = ["LaunchError", "NodeResult", "fan_out", "launch", "live_machines", "node_command"]

LOG_DIR = "logs/launch"
TAIL_LINES = 20
# environment a node's command must not inherit from the launcher: it would pin the wrong rank or world
_RANK_VARS = ("NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT")


class LaunchError(FaceopsError):
    """A multi-node launch that could not start or whose node failed; the message names the node."""


@dataclass(frozen=True)
class NodeResult:
    """What one node's command did: its rank, its machine's address, exit status, wall seconds and log file."""

    rank: int
    address: str
    returncode: int
    seconds: float
    log: str


def node_command(stage: str) -> list[str]:
    """The command each node runs: the stage's own code, as ``dvc.yaml``'s cmd does."""
    return [sys.executable, "-m", "faceops.cli", "stage", stage]


class _Node:
    """One node of the launch, a Ray actor in its bundle: reports its address, runs the command in its own process
    group, and terminates that group when asked (from a second thread: ``max_concurrency=2``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:  # a port free now on this machine, for rank 0's rendezvous
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, cmd: list[str], env: dict[str, str], cwd: str, log_file: str) -> tuple[int, float, list[str]]:
        import ray

        path = Path(cwd) / log_file
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        full_env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
        full_env.update(env)
        with path.open("w") as out:
            out.write(f"# {ray.util.get_node_ip_address()}: {shlex.join(cmd)}\n")
            out.flush()
            self._proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            code = self._proc.wait()
        lines = path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return code, time.perf_counter() - start, lines

    def terminate(self, grace: float = 10.0) -> None:
        """SIGTERM the command's process group (Lightning's node processes with it), SIGKILL after ``grace``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


MULTINODE_STAGES = {"train_fr": "fr"}  # stage → params section whose num_nodes it reads; the other models fit one GPU


def _check_params(root: Path, stage: str, nodes: int) -> None:
    from tasks.common import load_params

    base = stage.split("@", 1)[0]
    if base not in MULTINODE_STAGES:
        raise ConfigError(f"{stage}: only {', '.join(sorted(MULTINODE_STAGES))} trains across nodes (the other "
                          "trainers' models fit one GPU); run it with `faceops run --stage` or `faceops stage`")
    section = MULTINODE_STAGES[base]
    params = load_params(root / "params.yaml")
    found = int(params.get(section, {}).get("num_nodes", 1))
    if found != nodes:
        raise ConfigError(f"{root / 'params.yaml'}: {section}.num_nodes is {found} but the launch has {nodes} nodes; "
                          f"set {section}.num_nodes: {nodes} (and {section}.strategy: ddp) in the params.yaml every "
                          "node reads")


def _connect(address: str | None, cpus: float, nodes: int) -> bool:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), or start a local one → whether this call did."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address is None:  # a local instance with room for every node's bundle
        kwargs["num_cpus"] = max(int(cpus * nodes), os.cpu_count() or 1)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise LaunchError(f"cannot reach the Ray cluster at {address!r} ({exc}); start it (`ray start --head` on "
                          "the head node) or pass its address (RAY_ADDRESS, ray://HOST:10001)") from exc
    return True


def _wait_placed(group: Any, nodes: int, cpus: float, gpus: float, strategy: str, timeout: float) -> None:
    import ray

    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        where = {"PACK": "one machine", "STRICT_SPREAD": f"{nodes} different machines"}.get(strategy, "the cluster")
        raise LaunchError(f"Ray could not place {nodes} nodes of {cpus:g} CPUs and {gpus:g} GPUs on {where} within "
                          f"{timeout:.0f} s: the cluster has {len(live_machines())} live machine(s) with "
                          f"{ray.cluster_resources()}; add machines, ask for less"
                          + (", or pass --pack to use one machine" if strategy == "STRICT_SPREAD" else "")) from None


def live_machines() -> list[str]:
    """The addresses of the Ray cluster's live machines (Ray connected)."""
    import ray

    return [n.get("NodeManagerAddress", "?") for n in ray.nodes() if n.get("Alive")]


@contextlib.contextmanager
def _placed(nodes: int, *, address: str | None, cpus: float, gpus: float, strategy: str, place_timeout: float,
            machine_local: Sequence[str] = ()) -> Iterator[tuple[list[Any], list[tuple[str, int]]]]:
    """``nodes`` :class:`_Node` actors in a placement group of one bundle each (``strategy``: ``PACK``,
    ``STRICT_SPREAD`` or ``SPREAD``) → (the actors, each one's (IP, free port)); a cluster of several machines is
    refused when ``machine_local`` names something only this machine can reach. Everything is released on exit
    (and a Ray instance this call started, shut down)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = _connect(address, cpus, nodes)
    group = None
    actors: list[Any] = []
    try:
        machines = live_machines()
        if machine_local and len(machines) > 1:
            raise LaunchError(f"the Ray cluster has {len(machines)} machines ({', '.join(machines)}) but "
                              f"{' and '.join(machine_local)} only this machine can reach; use a server both can "
                              "reach, or a single-machine Ray instance")
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        group = placement_group([dict(bundle) for _ in range(nodes)], strategy=strategy)
        _wait_placed(group, nodes, cpus, gpus, strategy, place_timeout)
        node_cls = ray.remote(max_concurrency=2)(_Node)
        actors = [node_cls.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=k)).remote() for k in range(nodes)]
        yield actors, ray.get([a.address.remote() for a in actors])
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if started:
            ray.shutdown()


def launch(stage: str, nodes: int, *, root: str | os.PathLike = ".", address: str | None = None, cpus: float = 1,
           gpus: float = 0, pack: bool = False, env: dict[str, str] | None = None, timeout: float | None = None,
           place_timeout: float = 120.0) -> list[NodeResult]:
    """Run ``faceops stage <stage>`` on ``nodes`` Ray nodes as one multi-node DDP job (module docstring) → each
    node's result, rank 0 first. Raises :class:`LaunchError` naming the first node that failed (the others are
    stopped) or, past ``timeout`` seconds, the nodes still running."""
    if nodes < 1:
        raise ConfigError(f"nodes must be ≥ 1, got {nodes}")
    root = Path(root).resolve()
    _check_params(root, stage, nodes)
    with _placed(nodes, address=address, cpus=cpus, gpus=gpus, strategy="PACK" if pack else "STRICT_SPREAD",
                 place_timeout=place_timeout) as (actors, places):
        addresses = [ip for ip, _ in places]
        master, port = places[0]
        base = {**(env or {}), "MASTER_ADDR": master, "MASTER_PORT": str(port)}
        log.info("launching %s on %d nodes (rank 0 at %s:%d)", stage, nodes, master, port)
        logs = [f"{LOG_DIR}/{stage.replace('@', '-')}-node{k}.log" for k in range(nodes)]
        refs = [a.run.remote(node_command(stage), {**base, "NODE_RANK": str(k)}, str(root), logs[k])
                for k, a in enumerate(actors)]
        return _watch(refs, actors, addresses, logs, timeout)


def fan_out(name: str, commands: Sequence[Sequence[str]], *, root: str | os.PathLike = ".",
            address: str | None = None, cpus: float = 1, gpus: float = 0, env: dict[str, str] | None = None,
            timeout: float | None = None, place_timeout: float = 120.0,
            machine_local: Sequence[str] = ()) -> list[NodeResult]:
    """Run independent ``commands`` at once, one per Ray worker of ``cpus`` CPUs and ``gpus`` GPUs, spread over the
    cluster's machines where they fit (``SPREAD``), each in ``root`` with ``env`` added → each worker's result, in
    order. Watched as :func:`launch` watches its nodes: the first worker that fails (or is lost, or outlives
    ``timeout``) stops the others and is named in the :class:`LaunchError`. Logs: ``logs/launch/<name>-node<k>.log``.
    ``machine_local`` names what the commands need that only this machine can reach (a SQLite file, a local MLflow
    store): with it, a cluster of several machines is refused before anything starts."""
    if not commands:
        raise ConfigError("fan_out needs at least one command")
    root = Path(root).resolve()
    with _placed(len(commands), address=address, cpus=cpus, gpus=gpus, strategy="SPREAD",
                 place_timeout=place_timeout, machine_local=machine_local) as (actors, places):
        addresses = [ip for ip, _ in places]
        log.info("%s: %d workers on %s", name, len(commands), ", ".join(sorted(set(addresses))))
        logs = [f"{LOG_DIR}/{name}-node{k}.log" for k in range(len(commands))]
        refs = [a.run.remote(list(cmd), dict(env or {}), str(root), logs[k])
                for k, (a, cmd) in enumerate(zip(actors, commands))]
        return _watch(refs, actors, addresses, logs, timeout)


def _watch(refs: Sequence[Any], actors: Sequence[Any], addresses: Sequence[str], logs: Sequence[str],
           timeout: float | None) -> list[NodeResult]:
    """Wait for every node; on the first failure (or the timeout) terminate the others and raise naming it."""
    import ray

    results: dict[int, NodeResult] = {}
    pending = {ref: k for k, ref in enumerate(refs)}
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: str | None = None
    while pending and failure is None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not done:
            failure = (f"nodes {sorted(pending.values())} still running after {timeout:.0f} s; stopped them (see "
                       f"{', '.join(logs[k] for k in sorted(pending.values()))})")
            break
        k = pending.pop(done[0])
        try:
            code, seconds, tail = ray.get(done[0])
        except ray.exceptions.RayError as exc:  # the node's Ray worker or machine is gone
            failure = f"node {k} ({addresses[k]}) was lost: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            break
        results[k] = NodeResult(k, addresses[k], code, seconds, logs[k])
        if code != 0:
            failure = (f"node {k} ({addresses[k]}) exited with status {code}; the end of {logs[k]}:\n  "
                       + "\n  ".join(tail))
    if failure is not None:
        # nodes that end within moments of the first are part of the same failure (a peer's collective breaks when
        # a node goes): name them too, then stop the rest
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=5.0) if pending else ([], [])
        also = []
        for ref in done:
            k = pending.pop(ref)
            try:
                code = ray.get(ref)[0]
                also.append(f"node {k} ({addresses[k]}) exited with status {code}")
            except ray.exceptions.RayError:
                also.append(f"node {k} ({addresses[k]}) was lost")
        for k in pending.values():
            with contextlib.suppress(Exception):
                ray.get(actors[k].terminate.remote(), timeout=30)
        stopped = [f"node {k} ({addresses[k]})" for k in sorted(pending.values())]
        raise LaunchError(failure + "".join(f"\nthen {a}" for a in also)
                          + (f"\nstopped: {', '.join(stopped)}" if stopped else ""))
    return [results[k] for k in range(len(refs))]
