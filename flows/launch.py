"""The ``launch`` flow: one stage as a multi-node DDP job placed and watched by Ray (``ops.launch``).

One Prefect task starts the job and waits for every node; the flow run fails, naming the node, when a node's command
fails or its machine is lost (the other nodes are stopped first). A deployment of this flow on any work pool (the
flow itself needs no GPU: the nodes are Ray's) is how a scheduled or UI-started run trains on N machines::

    faceops launch train_fr@real --nodes 2 --address ray://head:10001      # the same from a terminal
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ops import launch as ln


@task(task_run_name="launch-{stage}-on-{nodes}-nodes", cache_policy=NO_CACHE)
def run_nodes(stage: str, nodes: int, root: str, address: str | None, cpus: float, gpus: float, pack: bool,
              timeout: float | None) -> list[dict[str, Any]]:
    results = ln.launch(stage, nodes, root=root, address=address, cpus=cpus, gpus=gpus, pack=pack, timeout=timeout)
    logger = get_run_logger()
    for r in results:
        logger.info("node %d (%s): exit %d in %.0f s, log %s", r.rank, r.address, r.returncode, r.seconds, r.log)
    return [dataclasses.asdict(r) for r in results]


@flow(name="launch", log_prints=True)
def launch_flow(stage: str = "train_fr@real", nodes: int = 2, root: str = ".", address: str | None = None,
                cpus: float = 1, gpus: float = 0, pack: bool = False, timeout: float | None = None
                ) -> list[dict[str, Any]]:
    """Run ``faceops stage STAGE`` on ``nodes`` Ray nodes as one DDP job; ``params.yaml`` must say
    ``fr.num_nodes: NODES`` (checked before anything starts). ``address``: the Ray cluster (default
    ``RAY_ADDRESS``, else a local instance); ``cpus``/``gpus``: each node's bundle; ``pack``: all nodes on one
    machine (a single-machine check)."""
    return run_nodes(stage, nodes, root, address, cpus, gpus, pack, timeout)
