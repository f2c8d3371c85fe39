"""Security: no credential from the environment reaches params, logs, MLflow or the reports; the servers listen on
loopback only; nothing is unpickled from a file without the restricted unpickler or ``weights_only``.

Already proven elsewhere: tests/stages/test_storage.py (no AWS secret in any `faceops data` output, DVC config or botocore
debug log; a credential-looking ``storage`` key is refused), tests/stages/test_sweep.py (a password in ``sweep.storage``
is refused and masked), tests/stages/test_stack.py (every `faceops stack` server is started with ``--host 127.0.0.1`` and
its URLs are loopback). Added: one tracked sweep with every kind of credential set, scanned end to end; the
listening sockets themselves; the pickle audit.
"""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.servers import mlflow_server

from .report_faults import prepared_workspace, record

REPO = Path(__file__).resolve().parents[2]
AREA = "Security"
PRODUCT = ("ml", "tasks", "flows", "faceops")


def _secrets() -> dict[str, str]:
    return {name: f"faceops-{name.lower()}-{uuid.uuid4().hex[:12]}" for name in
            ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "URI_PASSWORD", "PGPASSWORD")}


def _listening(port: int) -> list[str]:
    """Local addresses (``/proc/net/tcp*`` hex) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.append(address)
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (as /proc writes them)


@pytest.mark.slow
def test_no_credential_in_params_logs_mlflow_or_reports(tmp_path_factory, tmp_path):
    from mlflow import MlflowClient

    if not Path("/proc/net/tcp").is_file():
        pytest.skip("no /proc/net/tcp on this system: the listening-socket check needs Linux")
    root = prepared_workspace(tmp_path_factory, tmp_path / "ws", {"sweep.train_fr.trials": 1, "fr.epochs": 1})
    secrets = _secrets()
    store = tmp_path / "mlflow"
    store.mkdir()
    with mlflow_server(store) as server:
        url = server["MLFLOW_TRACKING_URI"]
        port = int(url.rsplit(":", 1)[1])
        sockets = _listening(port)
        with_password = url.replace("http://", f"http://faceops:{secrets['URI_PASSWORD']}@")
        env = {**os.environ, **{k: v for k, v in secrets.items() if k != "URI_PASSWORD"},
               "AWS_ACCESS_KEY_ID": "AKIAFACEOPSTEST", "MLFLOW_TRACKING_USERNAME": "faceops",
               "MLFLOW_TRACKING_URI": with_password, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        log = tmp_path / "sweep.log"
        script = ("import logging; logging.basicConfig(level=logging.DEBUG); "
                  "from ops.sweep import run_sweep; run_sweep('train_fr', study='sec', root='.')")
        with open(log, "w") as out:
            proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=600)
        client = MlflowClient(url)
        runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert len(runs) >= 2  # the sweep's parent run and its trial
    assert sockets and set(sockets) <= LOOPBACK, sockets  # the MLflow server listens on loopback only
    tracked = "\n".join(f"{r.info.run_name} {r.data.params} {r.data.tags}" for r in runs)
    places: dict[str, bytes] = {"sweep log (DEBUG)": text.encode(), "MLflow params, tags, names": tracked.encode()}
    for rel in ("params.yaml", "reports", "metrics", "plots", "optuna.db", "dvc.yaml"):
        for path in [root / rel] if (root / rel).is_file() else sorted((root / rel).rglob("*")):
            if path.is_file():
                places[str(path.relative_to(root))] = path.read_bytes()
    for path in sorted(store.rglob("*")):  # the tracking server's database and artifact store
        if path.is_file():
            places[f"mlflow server: {path.relative_to(store)}"] = path.read_bytes()
    assert any(p.startswith("reports/sweeps/") for p in places), sorted(places)
    leaks = [f"{name} in {place}" for place, data in places.items() for name, value in secrets.items()
             if value.encode() in data]
    assert leaks == []
    record(AREA, "tracked sweep (1 trial) with AWS secret + session token, MLflow password, PGPASSWORD and a "
           "user:password@ tracking URI in the environment", f"none of the {len(secrets)} secrets in the DEBUG log, "
           f"params.yaml, reports/, plots/, optuna.db, the {len(runs)} MLflow runs' params/tags or the server's "
           f"database and artifacts ({len(places)} places scanned); the server listened on {len(sockets)} socket(s), "
           "all 127.0.0.1", True, places=len(places))


# ── pickles ──────────────────────────────────────────────────────────────────────────────────────────────────────


class _Exploit:
    """Unpickling this runs ``os.system`` (what a malicious ``.bin`` or checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return os.system, (f"touch {self.marker}",)


def test_malicious_verification_bin_and_checkpoint_are_refused(tmp_path):
    import torch

    from ml.data.formats import read_verification_bin
    from ml.errors import DataError

    marker = tmp_path / "pwned"
    evil_bin = tmp_path / "lfw.bin"
    evil_bin.write_bytes(pickle.dumps(([b"\xff\xd8"], [True, _Exploit(marker)])))
    with pytest.raises(DataError) as err:
        read_verification_bin(evil_bin)
    assert "refused to unpickle" in str(err.value) and str(evil_bin) in str(err.value)
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)
    evil_ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "hook": _Exploit(marker)}, evil_ckpt)
    with pytest.raises(pickle.UnpicklingError):  # torch's default, which Lightning's resume (weights_only=None) uses
        torch.load(evil_ckpt, map_location="cpu")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil_ckpt, map_location="cpu", weights_only=True)
    assert not marker.exists()
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
    record(AREA, "malicious pickle as a verification .bin and as a training checkpoint",
           "the .bin is refused by the restricted unpickler naming the file and the global; torch.load refuses the "
           "checkpoint both by default (Lightning's resume path) and with weights_only=True; the payload never ran",
           True)


