"""Stage ``align``: the trained DFA aligner turns unaligned faces into aligned crops with predicted landmarks.

Predicts 5 landmarks for the unaligned faces the aligner never trained on (``data/prepared/unaligned`` split ``test``),
warps each onto the ArcFace template at ``data.image_size`` with the differentiable similarity solve + ``grid_sample``
(``ml.aligner.align``) and writes ``data/aligned/`` (manifest with the predicted landmarks in the crop, the keypoints
KP-RPE reads; ``quality`` left empty). Metrics: how far the ground-truth landmarks land from the template after
alignment with the predicted ones (``align/residual_px``, ``align/residual_nme`` over the template's inter-pupil
distance): the error alignment leaves behind. With real faces ingested (no landmarks) it also predicts those of
``data/prepared/{train,heldout,discovery}`` and ``verification/real.bin`` into
``data/aligned/predicted_landmarks.parquet`` (+ ``.json``, tied to each dataset's digest; ``ml.data.landmarks``) and
``data/aligned/verification/real.landmarks.npy``, the keypoints a KP-RPE model trains and is scored on
(``keypoints_source: aligner``); ``align/real/template_nme`` says how far they stray from the template,
``align/real/score_mean`` gives their mean face score. ``plots/aligned_samples.png``: inputs above their crops.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ml.atomic import atomic_path
from ml.config import from_mapping
from tasks.common import Paths, StageResult, load_params, section, stage_main, write_json
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)


def align_images(model: Any, images: np.ndarray, size: int, batch_size: int = 128
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(aligned uint8 (N, size, size, 3), predicted landmarks in the crops (N, 5, 2), scores (N,),
    matrices input→crop (N, 2, 3))."""
    import torch

    from ml.aligner.align import align_faces, transform_points

    pred, scores = model.predict(images, batch_size=batch_size)
    out, lms, mats = [], [], []
    for start in range(0, len(images), batch_size):
        x = torch.from_numpy(images[start:start + batch_size]).permute(0, 3, 1, 2).float()
        p = torch.from_numpy(pred[start:start + batch_size])
        crops, m = align_faces(x, p, out_size=size)
        out.append(crops.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy())
        lms.append(transform_points(p, m).numpy())
        mats.append(m.numpy())
    return np.concatenate(out), np.concatenate(lms), scores, np.concatenate(mats)


ROW_LABELS = ("unaligned input", "aligned crop")  # the rows of plots/aligned_samples.png, top to bottom


