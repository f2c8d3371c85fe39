"""``faceops data``: the ``storage`` bucket as DVC remote and MLflow artifact store (the work is in ``ops/remote.py``).

Datasets, models and reports are DVC outputs, so they travel with ``dvc push`` / ``dvc pull`` / ``dvc get``; these
commands configure the remote from ``params.yaml``, give DVC the AWS SDK's retry settings, and turn a failure into
one message. Models are published by name through the MLflow registry: ``faceops promote``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from faceops.console import fail as _fail

if TYPE_CHECKING:
    from ops.remote import StorageConfig

app = typer.Typer(
    name="data",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    help=(
        "Push and pull the pipeline's datasets, models and reports: DVC's remote on S3 (AWS, MinIO or any "
        "S3-compatible endpoint), the same bucket as MLflow's artifact store.\n\n"
        "Configured by the `storage:` section of `params.yaml` (bucket, prefix, endpoint_url, retries, timeouts). "
        "Credentials come from the environment only: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` "
        "(`AWS_SESSION_TOKEN`, or `AWS_PROFILE`); `AWS_ENDPOINT_URL` when `storage.endpoint_url` is empty. "
        "TARGETS are DVC's: a stage (`prepare`, `train_fr@real`) or a tracked path (`data/prepared/train`, "
        "`models/fr/real`); none means everything in `dvc.lock`.\n\n"
        "Examples:\n\n"
        "* `faceops data push` — every output not yet on the remote (content-addressed: nothing goes up twice)\n\n"
        "* `faceops data pull data/prepared/train` — one dataset into the workspace, every file's hash checked\n\n"
        "* `faceops data pull models/fr/real --rev v1.2 --to /scratch/fr` — the version a git revision recorded\n\n"
        "* `faceops data ls` — what is versioned, its hash and size, and whether the remote holds it\n\n"
        "* `faceops data remote` — write the remote to `.dvc/config.local`; print the MLflow server flags\n\n"
        "* `faceops promote` — publish a model by name (the MLflow registry, artifacts on the same bucket)\n\n"
        "* `faceops data shard /data/casia/train.rec /data/casia-shards` — a RecordIO as WebDataset shards, its "
        "JPEGs kept as they are\n\n"
        "* `faceops data export /data/casia-shards look --limit 200` — faces of a shard set as image files\n\n"
        "* `faceops data export data/prepared/train look` — a prepared dataset's faces as "
        "`look/images/<identity>/<n>.png`"
    ),
)

Targets = Annotated[Optional[list[str]], typer.Argument(help="DVC targets: stages or tracked paths (default: all)")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="DVC's debug log: each object it checks and moves")]


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """One clear line for a faceops error: exit 1 for a transfer that failed, 2 for bad input."""
    from ml.errors import FaceopsError
    from ops.remote import StorageError

    try:
        yield
    except StorageError as exc:
        _fail(str(exc), code=1)
    except FaceopsError as exc:
        _fail(str(exc))


def _config(*, remote: bool = True) -> tuple[Path, StorageConfig]:
    """The repository root and its storage section; with ``remote``, the DVC remote (re)written from it first."""
    root = Path.cwd()
    if not (root / "params.yaml").is_file():
        _fail(f"no params.yaml in {root}: run faceops data from the repository root.")
    from ops.remote import configure_dvc_remote, storage_config
    from tasks.common import load_params

    with _errors():
        cfg = storage_config(load_params(root / "params.yaml"))
        if not (root / ".dvc").is_dir():
            _fail(f"{root} is not a DVC repository (no .dvc/): run faceops data from the repository root.")
        if remote:
            configure_dvc_remote(cfg, root)
    return root, cfg


def _dvc(cfg: StorageConfig, root: Path, args: list[str], verbose: bool) -> None:
    from ops.remote import REMOTE, run_dvc

    with _errors():
        out = run_dvc(cfg, root, [args[0], "-r", REMOTE, *args[1:]], verbose=verbose)
    typer.echo(out.rstrip() or "done")


@app.command("push")
def push(targets: Targets = None, verbose: Verbose = False) -> None:
    """Upload what the remote lacks of TARGETS' cached outputs (`dvc push`); files are addressed by content hash."""
    root, cfg = _config()
    _dvc(cfg, root, ["push", *(targets or [])], verbose)


@app.command("pull")
def pull(
    targets: Targets = None,
    rev: Annotated[Optional[str], typer.Option(help="the version a git revision recorded (commit, tag, branch); "
                                                    "needs one target and --to")] = None,
    to: Annotated[Optional[Path], typer.Option(help="download one target here instead of into the workspace "
                                                    "(`dvc get`)")] = None,
    verbose: Verbose = False,
) -> None:
    """Download TARGETS into the workspace (`dvc pull`); DVC checks every file's hash before it is linked in, so an
    interrupted or corrupt pull leaves the workspace as it was. With `--to`, one target elsewhere (`dvc get`)."""
    if (rev or to) and (to is None or len(targets or []) != 1):
        _fail("--rev and --to take exactly one target path and --to DIR, e.g. "
              "`faceops data pull models/fr/real --rev v1.2 --to /scratch/fr`.")
    root, cfg = _config()
    if to is None:
        _dvc(cfg, root, ["pull", *(targets or [])], verbose)
        return
    import tempfile

    from ops.remote import remote_settings, run_dvc

    with tempfile.TemporaryDirectory() as tmp, _errors():  # the remote for `dvc get`'s copy of the repository
        config = Path(tmp) / "config"
        settings = remote_settings(cfg)
        config.write_text("[core]\n    remote = faceops\n['remote \"faceops\"']\n" +
                          "".join(f"    {key} = {value}\n" for key, value in settings.items()))
        run_dvc(cfg, root, ["get", str(root), targets[0], "-o", str(to.resolve()), "--config", str(config),
                            *(["--rev", rev] if rev else [])], verbose=verbose)
    typer.echo(f"{targets[0]}{f' @ {rev}' if rev else ''} → {to}")


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""  # pragma: no cover