UNSAFE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cloudpickle", "load"),
                ("cloudpickle", "loads"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"),
                ("pd", "read_pickle"), ("pandas", "read_pickle"), ("torch", "load")}
# the one place allowed to unpickle: ml/data/formats/verification_bin.py's allow-listing unpickler (a subclass)


def _unsafe_loads(path: Path) -> list[str]:
    """``file:line call`` for each unpickling call in ``path`` that is not opted out of code execution."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        name = node.func.attr
        keywords = {k.arg: k.value for k in node.keywords}
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{node.lineno} {owner}.{name}"
        if (owner, name) == ("torch", "load"):
            flag = keywords.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                found.append(where + " without weights_only=True")
        elif (owner, name) in UNSAFE_CALLS:
            found.append(where)
        elif name == "load" and owner in ("np", "numpy"):
            flag = keywords.get("allow_pickle")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                found.append(where + " with allow_pickle")
    return found


def test_product_code_never_unpickles_without_restriction(tmp_path):
    files = [p for d in PRODUCT for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 50
    assert [hit for p in files for hit in _unsafe_loads(p)] == []
    formats = (REPO / "ml/data/formats/verification_bin.py").read_text()
    assert "class _RestrictedUnpickler(pickle.Unpickler)" in formats and "find_class" in formats
    # the audit itself can fail: it finds each unsafe form in a sample
    sample = tmp_path / "sample.py"
    sample.write_text("import pickle, torch, numpy as np\npickle.load(f)\ntorch.load(p)\n"
                      "torch.load(p, weights_only=False)\nnp.load(p, allow_pickle=True)\n"
                      "torch.load(p, weights_only=True)\n")
    assert len(_unsafe_loads(sample)) == 4
    record(AREA, "audit of every unpickling call in ml/, tasks/, flows/, faceops/",
           f"{len(files)} files: no pickle/cloudpickle/dill/joblib/read_pickle load, every torch.load has "
           "weights_only=True, no np.load(allow_pickle=True); .bin files go through the allow-listing unpickler",
           True, files=len(files))
