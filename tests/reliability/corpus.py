"""The bad-input corpus: malformed inputs at every entry point, as data, and the harness that runs them.

Each :class:`Case` names an entry point, builds one malformed input under a temporary directory (plus, where the
entry point writes outputs, a *prior* output of a previous good run) and says how to invoke the entry point and
which words the error message must contain: the input's file, key or row, and the problem. :func:`run_case`
invokes it and judges the outcome. A case is **handled well** when

- the exit status is non-zero,
- there is no traceback, and exactly one ``error: ...`` line, the last line of stderr (one line, not a paragraph),
- that line contains every expected word (case-insensitive),
- every file that existed before (prior outputs, the malformed input itself) is byte-for-byte unchanged with the
  same modification time, and no new file was left behind (temporary files included) apart from the evidence an
  entry point writes on purpose (``reports/validation-failed/`` of a failed Great Expectations gate),
- the case's own post-condition holds (e.g. the malicious pickle's command did not run).

Most cases run in-process (``faceops`` through its Typer app with ``argv``, ``python -m tasks.<stage>`` through
``runpy``, both with stdout/stderr captured and ``SystemExit`` caught), a few as real ``faceops`` processes to
show the exit status and the one-line message end to end. An in-process ``faceops run``/``sweep`` whose bad input
is not refused before its Prefect flow starts is stopped at the flow's door and counts as not handled.

``tests/reliability/test_bad_inputs.py`` asserts every case; ``python -m tests.reliability.report_inputs`` writes
``reports/reliability_inputs.md``.
"""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import pickle
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SMOKE_PRESET = "smoke"
PROJECT_FILES = ("dvc.yaml", "params.yaml", "presets.yaml")

# -------------------------------------------------------------------------------------------------- the data model


@dataclass(frozen=True)
class Invocation:
    """How to invoke the entry point on the malformed input.

    ``kind``: ``cli`` (``faceops ARGV`` in-process), ``module`` (``python -m ARGV[0] ARGV[1:]`` in-process) or
    ``subprocess`` (the real ``faceops`` executable). ``evidence``: globs (relative to ``cwd``) of files the entry
    point writes on purpose when it fails. ``check``: a post-condition; returns what is wrong, or None.
    """

    argv: tuple[str, ...]
    cwd: Path
    kind: str = "cli"
    env: Mapping[str, str] = field(default_factory=dict)
    evidence: tuple[str, ...] = ()
    check: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class Case:
    id: str
    entry: str                      # the entry point, as a user would name it
    input: str                      # the malformed input, in words
    build: Callable[["Workspace"], Invocation]
    expect: tuple[str, ...]         # words the error message must contain (input name and problem)


@dataclass
class Outcome:
    case: Case
    command: str
    code: int | str | None
    stdout: str
    stderr: str
    message: str
    problems: list[str]
    seconds: float
    tmp: Path | None = None

    @property
    def handled_well(self) -> bool:
        return not self.problems

    @property
    def shown_message(self) -> str:
        """The message with the case's temporary directory shown as ``<tmp>``."""
        return self.message.replace(f"{self.tmp}/", "<tmp>/") if self.tmp else self.message

    def explain(self) -> str:
        tail = "\n".join(self.stderr.strip().splitlines()[-25:])
        return (f"{self.case.id} ({self.command}): exit {self.code}; problems: {'; '.join(self.problems)}\n"
                f"--- stderr (tail) ---\n{tail}")


# ------------------------------------------------------------------------------------------- shared, built once


