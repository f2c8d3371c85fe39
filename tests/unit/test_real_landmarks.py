"""Real faces come without landmarks: `align` predicts them with the trained DFA aligner, and a KP-RPE model trains
on those predictions (recording that it did); stale or missing predictions are refused naming what to run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ml.data.dataset import landmarks_array, load_images, read_manifest
from ml.data.formats import read_verification_bin, write_recordio
from ml.data.landmarks import PREDICTED_INFO, manifest_keypoints, read_predicted
from ml.errors import DataError
from tasks.common import Paths

from tests.stages.test_ingest import TINY, _faces

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    """A workspace whose prepared sets hold 40 ingested faces (no landmarks) and an (untrained) tiny aligner."""
    import torch

    from ml.aligner.dfa import DFA, DFAConfig, save_aligner
    from tasks.prepare import run as prepare

    root = tmp_path_factory.mktemp("ws")
    images, labels = _faces(8, 5)
    write_recordio(root / "in" / "train.rec", images, labels)
    cfg = dataclasses.replace(TINY, ingest_recordio=str(root / "in" / "train.rec"))
    paths = Paths(root)
    prepare(cfg, paths, workers=1)
    torch.manual_seed(0)
    model = DFA(DFAConfig(input_size=64, fpn_channels=16, mixer_depth=1, mixer_dim=8, mixer_token_hidden=8,
                          mixer_channel_hidden=8)).eval()
    save_aligner(paths.aligner_model, model)
    return cfg, paths, model


def test_ingested_faces_have_no_landmarks_until_align_predicts_them(ingested):
    from tasks.align import run as align

    cfg, paths, model = ingested
    train = read_manifest(paths.train_set / "manifest.parquet")
    assert np.isnan(landmarks_array(train)).all()  # ingest has no landmarks to give
    with pytest.raises(DataError, match=r"no predicted landmarks.*dvc repro align"):
        manifest_keypoints(paths.train_set, train, paths.aligned_set)

    result = align(cfg, paths)
    table, info = read_predicted(paths.aligned_set)
    for name in ("train", "heldout", "discovery"):
        manifest = read_manifest(paths.prepared / name / "manifest.parquet")
        keypoints, source = manifest_keypoints(paths.prepared / name, manifest, paths.aligned_set)
        expected, _ = model.predict(load_images(paths.prepared / name, manifest))
        assert source == "aligner" and info["datasets"][name]["images"] == len(manifest)
        np.testing.assert_allclose(keypoints, expected, atol=1e-5)
    assert len(table) == 40
    bin_images, _ = read_verification_bin(paths.verification_dir / "real.bin")
    bin_landmarks = np.load(paths.aligned_set / "verification" / "real.landmarks.npy")
    np.testing.assert_allclose(bin_landmarks, model.predict(bin_images)[0], atol=1e-5)
    assert result.metrics["align/real/faces"] == 40 and result.metrics["align/real/template_nme"] > 0
    # the procedural unaligned test crops are still aligned as before
    assert result.metrics["align/faces"] > 0 and (paths.aligned_set / "manifest.parquet").is_file()


def test_kprpe_trains_on_the_predicted_landmarks_and_records_it(ingested):
    from ml.fr.train import FRConfig
    from tasks.align import run as align
    from tasks.train_fr import run as train_fr

    cfg, paths, _ = ingested
    if not (paths.aligned_set / PREDICTED_INFO).is_file():
        align(cfg, paths)
    fr = FRConfig(backbone="vit_tiny_kprpe", epochs=1, batch_size=8, embedding_dim=32, accelerator="cpu")
    result = train_fr(fr, cfg, paths, source="real")
    extra = json.loads((paths.fr_model("real") / "config.json").read_text())["extra"]
    assert extra["keypoints_source"] == {"data/prepared/train": "aligner"}
    assert result.metrics["train/keypoints_from_aligner"] == 1.0


def test_predictions_for_another_version_of_the_dataset_are_refused(ingested, tmp_path):
    import shutil

    from tasks.align import run as align

    cfg, paths, _ = ingested
    if not (paths.aligned_set / PREDICTED_INFO).is_file():
        align(cfg, paths)
    predicted = tmp_path / "aligned"
    shutil.copytree(paths.aligned_set, predicted)
    info = json.loads((predicted / PREDICTED_INFO).read_text())
    info["datasets"]["train"]["digest"] = "0" * 64  # made on an earlier `prepare`
    (predicted / PREDICTED_INFO).write_text(json.dumps(info))
    train = read_manifest(paths.train_set / "manifest.parquet")
    with pytest.raises(DataError, match=r"predicted on another version .*dvc repro align"):
        manifest_keypoints(paths.train_set, train, predicted)
