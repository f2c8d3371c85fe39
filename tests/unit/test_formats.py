"""Interchange formats: verification .bin, RecordIO framing and layout, image folders."""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ml.data.formats import (
    RECORDIO_MAGIC,
    RecordIOReader,
    decode_image,
    encode_image,
    ingest_image_folder,
    pack_irheader,
    read_record_at,
    read_verification_bin,
    unpack_irheader,
    write_record,
    write_recordio,
    write_verification_bin,
)
from ml.errors import DataError

MAGIC = struct.pack("<I", RECORDIO_MAGIC)


def _images(n: int, h: int = 16, w: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def _smooth_images(n: int, size: int = 32) -> np.ndarray:
    """Gradients compress well under JPEG, so decoded values stay close to the originals."""
    y, x = np.mgrid[0:size, 0:size]
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for i in range(n):
        out[i, ..., 0] = (x * 6 + i * 10) % 256
        out[i, ..., 1] = (y * 5 + i * 20) % 256
        out[i, ..., 2] = 128
    return out


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# image coding
# --------------------------------------------------------------------------------------------------


def test_encode_decode_png_exact_and_grayscale_to_rgb():
    img = _images(1)[0]
    assert np.array_equal(decode_image(encode_image(img, "png"), source="x"), img)
    buf = io.BytesIO()
    Image.fromarray(img[..., 0], mode="L").save(buf, format="PNG")
    gray = decode_image(buf.getvalue(), source="x")
    assert gray.shape == (16, 12, 3) and np.array_equal(gray[..., 2], img[..., 0])
    with pytest.raises(DataError, match=r"x: grayscale image \(mode L\)"):  # ingestion wants colour faces
        decode_image(buf.getvalue(), source="x", rgb_only=True)
    rgba = io.BytesIO()
    Image.fromarray(img, mode="RGB").convert("RGBA").save(rgba, format="PNG")
    with pytest.raises(DataError, match=r"x: image has an alpha channel \(mode RGBA\)"):
        decode_image(rgba.getvalue(), source="x", rgb_only=True)
    assert decode_image(encode_image(img, "png"), source="x", rgb_only=True).shape == (16, 12, 3)


def test_decode_image_error_names_source():
    with pytest.raises(DataError, match="my-source"):
        decode_image(b"not an image", source="my-source")


# --------------------------------------------------------------------------------------------------
# verification .bin
# --------------------------------------------------------------------------------------------------


def test_bin_round_trip_png_exact(tmp_path):
    imgs = _images(6)
    path = tmp_path / "lfw.bin"
    write_verification_bin(path, imgs, [True, False, True])
    images, issame = read_verification_bin(path)
    assert images.dtype == np.uint8 and images.shape == (6, 16, 12, 3)
    assert np.array_equal(images, imgs)
    assert issame.dtype == bool and issame.tolist() == [True, False, True]
    # the file is what insightface's loader expects: (list of bytes, list of Python bools)
    with path.open("rb") as f:
        bins, issame_list = pickle.load(f)
    assert isinstance(bins, list) and all(type(b) is bytes for b in bins)
    assert issame_list == [True, False, True] and all(type(v) is bool for v in issame_list)
    assert not [p for p in tmp_path.iterdir() if p.name != "lfw.bin"]  # no temp file left


def test_bin_round_trip_jpeg_close(tmp_path):
    imgs = _smooth_images(4)
    path = tmp_path / "cfp.bin"
    write_verification_bin(path, imgs, np.array([False, True]), image_format="jpg")
    assert pickle.loads(path.read_bytes())[0][0][:2] == b"\xff\xd8"  # JPEG SOI marker
    images, issame = read_verification_bin(path)
    assert np.abs(images.astype(int) - imgs.astype(int)).mean() < 3.0
    assert issame.tolist() == [False, True]


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_bin_handcrafted_like_insightface(tmp_path, protocol):
    imgs = _smooth_images(4, size=20)
    bins = [_jpeg(im) for im in imgs]
    path = tmp_path / "agedb.bin"
    with path.open("wb") as f:
        pickle.dump((bins, [True, False]), f, protocol=protocol)
    images, issame = read_verification_bin(path)
    assert images.shape == (4, 20, 20, 3)
    assert np.array_equal(images[3], decode_image(bins[3], source="ref"))
    assert issame.tolist() == [True, False]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_bin_with_numpy_array_bins(tmp_path, protocol):
    imgs = _images(4)
    bins = [np.frombuffer(_png(im), dtype=np.uint8) for im in imgs]
    path = tmp_path / "np.bin"
    path.write_bytes(pickle.dumps((bins, np.array([True, True])), protocol=protocol))
    images, issame = read_verification_bin(path)
    assert np.array_equal(images, imgs) and issame.tolist() == [True, True]


def test_bin_py2_str_pickle_needs_bytes_encoding(tmp_path):
    """Python 2 cPickle stores ``str`` with BINSTRING; non-ASCII image bytes then need encoding="bytes"."""
    imgs = _images(2)
    body = b"".join(b"T" + struct.pack("<i", len(b)) + b for b in (_png(im) for im in imgs))
    data = b"\x80\x02" + b"](" + body + b"e" + b"](\x88e" + b"\x86."  # ([str, str], [True])
    path = tmp_path / "py2.bin"
    path.write_bytes(data)
    with pytest.raises(UnicodeDecodeError):
        pickle.loads(data)
    images, issame = read_verification_bin(path)
    assert np.array_equal(images, imgs) and issame.tolist() == [True]


def test_bin_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.bin.*not found"):
        read_verification_bin(tmp_path / "nope.bin")


def test_bin_truncated(tmp_path):
    path = tmp_path / "t.bin"
    write_verification_bin(path, _images(4), [True, False])
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(DataError, match=r"t\.bin.*(corrupt|truncated)"):
        read_verification_bin(path)


def test_bin_length_mismatch(tmp_path):
    path = tmp_path / "m.bin"
    path.write_bytes(pickle.dumps(([_png(im) for im in _images(3)], [True, False])))
    with pytest.raises(DataError, match="3 images for 2 pairs"):
        read_verification_bin(path)


def test_bin_wrong_structure(tmp_path):
    path = tmp_path / "s.bin"
    path.write_bytes(pickle.dumps({"bins": []}))
    with pytest.raises(DataError, match=r"s\.bin.*\(bins, issame_list\)"):
        read_verification_bin(path)


def test_bin_corrupt_image_names_index(tmp_path):
    bins = [_png(im) for im in _images(4)]
    bins[2] = bins[2][:40]
    path = tmp_path / "c.bin"
    path.write_bytes(pickle.dumps((bins, [True, False])))
    with pytest.raises(DataError, match=r"c\.bin image 2"):
        read_verification_bin(path)


def test_bin_differing_sizes(tmp_path):
    bins = [_png(im) for im in _images(2)] + [_png(_images(1, h=20)[0]), _png(_images(1)[0])]
    path = tmp_path / "d.bin"
    path.write_bytes(pickle.dumps((bins, [True, False])))
    with pytest.raises(DataError, match="image 2 has size"):
        read_verification_bin(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_bin_refuses_disallowed_global(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([_Evil()], [True])))
    with pytest.raises(DataError, match=r"evil\.bin.*(posix|os|nt)\.system.*not allowed"):
        read_verification_bin(path)
    assert not (tmp_path / "pwned").exists()


def test_bin_writer_validates_pairs(tmp_path):
    with pytest.raises(DataError, match="3 images for 2 pairs"):
        write_verification_bin(tmp_path / "x.bin", _images(3), [True, False])
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------
# RecordIO framing
# --------------------------------------------------------------------------------------------------


def _parts(raw: bytes) -> list[tuple[int, bytes]]:
    """Parse framed bytes into (cflag, data) parts, independently of the reader under test."""
    parts, pos = [], 0
    while pos < len(raw):
        magic, lrec = struct.unpack_from("<II", raw, pos)
        assert magic == RECORDIO_MAGIC
        length = lrec & ((1 << 29) - 1)
        parts.append((lrec >> 29, raw[pos + 8:pos + 8 + length]))
        pos += 8 + (length + 3) // 4 * 4
    return parts


def test_record_framing_matches_hand_computed_bytes():
    f = io.BytesIO()
    assert write_record(f, b"abc") == 0
    assert f.getvalue() == bytes.fromhex("0a23d7ce") + struct.pack("<I", 3) + b"abc\x00"
    assert write_record(f, b"wxyz") == 12
    assert read_record_at(f, 0) == b"abc" and read_record_at(f, 12) == b"wxyz"


def test_record_with_aligned_magic_is_split_and_rejoined():
    payload = MAGIC + b"AAAA" + MAGIC + b"BBBBBBBB" + MAGIC  # magic at aligned offsets 0, 8 and 20 (the end)
    f = io.BytesIO()
    f.write(b"\x00" * 4)  # records need not start at offset 0
    offset = write_record(f, payload)
    raw = f.getvalue()[offset:]
    assert _parts(raw) == [(1, b""), (2, b"AAAA"), (2, b"BBBBBBBB"), (3, b"")]
    assert len(raw) == 4 * 8 + 12  # four headers, 12 data bytes, no padding needed
    assert read_record_at(f, offset) == payload


def test_record_split_with_padding_on_last_part():
    payload = b"head" + MAGIC + b"tail!"  # 13 bytes: aligned magic at 4, odd-length tail
    f = io.BytesIO()
    write_record(f, payload)
    assert _parts(f.getvalue()) == [(1, b"head"), (3, b"tail!")]
    assert len(f.getvalue()) % 4 == 0
    assert read_record_at(f, 0) == payload


def test_unaligned_magic_is_not_split():
    payload = b"x" + MAGIC + b"yyy" + b"z" + MAGIC[:3]  # magic at offset 1 only; a partial magic at the end
    f = io.BytesIO()
    write_record(f, payload)
    assert _parts(f.getvalue()) == [(0, payload)]
    assert read_record_at(f, 0) == payload


def test_read_record_rejects_bad_magic_and_truncation():
    f = io.BytesIO()
    write_record(f, b"0123456789")
    with pytest.raises(DataError, match="bad magic"):
        read_record_at(f, 4, key=7)
    short = io.BytesIO(f.getvalue()[:-4])
    with pytest.raises(DataError, match="record 3 .*truncated"):
        read_record_at(short, 0, key=3)


def test_irheader_pack_unpack():
    payload = pack_irheader(5.0, b"IMG", id=9)
    assert len(payload) == 24 + 3
    header, rest = unpack_irheader(payload)
    assert (header.flag, header.label, header.id, header.id2, rest) == (0, 5.0, 9, 0, b"IMG")
    header, rest = unpack_irheader(pack_irheader([3, 8], b"IMG"))
    assert header.flag == 2 and header.label.tolist() == [3.0, 8.0] and rest == b"IMG"
    assert struct.unpack_from("<IfQQ", pack_irheader([3, 8]))[:2] == (2, 0.0)


# --------------------------------------------------------------------------------------------------
# RecordIO files
# --------------------------------------------------------------------------------------------------


def test_recordio_round_trip_insightface_layout(tmp_path):
    imgs = _images(6)
    labels = [2, 0, 1, 0, 2, 2]
    rec = tmp_path / "train.rec"
    write_recordio(rec, list(imgs), labels, image_format="png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.idx", "train.rec"]

    # .idx: key<TAB>offset, 1 header + 6 images + 3 identities
    lines = (tmp_path / "train.idx").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(k) for k in range(10)]

    with RecordIOReader(rec) as reader:
        assert len(reader) == 6
        header0, rest = reader.read_record(0)
        assert header0.flag == 2 and header0.label.tolist() == [7.0, 10.0] and rest == b""
        assert reader.header0 == (7, 10) and reader.num_identities == 3
        # images are stably grouped by label: original order [1, 3] (label 0), [2] (1), [0, 4, 5] (2)
        got = list(reader)
        assert [lab for _, lab in got] == [0, 0, 1, 2, 2, 2]
        for (img, _), src in zip(got, [1, 3, 2, 0, 4, 5]):
            assert np.array_equal(img, imgs[src])
        assert [reader.identity_range(i) for i in range(3)] == [(1, 3), (3, 4), (4, 7)]
        h, _ = reader.read_record(8)
        assert h.flag == 2 and h.label.tolist() == [3.0, 4.0]
        h, payload = reader.read_record(2)
        assert h.flag == 0 and h.label == 0.0 and payload[:8] == b"\x89PNG\r\n\x1a\n"
        assert np.array_equal(reader[-1][0], imgs[5])
        with pytest.raises(IndexError):
            reader[6]


