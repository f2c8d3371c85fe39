"""Real data in: the user's faces are split into disjoint training / held-out / discovery identities, streamed into
the prepared datasets every stage reads, and bad input is refused (or skipped, within a budget) naming the item."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from ml.data.dataset import read_dataset_info, read_manifest
from ml.data.formats import ingest_image_folder, read_verification_bin, write_recordio
from ml.data.ingest import MIN_CAPPED_IMAGES, IngestSpec, cap_items, ingest_split, list_items, split_identities
from ml.data.procedural import ProceduralFaces
from ml.errors import ConfigError, DataError
from tasks.common import Paths
from tasks.prepare import DataConfig, run

TINY = DataConfig(train_identities=4, images_per_identity=4, heldout_identities=4, heldout_images_per_identity=3,
                  gallery_images_per_identity=1, verification_pairs=40, template_identities=2,
                  templates_per_identity=2, frames_per_template=1, discovery_identities=4,
                  discovery_images_per_identity=4, video_identities=2, video_distractors=1, video_frames=(2, 4),
                  unaligned_identities=3, unaligned_images_per_identity=2, unaligned_test_identities=1)


def _faces(n_ids: int, per: int, size: int = 64, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    gen = ProceduralFaces(seed=seed)
    images = np.stack([gen.sample(i, j).image for i in range(n_ids) for j in range(per)])
    if size != images.shape[1]:
        from PIL import Image

        images = np.stack([np.asarray(Image.fromarray(im).resize((size, size))) for im in images])
    return images, np.repeat(np.arange(n_ids), per)


def _nearest_is_allowed(bin_images: np.ndarray, allowed: np.ndarray, others: np.ndarray) -> bool:
    """Every (JPEG-recompressed) image of a ``.bin`` is closest to one of ``allowed`` and nearly equal to it."""
    def small(x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), 16, 4, 16, 4, 3).mean(axis=(2, 4)).reshape(len(x), -1).astype(np.float32)

    def dist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ((a ** 2).sum(1)[:, None] - 2 * a @ b.T + (b ** 2).sum(1)[None]).clip(0)

    q = small(bin_images)
    to_allowed = dist(q, small(allowed)).min(axis=1)
    to_others = dist(q, small(others)).min(axis=1) if len(others) else np.full(len(q), np.inf)
    return bool((to_allowed < to_others).all() and (np.sqrt(to_allowed / q.shape[1]) < 4.0).all())


def _nearest(bin_images: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Index into ``faces`` of the face each (JPEG-recompressed) ``.bin`` image is closest to."""
    q, f = (x.reshape(len(x), -1).astype(np.float32) for x in (bin_images, faces))
    return ((q ** 2).sum(1)[:, None] - 2 * q @ f.T + (f ** 2).sum(1)[None]).argmin(axis=1)


def _manifests(paths: Paths) -> dict[str, object]:
    return {d: read_manifest(paths.prepared / d / "manifest.parquet") for d in ("train", "heldout", "discovery")}


def test_split_is_deterministic_disjoint_and_follows_the_fractions():
    names = [f"p{i:02d}" for i in range(50)]
    split = split_identities(names, seed=0, heldout_fraction=0.2, discovery_fraction=0.1)
    assert split == split_identities(list(reversed(names)), seed=0, heldout_fraction=0.2, discovery_fraction=0.1)
    counts = {g: sum(v == g for v in split.values()) for g in ("train", "heldout", "discovery")}
    assert counts == {"train": 35, "heldout": 10, "discovery": 5}
    other = split_identities(names, seed=1, heldout_fraction=0.2, discovery_fraction=0.1)
    assert other != split  # the seed decides which identities are held out
    assert "discovery" not in split_identities(names, seed=0, heldout_fraction=0.2, discovery_fraction=0.0).values()
    with pytest.raises(DataError, match="3 identities: too few"):
        split_identities(["a", "b", "c"], seed=0, heldout_fraction=0.2, discovery_fraction=0.0)


