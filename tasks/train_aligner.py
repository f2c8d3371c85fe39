"""Stage ``train_aligner``: the DFA landmark aligner on unaligned procedural crops with exact landmarks.

Trains on ``data/prepared/unaligned`` split ``train``, follows split ``val`` after every epoch (other identities;
``val/*`` in the history, what ``faceops sweep train_aligner`` optimises) and measures once on split ``test``
(identities never trained on nor chosen on) against the trivial mean-landmark predictor, in two conventions: inter-pupil
(``test/nme``, ``test/failure@0.1``, ``test/auc@0.1``) and face box as RetinaFace and the DFA paper report it (box
estimated from the ground truth by ``ml.aligner.metrics.face_box_size``: ``test/nme_box``, ``test/failure_box@0.05``,
``test/failure_box@0.07``, ``test/auc_box@0.07``). ``test/*_top_anchor`` read the same model's best-scoring anchor
instead of the pooled landmarks (the paper's pooling-vs-one-detection claim); ``plots/aligner_ced.png`` the CEDs.
Face score: ROC AUC and accuracy at 0.5 of the test faces against held-out non-face crops (indices from
``HELDOUT_NONFACE_START``; ``test/face_auc``, ``test/face_accuracy@0.5``), and Spearman's ρ with the procedural quality
on freshly rendered faces of reserved identities (``quality/score_spearman``). On real aligned faces
(``aligner.reference_faces``, else the held-out real identities of a run that ingests real faces) the predictions
are compared with OpenCV Zoo's YuNet when installed (``faceops[reference]``), else the reason is recorded; on the
procedural test faces YuNet's own landmarks stand beside DFA's (``test/yunet/*``, ``detector_comparison``). Writes ``models/aligner/``, ``metrics/train_aligner.json``,
``plots/train_aligner_history.csv``; registers ``faceops-aligner`` @candidate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from ml.errors import ConfigError
from ml.aligner.train import AlignerConfig
from ops.tracking import registered_note
from tasks import registered_model
from tasks.common import (
    Paths, StageResult, load_params, numerics, section, stage_main, write_json, write_history_csv,
)

log = logging.getLogger(__name__)

REGISTERED_MODEL = registered_model("train_aligner")


@dataclass(frozen=True)
class AlignerStageConfig:
    """``params.yaml`` section ``aligner``; ``train`` holds ml/aligner/train.py's AlignerConfig keys."""

    train: AlignerConfig = field(default_factory=AlignerConfig)
    reference_faces: str = ""   # folder <identity>/<image> of real aligned faces for the YuNet comparison; "" = off
    reference_max_images: int = 300
    score_nonfaces: int = 400  # held-out non-face crops scored against the test faces (face_auc, accuracy@0.5)
    score_quality_faces: int = 200  # rendered faces (at most one per test face) for the score–quality ρ; 0 = skip

    def __post_init__(self) -> None:
        for key in ("score_nonfaces", "score_quality_faces"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"aligner.{key} = {value!r}: a count ≥ 0")


QUALITY_FIRST_IDENTITY = 10_000_000  # the quality faces' identities: above every dataset's range
QUALITY_PER_IDENTITY = 4