def test_recordio_jpeg_round_trip_close(tmp_path):
    imgs = _smooth_images(3)
    write_recordio(tmp_path / "j.rec", imgs, np.array([0, 1, 1]))
    with RecordIOReader(tmp_path / "j.rec") as reader:
        for (img, _), ref in zip(reader, imgs):
            assert np.abs(img.astype(int) - ref.astype(int)).mean() < 3.0


def test_recordio_array_labels_without_header0(tmp_path):
    """A handcrafted file without a header-only record 0: every idx key is an image, array labels give
    their first value."""
    imgs = _images(2)
    rec = tmp_path / "arr.rec"
    with rec.open("wb") as f:
        offsets = []
        head = struct.pack("<IfQQ", 2, 0.0, 0, 0) + np.array([7, 0.5], dtype="<f4").tobytes()
        offsets.append(write_record(f, head + _png(imgs[0])))
        offsets.append(write_record(f, struct.pack("<IfQQ", 0, 3.0, 1, 0) + _png(imgs[1])))
    (tmp_path / "arr.idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets)))
    with RecordIOReader(rec) as reader:
        assert reader.header0 is None and len(reader) == 2
        assert [lab for _, lab in reader] == [7, 3]
        assert np.array_equal(reader[1][0], imgs[1])
        header, _ = reader.read_record(0)
        assert header.label.tolist() == [7.0, 0.5]


def test_recordio_image_containing_magic_round_trips(tmp_path):
    """Encoded bytes holding the magic at an aligned offset survive the split/re-join."""
    rec = tmp_path / "m.rec"
    png = _png(_images(1)[0])
    png += b"\x00" * (-(24 + len(png)) % 4)  # IRHeader is 24 bytes: the magic lands on an aligned offset
    image_bytes = png + MAGIC + b"trailer"
    write_recordio(rec, [image_bytes], [0])
    with RecordIOReader(rec) as reader:
        _, payload = reader.read_record(1)
        assert payload == image_bytes
    raw = rec.read_bytes()
    cflags = [lrec >> 29 for _, lrec in (struct.unpack_from("<II", raw, m) for m in _headers_offsets(raw))]
    assert 1 in cflags and 3 in cflags


def _headers_offsets(raw: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(raw):
        out.append(pos)
        length = struct.unpack_from("<I", raw, pos + 4)[0] & ((1 << 29) - 1)
        pos += 8 + (length + 3) // 4 * 4
    return out


def test_recordio_missing_idx(tmp_path):
    write_recordio(tmp_path / "a.rec", _images(2), [0, 1], image_format="png")
    (tmp_path / "a.idx").unlink()
    with pytest.raises(DataError, match=r"a\.idx.*not found.*[Rr]ebuild"):
        RecordIOReader(tmp_path / "a.rec")
    RecordIOReader.rebuild_index(tmp_path / "a.rec")
    with RecordIOReader(tmp_path / "a.rec") as reader:
        assert [lab for _, lab in reader] == [0, 1]


def test_recordio_truncated_names_key(tmp_path):
    rec = tmp_path / "t.rec"
    write_recordio(rec, _images(3), [0, 1, 2], image_format="png")
    offsets = dict(line.split("\t") for line in (tmp_path / "t.idx").read_text().splitlines())
    rec.write_bytes(rec.read_bytes()[: int(offsets["3"]) + 100])  # cut inside image record 3
    with RecordIOReader(rec) as reader:
        assert reader[0][1] == 0
        with pytest.raises(DataError, match=r"t\.rec: record 3 .*truncated"):
            reader[2]
        with pytest.raises(DataError, match=r"t\.rec: record 4 .*end of the file"):
            reader.read_record(4)


def test_recordio_bad_idx_line(tmp_path):
    write_recordio(tmp_path / "b.rec", _images(1), [0], image_format="png")
    (tmp_path / "b.idx").write_text("0\t0\nbogus line\n")
    with pytest.raises(DataError, match=r"b\.idx: line 2"):
        RecordIOReader(tmp_path / "b.rec")
    (tmp_path / "b.idx").write_text("0\t0\n1\t99999999999999999999\n")  # past int64: corrupt, not a crash
    with pytest.raises(DataError, match=r"b\.idx: line 2 holds a key or offset beyond 2\^63"):
        RecordIOReader(tmp_path / "b.rec")


def test_recordio_index_duplicate_key_names_both_lines_and_unknown_key_is_refused(tmp_path):
    write_recordio(tmp_path / "d.rec", _images(3), [0, 1, 2], image_format="png")
    idx = tmp_path / "d.idx"
    lines = idx.read_text().splitlines()
    with RecordIOReader(tmp_path / "d.rec") as reader:
        assert reader.image_keys.tolist() == [1, 2, 3] and not reader.image_keys.flags.writeable
        assert reader.keys == [int(line.split("\t")[0]) for line in lines]  # file order
        with pytest.raises(DataError, match=r"d\.rec: key 99 is not in d\.idx"):
            reader.read_raw(99)
    idx.write_text("\n".join(lines[:2] + [""] + lines[2:] + [lines[1]]) + "\n")  # a blank line, key 1 again
    with pytest.raises(DataError, match=rf"d\.idx: key 1 appears twice \(lines 2 and {len(lines) + 2}\)"):
        RecordIOReader(tmp_path / "d.rec")


def test_recordio_index_out_of_key_order_reads_each_key(tmp_path):
    """An ``.idx`` need not be in key order (the reader searches a sorted copy then): every key reads its record."""
    images = _images(4)
    write_recordio(tmp_path / "o.rec", images, [0, 1, 2, 3], image_format="png")
    idx = tmp_path / "o.idx"
    in_order = idx.read_text().splitlines()
    with RecordIOReader(tmp_path / "o.rec") as reader:
        expected = {key: reader.read_raw(key) for key in reader.keys}
    idx.write_text("\n".join(in_order[::-1]) + "\n")
    with RecordIOReader(tmp_path / "o.rec") as reader:
        assert reader.keys == sorted(expected, reverse=True)
        assert {key: reader.read_raw(key) for key in reader.keys} == expected
        with pytest.raises(DataError, match=r"o\.rec: key 99 is not in o\.idx"):
            reader.read_raw(99)


def test_write_recordio_is_atomic_on_bad_input(tmp_path):
    rec = tmp_path / "x.rec"
    write_recordio(rec, _images(2), [0, 1], image_format="png")
    before = rec.read_bytes(), (tmp_path / "x.idx").read_bytes()
    bad = [_images(1)[0], np.zeros((4, 4), dtype=np.uint8)]
    with pytest.raises(DataError, match="image 1"):
        write_recordio(rec, bad, [0, 1])
    assert (rec.read_bytes(), (tmp_path / "x.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.idx", "x.rec"]


# --------------------------------------------------------------------------------------------------
# image folders
# --------------------------------------------------------------------------------------------------


def _touch_image(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_png(_images(1, 4, 4)[0]))


def test_ingest_image_folder(tmp_path):
    for rel in ("bob/2.jpg", "bob/1.PNG", "alice/a.jpeg", "carol/x.bmp"):
        _touch_image(tmp_path / rel)
    (tmp_path / "bob" / "notes.txt").write_text("ignored")
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / ".cache").mkdir()  # hidden: not an identity
    pairs = ingest_image_folder(tmp_path)
    assert [(p.relative_to(tmp_path).as_posix(), ident) for p, ident in pairs] == [
        ("alice/a.jpeg", "alice"), ("bob/1.PNG", "bob"), ("bob/2.jpg", "bob"), ("carol/x.bmp", "carol")]
    assert [p.name for p, _ in ingest_image_folder(tmp_path, extensions=(".jpg",))] == ["2.jpg"]


def test_ingest_image_folder_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        ingest_image_folder(tmp_path / "missing")
    with pytest.raises(DataError, match="no images"):
        ingest_image_folder(tmp_path)
    _touch_image(tmp_path / "bob" / "1.png")
    _touch_image(tmp_path / "stray.png")
    with pytest.raises(DataError, match=r"stray\.png.*top level"):
        ingest_image_folder(tmp_path)
    (tmp_path / "stray.png").unlink()
    (tmp_path / "carol").mkdir()
    (tmp_path / "carol" / "notes.txt").write_text("no faces here")
    with pytest.raises(DataError, match=r"carol: identity folder has no images"):
        ingest_image_folder(tmp_path)
    (tmp_path / "carol" / "notes.txt").unlink()
    (tmp_path / "carol").rmdir()
    _touch_image(tmp_path / "bob" / "deeper" / "x.jpg")
    with pytest.raises(DataError, match=r"deeper/x\.jpg.*nested"):
        ingest_image_folder(tmp_path)