def test_real_faces_replace_the_procedural_training_and_heldout_sets(glint24, tmp_path):
    cfg = dataclasses.replace(TINY, ingest_folder=str(glint24), verification_pairs=600)
    paths = Paths(tmp_path)
    result = run(cfg, paths, workers=1)
    sets = _manifests(paths)
    ids = {name: set(m["identity"]) for name, m in sets.items()}
    assert ids["train"].isdisjoint(ids["heldout"]) and ids["train"].isdisjoint(ids["discovery"])
    assert ids["heldout"].isdisjoint(ids["discovery"])
    assert len(ids["train"] | ids["heldout"] | ids["discovery"]) == 24  # every person, in exactly one group
    assert (len(ids["train"]), len(ids["heldout"]), len(ids["discovery"])) == (14, 5, 5)
    for name, m in sets.items():
        assert set(m["source"]) == {"real"} and (m["width"] == 64).all()
        assert read_dataset_info(paths.prepared / name)["generator"]["ingested_from"] == str(glint24.resolve())
    assert sum(len(m) for m in sets.values()) == 942 == result.metrics["data/real_images"]
    assert set(sets["train"]["split"]) == {"train", "val"} and set(sets["heldout"]["split"]) == {"gallery", "probe"}
    # real.bin pairs only held-out faces (never a training face)
    from ml.data.dataset import load_images

    images, issame = read_verification_bin(paths.verification_dir / "real.bin")
    assert len(issame) == 600 and issame.sum() == 300
    heldout = load_images(paths.heldout_set, sets["heldout"])
    assert _nearest_is_allowed(images, heldout, load_images(paths.train_set, sets["train"]))
    who = sets["heldout"]["identity"].to_numpy()[_nearest(images, heldout)]  # each pair's two people
    np.testing.assert_array_equal(who[0::2] == who[1::2], issame)  # genuine pairs are one person, impostors two
    gfd = json.loads((paths.gfd_split.parent / "split.json").read_text())
    assert gfd["source"] == "real" and gfd["identities"] == 5
    assert (paths.verification_dir / "procedural.bin").is_file()  # the procedural reference stays
    # the validation gate accepts the real sets (their counts are the user's, not params')
    from tasks.validate import ValidateConfig, run as validate

    validate(cfg, ValidateConfig(), paths)
    # same seed, same split; another seed holds out other people
    again = Paths(tmp_path / "again")
    run(dataclasses.replace(cfg, seed=1), again, workers=1)
    assert set(_manifests(again)["heldout"]["identity"]) != ids["heldout"]


def test_one_person_under_two_folder_names_is_refused_at_validate_naming_the_folders(glint24, tmp_path):
    """Every glint24 person copied under a second folder name (48 folders, each image twice): wherever the seed puts
    the two copies — one training group, or training and held-out — the gate stops before anything trains."""
    import re
    import shutil

    from tasks.validate import ValidateConfig, run as validate

    folder = tmp_path / "faces"
    for person in sorted(p for p in glint24.iterdir() if p.is_dir()):
        shutil.copytree(person, folder / person.name)
        shutil.copytree(person, folder / f"{person.name}_again")
    cfg = dataclasses.replace(TINY, ingest_folder=str(folder), verification_pairs=600)
    paths = Paths(tmp_path / "ws")
    run(cfg, paths, workers=1)
    with pytest.raises(DataError, match="the leakage check failed") as err:
        validate(cfg, ValidateConfig(), paths)
    message = str(err.value)
    named = re.findall(r"(\S+) and \1_again share (\d+) of (\d+)", message)
    crossed = re.findall(r"images in both (\w+) and (\w+) \((\d+)\)", message)
    assert named and all(int(a) >= 0.9 * int(b) for _, a, b in named), message  # one set: (nearly) every image
    assert crossed, message  # the copies the seed split apart: the same images on both sides
    assert (paths.root / "reports" / "validation-failed" / "leakage.json").is_file()
    assert not paths.validation_reports.exists()


def test_recordio_ingest_streams_and_checks_the_header_ranges(tmp_path):
    images, labels = _faces(8, 5)
    rec = tmp_path / "in" / "train.rec"
    rec.parent.mkdir()
    write_recordio(rec, images, labels)
    spec = IngestSpec(recordio=str(rec))
    items = list_items(spec)
    assert len(items) == 40 and len({it.identity for it in items}) == 8
    got: dict[str, list] = {"train": [], "heldout": [], "discovery": []}
    stats = ingest_split(spec, {g: (lambda g: lambda img, ident, i, n, ref, enc: got[g].append((ident, i, n)))(g)
                                for g in got}, seed=0, heldout_fraction=0.25, discovery_fraction=0.25, progress=False)
    assert stats["data/real_images"] == 40 and stats["data/real_heldout_identities"] == 2
    assert {len({ident for ident, _, _ in v}) for v in got.values()} == {2, 4}
    # an image record whose label disagrees with the identity record whose range holds it
    raw = bytearray(rec.read_bytes())
    idx = dict(tuple(map(int, line.split("\t"))) for line in rec.with_suffix(".idx").read_text().splitlines())
    struct.pack_into("<f", raw, idx[2] + 8 + 4, 3.0)  # record 2 (identity 0's range) now says label 3
    rec.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"record 2 has label 3 .*label ranges disagree"):
        list_items(spec)