def render_quality_faces(count: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` unaligned procedural faces (``size``², default nuisance) of reserved identities with their
    landmarks and quality: (images, landmarks px, quality)."""
    from ml.data.unaligned import unaligned_faces

    ids = -(-count // QUALITY_PER_IDENTITY)
    images, landmarks, _, quality = unaligned_faces(ids, QUALITY_PER_IDENTITY, size, seed,
                                                    first_identity=QUALITY_FIRST_IDENTITY, return_quality=True)
    return images[:count], landmarks[:count], quality[:count]


def reference_images(cfg: AlignerStageConfig, paths: Paths) -> tuple[np.ndarray | None, str]:
    """(real aligned faces to set DFA beside YuNet on, where they come from): ``aligner.reference_faces`` when set;
    else, in a run that ingests real faces, its held-out real identities (``data/prepared/heldout``: never trained
    on); else (None, why there are none). At most ``reference_max_images``, of one size."""
    from ml.data.dataset import load_images, read_manifest
    from ml.data.formats import decode_image, ingest_image_folder

    if cfg.reference_faces:
        path = Path(cfg.reference_faces)
        if not path.is_dir():
            return None, (f"reference faces not found at {path} (a development-only set; point "
                          "aligner.reference_faces at a folder of aligned faces)")
        items = list(ingest_image_folder(path))[:cfg.reference_max_images]
        if not items:
            return None, f"no images under {path} (aligner.reference_faces wants <identity>/<image> files)"
        images = [decode_image(p.read_bytes(), source=str(p)) for p, _ in items]
        size = images[0].shape[0]
        return np.stack([im for im in images if im.shape[:2] == (size, size)]), str(path)
    manifest = paths.heldout_set / "manifest.parquet"
    rows = read_manifest(manifest) if manifest.is_file() else None
    if rows is None or rows.empty or not (rows["source"] == "real").all():
        return None, "aligner.reference_faces is empty and the run's faces are procedural"
    rows = rows.iloc[:cfg.reference_max_images]
    return load_images(paths.heldout_set, rows, progress=False), "data/prepared/heldout (held-out real identities)"


def reference_comparison(model: Any, images: np.ndarray | None, source: str) -> dict[str, Any]:
    """NME between DFA and YuNet landmarks on real aligned ``images`` (normalised by YuNet's inter-pupil distance);
    {"skipped": why} without images (``source`` says why) or without YuNet."""
    from ml.aligner.metrics import failure_rate, nme
    from ml.aligner.yunet import yunet_available, yunet_landmarks

    if images is None:
        return {"skipped": source}
    reason = yunet_available()
    if reason:
        return {"skipped": reason}
    ref, _ = yunet_landmarks(images)
    found = ~np.isnan(ref).any(axis=(1, 2))
    if not found.any():
        return {"skipped": f"YuNet found no face among the {len(images)} real faces of {source}"}
    pred, _ = model.predict(images[found])
    errors = nme(pred, ref[found])
    return {"images": int(len(images)), "yunet_found": int(found.sum()), "nme_vs_yunet": float(errors.mean()),
            "median_nme_vs_yunet": float(np.median(errors)), "failure@0.1_vs_yunet": failure_rate(errors, 0.1),
            "size": int(images.shape[1]), "source": source}


def detector_comparison(fit: tuple[np.ndarray, np.ndarray] | None, test: tuple[np.ndarray, np.ndarray],
                        dfa_nmes: np.ndarray, dfa_nmes_box: np.ndarray) -> dict[str, Any]:
    """DFA beside a landmark detector nobody here trained, on the same held-out procedural crops with exact
    landmarks: OpenCV Zoo's YuNet (``ml.aligner.yunet``), its points mapped to the renderer's convention by a
    ``ConventionMap`` fitted on ``fit`` (the val split), never on test. Both are scored on the test faces YuNet finds
    (``found``: their share; DFA's numbers over every test face are the stage's own). {"skipped": reason} where
    YuNet cannot run or finds too few val faces to fit the map."""
    from ml.aligner.metrics import failure_rate, nme, nme_box
    from ml.aligner.yunet import ConventionMap, yunet_available, yunet_landmarks

    reason = yunet_available()
    if reason:
        return {"skipped": reason}
    if fit is None:
        return {"skipped": "no val split to fit YuNet's landmark convention on (data.unaligned_val_identities: 0)"}
    fit_points, _ = yunet_landmarks(fit[0])
    fit_found = ~np.isnan(fit_points).any(axis=(1, 2))
    if fit_found.sum() < 11:
        return {"skipped": f"YuNet found {int(fit_found.sum())} val faces, too few to fit its landmark convention"}
    mapping = ConventionMap(fit_points[fit_found], fit[1][fit_found])
    points, _ = yunet_landmarks(test[0])
    found = ~np.isnan(points).any(axis=(1, 2))
    out: dict[str, Any] = {"found": float(found.mean()), "faces": float(found.sum()), "fit_faces": float(fit_found.sum())}
    if not found.any():
        return out
    raw, mapped, truth = points[found], mapping(points[found]), test[1][found]
    for name, pred in (("raw", raw), ("mapped", mapped)):
        box = nme_box(pred, truth)
        out.update({f"{name}/nme": float(nme(pred, truth).mean()), f"{name}/nme_box": float(box.mean()),
                    f"{name}/failure_box@0.05": failure_rate(box, 0.05)})
    out.update({"dfa/nme": float(dfa_nmes[found].mean()), "dfa/nme_box": float(dfa_nmes_box[found].mean()),
                "dfa/failure_box@0.05": failure_rate(dfa_nmes_box[found], 0.05)})
    return out


def unaligned_split(paths: Paths, split: str, progress: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """(images, landmarks) of the unaligned set's ``split`` (``train``, ``val`` or ``test``); None when it has no
    such rows (``val`` with ``data.unaligned_val_identities: 0``). The stage and the sweep's trials read the same."""
    from ml.data.dataset import landmarks_array, load_images, read_manifest

    manifest = read_manifest(paths.unaligned_set / "manifest.parquet")
    rows = manifest[manifest["split"] == split].reset_index(drop=True)
    if not len(rows):
        return None
    return load_images(paths.unaligned_set, rows, progress=progress), landmarks_array(rows)


def run(cfg: AlignerStageConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import read_dataset_info
    from ml.aligner.metrics import auc_at, failure_rate, nme, nme_box, plot_ced
    from ml.aligner.dfa import save_aligner
    from ml.aligner.train import train_aligner
    from ml.aligner.data import HELDOUT_NONFACE_START, nonface_crops
    from ml.aligner.evaluate import evaluate_aligner

    x, lm = unaligned_split(paths, "train")
    val = unaligned_split(paths, "val")
    res = train_aligner(cfg.train, x, lm, val=val, progress=True)
    tx, tlm = unaligned_split(paths, "test")  # read once, after training
    info = read_dataset_info(paths.unaligned_set)
    save_aligner(paths.aligner_model, res.model, extra={"registered_name": REGISTERED_MODEL,
                                                        "training_data_digest": info["digest"],
                                                        "face_score_trained": cfg.train.nonfaces_per_batch > 0,
                                                        **numerics(cfg.train.accelerator, cfg.train.precision)})
    n_neg = min(cfg.score_nonfaces, len(tx))
    nonfaces = (nonface_crops(cfg.train.seed, HELDOUT_NONFACE_START, n_neg, tx.shape[1], progress=True)
                if n_neg else None)
    test = evaluate_aligner(res.model, tx, tlm, nonfaces=nonfaces, top_anchor=True)
    mean_shape = np.broadcast_to(lm.mean(axis=0), tlm.shape)  # the trivial predictor: the training mean landmarks
    baseline, baseline_box = nme(mean_shape, tlm), nme_box(mean_shape, tlm)
    plot_ced({"DFA": test["nmes"], "mean landmarks": baseline}, paths.plots / "aligner_ced.png",
             box_curves={"DFA": test["nmes_box"], "DFA top anchor": test["nmes_box_top_anchor"],
                         "mean landmarks": baseline_box})
    result = StageResult("train_aligner", outputs=[paths.aligner_model])
    result.metrics = {
        "test/nme": test["nme"], "test/failure@0.1": test["failure@0.1"], "test/auc@0.1": test["auc@0.1"],
        **{f"test/{k}": test[k] for k in ("nme_box", "failure_box@0.05", "failure_box@0.07", "auc_box@0.07",
                                          "nme_box_top_anchor", "nme_top_anchor", "failure_box@0.05_top_anchor")},
        "test/mean_shape_nme": float(baseline.mean()), "test/mean_shape_failure@0.1": failure_rate(baseline, 0.1),
        "test/mean_shape_auc@0.1": auc_at(baseline, 0.1), "test/mean_shape_nme_box": float(baseline_box.mean()),
        "test/mean_shape_failure_box@0.05": failure_rate(baseline_box, 0.05), "test/faces": float(len(tx)),
        **{k: float(v) for k, v in (res.history[-1] if res.history else {}).items() if k.startswith("val/")},
        "train/seconds": float(res.seconds), "train/faces": float(len(x)),
        "train/nonfaces_per_batch": float(cfg.train.nonfaces_per_batch),
        "test/face_score_mean": test["face_score_mean"], "test/nonfaces": float(n_neg),
    }
    if nonfaces is not None:
        result.metrics.update({f"test/{k}": test[k] for k in ("face_auc", "face_accuracy@0.5", "nonface_score_mean")})
    n_quality = min(cfg.score_quality_faces, len(tx))
    if n_quality >= 2:
        qx, qlm, quality = render_quality_faces(n_quality, tx.shape[1], cfg.train.seed)
        q = evaluate_aligner(res.model, qx, qlm, qualities=quality)
        result.metrics.update({"quality/score_spearman": q["score_quality_spearman"], "quality/faces": float(len(qx)),
                               "quality/nme": q["nme"], "quality/nme_box": q["nme_box"]})
    detector = detector_comparison(val, (tx, tlm), test["nmes"], test["nmes_box"])
    result.metrics.update({f"test/yunet/{k}": float(v) for k, v in detector.items() if k != "skipped"})
    reference = reference_comparison(res.model, *reference_images(cfg, paths))
    result.metrics.update({f"reference/{k}": float(v) for k, v in reference.items() if k not in ("skipped", "source")})
    write_json(paths.metrics / "train_aligner.json", {**result.metrics, "reference": reference, "yunet": detector})
    write_history_csv(paths.plots / "train_aligner_history.csv", res.history)
    result.summary = (f"DFA: test NME (face box) {test['nme_box']:.4f} (top anchor {test['nme_box_top_anchor']:.4f}, "
                      f"mean shape {baseline_box.mean():.4f}), failure_box@0.05 "
                      f"{100 * test['failure_box@0.05']:.1f} %; inter-pupil NME {test['nme']:.4f} (mean shape "
                      f"{baseline.mean():.4f}), failure@0.1 {100 * test['failure@0.1']:.1f} %")
    if nonfaces is not None:
        result.summary += f", face score AUC {test['face_auc']:.3f} vs {n_neg} non-face crops"
    result.summary += f" in {res.seconds:.0f}s → {paths.aligner_model}"
    if "skipped" in reference:
        result.summary += f"; YuNet comparison skipped: {reference['skipped']}"
    if tracker is not None:
        tracker.log_dataset(paths.unaligned_set, context="train")
        for h in res.history:
            tracker.log_metrics({k: v for k, v in h.items() if k != "epoch"}, step=int(h["epoch"]))
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "aligner_ced.png", artifact_path="plots")
        version = tracker.register_model_dir(REGISTERED_MODEL, model_dir=paths.aligner_model,
                                             tags={"data_digest": info["digest"]})
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(AlignerStageConfig, section(params, "aligner"), "aligner")
    with stage_run("train_aligner", {"aligner": section(params, "aligner")}, paths.root) as tracker:
        result = run(cfg, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "train_aligner")