def sample_grid(unaligned: np.ndarray, aligned: np.ndarray, path: Path, n: int = 10, margin: int = 64) -> None:
    """The first ``n`` unaligned faces (top row, shown at the crop size) above their aligned crops, each row named
    in a ``margin`` on the left with its pixel size."""
    from PIL import Image, ImageDraw, ImageFont

    size = aligned.shape[1]
    n = min(n, len(aligned))
    canvas = Image.new("RGB", (margin + n * (size + 2) + 2, 2 * (size + 2) + 2), (255, 255, 255))
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default(size=9)
    for row, (label, px) in enumerate(zip(ROW_LABELS, (unaligned.shape[1], size))):
        draw.multiline_text((3, 2 + row * (size + 2) + size // 2), f"{label.replace(' ', chr(10))}\n{px} px",
                            fill=(0, 0, 0), font=font, anchor="lm", spacing=1)
    for i in range(n):
        canvas.paste(Image.fromarray(unaligned[i]).resize((size, size)), (margin + 2 + i * (size + 2), 2))
        canvas.paste(Image.fromarray(aligned[i]), (margin + 2 + i * (size + 2), size + 4))
    with atomic_path(path) as tmp:
        canvas.resize((canvas.width * 2, canvas.height * 2), Image.NEAREST).save(tmp, format="PNG")


REAL_DATASETS = ("train", "heldout", "discovery")  # the prepared datasets ingest fills with the user's real faces
PREDICT_CHUNK = 2048  # real faces decoded and predicted per chunk: memory holds one chunk, not the whole set


def predict_real_landmarks(model: Any, paths: Paths, out: Path, image_size: int) -> dict[str, float]:
    """Predict the landmarks of every real face without them (the ingested datasets and ``real.bin``) into
    ``out`` (the aligned set's folder, before it is moved into place); returns ``align/real/*`` metrics, empty
    when nothing is real."""
    from ml.data.dataset import landmarks_array, load_images, read_dataset_info, read_manifest
    from ml.data.formats import read_verification_bin
    from ml.data.landmarks import write_predicted
    from ml.aligner.align import template_for

    predictions, digests = {}, {}
    for name in REAL_DATASETS:
        d = paths.prepared / name
        if not (d / "dataset.json").is_file() or read_dataset_info(d)["source"] != "real":
            continue
        manifest = read_manifest(d / "manifest.parquet")
        rows = manifest[~np.isfinite(landmarks_array(manifest)).all(axis=(1, 2))].reset_index(drop=True)
        if not len(rows):
            continue
        lms, scores = [], []
        for start in range(0, len(rows), PREDICT_CHUNK):
            images = load_images(d, rows.iloc[start:start + PREDICT_CHUNK])
            p, s = model.predict(images)
            lms.append(p)
            scores.append(s)
        predictions[name] = (rows, np.concatenate(lms), np.concatenate(scores))
        digests[name] = read_dataset_info(d)["digest"]
    if not predictions:
        return {}
    write_predicted(out, predictions, digests, aligner=str(paths.aligner_model.relative_to(paths.root)))
    metrics = {"align/real/faces": float(sum(len(r) for r, _, _ in predictions.values()))}
    real_bin = paths.verification_dir / "real.bin"
    if real_bin.is_file():
        images, _ = read_verification_bin(real_bin)
        bin_lms, _ = model.predict(images)
        (out / "verification").mkdir(exist_ok=True)
        np.save(out / "verification" / "real.landmarks.npy", bin_lms.astype(np.float32))
        metrics["align/real/bin_images"] = float(len(images))
    template = template_for(image_size).numpy()
    pupil = float(np.linalg.norm(template[1] - template[0]))
    every = np.concatenate([p for _, p, _ in predictions.values()])
    dist = np.linalg.norm(every - template, axis=2).mean(axis=1) / pupil  # (N,) per face, in inter-pupil units
    metrics.update({"align/real/template_nme": float(dist.mean()),
                    "align/real/template_failure@0.1": float((dist > 0.1).mean()),
                    "align/real/score_mean": float(np.concatenate([s for _, _, s in predictions.values()]).mean())})
    return metrics


def run(data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    import torch

    from ml.data.dataset import DatasetWriter, landmarks_array, load_images, read_manifest
    from ml.aligner.align import template_for, transform_points
    from ml.aligner.dfa import load_aligner

    model, _ = load_aligner(paths.aligner_model)
    manifest = read_manifest(paths.unaligned_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "test"].reset_index(drop=True)
    images = load_images(paths.unaligned_set, rows, progress=True)
    aligned, landmarks, _, mats = align_images(model, images, data.image_size)
    with DatasetWriter(paths.aligned_set, name="aligned", source="procedural", aligned=True,
                       generator={"aligner": str(paths.aligner_model.relative_to(paths.root))}) as w:
        for img, lm, identity in zip(aligned, landmarks, rows["identity"]):
            w.add(img, identity=identity, split="aligned", landmarks=lm.reshape(-1))
        real = predict_real_landmarks(model, paths, w.tmp_dir, data.image_size)  # moved into place with the set
    gt = transform_points(torch.from_numpy(landmarks_array(rows)), torch.from_numpy(mats)).numpy()
    template = template_for(data.image_size).numpy()
    residual = np.linalg.norm(gt - template, axis=2).mean(axis=1)  # (N,) px
    pupil = float(np.linalg.norm(template[1] - template[0]))
    sample_grid(images, aligned, paths.plots / "aligned_samples.png")
    result = StageResult("align", outputs=[paths.aligned_set, paths.plots / "aligned_samples.png"])
    result.metrics = {"align/faces": float(len(rows)), "align/residual_px": float(residual.mean()),
                      "align/residual_nme": float(residual.mean() / pupil),
                      "align/residual_failure@0.1": float((residual / pupil > 0.1).mean()), **real}
    write_json(paths.metrics / "align.json", result.metrics)
    result.summary = (f"{len(rows)} faces aligned to {data.image_size}px; ground-truth landmarks land "
                      f"{residual.mean():.2f}px from the template on average → {paths.aligned_set}")
    if real:
        result.summary += (f"; landmarks predicted for {real['align/real/faces']:.0f} real faces (mean distance to "
                           f"the template {real['align/real/template_nme']:.3f} inter-pupil)")
    if tracker is not None:
        tracker.log_dataset(paths.aligned_set, context="aligned")
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "aligned_samples.png", artifact_path="plots")
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("align", {"data": {"image_size": data.image_size}}, paths.root) as tracker:
        result = run(data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "align")