def test_corrupt_images_are_skipped_within_the_budget_and_refused_above_it(tmp_path):
    from ml.data.formats import encode_image

    images, labels = _faces(8, 5)
    payloads = [encode_image(im, "jpg") for im in images]
    payloads[7] = payloads[7][:20] + b"\x00" * 200  # identity 1's third image: a JPEG header and then garbage
    rec = tmp_path / "train.rec"
    write_recordio(rec, payloads, labels)
    ws = Paths(tmp_path / "ok")
    result = run(dataclasses.replace(TINY, ingest_recordio=str(rec), ingest_max_corrupt_fraction=0.05), ws, workers=1)
    assert result.metrics["data/real_corrupt_skipped"] == 1 and result.metrics["data/real_images"] == 39
    with pytest.raises(DataError, match=r"1 of 40 images could not be ingested .*record 8: cannot decode"):
        run(dataclasses.replace(TINY, ingest_recordio=str(rec)), Paths(tmp_path / "strict"), workers=1)
    assert not (tmp_path / "strict" / "data" / "prepared").exists()  # nothing half-written


def test_single_image_identities_are_kept_for_training_and_left_out_of_pairs(tmp_path):
    from ml.data.formats import encode_image

    images, _ = _faces(16, 4)
    folder = tmp_path / "faces"
    for k, im in enumerate(images):
        ident, i = divmod(k, 4)
        if ident >= 10 and i > 0:  # identities 10..15 have one image each
            continue
        (folder / f"person{ident}").mkdir(parents=True, exist_ok=True)
        (folder / f"person{ident}" / f"{i}.jpg").write_bytes(encode_image(im, "jpg"))
    paths = Paths(tmp_path / "ws")
    cfg = dataclasses.replace(TINY, ingest_folder=str(folder), real_heldout_fraction=0.5, real_discovery_fraction=0.0,
                              gfd_dataset="discovery")
    result = run(cfg, paths, workers=1)
    assert result.metrics["data/real_single_image_identities"] == 6
    train, heldout = (read_manifest(p / "manifest.parquet") for p in (paths.train_set, paths.heldout_set))
    singles = {f"person{i}" for i in range(10, 16)}
    assert singles & set(train["identity"])  # kept for training (split "train": no val image to spare)
    assert set(train.loc[train["identity"].isin(singles), "split"]) == {"train"}
    held_singles = singles & set(heldout["identity"])
    assert set(heldout.loc[heldout["identity"].isin(held_singles), "split"]) <= {"gallery"}
    from ml.data.dataset import load_images

    images_bin, _ = read_verification_bin(paths.verification_dir / "real.bin")
    single = heldout["identity"].isin(singles)
    assert held_singles and _nearest_is_allowed(
        images_bin, load_images(paths.heldout_set, heldout[~single]), load_images(paths.heldout_set, heldout[single]))


def test_wrong_size_is_refused_unless_resizing_is_allowed(tmp_path):
    from ml.data.formats import encode_image

    images, _ = _faces(6, 3, size=80)
    folder = tmp_path / "faces"
    for k, im in enumerate(images):
        ident, i = divmod(k, 3)
        (folder / f"p{ident}").mkdir(parents=True, exist_ok=True)
        (folder / f"p{ident}" / f"{i}.png").write_bytes(encode_image(im, "png"))
    cfg = dataclasses.replace(TINY, ingest_folder=str(folder), ingest_resize=False)
    with pytest.raises(DataError, match=r"p0/0\.png: image is 80x80, not data.image_size 64x64.*ingest_resize"):
        run(cfg, Paths(tmp_path / "strict"), workers=1)
    run(dataclasses.replace(cfg, ingest_resize=True), Paths(tmp_path / "ok"), workers=1)
    assert (read_manifest(tmp_path / "ok" / "data" / "prepared" / "train" / "manifest.parquet")["width"] == 64).all()


