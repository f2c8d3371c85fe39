"""``faceops import``: a pretrained face recogniser as a named FR source (registered in ``faceops/cli.py``).

The file is checked and written by ``ml.fr.pretrained.import_recogniser`` to ``models/fr/<name>``; this command then
tracks that directory with DVC (``models/fr/<name>.dvc``, so ``dvc repro`` reruns the stages that read it when it
changes) and registers it in MLflow as ``faceops-fr-<name>`` (alias ``@pretrained``) with its provenance as tags.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from faceops.console import fail, quiet_env, repo_root

TRAINED_SOURCES = ("real", "synthetic", "mixed", "real_matched")  # models/fr/<these> are train_fr@ outputs
ALIAS = "pretrained"


def registered_name(name: str) -> str:
    return f"faceops-fr-{name}"


def probe_folder(folder: Path) -> tuple[Any, Any]:
    """(uint8 RGB faces, labels) from an image folder of identity subfolders: as many identities and images as
    the procedural probe has (``ml.fr.pretrained.PROBE_IDENTITIES`` × ``PROBE_IMAGES``), in name order."""
    import numpy as np
    from PIL import Image

    from ml.errors import DataError
    from ml.fr.pretrained import PROBE_IDENTITIES, PROBE_IMAGES

    faces, labels = [], []
    people = sorted(p for p in folder.iterdir() if p.is_dir())[:PROBE_IDENTITIES]
    for label, person in enumerate(people):
        files = sorted(f for f in person.iterdir() if f.suffix.lower() in (".png", ".jpg", ".jpeg"))[:PROBE_IMAGES]
        for f in files:
            faces.append(np.asarray(Image.open(f).convert("RGB").resize((112, 112), Image.BILINEAR)))
            labels.append(label)
    if len(set(labels)) < 2:
        raise DataError(f"--probe {folder}: needs identity subfolders of aligned faces (at least 2 identities), "
                        f"found {len(set(labels))}")
    return np.stack(faces), np.asarray(labels)


def import_command(
    source: Annotated[Path, typer.Argument(help="an ONNX file, an arcface_torch `backbone.pth`, or a faceops "
                                                "model directory")],
    name: Annotated[str, typer.Option("--name", help="the FR source name: the model goes to `models/fr/<name>`, "
                                                     "stages read it with `--set synthesize.fr_source=<name>`")],
    contract: Annotated[Optional[str], typer.Option(
        help="an ONNX file's pixels: `sface` (BGR 0–255), `arcface` (insightface model zoo: RGB (x−127.5)/127.5); "
             "a faceops export carries its own")] = None,
    backbone: Annotated[Optional[str], typer.Option(
        help="an arcface_torch checkpoint's size (`r18` … `r100` are read off the keys; `vit_t` … `vit_l` must "
             "be named)")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", help="`onnx`, `arcface_torch` or `faceops` (default: "
                                                                "from the path)")] = None,
    styles: Annotated[Optional[str], typer.Option(
        help="an ONNX graph's intermediate (batch, C, H, W) tensors, comma-separated, whose per-channel mean and std "
             "are CAFace's styles (`--contract sface` names SFace's own); without them fusion.fr_source cannot be "
             "this model")] = None,
    probe: Annotated[Optional[Path], typer.Option(
        help="a folder of identity subfolders of aligned real faces to check the model on (default: the embedded "
             "procedural faces)")] = None,
    register: Annotated[bool, typer.Option(help="register the model in MLflow")] = True,
    dvc: Annotated[bool, typer.Option(help="track `models/fr/<name>` with `dvc add`")] = True,
) -> None:
    """Import a pretrained face recogniser (nothing downloads: the file is yours) as FR source `<name>`.

    The model is checked on probe faces before anything is written: its embeddings must be finite, differ between
    faces, separate the probes' identities (ROC AUC ≥ 0.6 and above raw pixels' AUC), and — for ONNX — not separate
    them markedly better under the other colour order or another pixel scale than under the contract you declared.
    Then `models/fr/<name>` is written in one rename, tracked by DVC and registered as `faceops-fr-<name>@pretrained`
    with the file's sha256, path, format and contract as tags; `faceops ls` lists it.

    Examples:

    * `faceops import ~/models/face_recognition_sface_2021dec.onnx --name sface --contract sface`

    * `faceops import ~/arcface_torch/ms1mv3_r50/backbone.pth --name r50`

    * `faceops import ~/w600k_r50.onnx --name buffalo --contract arcface --probe ~/faces/aligned
      --styles <a 28-px map>,<a 14-px map>` — CAFace's styles from two of its maps

    * `faceops run --set generator.fr_source=sface --set synthesize.fr_source=sface --set fusion.fr_source=sface`
      — build UIFace and CAFace on it
    """
    root = repo_root()
    quiet_env()
    from ml.errors import FaceopsError
    from ml.fr.pretrained import import_recogniser

    if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name):
        fail(f"--name {name!r}: use lower-case letters, digits and _ (it names models/fr/<name> and a params value)")
    if name in TRAINED_SOURCES:
        fail(f"--name {name}: models/fr/{name} is the output of stage train_fr@{name}; choose another name")
    model_dir = root / "models" / "fr" / name
    try:
        probe_faces = probe_folder(probe) if probe is not None else None
        config = import_recogniser(source.expanduser().resolve(), model_dir, fmt=fmt, contract=contract,
                                   backbone=backbone, probe=probe_faces,
                                   styles=None if styles is None else [s for s in styles.split(",") if s])
    except FaceopsError as exc:
        fail(str(exc))
    extra = config["extra"]
    styles_note = (f", CAFace styles {config['input_contract']['style_dim']}-d"
                   if "style_dim" in config["input_contract"] else ", no CAFace styles")
    typer.echo(f"wrote {model_dir.relative_to(root)}: {config['backbone']} {config['input_contract']['size']} px, "
               f"{config['input_contract']['embedding_dim']}-d{styles_note}; probe AUC {extra['probe_auc']:.3f} "
               f"(raw pixels {extra['probe_auc/pixels']:.3f})")
    if dvc:
        added = subprocess.run([sys.executable, "-m", "dvc", "add", "-q", str(model_dir.relative_to(root))],
                               cwd=root, capture_output=True, text=True)
        if added.returncode != 0:
            fail(f"dvc add models/fr/{name} failed: {(added.stderr or added.stdout).strip()[-800:]}", code=1)
        typer.echo(f"tracked by DVC: models/fr/{name}.dvc (commit it with git)")
    if register:
        version = register_import(root, name, model_dir, config)
        typer.echo(f"registered {registered_name(name)} v{version} @{ALIAS}")


def register_import(root: Path, name: str, model_dir: Path, config: dict[str, Any]) -> str:
    """One MLflow run ``import_fr`` that logs the model and registers it as ``faceops-fr-<name>@pretrained``,
    tagged with its provenance; → the version."""
    import os

    from mlflow import MlflowClient

    from ops.tracking import ENV_JOURNAL, stage_run

    extra = config["extra"]
    tags = {"source": "pretrained", "backbone": config["backbone"], "import.format": extra["format"],
            "import.file": extra["file"], "import.sha256": extra["sha256"], "import.probe_auc": f"{extra['probe_auc']:.4f}",
            "import.contract": str(extra.get("pixel_contract") or config["input_contract"])}
    os.environ.pop(ENV_JOURNAL, None)  # an import is never relayed through a stage's journal: it is its own run
    with stage_run("import_fr", {"import": {"name": name, "format": extra["format"], "file": extra["file"]}},
                   root) as tracker:
        tracker.set_tags(tags)
        tracker.log_metrics({"import/probe_auc": extra["probe_auc"], "import/probe_auc_pixels": extra["probe_auc/pixels"]})
        version = tracker.log_model_dir(model_dir, registered_name(name), alias=ALIAS, tags=tags)
    client = MlflowClient()
    client.set_registered_model_alias(registered_name(name), ALIAS, version)  # an import is never a toy run
    return str(version)
