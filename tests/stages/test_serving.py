"""The serving contract of a registered embedding model: its MLflow signature and input example, what
``mlflow.pyfunc`` returns and refuses, and ``mlflow models serve`` answering the README's request and refusing a
wrong one with the reason in the message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.servers import mlflow_model_server

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VIT = dict(depth=1, dim=32, heads=2, embed_dim=16, drop_path=0.0)  # vit_tiny at 64 px: 16-d embeddings
GCD_VIT = dict(img_size=32, patch_size=8, dim=32, depth=2, heads=2, embed_dim=16, drop_path=0.0)
GCD_HEAD = dict(proj_dim=32, proj_hidden=64, proj_bottleneck=16, prefix_length=3)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An MLflow SQLite store holding a tiny FR model as ``faceops-fr@candidate`` and a tiny FaceGCD as
    ``faceops-discovery@candidate``, registered the way the stages do."""
    from ml.fr.backbones import build_backbone
    from ml.fr.backbones.vit import vit_tiny
    from ml.discovery.facegcd import FaceGCD, save_facegcd
    from ml.models.io import save_model
    from ops.tracking import stage_run

    tmp = tmp_path_factory.mktemp("serving")
    torch.manual_seed(0)
    fr_dir = save_model(tmp / "fr", build_backbone("vit_tiny", **VIT).eval(), backbone="vit_tiny", kwargs=VIT)
    torch.manual_seed(1)
    gcd_dir = save_facegcd(FaceGCD(vit_tiny(**GCD_VIT).eval(), **GCD_HEAD).eval(), tmp / "gcd")
    with pytest.MonkeyPatch.context() as mp:
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(tmp)  # MLflow puts a SQLite store's artifacts under ./mlruns of the working directory
        with stage_run("train_fr@real", {}, tmp) as tracker:
            tracker.log_model_dir(fr_dir, "faceops-fr")
        with stage_run("train_discovery", {}, tmp) as tracker:
            tracker.log_model_dir(gcd_dir, "faceops-discovery")
        yield {"tmp": tmp, "uri": uri, "fr": fr_dir, "gcd": gcd_dir}


def _faces(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _expected(model_dir: Path, images: np.ndarray) -> np.ndarray:
    from ml.models.io import load_model
    from ml.fr.train import embed

    feats = embed(load_model(model_dir)[0], images, flip=True)
    return feats / np.linalg.norm(feats, axis=1, keepdims=True)


def test_registered_models_carry_their_signature_and_a_one_image_example(store):
    import mlflow
    from mlflow.types import TensorSpec

    for name, size in (("faceops-fr", 64), ("faceops-discovery", 32)):
        model = mlflow.pyfunc.load_model(f"models:/{name}@candidate")
        (inputs,), (outputs,) = model.metadata.signature.inputs.inputs, model.metadata.signature.outputs.inputs
        assert isinstance(inputs, TensorSpec) and isinstance(outputs, TensorSpec)
        assert (inputs.type, inputs.shape) == (np.dtype(np.uint8), (-1, size, size, 3)), name
        assert (outputs.type, outputs.shape) == (np.dtype(np.float32), (-1, 16)), name
        example = np.asarray(json.loads(Path(mlflow.artifacts.download_artifacts(
            f"models:/{name}@candidate/serving_input_example.json")).read_text())["inputs"])
        assert example.shape == (1, size, size, 3) and example.min() >= 0 and example.max() <= 255
        assert example.std() > 10  # a face to copy from the UI, not a uniform grey square
        out = np.asarray(model.predict(example.astype(np.uint8)))
        assert out.shape == (1, 16) and out.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_prediction_is_the_l2_normalised_flip_embedding(store):
    import mlflow

    images = _faces(4)
    out = np.asarray(mlflow.pyfunc.load_model("models:/faceops-fr@candidate").predict(images))
    assert out.shape == (4, 16) and out.dtype == np.float32
    np.testing.assert_allclose(out, _expected(store["fr"], images), atol=1e-5)


def test_wrong_input_is_refused_saying_what_was_expected_and_what_came(store):
    import mlflow
    from mlflow.exceptions import MlflowException

    model = mlflow.pyfunc.load_model("models:/faceops-fr@candidate")
    with pytest.raises(MlflowException, match=r"Shape of input \(1, 32, 32, 3\) does not match expected shape "
                                              r"\(-1, 64, 64, 3\)"):
        model.predict(_faces(1, size=32))
    with pytest.raises(MlflowException, match="dtype of input float32 does not match expected dtype uint8"):
        model.predict(_faces(1).astype(np.float32) / 255)
    # the model itself (an older version without a signature is called like this) says the same in its own words
    inner = model.unwrap_python_model()
    expected = r"expected uint8 RGB images of shape \(N, 64, 64, 3\), values 0-255, channels last"
    with pytest.raises(MlflowException, match=expected + r".*got uint8 of shape \(1, 32, 32, 3\)") as err:
        inner.predict(None, _faces(1, size=32))
    assert err.value.get_http_status_code() == 400
    with pytest.raises(MlflowException, match=expected + r".*got float64 of shape \(1, 64, 64, 3\)"):
        inner.predict(None, _faces(1) / 255.0)
    with pytest.raises(MlflowException, match=r"got int64 of shape \(1, 64, 64, 3\) with values -1\.\.255"):
        inner.predict(None, np.concatenate([[-1], _faces(1).ravel()[1:].astype(np.int64)]).reshape(1, 64, 64, 3))
    images = _faces(2)
    np.testing.assert_allclose(inner.predict(None, images.astype(np.int64).tolist()),
                               _expected(store["fr"], images), atol=1e-5)  # integers in 0..255 are accepted


def _documented_requests() -> list[str]:
    """The download and ``curl`` lines of the first example on the Serving page, in order."""
    text = (REPO / "docs" / "operations" / "serving.md").read_text(encoding="utf-8")
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    wanted = ("mlflow artifacts", "curl")
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith(wanted)]


@pytest.mark.slow
def test_served_model_answers_the_documented_request_and_refuses_a_wrong_one_with_the_reason(store):
    tmp = store["tmp"]
    requests = _documented_requests()
    assert [r.split()[0] for r in requests] == ["mlflow", "curl"], requests
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"], "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    work = tmp / "client"
    work.mkdir()
    with mlflow_model_server("models:/faceops-fr@candidate", {"MLFLOW_TRACKING_URI": store["uri"]},
                             log=tmp / "serve.log") as url:
        outs = []
        for command in requests:  # as documented; before any promotion the model is @candidate
            command = command.replace("@champion", "@candidate").replace("http://127.0.0.1:5001", url)
            proc = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            outs.append(proc.stdout)
        example = np.asarray(json.loads((work / "serving_input_example.json").read_text())["inputs"], dtype=np.uint8)
        answer = np.asarray(json.loads(outs[-1])["predictions"], dtype=np.float32)
        np.testing.assert_allclose(answer, _expected(store["fr"], example), atol=1e-4)

        request = urllib.request.Request(f"{url}/invocations", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"inputs": _faces(1, size=32).tolist()}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    body = json.loads(refused.value.read())
    assert body["error_code"] == "INVALID_PARAMETER_VALUE" and "stack_trace" not in body
    assert body["message"].endswith("Error: Shape of input (1, 32, 32, 3) does not match expected shape "
                                    "(-1, 64, 64, 3).")