def test_faces_at_the_right_size_keep_their_bytes_others_are_resized_to_pngs(tmp_path):
    """A JPEG or PNG face already at data.image_size is stored as the file it was (no re-encode); a BMP, or a face
    that needed a resize, is stored as a PNG. The dataset reads back the same pixels either way."""
    import io

    from PIL import Image

    from ml.data.dataset import dataset_digest, load_images
    from ml.data.formats import decode_image, encode_image
    from ml.data.shards import ShardReader

    images, _ = _faces(8, 4)
    big, _ = _faces(8, 1, size=80, seed=5)
    folder, source = tmp_path / "faces", {}
    for ident in range(8):
        (folder / f"p{ident}").mkdir(parents=True)
        files = {"0.jpg": encode_image(images[4 * ident], "jpg"), "1.png": encode_image(images[4 * ident + 1], "png"),
                 "3.jpg": encode_image(big[ident], "jpg")}  # 80 px: resized
        bmp = io.BytesIO()
        Image.fromarray(images[4 * ident + 2]).save(bmp, "BMP")
        files["2.bmp"] = bmp.getvalue()
        for name, data in files.items():
            (folder / f"p{ident}" / name).write_bytes(data)
            source[data] = name
    paths = Paths(tmp_path / "ws")
    run(dataclasses.replace(TINY, ingest_folder=str(folder), ingest_resize=True), paths, workers=1)
    for root in (paths.train_set, paths.heldout_set):
        manifest = read_manifest(root / "manifest.parquet")
        stored = ShardReader(root / "shards").read_many([p.rsplit(".", 1)[0] for p in manifest["path"]])
        kept = [source.get(data) for data in stored]
        for path, name in zip(manifest["path"], kept):  # kept: the 64-px JPEG and PNG files, nothing else
            assert path.endswith(name[-4:]) if name else path.endswith(".png")
        assert {name for name in kept if name} == {"0.jpg", "1.png"}
        assert kept.count("0.jpg") == kept.count("1.png") == len(kept) // 4
        decoded = np.stack([decode_image(data, source="test") for data in stored])
        assert np.array_equal(load_images(root, manifest), decoded)
        assert read_dataset_info(root)["digest"] == dataset_digest(root)


def test_ingest_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="exactly one of 'data.ingest_folder'"):
        IngestSpec()
    with pytest.raises(ConfigError, match="data.real_heldout_fraction"):
        dataclasses.replace(TINY, real_heldout_fraction=0.0)
    with pytest.raises(ConfigError, match="data.ingest_max_corrupt_fraction"):
        dataclasses.replace(TINY, ingest_max_corrupt_fraction=1.0)
    assert TINY.gfd_source == "discovery"
    assert dataclasses.replace(TINY, ingest_folder="x").gfd_source == "real"
    assert dataclasses.replace(TINY, ingest_folder="x", gfd_dataset="discovery").gfd_source == "discovery"


def test_folder_listing_matches_the_image_folder_reader(glint24):
    listed = ingest_image_folder(glint24)
    assert [(it.ref, it.identity) for it in list_items(IngestSpec(folder=str(glint24)))] == listed
    capped = [(it.ref, it.identity) for it in list_items(IngestSpec(folder=str(glint24), max_images=100))]
    assert len(capped) <= 100 and set(capped) <= set(listed)
    assert len({identity for _, identity in capped}) == len({identity for _, identity in listed})  # all 24 kept


def test_a_cap_spreads_over_the_identities_by_hand():
    codes = np.repeat([0, 1, 2], [10, 3, 8])
    kept = cap_items(codes, 12, seed=0)  # the largest c with Σ min(n_i, c) ≤ 12 is 4: 4 + 3 + 4
    assert np.bincount(codes[kept]).tolist() == [4, 3, 4] and np.all(np.diff(kept) > 0)
    assert not np.array_equal(kept, cap_items(codes, 12, seed=1))  # which images: a seeded draw
    np.testing.assert_array_equal(kept, cap_items(codes, 12, seed=0))
    # too many identities for MIN_CAPPED_IMAGES each: a seeded subset of identities keeps that many
    many = np.repeat(np.arange(50), 20)
    few = cap_items(many, 40, seed=0)
    assert len(few) == 40 and set(np.bincount(many[few])[np.unique(many[few])].tolist()) == {MIN_CAPPED_IMAGES}
    assert len(cap_items(codes, 100, seed=0)) == len(codes)


def test_a_capped_identity_ordered_recordio_trains_on_many_identities(tmp_path):
    """A RecordIO is ordered by identity (every insightface .rec is): the smoke preset's 1,000-face cap must not keep
    the first identities only."""
    images, labels = _faces(60, 40, size=32)  # 2,400 faces of 60 identities, identity by identity
    rec = tmp_path / "in" / "train.rec"
    rec.parent.mkdir()
    write_recordio(rec, images, labels)
    items = list_items(IngestSpec(recordio=str(rec), max_images=1000, seed=0))
    counts = np.bincount(items.codes)
    assert len(items) <= 1000 and len(items.identities) == 60 and counts.min() == counts.max() == 16
    cfg = dataclasses.replace(TINY, image_size=32, ingest_recordio=str(rec), ingest_max_images=1000)
    paths = Paths(tmp_path / "ws")
    run(cfg, paths, workers=1)
    train = _manifests(paths)["train"]
    assert train["identity"].nunique() >= 30 and len(train) >= 30 * 16
