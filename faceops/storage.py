"""``faceops data``: datasets, models and reports on any S3-compatible endpoint, and the same bucket as DVC remote
and MLflow artifact store. The work is in ``tasks/storage.py``; boto3 is imported inside the commands."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from tasks.storage import StorageConfig, Transfer

app = typer.Typer(
    name="data",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    help=(
        "Publish and fetch datasets, models and reports on S3 (AWS, MinIO or any S3-compatible endpoint).\n\n"
        "Configured by the `storage:` section of `params.yaml` (bucket, prefix, endpoint_url, retries, multipart "
        "sizes). Credentials come from the environment only: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` "
        "(`AWS_SESSION_TOKEN`, or `AWS_PROFILE`); `AWS_ENDPOINT_URL` when `storage.endpoint_url` is empty.\n\n"
        "Examples:\n\n"
        "* `faceops data push` — every dataset under `data/` to `s3://BUCKET/PREFIX/datasets/NAME/DIGEST/`\n\n"
        "* `faceops data pull train` — the latest published `train` into `data/prepared/train` (identical files skipped)\n\n"
        "* `faceops data pull train --digest 3f2a9c --to /scratch/train` — one version, elsewhere\n\n"
        "* `faceops data publish models/fr/real reports/benchmark.md metrics plots` — a model and a run's reports\n\n"
        "* `faceops data ls` — what is published\n\n"
        "* `faceops data remote` — the same bucket as DVC remote (then `dvc push`) and MLflow artifact store"
    ),
)


def _fail(message: str, code: int = 2) -> None:
    from faceops.cli import _fail as fail

    fail(message, code)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """One clear line for a faceops error: exit 1 for a storage failure, 2 for bad input."""
    from ml.errors import FaceopsError
    from tasks.storage import StorageError

    try:
        yield
    except StorageError as exc:
        _fail(str(exc), code=1)
    except FaceopsError as exc:
        _fail(str(exc))


def _config() -> tuple[Path, StorageConfig]:
    root = Path.cwd()
    if not (root / "params.yaml").is_file():
        _fail(f"no params.yaml in {root}: run faceops data from the repository root.")
    from tasks.common import load_params
    from tasks.storage import storage_config

    with _errors():
        cfg = storage_config(load_params(root / "params.yaml"))
    return root, cfg


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""  # pragma: no cover


def _summary(t: Transfer, verb: str) -> str:
    if t.transferred == 0:
        return f"{t.files} files, all identical already"
    return f"{t.files} files, {t.transferred} {verb} ({_size(t.bytes)}), {t.skipped} identical already"


Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="progress bar for transfers of many files")]


@app.callback()
def _options(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log each transfer and every retry")] = False
             ) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("tasks.storage").setLevel(logging.INFO)
        logging.getLogger("botocore.retries").setLevel(logging.DEBUG)  # "Retry needed, retrying request after ..."


@app.command("push")
def push(
    names: Annotated[Optional[list[str]], typer.Argument(help="dataset names (default: all), e.g. `train synthetic`")] = None,
    progress: Progress = True,
) -> None:
    """Publish datasets addressed by their content digest: `s3://BUCKET/PREFIX/datasets/NAME/DIGEST/`.

    Datasets are `data/prepared/NAME`, `data/synthetic` and `data/aligned`; the digest is `dataset.json`'s (checked
    against the content first). `datasets/NAME/LATEST` then names the pushed version. A version already published
    is not uploaded again.
    """
    root, cfg = _config()
    from tasks.common import Paths
    from tasks.storage import S3Store, local_datasets, push_dataset

    found = local_datasets(Paths(root))
    unknown = [n for n in names or [] if n not in found]
    if not found:
        _fail("no datasets under data/: run `faceops run` (or `dvc repro prepare`) first.")
    if unknown:
        _fail(f"no dataset {', '.join(map(repr, unknown))} here. Datasets: {', '.join(found)}.")
    with _errors():
        store = S3Store(cfg)
        for name in names or found:
            digest, transfer = push_dataset(store, name, found[name], progress=progress)
            typer.echo(f"{name:<13} {digest[:12]}  {transfer.uri}/  {_summary(transfer, 'uploaded')}")


@app.command("pull")
def pull(
    name: Annotated[str, typer.Argument(help="dataset name, e.g. `train`; or a published directory, e.g. "
                                             "`models/fr/real/0123abcd4567`")],
    digest: Annotated[Optional[str], typer.Option(help="dataset version: its digest or a unique prefix (default: LATEST)")] = None,
    to: Annotated[Optional[Path], typer.Option(help="destination (default: the dataset's place, e.g. `data/prepared/train`)")] = None,
    progress: Progress = True,
) -> None:
    """Fetch a published dataset (or any published directory) and verify every file's sha256 and size.

    Files already identical locally are skipped; each download lands in a temporary file and is renamed into
    place only when it matches, so an interrupted or corrupt pull leaves nothing half-written.
    """
    root, cfg = _config()
    from tasks.common import Paths
    from tasks.storage import S3Store, dataset_home, pull_dataset

    if "/" in name and (to is None or digest):
        _fail(f"pulling the published directory '{name}' needs --to DIR (and takes no --digest).")
    with _errors():
        store = S3Store(cfg)
        if "/" in name:
            transfer = store.pull_dir(name.strip("/"), to, progress=progress)
            typer.echo(f"{transfer.uri}/ → {to}  {_summary(transfer, 'downloaded')}")
            return
        dest = to or dataset_home(Paths(root), name)
        digest, transfer = pull_dataset(store, name, dest, digest=digest, progress=progress)
        typer.echo(f"{name} {digest[:12]} → {dest}  {_summary(transfer, 'downloaded')}")


@app.command("publish")
def publish(
    paths: Annotated[list[Path], typer.Argument(help="model directories under `models/` and report files or "
                                                     "directories, e.g. `reports/benchmark.md metrics plots`")],
    run: Annotated[Optional[str], typer.Option("--id", help="file under this id (default: the git commit, with "
                                                            "`-dirty-TIME` for uncommitted changes)")] = None,
    progress: Progress = True,
) -> None:
    """Publish models to `PREFIX/models/PATH/ID/` and reports together to `PREFIX/reports/ID/`.

    A path below `models/` is one model (a directory with `config.json`) or all models below it; anything else
    (`reports/benchmark.md`, `metrics/`, `plots/`) goes into the run's report under its repository path.
    """
    root, cfg = _config()
    from tasks.storage import S3Store, publish as publish_paths, run_id

    with _errors():
        store = S3Store(cfg)
        for transfer in publish_paths(store, root, paths, run=run or run_id(root), progress=progress):
            typer.echo(f"{transfer.uri}/  {_summary(transfer, 'uploaded')}")


@app.command("ls")
def ls() -> None:
    """List what is published: dataset versions (LATEST marked), models and reports, with sizes."""
    _, cfg = _config()
    from tasks.storage import S3Store, catalog

    with _errors():
        store = S3Store(cfg)
        entries = catalog(store)
    typer.echo(f"{store.uri()}  at {store.endpoint}")
    for kind in ("datasets", "models", "reports"):
        rows = [e for e in entries if e.kind == kind]
        typer.secho(kind.capitalize(), bold=True)
        for e in rows:
            name, version = (e.name, e.version[:12] if kind == "datasets" else e.version) if e.name else (e.version, "")
            typer.echo(f"  {name:<22} {version:<34} {e.files:>6} files {_size(e.bytes):>9}  "
                       f"{e.modified:%Y-%m-%d %H:%M}{'  LATEST' if e.latest else ''}")
        if not rows:
            typer.echo("  (none)")


@app.command("remote")
def remote(
    name: Annotated[str, typer.Option(help="DVC remote name")] = "faceops",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the dvc commands instead of running them")] = False,
) -> None:
    """Use the same bucket as DVC remote (`PREFIX/dvc`) and MLflow artifact store (`PREFIX/mlflow`).

    The DVC remote goes into `.dvc/config.local` (`dvc remote add --local --default`, plus `endpointurl` for
    MinIO), which is not committed: nothing machine-specific or secret lands in git, and DVC reads the credentials
    from the same AWS_* environment. Then `dvc push` / `dvc pull`. For MLflow it prints the server flags.
    """
    root, cfg = _config()
    from tasks.storage import configure_dvc_remote, dvc_remote_commands, mlflow_artifacts

    with _errors():
        commands = dvc_remote_commands(cfg, name) if dry_run else configure_dvc_remote(cfg, root, name)
        destination, env = mlflow_artifacts(cfg)
    typer.echo("DVC remote (.dvc/config.local):" if not dry_run else "DVC remote, to run:")
    for args in commands:
        typer.echo(f"  dvc {' '.join(args)}")
    typer.echo("MLflow artifact store on the same bucket:")
    prefix = "".join(f"{key}={value} " for key, value in env.items())
    typer.echo(f"  {prefix}mlflow server --backend-store-uri sqlite:///{root / 'mlflow.db'} "
               f"--artifacts-destination {destination}")
