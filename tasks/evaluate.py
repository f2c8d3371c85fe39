"""Stage ``evaluate``: benchmark the FR model on everything ``prepare`` wrote.

- every ``data/prepared/verification/*.bin``: 10-fold verification accuracy with flip TTA (InsightFace/LFW protocol)
- the IJB-style template set: media-then-template pooling, TAR@FAR, ROC
- the held-out identities: closed-set identification rank-1/5 (gallery vs probe split)
- reference baselines on the same pairs: raw-pixel cosine and a linear probe on raw pixels (trained on the
  training identities), to show the benchmark is not solvable by pixel matching

Writes ``metrics/evaluate.json``, ``plots/roc.png``, ``plots/roc_templates.csv`` and ``reports/benchmark.md``.
"""

from __future__ import annotations

import datetime as _dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from tasks.common import Paths, StageResult, atomic_path, load_params, section, stage_main, write_json, write_text
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluateConfig:
    """``params.yaml`` section ``evaluate``."""

    fars: tuple[float, ...] = (1e-4, 1e-3, 1e-2)
    ranks: tuple[int, ...] = (1, 5)
    n_folds: int = 10
    flip: bool = True
    batch_size: int = 256
    baselines: bool = True
    probe_epochs: int = 20


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


def _fmt_far(far: float) -> str:
    return f"{far:.0e}".replace("e-0", "e-")


