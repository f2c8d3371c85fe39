"""Stage prepare: the benchmark files it writes are consistent, and real data can be ingested."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from ml.data.dataset import read_dataset_info, read_manifest
from ml.data.formats import RecordIOReader, read_verification_bin, write_recordio
from ml.data.procedural import ProceduralFaces
from tasks.common import Paths
from tasks.prepare import DataConfig, run

TINY = DataConfig(train_identities=6, images_per_identity=5, val_fraction=0.2, heldout_identities=6, heldout_images_per_identity=4,
                  gallery_images_per_identity=1, verification_pairs=40, template_identities=4,
                  templates_per_identity=2, frames_per_template=3, discovery_identities=8,
                  discovery_images_per_identity=10, video_identities=4, video_distractors=2, video_frames=(30, 60),
                  fusion_identities=3, fusion_clean_images=2, fusion_sources=2, fusion_copies=3)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    paths = Paths(tmp_path_factory.mktemp("ws"))
    result = run(TINY, paths)
    return paths, result


def test_split_sizes_and_disjoint_identities(prepared):
    paths, result = prepared
    train = read_manifest(paths.train_set / "manifest.parquet")
    heldout = read_manifest(paths.heldout_set / "manifest.parquet")
    assert len(train) == 30 and Counter(train["split"]) == {"train": 24, "val": 6}
    assert set(train["identity"]).isdisjoint(set(heldout["identity"]))
    assert Counter(heldout["split"]) == {"gallery": 6, "probe": 18}
    assert sorted(train["label"].unique()) == list(range(6))
    assert result.metrics["data/verification_pairs"] == 40


def test_discovery_set_and_gfd_split(prepared):
    import json

    from ml.discovery.split import check_gfd_split, read_gfd_split

    paths, result = prepared
    discovery = read_manifest(paths.discovery_set / "manifest.parquet")
    others = set(read_manifest(paths.train_set / "manifest.parquet")["identity"]) | set(
        read_manifest(paths.heldout_set / "manifest.parquet")["identity"])
    assert discovery["identity"].nunique() == 8 and len(discovery) == 80
    assert set(discovery["identity"]).isdisjoint(others)  # unseen by the FR model
    split = read_gfd_split(paths.gfd_split)
    check_gfd_split(split)
    assert set(split["path"]) == set(discovery["path"])
    assert split.groupby("identity")["known"].first().sum() == 4
    assert (split["subset"] == "test").sum() == 8  # 10 % of 10 images per identity
    assert split["labelled"].sum() == 4 * 5  # round(0.5 × 9) = 5 (half up) of each known identity's train images
    info = json.loads((paths.gfd_split.parent / "split.json").read_text())
    assert info["dataset"] == "discovery" and info["known_identities"] == 4
    assert result.metrics["data/gfd_labelled_images"] == 20


def test_gfd_split_of_real_data_needs_real_data(tmp_path):
    from ml.errors import ConfigError

    with pytest.raises(ConfigError, match="data.gfd_dataset"):
        run(dataclasses.replace(TINY, gfd_dataset="real"), Paths(tmp_path))
    with pytest.raises(ConfigError, match="data.gfd_dataset"):
        dataclasses.replace(TINY, gfd_dataset="webface")
    assert not (tmp_path / "data").exists()


def test_verification_bin_pairs_are_balanced_and_decodable(prepared):
    paths, _ = prepared
    images, issame = read_verification_bin(paths.verification_dir / "procedural.bin")
    assert images.shape == (80, 64, 64, 3) and issame.sum() == 20


def test_template_meta_files_match_manifest(prepared):
    paths, _ = prepared
    manifest = read_manifest(paths.template_set / "manifest.parquet")
    meta = pd.read_csv(paths.template_set / "meta" / "face_tid_mid.txt", sep=" ", names=["path", "tid", "mid"])
    assert list(meta["path"]) == list(manifest["path"])
    assert (meta["tid"].to_numpy() == manifest["template"].to_numpy()).all()
    assert len(meta) == 4 * 2 * (3 + 1)
    pairs = np.loadtxt(paths.template_set / "meta" / "template_pair_label.txt", dtype=int)
    assert len(pairs) == 8 * 7 // 2 and pairs[:, 2].sum() == 4  # one genuine pair per identity (2 templates)
    # a genuine pair's templates hold the same identity
    ident = manifest.groupby("template")["identity"].first()
    for a, b, same in pairs:
        assert (ident[a] == ident[b]) == bool(same)


def test_fusion_set_clean_targets_and_degraded_sources(prepared):
    """CAFace's training sets: per identity 2 clean renders and 2 sources × 3 degraded copies, on identities no
    other set uses; sources are numbered across the set and each belongs to one identity."""
    paths, result = prepared
    fusion = read_manifest(paths.fusion_set / "manifest.parquet")
    assert Counter(fusion["split"]) == {"clean": 3 * 2, "degraded": 3 * 2 * 3}
    assert result.metrics["data/fusion_images"] == 3 * (2 + 2 * 3)
    assert fusion["identity"].nunique() == 3 and fusion["quality"].notna().all()
    others = set().union(*(read_manifest(paths.prepared / d / "manifest.parquet")["identity"]
                           for d in ("train", "heldout", "discovery", "templates", "videos")))
    assert set(fusion["identity"]).isdisjoint(others)
    clean, degraded = fusion[fusion["split"] == "clean"], fusion[fusion["split"] == "degraded"]
    assert clean["template"].isna().all() and degraded["template"].notna().all()
    assert sorted(degraded["template"].unique()) == list(range(6))
    assert (degraded.groupby("template")["identity"].nunique() == 1).all()
    assert (degraded.groupby("template").size() == 3).all()
    assert clean["quality"].min() >= degraded["quality"].mean()  # the targets are the clean faces


def test_video_probes_have_a_short_usable_window(prepared):
    """Surveillance probes at the default degradations: most frames unusable (median quality < 0.15), a usable
    window in each. Over 200 probes of 8–96 frames the best frame lies in 0.24–0.9 (> 0.3 for 95 % of them) and
    the median quality below 0.08."""
    paths, _ = prepared
    videos = read_manifest(paths.video_set / "manifest.parquet")
    probes = videos[videos["split"] == "probe"].groupby("template")["quality"]
    assert probes.ngroups == 6
    best, median = probes.max(), probes.median()
    assert (best > 0.2).all() and best.median() > 0.3, best
    assert (median < 0.15).all(), median
    assert (best > 3 * median).all()


def test_ingest_recordio(tmp_path):
    """Ingested real faces take the procedural training, held-out and discovery sets' places (tests/stages/test_ingest.py
    covers the split and bad input)."""
    gen = ProceduralFaces(seed=3)
    images = np.stack([gen.sample(i, j).image for i in range(8) for j in range(4)])
    labels = np.repeat(np.arange(8), 4)
    rec = tmp_path / "train.rec"
    write_recordio(rec, images, labels)
    assert len(RecordIOReader(rec)) == 32
    cfg = dataclasses.replace(TINY, ingest_recordio=str(rec))
    paths = Paths(tmp_path / "ws")
    result = run(cfg, paths)
    from ml.discovery.split import read_gfd_split

    sets = {d: read_manifest(paths.prepared / d / "manifest.parquet") for d in ("train", "heldout", "discovery")}
    assert {d: m["identity"].nunique() for d, m in sets.items()} == {"train": 4, "heldout": 2, "discovery": 2}
    assert all(set(m["source"]) == {"real"} for m in sets.values())
    assert read_dataset_info(paths.train_set)["source"] == "real"
    split = read_gfd_split(paths.gfd_split)  # the GFD split covers the real discovery identities
    assert set(split["path"]) == set(sets["discovery"]["path"]) and split["known"].any() and not split["known"].all()
    assert result.metrics["data/real_images"] == 32 and result.metrics["data/real_train_images"] == 16
    assert (paths.verification_dir / "real.bin").is_file() and (paths.verification_dir / "procedural.bin").is_file()
    assert not paths.fusion_set.exists()  # CAFace then trains on degraded copies of the real training faces


def test_parts_in_parallel_write_the_same_bytes_as_one_process(tmp_path):
    """The prepared directory's parts are rendered by several processes: the bytes must not depend on that."""
    import hashlib

    small = dataclasses.replace(
        TINY, video_identities=2, video_distractors=1, video_frames=(3, 5), unaligned_identities=4,
        unaligned_images_per_identity=2, unaligned_test_identities=1, unaligned_size=64,
    )

    def tree(root):
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    one, two = Paths(tmp_path / "one"), Paths(tmp_path / "two")
    r1, r2 = run(small, one, workers=1), run(small, two, workers=2)
    assert r1.metrics == r2.metrics
    files = tree(one.prepared)
    assert {"videos/manifest.parquet", "unaligned/dataset.json", "verification/procedural.bin"} <= set(files)
    assert files == tree(two.prepared)
    assert not list(tmp_path.glob("*/data/.prepared.*.tmp"))  # no temporary directory left behind