@app.command("ls")
def ls(local: Annotated[bool, typer.Option("--local", help="do not ask the remote what it holds")] = False) -> None:
    """List what DVC versions here: path, content hash, files, size, and whether the remote holds it."""
    root, cfg = _config(remote=not local)
    from ops.remote import catalog

    with _errors():
        entries = catalog(cfg, root, remote=not local)
    typer.echo(f"{cfg.url('dvc')}  at {cfg.endpoint() or 'AWS'}" if cfg.bucket else "no remote (storage.bucket)")
    for e in entries:
        state = {True: "pushed", False: "not pushed", None: ""}[e.pushed]
        typer.echo(f"  {e.path:<40} {e.md5[:12]}  {e.files:>6} files {_size(e.size):>9}  {state}")
    if not entries:
        typer.echo("  (nothing versioned yet: `faceops run` first)")


@app.command("remote")
def remote(
    name: Annotated[str, typer.Option(help="DVC remote name")] = "faceops",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the dvc commands instead of running them")] = False,
) -> None:
    """Use the same bucket as DVC remote (`PREFIX/dvc`) and MLflow artifact store (`PREFIX/mlflow`).

    The DVC remote goes into `.dvc/config.local` (`dvc remote add --local --default`, plus `endpointurl`, timeouts,
    `jobs` and `verify`), which is not committed: nothing machine-specific or secret lands in git, and DVC reads the
    credentials from the same AWS_* environment. `push`/`pull` write it themselves; for MLflow this prints the
    server flags.
    """
    root, cfg = _config(remote=False)
    from ops.remote import configure_dvc_remote, dvc_remote_commands, mlflow_artifacts

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


@app.command("shard")
def shard(
    recordio: Annotated[Path, typer.Argument(help="an InsightFace/MXNet `.rec` (its `.idx` beside it)")],
    out: Annotated[Path, typer.Argument(help="a new folder for the shard set")],
    workers: Annotated[Optional[int], typer.Option(help="writer processes (default: every core)")] = None,
    size: Annotated[Optional[int], typer.Option(help="refuse faces whose header says another width or height, "
                                                     "e.g. 112")] = None,
    shard_mb: Annotated[int, typer.Option(help="largest shard file, MB")] = 256,
    pack_kb: Annotated[int, typer.Option(help="pack faces into tar members of this many kB (0: a member per face, "
                                              "as WebDataset samples)", min=0)] = 1024,
) -> None:
    """Convert a RecordIO's faces to WebDataset shards without decoding or re-encoding them.

    Each writer process takes a contiguous range of records and writes its own series of tar files
    (`faces-<writer>-<n>.tar`, at most `--shard-mb` each); `index.parquet` says where each face's bytes lie and its
    label. Faces keep their JPEG (or PNG) bytes, packed back to back into members of `--pack-kb`: the shard set is
    about the RecordIO's size. With `--pack-kb 0` each face is its own member, as a plain WebDataset reader expects,
    at a tar header and padding (about 0.8 kB) per face. Nothing is left behind when a record is refused.
    """
    import time

    from ml.data.shards import shard_recordio

    start = time.perf_counter()
    with _errors():
        done = shard_recordio(recordio, out, workers=workers, size=size, max_bytes=shard_mb * 2**20,
                              pack_bytes=pack_kb * 1024)
    seconds = time.perf_counter() - start
    total = sum(p.stat().st_size for p in out.glob("*.tar"))
    typer.echo(f"{done.faces:,} faces of {done.identities:,} identities in {done.shards} shards, {_size(total)} "
               f"(the .rec: {_size(recordio.stat().st_size)}), {done.faces / max(seconds, 1e-9):,.0f} faces/s → {out}")


@app.command("export")
def export(
    shards: Annotated[str, typer.Argument(help="a shard set (a folder or an fsspec URL such as s3://bucket/path) or "
                                                "a faceops dataset directory such as data/prepared/train")],
    out: Annotated[Path, typer.Argument(help="the folder to write `<key>.<ext>` image files into")],
    limit: Annotated[Optional[int], typer.Option(help="only the first N faces of the index (default: all)")] = None,
) -> None:
    """Write a shard set's faces as image files, for people who want to look.

    A dataset directory's faces land at their manifest paths (`images/<identity>/<n>.png`) under OUT."""
    from ml.data.dataset import INFO_FILE, SHARDS_DIR
    from ml.data.shards import export_folder

    if (Path(shards) / INFO_FILE).is_file():
        shards = str(Path(shards) / SHARDS_DIR)
    with _errors():
        n = export_folder(shards, out, limit=limit)
    typer.echo(f"{n:,} faces → {out}")