class Context:
    """What many cases share, built once per session under ``cache``: the smoke-size params, a valid prepared
    dataset (for the validate cases) and a valid tiny FR model directory (for the export cases)."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.cache.mkdir(parents=True, exist_ok=True)
        self._params: dict | None = None

    def params(self) -> dict:
        """``params.yaml`` with the ``smoke`` preset applied (a deep copy each time)."""
        if self._params is None:
            from tasks.common import load_yaml

            params = load_yaml((REPO / "params.yaml").read_text())
            preset = load_yaml((REPO / "presets.yaml").read_text())[SMOKE_PRESET]
            for key, value in preset.items():
                node = params
                *parents, last = key.split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                node[last] = value
            self._params = params
        return json.loads(json.dumps(self._params))

    def prepared(self) -> Path:
        """A valid ``data/prepared`` at smoke size (the validate gate passes on it)."""
        out = self.cache / "prepared-root"
        if not (out / "data" / "prepared" / "gfd" / "split.json").is_file():
            from ml.config import from_mapping
            from tasks.common import Paths
            from tasks.prepare import DataConfig, run

            shutil.rmtree(out, ignore_errors=True)
            cfg = from_mapping(DataConfig, self.params()["data"], "data")
            run(cfg, Paths(out), workers=1)
        return out / "data" / "prepared"

    def model_dir(self) -> Path:
        """A valid tiny FR model directory (``config.json`` + ``model.safetensors``)."""
        out = self.cache / "model"
        if not (out / "config.json").is_file():
            from ml.fr.backbones import build_backbone
            from ml.models.io import save_model

            kwargs = {"depth": 1, "dim": 32, "heads": 2, "embed_dim": 16}
            save_model(out, build_backbone("vit_tiny", **kwargs).eval(), backbone="vit_tiny", kwargs=kwargs)
        return out


class Workspace:
    """One case's directory: ``root`` is the project working copy the entry point runs in, ``inputs`` holds user
    inputs outside it (image folders, RecordIO files)."""

    def __init__(self, tmp: Path, ctx: Context):
        self.tmp = Path(tmp)
        self.ctx = ctx
        self.root = self.tmp / "ws"
        self.inputs = self.tmp / "inputs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.inputs.mkdir(parents=True, exist_ok=True)

    def params(self) -> dict:
        return self.ctx.params()

    def project(self, params: dict | None = None, *, params_text: str | None = None,
                dvc_yaml_text: str | None = None, dvc: bool = False) -> Path:
        """The project files (``dvc.yaml``, ``params.yaml`` at smoke size or as given, ``presets.yaml``); with
        ``dvc`` also a DVC repository (``.dvc/``, git) so DVC can read the stage graph."""
        import yaml

        for name in PROJECT_FILES:
            shutil.copyfile(REPO / name, self.root / name)
        if params_text is None:
            params_text = yaml.safe_dump(self.params() if params is None else params, sort_keys=False)
        (self.root / "params.yaml").write_text(params_text)
        if dvc_yaml_text is not None:
            (self.root / "dvc.yaml").write_text(dvc_yaml_text)
        if dvc:
            (self.root / ".dvc").mkdir(exist_ok=True)
            (self.root / ".dvc" / "config").write_text("")
            subprocess.run(["git", "init", "-q"], cwd=self.root, check=True)
        return self.root

    def write(self, rel: str, data: bytes | str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    def prior(self, *rels: str) -> None:
        """Outputs of an earlier good run, which a failure must leave exactly as they are."""
        for rel in rels:
            if rel.endswith("/"):
                self.write(rel + "dataset.json", json.dumps({"prior": rel}) + "\n")
            elif rel.endswith(".png"):
                self.write(rel, _encode(_rgb((8, 8), seed=7), "png"))
            else:
                self.write(rel, f"prior output {rel}\n")

    def prepared(self) -> Path:
        dst = self.root / "data" / "prepared"
        shutil.copytree(self.ctx.prepared(), dst)
        return dst


# ------------------------------------------------------------------------------------------------------ helpers


def _rgb(size: tuple[int, int] = (64, 64), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3)).astype(np.uint8)
    img = np.kron(coarse, np.ones((size[0] // 4 + 1, size[1] // 4 + 1, 1), dtype=np.uint8))[: size[0], : size[1]]
    return np.ascontiguousarray(img)


def _encode(img: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    from PIL import Image

    pil = Image.fromarray(img)
    if mode is not None:
        pil = pil.convert(mode)
    buf = io.BytesIO()
    pil.save(buf, format={"jpg": "JPEG", "png": "PNG"}[fmt])
    return buf.getvalue()


def _marker_absent(path: Path) -> Callable[[], str | None]:
    return lambda: f"{path} exists: the pickle's payload ran" if path.exists() else None


class _Exec:
    """Pickles to ``func(*args)``: unpickled with plain ``pickle.load`` it calls ``func``."""

    def __init__(self, func: Callable, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def malicious_bin(marker: Path, via: str = "os.system") -> bytes:
    """A ``.bin``-shaped pickle that runs code when unpickled: it creates ``marker``."""
    payload = (_Exec(os.system, f"touch {marker}") if via == "os.system"
               else _Exec(builtins.exec, f"open({str(marker)!r}, 'w').close()"))
    return pickle.dumps(([payload, b"x"], [True]), protocol=2)


CASES: list[Case] = []


def case(id: str, entry: str, input: str, expect: tuple[str, ...]) -> Callable:
    def register(build: Callable[[Workspace], Invocation]) -> Callable[[Workspace], Invocation]:
        CASES.append(Case(id, entry, input, build, expect))
        return build
    return register


# ------------------------------------------------------------------------------ prepare: data.ingest_folder

PREPARE = "faceops stage prepare"
PREPARE_OUTPUTS = ("data/prepared/", "plots/samples.png")


def _ingest_folder(ws: Workspace, bad: Mapping[str, bytes | None], *, kind: str = "cli", **data: Any) -> Invocation:
    """An image folder of six good identities (3 RGB 64x64 PNGs each: enough to split into training, held-out and
    discovery identities) plus ``bad`` (path → bytes; None: a directory); params point ``data.ingest_folder`` at it;
    a prior ``data/prepared`` and sample grid exist."""
    folder = ws.inputs / "faces"
    for k, ident in enumerate(("alice", "bob", "erin", "frank", "grace", "heidi")):
        for i in range(3):
            path = folder / ident / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_encode(_rgb(seed=10 * k + i), "png"))
    for rel, payload in bad.items():
        path = folder / rel
        if payload is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(payload)
    params = ws.params()
    params["data"].update({"ingest_folder": str(folder), **data})
    ws.project(params)
    ws.prior(*PREPARE_OUTPUTS)
    argv = ("stage", "prepare") if kind != "module" else ("tasks.prepare",)
    return Invocation(argv, ws.root, kind=kind, env={"OMP_NUM_THREADS": "1"})


_JPG = _encode(_rgb(seed=99), "jpg")
_PNG = _encode(_rgb(seed=98), "png")


@case("ingest-truncated-jpeg", PREPARE, "data.ingest_folder: a JPEG cut in half", ("bob/z.jpg", "truncated"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.jpg": _JPG[: len(_JPG) // 2]})


@case("ingest-corrupt-jpeg", PREPARE, "data.ingest_folder: JPEG header followed by garbage",
      ("bob/z.jpg", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    garbage = np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    return _ingest_folder(ws, {"bob/z.jpg": _JPG[:20] + garbage})


@case("ingest-truncated-png", PREPARE, "data.ingest_folder: a PNG cut in half", ("bob/z.png", "truncated"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": _PNG[: len(_PNG) // 2]})


@case("ingest-corrupt-png", PREPARE, "data.ingest_folder: PNG with a corrupted header chunk (bad CRC)",
      ("bob/z.png", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": _PNG[:20] + bytes([_PNG[20] ^ 0xFF]) + _PNG[21:]})


@case("ingest-empty-file", PREPARE, "data.ingest_folder: a zero-byte .png", ("bob/z.png", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": b""})


@case("ingest-not-an-image", PREPARE, "data.ingest_folder: a text file named .jpg (wrong magic)",
      ("bob/z.jpg", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.jpg": b"<html>404 not found</html>\n"})


@case("ingest-grayscale", PREPARE, "data.ingest_folder: a grayscale (mode L) PNG", ("bob/z.png", "grayscale"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": _encode(_rgb(seed=5), "png", mode="L")})


@case("ingest-rgba", PREPARE, "data.ingest_folder: an RGBA PNG", ("bob/z.png", "alpha"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": _encode(_rgb(seed=5), "png", mode="RGBA")})


@case("ingest-not-square", PREPARE, "data.ingest_folder: a 64x40 face (aligned faces are square)",
      ("bob/z.png", "square"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/z.png": _encode(_rgb((64, 40), seed=5), "png")})


@case("ingest-empty-identity", PREPARE, "data.ingest_folder: an identity folder with no images",
      ("carol", "no images"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"carol": None, "dave/notes.txt": b"not a face\n"})


@case("ingest-top-level-image", PREPARE, "data.ingest_folder: an image beside the identity folders",
      ("stray.png", "top level"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"stray.png": _PNG})


@case("ingest-nested-image", PREPARE, "data.ingest_folder: an image two levels down", ("deeper/x.png", "nested"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {"bob/deeper/x.png": _PNG})


@case("ingest-folder-missing", PREPARE, "data.ingest_folder names a directory that does not exist",
      ("data.ingest_folder", "not a directory"))
def _(ws: Workspace) -> Invocation:
    params = ws.params()
    params["data"]["ingest_folder"] = str(ws.inputs / "no-such-faces")
    ws.project(params)
    ws.prior(*PREPARE_OUTPUTS)
    return Invocation(("stage", "prepare"), ws.root, env={"OMP_NUM_THREADS": "1"})


@case("ingest-both-sources", PREPARE, "data.ingest_folder and data.ingest_recordio both set",
      ("data.ingest_folder", "data.ingest_recordio"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {}, ingest_recordio=str(ws.inputs / "train.rec"))


@case("ingest-max-images-negative", PREPARE, "data.ingest_max_images: -5",
      ("data.ingest_max_images", "out of range"))
def _(ws: Workspace) -> Invocation:
    return _ingest_folder(ws, {}, ingest_max_images=-5)


# ---------------------------------------------------------------------------- prepare: data.ingest_recordio


def _recordio(ws: Workspace, corrupt: Callable[[Path, Path, dict[int, int]], None] | None = None,
              images: list | None = None) -> Invocation:
    """A valid InsightFace RecordIO (14 faces, 6 identities: keys 1..6 images of the first two, 7..14 images of four
    more, 15..20 identity records) under ``inputs/rec/``, then ``corrupt(rec, idx, offsets)``; params point
    ``data.ingest_recordio`` at it."""
    from ml.data.formats import write_recordio

    rec = ws.inputs / "rec" / "train.rec"
    rec.parent.mkdir(parents=True)
    images = (images or [_rgb(seed=i) for i in range(6)]) + [_rgb(seed=100 + i) for i in range(8)]
    write_recordio(rec, images, [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], image_format="jpg")
    idx = rec.with_suffix(".idx")
    offsets = {int(k): int(v) for k, v in (line.split("\t") for line in idx.read_text().splitlines())}
    if corrupt is not None:
        corrupt(rec, idx, offsets)
    params = ws.params()
    params["data"]["ingest_recordio"] = str(rec)
    ws.project(params)
    ws.prior(*PREPARE_OUTPUTS)
    return Invocation(("stage", "prepare"), ws.root, env={"OMP_NUM_THREADS": "1"})


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset: offset + len(data)] = data
    path.write_bytes(bytes(raw))


@case("rec-truncated", PREPARE, "data.ingest_recordio: train.rec cut inside image record 6",
      ("train.rec", "record 6", "truncated"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: rec.write_bytes(rec.read_bytes()[: off[6] + 40]))


@case("rec-idx-truncated", PREPARE, "data.ingest_recordio: train.idx cut after key 3 (keys 4.. missing)",
      ("train.idx", "key 4", "not in the index"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: idx.write_text("".join(f"{k}\t{off[k]}\n" for k in range(4))))


@case("rec-idx-cut-midline", PREPARE, "data.ingest_recordio: train.idx cut in the middle of a line",
      ("train.idx", "line 4", "key<TAB>offset"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: idx.write_text(idx.read_text()[: idx.read_text().index(f"\n3\t") + 3]))


@case("rec-idx-empty", PREPARE, "data.ingest_recordio: an empty train.idx", ("train.idx", "empty"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: idx.write_text(""))


@case("rec-idx-missing", PREPARE, "data.ingest_recordio: train.rec without its train.idx",
      ("train.idx", "not found"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: idx.unlink())


@case("rec-wrong-magic", PREPARE, "data.ingest_recordio: train.rec whose first record has the wrong magic",
      ("train.rec", "record 0", "bad magic"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: _patch(rec, 0, b"\x89PNG"))


@case("rec-wrong-magic-image", PREPARE, "data.ingest_recordio: image record 3 with the wrong magic",
      ("train.rec", "record 3", "bad magic"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: _patch(rec, off[3], b"\x00\x00\x00\x00"))


@case("rec-offset-past-end", PREPARE, "data.ingest_recordio: train.idx offset beyond the end of train.rec",
      ("train.rec", "record 2", "beyond the end"))
def _(ws: Workspace) -> Invocation:
    def corrupt(rec: Path, idx: Path, off: dict[int, int]) -> None:
        off = {**off, 2: rec.stat().st_size + 4096}
        idx.write_text("".join(f"{k}\t{v}\n" for k, v in off.items()))
    return _recordio(ws, corrupt)


@case("rec-corrupt-image", PREPARE, "data.ingest_recordio: record 2's JPEG bytes overwritten",
      ("train.rec", "record 2", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    return _recordio(ws, lambda rec, idx, off: _patch(rec, off[2] + 8 + 24, b"\x00" * 64))


@case("rec-grayscale", PREPARE, "data.ingest_recordio: record 3 is a grayscale JPEG",
      ("train.rec", "record 3", "grayscale"))
def _(ws: Workspace) -> Invocation:
    images: list = [_rgb(seed=i) for i in range(6)]
    images[2] = _encode(_rgb(seed=2), "jpg", mode="L")
    return _recordio(ws, images=images)


# ------------------------------------------------------------------------ evaluate: verification .bin files

EVALUATE = "faceops stage evaluate"
EVALUATE_OUTPUTS = ("metrics/evaluate.json", "reports/benchmark.md", "plots/roc.png")


def _pairs_bin(n_images: int = 4, issame: list | None = None, sizes: list[int] | None = None) -> tuple[list, list]:
    sizes = sizes or [64] * n_images
    bins = [_encode(_rgb((s, s), seed=i), "jpg") for i, s in enumerate(sizes)]
    return bins, ([True, False] if issame is None else issame)


def _verification(ws: Workspace, payload: bytes, *, name: str = "lfw.bin", kind: str = "cli",
                  sidecar: bytes | None = None, check: Callable[[], str | None] | None = None) -> Invocation:
    """``data/prepared/verification/<name>`` holds ``payload``; prior evaluate outputs exist."""
    ws.project()
    ws.write(f"data/prepared/verification/{name}", payload)
    if sidecar is not None:
        ws.write(f"data/prepared/verification/{Path(name).stem}.landmarks.npy", sidecar)
    ws.prior(*EVALUATE_OUTPUTS)
    argv = ("stage", "evaluate") if kind != "module" else ("tasks.evaluate",)
    return Invocation(argv, ws.root, kind=kind, check=check)


def _dump(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@case("bin-odd-image-count", EVALUATE, "lfw.bin with 5 images for 2 pairs", ("lfw.bin", "5 images for 2 pairs"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(5)))


@case("bin-issame-mismatch", EVALUATE, "lfw.bin with 4 images but 3 issame flags",
      ("lfw.bin", "4 images for 3 pairs"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(4, [True, False, True])))


@case("bin-issame-not-bool", EVALUATE, "lfw.bin whose issame_list holds the string 'yes'",
      ("lfw.bin", "issame_list[0]", "bool"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(4, ["yes", False])))


@case("bin-malicious-os-system", EVALUATE, "lfw.bin: a pickle that calls os.system when loaded",
      ("lfw.bin", "refused to unpickle", "system"))
def _(ws: Workspace) -> Invocation:
    marker = ws.tmp / "pwned-os-system"
    return _verification(ws, malicious_bin(marker, "os.system"), check=_marker_absent(marker))


@case("bin-malicious-exec", EVALUATE, "lfw.bin: a pickle that calls builtins.exec when loaded",
      ("lfw.bin", "refused to unpickle", "exec"))
def _(ws: Workspace) -> Invocation:
    marker = ws.tmp / "pwned-exec"
    return _verification(ws, malicious_bin(marker, "exec"), check=_marker_absent(marker))


@case("bin-truncated", EVALUATE, "lfw.bin cut in half", ("lfw.bin", "truncated"))
def _(ws: Workspace) -> Invocation:
    raw = _dump(_pairs_bin(4))
    return _verification(ws, raw[: len(raw) // 2])


@case("bin-empty", EVALUATE, "a zero-byte lfw.bin", ("lfw.bin", "truncated"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, b"")


@case("bin-wrong-magic", EVALUATE, "a PNG file named lfw.bin (not a pickle)", ("lfw.bin", "pickle"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _PNG)


@case("bin-not-a-pair", EVALUATE, "lfw.bin holding a dict instead of (bins, issame_list)",
      ("lfw.bin", "(bins, issame_list)"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump({"bins": [], "issame": []}))


@case("bin-mixed-sizes", EVALUATE, "lfw.bin whose image 1 is 32x32 and image 0 64x64",
      ("lfw.bin", "image 1", "one size"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(4, sizes=[64, 32, 64, 64])))


@case("bin-corrupt-image", EVALUATE, "lfw.bin whose image 3 is not an image", ("lfw.bin image 3", "cannot decode"))
def _(ws: Workspace) -> Invocation:
    bins, issame = _pairs_bin(4)
    bins[3] = b"\xff\xd8\xff\xe0garbage"
    return _verification(ws, _dump((bins, issame)))


@case("bin-landmarks-nan", EVALUATE, "lfw.landmarks.npy (KP-RPE keypoints beside lfw.bin) with NaN",
      ("lfw.landmarks.npy", "NaN"))
def _(ws: Workspace) -> Invocation:
    lm = np.full((4, 5, 2), 30.0, dtype=np.float32)
    lm[2, 1, 0] = np.nan
    return _verification(ws, _dump(_pairs_bin(4)), sidecar=_npy(lm))


@case("bin-landmarks-wrong-shape", EVALUATE, "lfw.landmarks.npy with 3 rows for lfw.bin's 4 images",
      ("lfw.landmarks.npy", "(3, 5, 2)", "(4, 5, 2)"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(4)), sidecar=_npy(np.full((3, 5, 2), 30.0, dtype=np.float32)))


@case("bin-landmarks-corrupt", EVALUATE, "lfw.landmarks.npy that is not a .npy file",
      ("lfw.landmarks.npy", "cannot read"))
def _(ws: Workspace) -> Invocation:
    return _verification(ws, _dump(_pairs_bin(4)), sidecar=b"not numpy\n")


# ------------------------------------------------------------------------------- validate: manifests (and GX)

VALIDATE = "faceops stage validate"
VALIDATE_OUTPUTS = ("reports/validation/train.json",)
FAILED_GATE_EVIDENCE = ("reports/validation-failed/*", "reports/validation-failed/**/*")


def _manifest(ws: Workspace, edit: Callable[[Any], Any] | None = None, *, dataset: str = "train",
              raw: bytes | None = None, kind: str = "cli", gx: bool = False) -> Invocation:
    """A valid prepared directory whose ``<dataset>/manifest.parquet`` is rewritten by ``edit(table) -> table``
    (pyarrow, bypassing the writer's checks) or replaced by ``raw`` bytes; a prior validation report exists."""
    import pyarrow.parquet as pq

    ws.project()
    prepared = ws.prepared()
    path = prepared / dataset / "manifest.parquet"
    if raw is not None:
        path.write_bytes(raw)
    elif edit is not None:
        pq.write_table(edit(pq.read_table(path)), path)
    ws.prior(*VALIDATE_OUTPUTS)
    argv = ("stage", "validate") if kind != "module" else ("tasks.validate",)
    return Invocation(argv, ws.root, kind=kind, evidence=FAILED_GATE_EVIDENCE if gx else ())


def _set_column(table: Any, name: str, values: Any, type_: Any = None) -> Any:
    import pyarrow as pa

    array = pa.array(values, type=type_)
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, array)
    return table.append_column(name, array)


