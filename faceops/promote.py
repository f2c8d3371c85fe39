"""``faceops promote``: model-registry promotion from the command line (registered in ``faceops/cli.py``).

The command runs the Prefect flow ``promote`` (``flows/promote.py``); heavy imports happen inside it, so
``faceops --help`` stays instant.
"""

from __future__ import annotations

from typing import Annotated

import typer

from faceops.console import fail, quiet_env, refusals_without_traceback, repo_root


def promote_cmd(
    model: Annotated[str, typer.Argument(
        help="registered model: `fr`, `fusion`, `aligner`, `generator`, `discovery` (or `faceops-fr`, ...)",
    )] = "faceops-fr",
    rollback: Annotated[bool, typer.Option(
        "--rollback", help="move `@champion` back to `@previous` instead of judging a candidate")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="evaluate and print the decision, write nothing (no aliases, tags or runs)")] = False,
    candidate: Annotated[str, typer.Option(
        "--candidate", help="alias of the version to judge, e.g. `candidate-synthetic`")] = "candidate",
) -> None:
    """Promote a registered model's `@candidate` to `@champion` when it passes its gate (`promote:` in `params.yaml`).

    Candidate and champion are evaluated on the same benchmarks (`data/prepared`); the gate asks that the **primary**
    metric improve by `min_improvement`, that no **guard** metric regress by more than its tolerance, and that every
    **floor** hold. A first candidate (no champion yet) is promoted when it passes the floors. On promotion the old
    champion becomes `@previous`. Every decision is printed as a table of both models' numbers and each rule, and
    recorded as tags on the candidate version (`promotion.decision`, `promotion.summary`), a `promote` MLflow run
    and a Prefect artifact.

    Examples:

    * `faceops promote` — judge `faceops-fr@candidate` against `faceops-fr@champion`

    * `faceops promote aligner --dry-run` — see what the aligner's gate would decide, change nothing

    * `faceops promote fr --candidate candidate-synthetic` — judge the FR model trained on synthetic faces

    * `faceops promote fr --rollback` — undo the last promotion (`@champion` ← `@previous`; once)

    * `faceops run --set promote.fr.min_improvement=0.01` — change a gate (any `promote.*` key)

    Exit status: **0** when a decision was made — a rejected candidate is a normal outcome, and the table says which
    rule failed; **2** on an error (a gate naming a metric its benchmarks do not produce, an unreachable tracking
    server, nothing to promote or roll back), with nothing half-written in the registry.
    """
    from ml.errors import FaceopsError

    root = repo_root()
    quiet_env()
    refusals_without_traceback()
    from mlflow.exceptions import MlflowException

    from flows.promote import promote_flow

    try:
        result = promote_flow(model=model, rollback=rollback, root=str(root), candidate=candidate, dry_run=dry_run)
    except (FaceopsError, MlflowException) as exc:
        fail(str(exc))
    typer.echo("")
    typer.echo(result["markdown"])
    colour = {"promoted": typer.colors.GREEN, "rolled_back": typer.colors.GREEN, "rejected": typer.colors.YELLOW}
    typer.secho(result["headline"], fg=colour.get(result["decision"]), bold=True)
    if result["decision"] == "rejected" and not dry_run:
        typer.echo("(a rejection is a normal outcome: the registry is unchanged apart from the decision tags)")
