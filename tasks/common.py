"""What every stage module shares: paths, params, atomic writes, the stage result."""

from __future__ import annotations

import contextlib
import json
import re
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ml.errors import ConfigError
from ml.atomic import atomic_path

PARAMS_FILE = "params.yaml"


@dataclass(frozen=True)
class Paths:
    """Where each stage reads and writes, relative to the repository root (DVC runs cmds there)."""

    root: Path = field(default_factory=Path.cwd)

    @property
    def params(self) -> Path:
        return self.root / PARAMS_FILE

    @property
    def prepared(self) -> Path:
        return self.root / "data" / "prepared"

    @property
    def train_set(self) -> Path:
        return self.prepared / "train"

    @property
    def heldout_set(self) -> Path:
        return self.prepared / "heldout"

    @property
    def template_set(self) -> Path:
        return self.prepared / "templates"

    @property
    def discovery_set(self) -> Path:
        return self.prepared / "discovery"

    @property
    def gfd_split(self) -> Path:
        """``data/prepared/gfd/split.parquet``; ``split.json`` beside it names the dataset it covers."""
        return self.prepared / "gfd" / "split.parquet"

    @property
    def video_set(self) -> Path:
        return self.prepared / "videos"

    @property
    def fusion_set(self) -> Path:
        """``data/prepared/fusion``: CAFace's procedural training sets (not written when real faces are ingested)."""
        return self.prepared / "fusion"

    @property
    def unaligned_set(self) -> Path:
        return self.prepared / "unaligned"

    @property
    def aligner_model(self) -> Path:
        return self.root / "models" / "aligner"

    @property
    def aligned_set(self) -> Path:
        """``data/aligned``: the ``align`` stage's crops and predicted landmarks."""
        return self.root / "data" / "aligned"

    @property
    def fusion_model(self) -> Path:
        return self.root / "models" / "fusion"

    @property
    def generator_model(self) -> Path:
        return self.root / "models" / "generator"

    @property
    def synthetic_set(self) -> Path:
        """``data/synthetic``: the synthesize stage's UIFace dataset (source ``synthetic``)."""
        return self.root / "data" / "synthetic"

    @property
    def discovery_model(self) -> Path:
        return self.root / "models" / "discovery"

    @property
    def verification_dir(self) -> Path:
        return self.prepared / "verification"

    @property
    def validation_reports(self) -> Path:
        return self.root / "reports" / "validation"

    @property
    def fr_models(self) -> Path:
        return self.root / "models" / "fr"

    def fr_model(self, source: str) -> Path:
        """``models/fr/<source>/``: one trained FR model per training source (``real``, ``synthetic``, ``mixed``)."""
        return self.fr_models / source

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def benchmark_report(self) -> Path:
        return self.root / "reports" / "benchmark.md"


@dataclass
class StageResult:
    """What a stage function returns: its metrics (``/``-names), the files it wrote, a summary line."""

    stage: str
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: list[Path] = field(default_factory=list)
    summary: str = ""


class ParamsLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: ``3e-4`` and ``1e-05`` are numbers, as DVC (ruamel, YAML 1.2)
    reads them, not the strings YAML 1.1 makes of an exponent without a dot."""


ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """YAML text as params are read everywhere (``ParamsLoader``)."""
    return yaml.load(text, Loader=ParamsLoader)


def load_params(path: Path | str = PARAMS_FILE) -> dict[str, Any]:
    """Read ``params.yaml``; a missing or malformed file raises ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found. Run from the repository root (where dvc.yaml is).")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({yaml_error(exc)}). Fix the file or `git checkout {path}`.") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level.")
    from tasks import PARAM_SECTIONS

    unknown = [str(k) for k in data if k not in PARAM_SECTIONS]
    if unknown:  # a misspelt section would leave its stage on the defaults without a word
        import difflib

        close = difflib.get_close_matches(unknown[0], list(PARAM_SECTIONS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{path}: unknown params section '{unknown[0]}'.{hint} Valid sections: "
                          f"{', '.join(sorted(PARAM_SECTIONS))}.")
    return dict(data)


def yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: ``line L, column C: problem (context)``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def section(params: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = params.get(name, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"params section '{name}' must be a mapping, got {value!r}")
    return value


# AWS credentials a boto3 or DVC error could echo back; no message of ours is built from them
CREDENTIAL_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_URL_PASSWORD = re.compile(r"(\b[\w+.-]+://[^/\s:@]*):[^@/\s]*@")  # scheme://user: … @ (user may be empty)


def redact(text: str) -> str:
    """``text`` fit for a message or log: the password of every ``scheme://user:password@`` URL in it becomes
    ``***`` (``postgresql://user:***@host/db``), and so does any value (4 characters or more) of the
    ``CREDENTIAL_ENV`` variables set in the environment."""
    text = _URL_PASSWORD.sub(r"\1:***@", text)
    for env in CREDENTIAL_ENV:
        value = os.environ.get(env, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


def stage_cores() -> int:
    """The cores this stage may use: its thread count as ``stage_main`` fixed it (``OMP_NUM_THREADS``: stages
    running side by side share the machine), otherwise the cores this process may run on."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return max(1, len(os.sched_getaffinity(0)))


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@contextlib.contextmanager
def single_threaded_children() -> Iterator[None]:
    """Processes started inside the block compute on one thread each (their BLAS/OpenMP pools read the environment
    when they start); the environment is put back afterwards."""
    before = {var: os.environ.get(var) for var in THREAD_ENV}
    os.environ.update({var: "1" for var in THREAD_ENV})
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def launch_rank(devices: int = 1) -> int:
    """This process's global rank as its launcher announced it, before any process group exists: ``RANK``
    (torchrun and most cluster launchers), else Lightning's own ``NODE_RANK`` × ``devices`` + ``LOCAL_RANK``
    (it re-runs the stage command once per extra device); 0 for a single process. Ranks other than 0 train
    but neither open a tracking run nor write the stage's outputs."""
    if os.environ.get("RANK", "").strip():
        return int(os.environ["RANK"])
    return int(os.environ.get("NODE_RANK") or 0) * max(devices, 1) + int(os.environ.get("LOCAL_RANK") or 0)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (stages run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> Path:
    """Write a matplotlib figure as PNG atomically and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def coinciding(curves: Mapping[str, Mapping[Any, float]], atol: float = 1e-9) -> list[list[str]]:
    """The names of ``curves`` ({name: {x: y}}) grouped by curves a plot would draw on top of each other (the same
    x, every y within ``atol``), in first-seen order: ``{"a": {1: .5}, "b": {1: .5}, "c": {1: .7}}`` →
    ``[["a", "b"], ["c"]]``. Draw one line per group and name the whole group in its legend entry."""
    groups: list[list[str]] = []
    for name, curve in curves.items():
        for group in groups:
            other = curves[group[0]]
            if other.keys() == curve.keys() and all(abs(other[x] - curve[x]) <= atol for x in curve):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


# one curve of a history panel: (legend label, EpochHistory rows, the key plotted, optional matplotlib style)
Curve = tuple  # (str, list[dict], str) or (str, list[dict], str, dict)


def plot_history(path: Path | str, panels: list[dict[str, Any]], width: float = 5.2) -> Path:
    """A trainer's per-epoch curves as a PNG, one panel per entry of ``panels`` ({"title", "ylabel", "curves":
    [Curve, ...], optional "ylim"}); a curve whose rows lack its key is left out, and a panel's legend is drawn
    when it holds more than one curve. Every stage draws its history through this one function."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 3.3), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        drawn = 0
        for label, rows, key, *style in panel["curves"]:
            if rows and key in rows[0]:
                ax.plot([r["epoch"] for r in rows], [r.get(key, float("nan")) for r in rows], marker="o",
                        markersize=3, label=label, **(style[0] if style else {}))
                drawn += 1
        ax.set(xlabel="epoch", ylabel=panel.get("ylabel", ""), title=panel["title"])
        if "ylim" in panel:
            ax.set_ylim(*panel["ylim"])
        if drawn > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def write_history_csv(path: Path | str, history: list[dict], fields: list[str] | None = None) -> Path:
    """Per-epoch rows as CSV (for ``dvc plots``): ``fields`` in order, default ``epoch`` then every other key."""
    import csv
    import io

    fields = fields or ["epoch"] + sorted({k for row in history for k in row if k != "epoch"})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(history)
    return write_text(path, buf.getvalue())


def write_json(path: Path | str, payload: Any) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_json_default) + "\n")
    return path


def read_stage_metrics(root: Path | str, name: str) -> dict[str, Any]:
    """A run's ``metrics/<name>.json`` under ``root`` as flat metrics (a file that wraps them under ``metrics`` is
    unwrapped); {} when the stage has not written it."""
    path = Path(root) / "metrics" / f"{name}.json"
    if not path.is_file():
        return {}
    tree = json.loads(path.read_text())
    return tree.get("metrics", tree)


def write_text(path: Path | str, text: str) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def fix_stage_threads(stage: str, params_path: Path | str = PARAMS_FILE) -> int:
    """Fix this process's torch threads for ``stage`` from params ``pipeline`` and the cores it may use
    (``tasks.pipeline.stage_threads``), before it computes anything; → the count, also in ``OMP_NUM_THREADS`` for
    the processes it starts and the stage's MLflow tags."""
    from ml.config import from_mapping
    from ml.train.device import available_cores, set_threads
    from tasks.pipeline import PipelineConfig, stage_threads

    cfg = from_mapping(PipelineConfig, load_params(params_path).get("pipeline") or {}, "pipeline")
    threads = stage_threads(stage, cfg, available_cores())
    set_threads(threads)
    return threads


def numerics(accelerator: str, precision: str) -> dict[str, Any]:
    """What a trainer computed in, for its model's ``config.json``: ``precision`` ("auto" resolved: a function of
    params and the machine's instruction set) and the torch ``threads`` this stage fixed."""
    import torch

    from ml.train.device import resolve_precision

    return {"precision": resolve_precision(accelerator, precision), "threads": torch.get_num_threads()}


def stage_main(main: Any, stage: str | None = None) -> None:
    """Run a stage's ``main()`` as a command: logging on, the threads of ``stage`` fixed (``fix_stage_threads``),
    one clear line and exit 2 on a FaceopsError."""
    import logging
    import sys

    from ml.errors import FaceopsError

    import warnings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # GX announces every API function it registers at INFO: dozens of lines per stage, none of them ours
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    # MLflow's schema-inference hints about our manifests are noise for a pipeline log
    warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow(\..*)?")
    try:
        if stage is not None:
            threads = fix_stage_threads(stage)
            logging.getLogger(__name__).info("%s: %d thread(s) (params pipeline.jobs, pipeline.exclusive)", stage,
                                             threads)
        main()
    except FaceopsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