def _landmarks(table: Any, row: int, value: Any) -> list:
    values = table.column("landmarks").to_pylist()
    values[row] = value
    return values


@case("manifest-missing-column", VALIDATE, "train/manifest.parquet without its 'label' column",
      ("train/manifest.parquet", "'label'", "missing"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: t.drop_columns(["label"]))


@case("manifest-extra-column-collides", VALIDATE, "train/manifest.parquet with an extra column 'row'",
      ("train/manifest.parquet", "'row'", "unexpected"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "row", list(range(t.num_rows))))


@case("manifest-extra-column", VALIDATE, "heldout/manifest.parquet with an extra column 'notes'",
      ("heldout/manifest.parquet", "'notes'", "unexpected"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "notes", ["ok"] * t.num_rows), dataset="heldout")


@case("manifest-label-string", VALIDATE, "train/manifest.parquet whose 'label' column is text",
      ("train/manifest.parquet", "'label'", "string"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "label", [str(v) for v in t.column("label").to_pylist()]))


@case("manifest-label-fractional", VALIDATE, "train/manifest.parquet whose 'label' column holds 0.5",
      ("train/manifest.parquet", "'label'", "double"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "label", [v + 0.5 for v in t.column("label").to_pylist()]))


@case("manifest-width-string", VALIDATE, "templates/manifest.parquet whose 'width' column reads '64px'",
      ("templates/manifest.parquet", "'width'", "string"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "width", ["64px"] * t.num_rows), dataset="templates")


@case("manifest-landmarks-text", VALIDATE, "train/manifest.parquet whose 'landmarks' column is text",
      ("train/manifest.parquet", "'landmarks'", "string"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "landmarks", ["30,30,34,30,32,34,30,38,34,38"] * t.num_rows))


@case("manifest-landmarks-nan", VALIDATE, "train/manifest.parquet with NaN landmarks in row 3",
      ("train/manifest.parquet", "row 3", "NaN"))
def _(ws: Workspace) -> Invocation:
    import pyarrow as pa

    return _manifest(ws, lambda t: _set_column(t, "landmarks", _landmarks(t, 3, [float("nan")] * 10),
                                               pa.list_(pa.float32())))


@case("manifest-landmarks-short", VALIDATE, "unaligned/manifest.parquet with 8 landmark values in row 2",
      ("unaligned/manifest.parquet", "row 2", "8 values"))
def _(ws: Workspace) -> Invocation:
    import pyarrow as pa

    return _manifest(ws, lambda t: _set_column(t, "landmarks", _landmarks(t, 2, [40.0] * 8), pa.list_(pa.float32())),
                     dataset="unaligned")


@case("manifest-identity-null", VALIDATE, "discovery/manifest.parquet with a null identity in row 4",
      ("discovery/manifest.parquet", "'identity'", "null", "row 4"))
def _(ws: Workspace) -> Invocation:
    def edit(t: Any) -> Any:
        values = t.column("identity").to_pylist()
        values[4] = None
        return _set_column(t, "identity", values)
    return _manifest(ws, edit, dataset="discovery")


@case("manifest-not-parquet", VALIDATE, "train/manifest.parquet that is a CSV file (wrong magic)",
      ("train/manifest.parquet", "cannot read"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, raw=b"path,identity,label\nimages/a/0.png,a,0\n")


@case("manifest-truncated", VALIDATE, "videos/manifest.parquet cut in half", ("videos/manifest.parquet", "cannot read"))
def _(ws: Workspace) -> Invocation:
    ws_bytes = (ws.ctx.prepared() / "videos" / "manifest.parquet").read_bytes()
    return _manifest(ws, dataset="videos", raw=ws_bytes[: len(ws_bytes) // 2])


@case("gfd-split-leak", VALIDATE, "gfd/split.parquet labelling an image of an unknown identity",
      ("gfd/split.parquet", "labelled"))
def _(ws: Workspace) -> Invocation:
    import pandas as pd

    ws.project()
    prepared = ws.prepared()
    path = prepared / "gfd" / "split.parquet"
    df = pd.read_parquet(path)
    df.loc[df.index[~df["known"]][0], "labelled"] = True
    df.to_parquet(path)
    ws.prior(*VALIDATE_OUTPUTS)
    return Invocation(("stage", "validate"), ws.root)


@case("gate-wrong-image-size", VALIDATE, "train/manifest.parquet declaring 32 px images in a 64 px dataset (GX gate)",
      ("dataset 'train'", "width", "row 0"))
def _(ws: Workspace) -> Invocation:
    return _manifest(ws, lambda t: _set_column(t, "width", [32] * t.num_rows), gx=True)


@case("gate-landmark-outside", VALIDATE, "heldout/manifest.parquet with a landmark at x = 500 in row 1 (GX gate)",
      ("dataset 'heldout'", "lm_x0_frac", "row 1"))
def _(ws: Workspace) -> Invocation:
    import pyarrow as pa

    def edit(t: Any) -> Any:
        values = t.column("landmarks").to_pylist()
        values[1] = [500.0] + list(values[1][1:])
        return _set_column(t, "landmarks", values, pa.list_(pa.float32()))
    return _manifest(ws, edit, dataset="heldout", gx=True)


# ------------------------------------------------------------------------------------ params.yaml and --set


def _params(ws: Workspace, argv: tuple[str, ...], *, edit: Callable[[dict], None] | None = None,
            text: str | None = None, prior: tuple[str, ...] = (), kind: str = "cli", dvc: bool = False) -> Invocation:
    params = ws.params()
    if edit is not None:
        edit(params)
    ws.project(params, params_text=text, dvc=dvc)
    ws.prior(*prior)
    return Invocation(argv, ws.root, kind=kind, env={"OMP_NUM_THREADS": "1"})


@case("params-unknown-key", PREPARE, "params.yaml: data.train_identites (typo)",
      ("data.train_identites", "did you mean", "data.train_identities"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "prepare"), edit=lambda p: p["data"].update(train_identites=12),
                   prior=PREPARE_OUTPUTS)


@case("params-mistyped-value", PREPARE, "params.yaml: data.seed: zero", ("data.seed", "integer"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "prepare"), edit=lambda p: p["data"].update(seed="zero"), prior=PREPARE_OUTPUTS)


@case("params-out-of-range", PREPARE, "params.yaml: data.image_size: 8", ("data.image_size", "out of range"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "prepare"), edit=lambda p: p["data"].update(image_size=8), prior=PREPARE_OUTPUTS)


@case("params-list-length", PREPARE, "params.yaml: data.video_frames: [4] (needs [min, max])",
      ("data.video_frames", "2 items"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "prepare"), edit=lambda p: p["data"].update(video_frames=[4]), prior=PREPARE_OUTPUTS)


@case("params-unknown-section", VALIDATE, "params.yaml: a section 'validation:' (the stage reads 'validate')",
      ("validation", "unknown params section"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "validate"), edit=lambda p: p.update(validation={"split_tolerance": 0.1}),
                   prior=VALIDATE_OUTPUTS)


@case("params-invalid-yaml", VALIDATE, "params.yaml that is not valid YAML (unclosed bracket)",
      ("params.yaml", "not valid YAML", "line"))
def _(ws: Workspace) -> Invocation:
    text = (REPO / "params.yaml").read_text().replace("fars: [0.0001, 0.001, 0.01]", "fars: [0.0001, 0.001")
    return _params(ws, ("stage", "validate"), text=text, prior=VALIDATE_OUTPUTS)


@case("params-not-a-mapping", VALIDATE, "params.yaml holding a list at the top level",
      ("params.yaml", "mapping"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "validate"), text="- data\n- validate\n", prior=VALIDATE_OUTPUTS)


@case("params-section-not-mapping", VALIDATE, "params.yaml: validate: 5", ("'validate'", "mapping"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "validate"), edit=lambda p: p.update(validate=5), prior=VALIDATE_OUTPUTS)


@case("params-mistyped-module", "python -m tasks.validate", "params.yaml: validate.split_tolerance: '5%'",
      ("validate.split_tolerance", "number"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("tasks.validate",), kind="module", prior=VALIDATE_OUTPUTS,
                   edit=lambda p: p["validate"].update(split_tolerance="5%"))


@case("params-nested-mistyped", "faceops stage train_aligner", "params.yaml: aligner.train.epochs: six",
      ("aligner.train.epochs", "integer"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "train_aligner"), edit=lambda p: p["aligner"]["train"].update(epochs="six"),
                   prior=("models/aligner/", "metrics/train_aligner.json"))


@case("params-train-fr-mistyped", "faceops stage train_fr@real", "params.yaml: fr.epochs: two",
      ("fr.epochs", "integer"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("stage", "train_fr@real"), edit=lambda p: p["fr"].update(epochs="two"),
                   prior=("models/fr/real/", "metrics/train_fr_real.json"))


@case("stage-unknown-source", "python -m tasks.train_fr", "train_fr source 'nosuch' (not real/synthetic/mixed)",
      ("nosuch", "unknown training source"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("tasks.train_fr", "nosuch"), kind="module", prior=("models/fr/real/",))


RUN = "faceops run"


@case("set-mistyped-value", RUN, "--set fr.epochs=two", ("fr.epochs", "integer"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run", "--set", "fr.epochs=two"))


@case("set-no-value", RUN, "--set fr.epochs (no =VALUE)", ("fr.epochs", "SECTION.KEY=VALUE"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run", "--set", "fr.epochs"))


@case("set-unknown-section", RUN, "--set frr.epochs=2", ("frr", "unknown params section"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run", "--set", "frr.epochs=2"))


@case("set-unknown-key", RUN, "--set fr.epoch=2", ("fr.epoch", "unknown params key", "fr.epochs"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run", "--set", "fr.epoch=2"))


@case("preset-unknown", RUN, "--preset nosuch", ("nosuch", "unknown preset"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run", "--preset", "nosuch"))


@case("run-params-unknown-key", RUN, "params.yaml: fr.epoch: 3 (edited by hand, no --set)",
      ("fr.epoch", "unknown params key"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run",), edit=lambda p: p["fr"].update(epoch=3), dvc=True)


@case("run-params-unknown-source", RUN, "params.yaml: pipeline.fr_sources.extra (no such training source)",
      ("pipeline.fr_sources.extra", "unknown training source"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("run",), edit=lambda p: p["pipeline"]["fr_sources"].update(extra="data/extra"), dvc=True)


SWEEP = "faceops sweep train_fr"


@case("sweep-range-inverted", SWEEP, "sweep.train_fr.space.fr.lr with low above high",
      ("sweep.train_fr.space.fr.lr", "low"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("sweep", "train_fr"), edit=lambda p: p["sweep"]["train_fr"]["space"]["fr.lr"].update(
        low=0.1, high=0.001))


@case("sweep-unknown-space-key", SWEEP, "sweep.train_fr.space names fr.lrr (no such fr key)", ("fr.lrr", "fr"))
def _(ws: Workspace) -> Invocation:
    def edit(p: dict) -> None:
        p["sweep"]["train_fr"]["space"]["fr.lrr"] = p["sweep"]["train_fr"]["space"].pop("fr.lr")
    return _params(ws, ("sweep", "train_fr"), edit=edit)


@case("sweep-unknown-sampler", SWEEP, "sweep.sampler: grid", ("sweep.sampler", "grid"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("sweep", "train_fr"), edit=lambda p: p["sweep"].update(sampler="grid"))


DATA = "faceops data ls"


@case("storage-credential-key", DATA, "params.yaml: storage.secret_access_key (a credential in params)",
      ("storage.secret_access_key", "credential"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("data", "ls"), edit=lambda p: p["storage"].update(bucket="b", secret_access_key="abc"))


@case("storage-mistyped", DATA, "params.yaml: storage.max_attempts: many", ("storage.max_attempts", "integer"))
def _(ws: Workspace) -> Invocation:
    return _params(ws, ("data", "ls"), edit=lambda p: p["storage"].update(bucket="b", max_attempts="many"))


# ----------------------------------------------------------------------------------- dvc.yaml read by the flow


def _dvc_yaml(ws: Workspace, edit: Callable[[dict], None] | None = None, *, text: str | None = None,
              argv: tuple[str, ...] = ("run",)) -> Invocation:
    import yaml

    if text is None:
        doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
        edit(doc)
        text = yaml.safe_dump(doc, sort_keys=False)
    ws.project(dvc_yaml_text=text, dvc=True)
    return Invocation(argv, ws.root, evidence=(".dvc/*", ".dvc/**/*"))


@case("dvc-stage-missing-deps", RUN, "dvc.yaml: stage validate without deps", ("dvc.yaml", "'validate'", "deps"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: d["stages"]["validate"].pop("deps"))


@case("dvc-stage-empty-deps", RUN, "dvc.yaml: foreach stage train_fr with deps: []", ("dvc.yaml", "'train_fr'", "deps"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: d["stages"]["train_fr"]["do"].update(deps=[]))


@case("dvc-stage-missing-cmd", RUN, "dvc.yaml: stage evaluate without cmd", ("dvc.yaml", "'evaluate'", "cmd"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: d["stages"]["evaluate"].pop("cmd"))


@case("dvc-invalid-yaml", RUN, "dvc.yaml that is not valid YAML", ("dvc.yaml", "not valid YAML", "line"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, text=(REPO / "dvc.yaml").read_text().replace("      - data/prepared\n", "      - [data/prepared\n", 1))


@case("dvc-foreach-unknown-param", RUN, "dvc.yaml: foreach over ${pipeline.fr_sourcez} (no such params key)",
      ("dvc.yaml", "pipeline.fr_sourcez"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: d["stages"]["train_fr"].update(foreach="${pipeline.fr_sourcez}"))


@case("dvc-ls-missing-deps", "faceops ls", "dvc.yaml: stage train_aligner without deps",
      ("dvc.yaml", "'train_aligner'", "deps"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: d["stages"]["train_aligner"].pop("deps"), argv=("ls",))


@case("run-unknown-stage", RUN, "--stage trian_fr@real (typo)", ("trian_fr@real", "unknown stage"))
def _(ws: Workspace) -> Invocation:
    return _dvc_yaml(ws, lambda d: None, argv=("run", "--stage", "trian_fr@real"))


# ----------------------------------------------------------------------------------------- faceops export

EXPORT = "faceops export"


def _export(ws: Workspace, corrupt: Callable[[Path], None], model: str = "models/fr/real") -> Invocation:
    """A copy of a valid model directory at ``models/fr/real``, then ``corrupt(model_dir)``; a prior ``fr.onnx``."""
    shutil.copytree(ws.ctx.model_dir(), ws.root / "models" / "fr" / "real")
    corrupt(ws.root / "models" / "fr" / "real")
    ws.prior("fr.onnx")
    return Invocation(("export", model, "fr.onnx"), ws.root)


@case("export-missing-config", EXPORT, "model directory without config.json", ("config.json", "missing"))
def _(ws: Workspace) -> Invocation:
    return _export(ws, lambda d: (d / "config.json").unlink())


@case("export-config-not-json", EXPORT, "config.json that is not JSON", ("config.json", "not valid JSON"))
def _(ws: Workspace) -> Invocation:
    return _export(ws, lambda d: (d / "config.json").write_text('{"backbone": "vit_tiny",'))


@case("export-truncated-weights", EXPORT, "model.safetensors cut in half",
      ("model.safetensors", "not a readable safetensors"))
def _(ws: Workspace) -> Invocation:
    def corrupt(d: Path) -> None:
        raw = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    return _export(ws, corrupt)


@case("export-unknown-backbone", EXPORT, "config.json naming backbone vit_huge", ("config.json", "vit_huge"))
def _(ws: Workspace) -> Invocation:
    def corrupt(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "backbone": "vit_huge"}))
    return _export(ws, corrupt)


@case("export-weights-mismatch", EXPORT, "config.json kwargs (depth 2) that do not match the weights (depth 1)",
      ("model.safetensors", "does not match"))
def _(ws: Workspace) -> Invocation:
    def corrupt(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "kwargs": {**cfg["kwargs"], "depth": 2}}))
    return _export(ws, corrupt)


# ------------------------------------------------------------- end to end: the real `faceops` executable

SUBPROCESS = "faceops (process)"


@case("e2e-prepare-truncated-jpeg", f"{SUBPROCESS} stage prepare", "data.ingest_folder: a JPEG cut in half",
      ("bob/z.jpg", "truncated"))
def _(ws: Workspace) -> Invocation:
    inv = _ingest_folder(ws, {"bob/z.jpg": _JPG[: len(_JPG) // 2]})
    return Invocation(inv.argv, inv.cwd, kind="subprocess")


@case("e2e-evaluate-malicious-bin", f"{SUBPROCESS} stage evaluate", "lfw.bin: a pickle that calls os.system",
      ("lfw.bin", "refused to unpickle", "system"))
def _(ws: Workspace) -> Invocation:
    marker = ws.tmp / "pwned-e2e"
    inv = _verification(ws, malicious_bin(marker), check=_marker_absent(marker))
    return Invocation(inv.argv, inv.cwd, kind="subprocess", check=inv.check)


@case("e2e-validate-nan-landmarks", f"{SUBPROCESS} stage validate", "train/manifest.parquet with NaN landmarks",
      ("train/manifest.parquet", "row 3", "NaN"))
def _(ws: Workspace) -> Invocation:
    import pyarrow as pa

    inv = _manifest(ws, lambda t: _set_column(t, "landmarks", _landmarks(t, 3, [float("nan")] * 10),
                                              pa.list_(pa.float32())))
    return Invocation(inv.argv, inv.cwd, kind="subprocess")


@case("e2e-run-set-mistyped", f"{SUBPROCESS} run", "--set fr.epochs=two", ("fr.epochs", "integer"))
def _(ws: Workspace) -> Invocation:
    inv = _params(ws, ("run", "--set", "fr.epochs=two"), dvc=True)
    return Invocation(inv.argv, inv.cwd, kind="subprocess")


@case("e2e-run-dvc-missing-deps", f"{SUBPROCESS} run", "dvc.yaml: stage validate without deps",
      ("dvc.yaml", "'validate'", "deps"))
def _(ws: Workspace) -> Invocation:
    inv = _dvc_yaml(ws, lambda d: d["stages"]["validate"].pop("deps"))
    return Invocation(inv.argv, inv.cwd, kind="subprocess", evidence=inv.evidence)


# ------------------------------------------------------------------------------------------------ the harness

QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "TQDM_DISABLE": "1",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RUN_LOCK = ".faceops/run.lock"  # `faceops run`'s lock file (faceops/runlock.py): kept, emptied, by design


class FlowStarted(BaseException):
    """Raised in place of a Prefect flow in in-process runs: the bad input reached the flow."""


def faceops_executable() -> list[str]:
    for candidate in (Path(sys.executable).parent / "faceops", REPO / ".venv" / "bin" / "faceops"):
        if candidate.is_file():
            return [str(candidate)]
    return [sys.executable, "-m", "faceops.cli"]


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            out[path.relative_to(root).as_posix()] = (path.stat().st_size, path.stat().st_mtime_ns,
                                                       hashlib.sha256(path.read_bytes()).hexdigest())
    return out


@contextlib.contextmanager
def _environment(cwd: Path, env: Mapping[str, str], argv: list[str] | None = None) -> Iterator[None]:
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    os.environ.update(env)
    os.chdir(cwd)
    if argv is not None:
        sys.argv = argv
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv


@contextlib.contextmanager
def _flows_guarded(argv: tuple[str, ...]) -> Iterator[None]:
    """In-process ``faceops run``/``sweep``: the Prefect flow is replaced by a tripwire (a bad input must be refused
    before any stage runs)."""
    targets = {"run": ("flows.pipeline", "run_pipeline"), "sweep": ("flows.sweep", "sweep_flow"),
               "promote": ("flows.promote", "promote_flow")}
    if not argv or argv[0] not in targets:
        yield
        return
    import importlib

    module = importlib.import_module(targets[argv[0]][0])
    name = targets[argv[0]][1]
    original = getattr(module, name)

    def tripwire(*args: Any, **kwargs: Any) -> Any:
        raise FlowStarted(f"{module.__name__}.{name} started")

    setattr(module, name, tripwire)
    try:
        yield
    finally:
        setattr(module, name, original)


def _in_process(inv: Invocation, env: Mapping[str, str]) -> tuple[int | str | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None
    argv = [inv.argv[0], *inv.argv[1:]] if inv.kind == "module" else None
    with _environment(inv.cwd, env, argv), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if inv.kind == "module":
                runpy.run_module(inv.argv[0], run_name="__main__", alter_sys=True)
            else:
                from faceops.cli import app

                with _flows_guarded(inv.argv):
                    app(args=list(inv.argv), prog_name="faceops", standalone_mode=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
            if code is None:
                code = 0
        except FlowStarted as exc:
            code = "flow started"
            err.write(f"[harness] the Prefect flow started ({exc}): the input was not refused up front\n")
        except BaseException:  # noqa: BLE001 - an escaped exception is exactly what the corpus looks for
            code = "exception"
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue()


def _subprocess(inv: Invocation, env: Mapping[str, str], timeout: float) -> tuple[int | str | None, str, str]:
    full_env = {**os.environ, **env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        proc = subprocess.run([*faceops_executable(), *inv.argv], cwd=inv.cwd, env=full_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return "timeout", str(exc.stdout or ""), str(exc.stderr or "") + f"\n[harness] timed out after {timeout}s"
    return proc.returncode, proc.stdout, proc.stderr


def _lines(text: str) -> list[str]:
    return [line.strip() for line in re.split(r"[\r\n]", _ANSI.sub("", text)) if line.strip()]


def command_line(inv: Invocation) -> str:
    if inv.kind == "module":
        return "python -m " + " ".join(inv.argv)
    return "faceops " + " ".join(inv.argv) + (" (process)" if inv.kind == "subprocess" else "")


def run_case(case: Case, ctx: Context, tmp: Path, timeout: float = 600.0) -> Outcome:
    """Build ``case`` under ``tmp``, invoke it, judge it (see the module docstring)."""
    ws = Workspace(tmp, ctx)
    inv = case.build(ws)
    before = _snapshot(ws.tmp)
    journal_dir = Path(tempfile.mkdtemp(prefix="faceops-journal-"))
    env = {**QUIET_ENV, "FACEOPS_TRACKING_JOURNAL": str(journal_dir / "journal.jsonl"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{journal_dir / 'mlflow.db'}", **inv.env}
    start = time.perf_counter()
    try:
        if inv.kind == "subprocess":
            code, stdout, stderr = _subprocess(inv, env, timeout)
        else:
            code, stdout, stderr = _in_process(inv, env)
    finally:
        shutil.rmtree(journal_dir, ignore_errors=True)
    seconds = time.perf_counter() - start
    after = _snapshot(ws.tmp)

    problems: list[str] = []
    if not isinstance(code, int):
        problems.append(f"did not exit cleanly ({code})")
    elif code == 0:
        problems.append("exit status 0: the bad input was accepted")
    text = stdout + "\n" + stderr
    if "Traceback (most recent call last)" in text or "Traceback" in _ANSI.sub("", stderr):
        problems.append("a traceback was printed")
    lines = _lines(stderr)
    errors = [line for line in lines if line.startswith("error:")]
    message = errors[-1][len("error:"):].strip() if errors else ""
    if len(errors) != 1:
        problems.append(f"{len(errors)} 'error:' lines (expected exactly one)")
    elif lines[-1] != errors[0]:
        problems.append(f"the error message is not the last line of stderr (then: {lines[-1][:120]!r})")
    missing = [w for w in case.expect if w.lower() not in message.lower()]
    if errors and missing:
        problems.append(f"the message does not name {missing}")
    changed = [p for p, meta in before.items() if after.get(p) != meta]
    if changed:
        problems.append(f"prior files changed or removed: {changed[:5]}")
    ws_prefix = inv.cwd.relative_to(ws.tmp).as_posix() + "/"
    evidence = inv.evidence + ((RUN_LOCK,) if inv.argv[:1] == ("run",) else ())
    allowed = tuple(ws_prefix + pattern for pattern in evidence)
    left = [p for p in after if p not in before and not any(fnmatch.fnmatch(p, g) for g in allowed)]
    if left:
        problems.append(f"files left behind: {left[:5]}")
    if inv.check is not None and (problem := inv.check()):
        problems.append(problem)
    return Outcome(case, command_line(inv), code, stdout, stderr, message, problems, seconds, ws.tmp)


def entry_points() -> list[str]:
    seen: list[str] = []
    for c in CASES:
        if c.entry not in seen:
            seen.append(c.entry)
    return seen