def evaluate_model(model: Any, cfg: EvaluateConfig, paths: Paths, data: DataConfig) -> tuple[dict, dict]:
    """All benchmark numbers of one model; returns (metrics, curves for plotting)."""
    from ml.data.dataset import load_images, read_manifest
    from ml.data.formats import read_verification_bin
    from ml.eval.baselines import LinearProbe, raw_pixels
    from ml.eval.metrics import (
        identification_rank, pair_scores, roc_curve, tar_at_far, template_features, verification_accuracy,
    )
    from ml.data.dataset import landmarks_array
    from ml.train.fr import embed, needs_keypoints

    def emb(images: np.ndarray, keypoints: np.ndarray | None = None) -> np.ndarray:
        return embed(model, images, batch_size=cfg.batch_size, flip=cfg.flip, progress=True,
                     keypoints=keypoints if needs_keypoints(model) else None)

    metrics: dict[str, float] = {}
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    probe = None
    if cfg.baselines:
        train_manifest = read_manifest(paths.train_set / "manifest.parquet")
        rows = train_manifest[train_manifest["split"] == "train"].reset_index(drop=True)
        probe = LinearProbe(epochs=cfg.probe_epochs, seed=data.seed).fit(
            load_images(paths.train_set, rows), rows["label"].to_numpy()
        )

    for bin_path in sorted(paths.verification_dir.glob("*.bin")):
        name = bin_path.stem
        images, issame = read_verification_bin(bin_path)
        sidecar = bin_path.with_suffix(".landmarks.npy")
        if needs_keypoints(model) and not sidecar.is_file():
            log.warning("%s: no landmarks (%s) for the KP-RPE model; not evaluated", bin_path, sidecar.name)
            metrics[f"verification/{name}/skipped_no_landmarks"] = 1.0
            continue
        candidates = {"model": emb(images, np.load(sidecar) if sidecar.is_file() else None)}
        if probe is not None:
            candidates["raw_pixels"] = raw_pixels(images)
            candidates["linear_probe"] = probe.embed(images)
        for method, feats in candidates.items():
            prefix = f"verification/{name}" if method == "model" else f"baseline/{method}/verification/{name}"
            acc = verification_accuracy(feats[0::2], feats[1::2], issame, n_folds=cfg.n_folds)
            metrics[f"{prefix}/accuracy"] = acc["accuracy"]
            metrics[f"{prefix}/std"] = acc["std"]
            scores = pair_scores(_normalise(feats[0::2]), _normalise(feats[1::2]))
            fpr, tpr, _ = roc_curve(scores, issame.astype(int))
            curves[f"{name}: {method}"] = (fpr, tpr)

    # IJB-style templates
    tdir = paths.template_set
    manifest = read_manifest(tdir / "manifest.parquet")
    feats = emb(load_images(tdir, manifest), landmarks_array(manifest))
    tids, tfeats = template_features(feats, manifest["template"].to_numpy(), manifest["media"].to_numpy())
    pairs = np.loadtxt(tdir / "meta" / "template_pair_label.txt", dtype=np.int64, ndmin=2)
    index = {int(t): i for i, t in enumerate(tids)}
    a = tfeats[[index[int(t)] for t in pairs[:, 0]]]
    b = tfeats[[index[int(t)] for t in pairs[:, 1]]]
    scores = pair_scores(a, b)
    labels = pairs[:, 2]
    for far, tar in tar_at_far(scores, labels, fars=cfg.fars).items():
        metrics[f"templates/tar@far={_fmt_far(far)}"] = tar
    fpr, tpr, _ = roc_curve(scores, labels)
    curves["templates: model"] = (fpr, tpr)
    metrics["templates/pairs"] = float(len(labels))
    metrics["templates/impostor_pairs"] = float((labels == 0).sum())

    # closed-set identification on held-out identities
    hdir = paths.heldout_set
    manifest = read_manifest(hdir / "manifest.parquet")
    feats = emb(load_images(hdir, manifest), landmarks_array(manifest))
    gallery = (manifest["split"] == "gallery").to_numpy()
    ranks = identification_rank(
        feats[~gallery], manifest["label"].to_numpy()[~gallery],
        feats[gallery], manifest["label"].to_numpy()[gallery], ranks=cfg.ranks,
    )
    for r, v in ranks.items():
        metrics[f"identification/rank{r}"] = v
    return metrics, curves


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, (fpr, tpr) in curves.items():
        ax.plot(np.clip(fpr, 1e-6, 1), tpr, label=label, lw=1.6 if "model" in label else 1.0,
                ls="-" if "model" in label else "--")
    ax.set(xscale="log", xlim=(1e-4, 1), ylim=(0, 1.01), xlabel="false accept rate", ylabel="true accept rate",
           title="ROC (held-out identities)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def render_report(metrics: dict[str, float], model_config: dict, data_info: dict, train_metrics: dict) -> str:
    """``reports/benchmark.md``: the embedded run's numbers, model vs baselines."""
    lines = [
        "# faceops benchmark",
        "",
        f"Generated by `dvc repro evaluate` on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}. "
        "Every number below was measured in this run; see `metrics/evaluate.json` for all of them.",
        "",
        "## Model",
        "",
        f"- backbone: `{model_config.get('backbone')}` {model_config.get('kwargs', {})}",
        f"- trained on: `{data_info.get('name')}` ({data_info.get('source')}), {data_info.get('identity_count')} identities, "
        f"{data_info.get('image_count')} images, digest `{str(data_info.get('digest', ''))[:12]}`",
    ]
    if train_metrics:
        lines.append(
            f"- training: {train_metrics.get('train/seconds', float('nan')):.0f} s, final train/loss "
            f"{train_metrics.get('train/loss', float('nan')):.3f}, train/accuracy {train_metrics.get('train/accuracy', float('nan')):.3f}"
        )
    lines += ["", "## Verification (10-fold, flip TTA, held-out identities)", "",
              "| benchmark | FR model | raw-pixel cosine | linear probe on pixels |", "|---|---|---|---|"]
    names = sorted({k.split("/")[1] for k in metrics if k.startswith("verification/") and k.endswith("/accuracy")})
    for name in names:
        def cell(prefix: str) -> str:
            acc = metrics.get(f"{prefix}verification/{name}/accuracy")
            std = metrics.get(f"{prefix}verification/{name}/std")
            return "—" if acc is None else f"{100 * acc:.2f} ± {100 * std:.2f} %"
        lines.append(f"| `{name}.bin` | {cell('')} | {cell('baseline/raw_pixels/')} | {cell('baseline/linear_probe/')} |")
    for k in sorted(k for k in metrics if k.endswith("/skipped_no_landmarks")):
        lines.append(f"| `{k.split('/')[1]}.bin` | not evaluated: the KP-RPE model needs landmarks and the file has none | — | — |")
    lines += ["", "## Templates (IJB-style: media mean → template mean)", "", "| metric | value |", "|---|---|"]
    for k in sorted(k for k in metrics if k.startswith("templates/tar")):
        lines.append(f"| {k.removeprefix('templates/')} | {100 * metrics[k]:.2f} % |")
    lines.append(f"| pairs (impostor) | {int(metrics['templates/pairs'])} ({int(metrics['templates/impostor_pairs'])}) |")
    lines += ["", "## Identification (closed set, held-out identities, cosine)", "", "| rank | accuracy |", "|---|---|"]
    for k in sorted(k for k in metrics if k.startswith("identification/")):
        lines.append(f"| {k.removeprefix('identification/rank')} | {100 * metrics[k]:.2f} % |")
    lines += ["", "![ROC](../plots/roc.png)", ""]
    return "\n".join(lines)


def run(cfg: EvaluateConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    import json

    from ml.data.dataset import read_dataset_info
    from ml.models.io import load_model

    model, model_config = load_model(paths.fr_model)
    metrics, curves = evaluate_model(model, cfg, paths, data)
    write_json(paths.metrics / "evaluate.json", metrics)
    plot_roc(curves, paths.plots / "roc.png")
    fpr, tpr = curves["templates: model"]
    write_text(paths.plots / "roc_templates.csv",
               "fpr,tpr\n" + "".join(f"{f:.6g},{t:.6g}\n" for f, t in zip(fpr, tpr)))
    train_metrics_path = paths.metrics / "train_fr.json"
    train_metrics = json.loads(train_metrics_path.read_text()) if train_metrics_path.is_file() else {}
    report = render_report(metrics, model_config, read_dataset_info(paths.train_set), train_metrics)
    write_text(paths.benchmark_report, report)
    result = StageResult("evaluate", metrics=metrics,
                         outputs=[paths.metrics / "evaluate.json", paths.plots / "roc.png", paths.benchmark_report])
    main_bin = "verification/procedural/accuracy"
    result.summary = (
        f"procedural.bin accuracy {100 * metrics.get(main_bin, float('nan')):.2f}%, "
        f"rank-1 {100 * metrics.get('identification/rank1', float('nan')):.2f}% → {paths.benchmark_report}"
    )
    if tracker is not None:
        for sub in ("heldout", "templates"):
            tracker.log_dataset(paths.prepared / sub, context=f"eval-{sub}")
        tracker.log_metrics(metrics)
        tracker.log_artifact(paths.plots / "roc.png", artifact_path="plots")
        tracker.log_artifact(paths.benchmark_report, artifact_path="reports")
        tracker.set_tags({"model.digest": model_config.get("extra", {}).get("training_data_digest", "")})
    return result


def main() -> None:
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(EvaluateConfig, section(params, "evaluate"), "evaluate")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("evaluate", {"evaluate": section(params, "evaluate")}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main)
