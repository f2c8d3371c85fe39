"""Where a project's MLflow runs go: its own store, ``mlflow.db`` (SQLite) with artifacts in ``mlruns/``, both in
the repository root, unless ``MLFLOW_TRACKING_URI`` names another (the stack's server, a team's).

The store belongs to the folder it is in. A stage that DVC runs in a temporary copy (a queued ``dvc exp run``)
logs into the repository that queued it (``project_root``); a workspace copied or moved with its store has the
store's absolute artifact paths rewritten to its own ``mlruns/`` (``adopt_store``); the experiment is created with
its artifact location in the repository's ``mlruns/``, not in whatever folder the first process ran from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

EXPERIMENT = "faceops"
# the experiment's kind as MLflow 3 records it: model training, not GenAI (the UI's own mode is a sidebar switch)
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
STORE_FILE = "mlflow.db"  # the repository's default MLflow store (SQLite) ...
ARTIFACT_DIR = "mlruns"  # ... and its artifact root, both in the repository root

log = logging.getLogger(__name__)


def runs_page(experiment_id: str) -> str:
    """The path of an experiment's runs table in MLflow's UI, in its model-training view: a browser that never chose
    a mode opens an experiment on the GenAI traces overview, and MLflow keeps no server-side default."""
    return f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def project_root(root: Path) -> Path:
    """The repository whose store a run in ``root`` logs to: ``DVC_ROOT`` when DVC runs the stage (a queued ``dvc exp
    run`` executes in a temporary copy under ``.dvc/tmp/exps/`` and DVC points ``DVC_ROOT`` at the repository that
    queued it), else ``root``."""
    return Path(os.environ.get("DVC_ROOT") or root)


def default_store(root: Path) -> str:
    """The repository's own MLflow store: ``sqlite:///<root>/mlflow.db`` (what ``make run`` logs to, and what
    ``faceops stack up`` serves), of the repository that queued a DVC experiment when it runs in DVC's copy."""
    return f"sqlite:///{(project_root(root) / STORE_FILE).resolve()}"


def default_artifact_root(root: Path) -> Path:
    """Where runs in the default store keep their artifacts: ``<root>/mlruns`` (MLflow's ``./mlruns`` from the
    repository root, where ``faceops run`` starts)."""
    return (project_root(root) / ARTIFACT_DIR).resolve()


def tracking_uri(root: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the SQLite store ``mlflow.db`` in the repository root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or default_store(root)


def configure(root: Path) -> str:
    """Point MLflow at the project's store and experiment; returns the experiment id."""
    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = tracking_uri(root)
    if urlsplit(uri).password:  # MLflow prints "View run ... at: <tracking URI>", password included, at every run end
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    mlflow.set_tracking_uri(uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
    with store_creation_lock(uri):
        if uri == default_store(root):
            adopt_store(root)
            if mlflow.get_experiment_by_name(name) is None:  # else MLflow puts it in ./mlruns of the current folder
                mlflow.create_experiment(name, artifact_location=(default_artifact_root(root) / name).as_uri())
        experiment = mlflow.set_experiment(name)
    if EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind the user chose is kept
        mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


@contextlib.contextmanager
def store_creation_lock(uri: str) -> Iterator[None]:
    """For an SQLite store, hold ``<db>.lock`` while MLflow opens it: the first process to open a new file creates
    and migrates its tables, and two doing that at once (two sweeps, two pipelines) leave it half-migrated
    ("table _alembic_tmp_... already exists"). Other stores: nothing to hold."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = Path(uri[len("sqlite:///"):])
    lock = db.with_name(db.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# where MLflow records an absolute artifact path: (table, column)
_PATH_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                 ("logged_models", "artifact_location"), ("model_versions", "storage_location"),
                 ("model_versions", "source"))


def adopt_store(root: Path) -> str | None:
    """Make a copied or moved repository's own store (``mlflow.db``) point at its own ``mlruns/`` → the folder it
    pointed at before, or None when nothing had to change.

    MLflow records every artifact location as an absolute path (there is no relative form), so a workspace copied
    with ``cp -r`` would keep writing its new runs' artifacts into the original's ``mlruns/``, and a moved one into a
    folder that is gone. An experiment located at ``<other>/mlruns/<id>`` is the mark of such a copy: every path
    under ``<other>/mlruns/`` in the store is rewritten to the same path under ``<root>/mlruns/``. Locations
    elsewhere (an S3 bucket, a folder the user chose) are left alone. Call it holding ``store_creation_lock``."""
    import sqlite3

    db, mine = project_root(root) / STORE_FILE, default_artifact_root(root)
    if not db.is_file():
        return None
    with contextlib.closing(sqlite3.connect(db)) as con:
        try:
            locations = [r[0] for r in con.execute("SELECT artifact_location FROM experiments")]
        except sqlite3.DatabaseError:  # not (yet) an MLflow store: MLflow says what is wrong with it
            return None
        found = {m.group(1) for loc in locations
                 if (m := re.fullmatch(r"(?:file://)?(/.*/" + ARTIFACT_DIR + r")/[^/]+", loc or ""))}
        others = sorted(found - {str(mine)})
        if not others:
            return None
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        with con:
            for other in others:
                for table, column in _PATH_COLUMNS:
                    if table in tables:
                        con.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?) "
                                    f"WHERE instr({column}, ?) > 0", (other + "/", f"{mine}/", other + "/"))
    log.warning("%s kept artifacts under another folder's mlruns/ (a copied or moved workspace, or a store first "
                "opened from another directory); its artifact locations now point at %s (were %s)",
                db, mine, ", ".join(others))
    return others[0]
