"""MLflow for stage executions: one run per execution, nested under the Prefect flow's run.

Every stage run carries its params section, metrics, plots, dataset inputs with content digests, and
the tags ``git.commit``, ``dvc.stage``, ``faceops.invocation`` and (when Prefect drives it)
``prefect.flow_run_id``. The flow adds DVC's dependency hashes after the stage ends (it reads
``dvc.lock``, which DVC writes only then).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "faceops"
ENV_PARENT_RUN = "FACEOPS_PARENT_RUN_ID"
ENV_FLOW_RUN = "FACEOPS_PREFECT_FLOW_RUN_ID"
ENV_INVOCATION = "FACEOPS_INVOCATION_ID"

log = logging.getLogger(__name__)


def tracking_uri(root: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the SQLite store ``mlflow.db`` in the repository root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def configure(root: Path) -> str:
    """Point MLflow at the project's store and experiment; returns the experiment id."""
    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    mlflow.set_tracking_uri(tracking_uri(root))
    experiment = mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT))
    return experiment.experiment_id


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def mlflow_metric_name(name: str) -> str:
    """MLflow accepts ``[\\w./\\- :]`` only: ``test/tar@far=1e-4`` → ``test/tar_at_far_1e-4``."""
    return re.sub(r"[^\w./\- :]", "_", name.replace("@", "_at_"))


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


class StageTracker:
    """Thin logging facade over the active MLflow run of one stage execution."""

    def __init__(self, run_id: str, root: Path):
        self.run_id = run_id
        self.root = root

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import mlflow

        clean = {mlflow_metric_name(k): float(v) for k, v in metrics.items() if v is not None}
        mlflow.log_metrics(clean, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        if Path(path).is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        import mlflow

        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_dataset(self, dataset_dir: Path, context: str) -> str:
        """Log a faceops dataset directory as an MLflow input (manifest + content digest)."""
        import mlflow

        from ml.data.dataset import read_dataset_info, read_manifest

        info = read_dataset_info(dataset_dir)
        manifest = read_manifest(dataset_dir / "manifest.parquet")
        view = manifest.drop(columns=["landmarks"])
        ds = mlflow.data.from_pandas(
            view,
            source=str(Path(dataset_dir).resolve()),
            name=f"{info['name']}",
            digest=info["digest"][:36],
        )
        mlflow.log_input(ds, context=context, tags={"faceops.digest": info["digest"]})
        mlflow.set_tag(f"dataset.{context}.digest", info["digest"])
        return info["digest"]

    def log_prepared_datasets(self, prepared: Path) -> None:
        """Log every dataset directory ``prepare`` wrote (``train``, ``heldout``, ``templates``, ``discovery``,
        ``videos``, ``unaligned``, ``real``)."""
        for sub in ("train", "heldout", "templates", "discovery", "videos", "unaligned", "real"):
            if (prepared / sub / "dataset.json").is_file():
                self.log_dataset(prepared / sub, context=sub)

    def log_model_dir(
        self, model_dir: Path, registered_name: str, *, alias: str = "candidate", tags: Mapping[str, str] = {}
    ) -> str:
        """Log a faceops model directory as an MLflow pyfunc model and register a new version.

        The version gets ``alias`` (``candidate``) and ``tags``; returns the version number.
        """
        import mlflow

        from tasks.pyfunc import FaceEmbedder

        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=FaceEmbedder(),
            artifacts={"model_dir": str(model_dir)},
            pip_requirements=["faceops", "torch==2.13.0", "safetensors", "numpy"],
            registered_model_name=registered_name,
            await_registration_for=60,
        )
        version = str(info.registered_model_version)
        self._alias_and_tags(registered_name, version, alias, tags)
        return version

    def register_model_dir(
        self, registered_name: str, *, artifact_path: str = "model", alias: str = "candidate",
        tags: Mapping[str, str] = {},
    ) -> str:
        """Register the model directory already logged under ``artifact_path`` of this run (a faceops model that is
        not an image embedder, e.g. the fusion model) as a new version of ``registered_name``; → version number."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient()
        try:
            client.create_registered_model(registered_name)
        except MlflowException as exc:
            if "already exists" not in str(exc).lower():
                raise
        mv = client.create_model_version(registered_name, source=f"runs:/{self.run_id}/{artifact_path}",
                                         run_id=self.run_id)
        version = str(mv.version)
        self._alias_and_tags(registered_name, version, alias, tags)
        return version

    def _alias_and_tags(self, name: str, version: str, alias: str, tags: Mapping[str, str]) -> None:
        from mlflow import MlflowClient

        client = MlflowClient()
        client.set_registered_model_alias(name, alias, version)
        for k, v in {**tags, "run_id": self.run_id}.items():
            client.set_model_version_tag(name, version, k, str(v))


@contextlib.contextmanager
def stage_run(stage: str, params: Mapping[str, Any], root: Path) -> Iterator[StageTracker]:
    """Open the MLflow run for one execution of ``stage``; closes it FAILED if the body raises."""
    import mlflow

    configure(root)
    flat: dict[str, Any] = {}
    _flatten("", params, flat)
    tags = {
        "dvc.stage": stage,
        "faceops.stage": stage,
        "git.commit": git_commit(root),
        "mlflow.source.git.commit": git_commit(root).removesuffix("-dirty"),
    }
    if os.environ.get(ENV_INVOCATION):
        tags["faceops.invocation"] = os.environ[ENV_INVOCATION]
    if os.environ.get(ENV_FLOW_RUN):
        tags["prefect.flow_run_id"] = os.environ[ENV_FLOW_RUN]
    parent = os.environ.get(ENV_PARENT_RUN) or None
    with mlflow.start_run(run_name=stage, parent_run_id=parent, tags=tags) as run:
        # MLflow caps param values at 6000 chars; ours are short scalars and lists.
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})
        yield StageTracker(run.info.run_id, root)
