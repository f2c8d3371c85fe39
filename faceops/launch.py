"""``faceops launch STAGE --nodes N``: one stage as a multi-node DDP job through Ray, as the Prefect flow ``launch``
(``flows/launch.py``; the work is in ``ops.launch``). Registered in ``faceops/cli.py``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from faceops.console import fail, quiet_env, repo_root


def launch_command(
    stage: Annotated[str, typer.Argument(help="the stage to run on every node, e.g. `train_fr@real`")],
    nodes: Annotated[int, typer.Option(help="machines; params.yaml's fr.num_nodes must say the same")] = 2,
    address: Annotated[Optional[str], typer.Option(
        help="the Ray cluster: `ray://HEAD:10001`, or `auto` on a cluster machine; default $RAY_ADDRESS, else a "
             "local Ray instance on this machine")] = None,
    cpus: Annotated[float, typer.Option(help="CPUs each node reserves")] = 1,
    gpus: Annotated[float, typer.Option(help="GPUs each node reserves (= fr.devices on GPU machines)")] = 0,
    pack: Annotated[bool, typer.Option(
        "--pack", help="put every node on one machine (a check of the launch on a single machine)")] = False,
    timeout: Annotated[Optional[float], typer.Option(help="seconds before the nodes still running are stopped")] = None,
) -> None:
    """Train on several machines: run `faceops stage STAGE` on NODES Ray nodes as one Lightning DDP job.

    Ray places one node per machine (a placement group, STRICT_SPREAD), tells each its NODE_RANK and rank 0's
    address and port, and watches them: a node that fails or whose machine is lost stops the others, and the error
    names it. Every machine needs the repository at the same path with the same params.yaml (fr.num_nodes: NODES,
    fr.strategy: ddp, fr.devices: GPUs per machine) and the data (`faceops data pull`). Each node's output is in
    logs/launch/STAGE-nodeK.log on its machine.

    Examples:

    * `faceops launch train_fr@real --nodes 2 --gpus 8 --address ray://head:10001` — two 8-GPU machines

    * `faceops launch train_fr@real --nodes 2 --pack` — two "nodes" on this machine (gloo on CPUs)
    """
    from ml.errors import FaceopsError

    root = repo_root()
    quiet_env()
    from flows.launch import launch_flow

    try:
        results = launch_flow(stage=stage, nodes=nodes, root=str(root), address=address, cpus=cpus, gpus=gpus,
                              pack=pack, timeout=timeout)
    except FaceopsError as exc:
        fail(str(exc))
    for r in results:
        typer.echo(f"node {r['rank']} ({r['address']}): exit {r['returncode']} in {r['seconds']:.0f} s — {r['log']}")
