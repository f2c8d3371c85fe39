"""Stage ``evaluate``: benchmark the FR model on everything ``prepare`` wrote.

- every ``data/prepared/verification/*.bin``: 10-fold verification accuracy with flip TTA (InsightFace/LFW protocol)
- the IJB-style template set: media-then-template pooling, TAR@FAR, ROC
- the user's IJB-B / IJB-C folders (``evaluate.ijb_dir``, ``ml/eval/ijb.py``): loose crops aligned on their 5
  landmarks, faceness-weighted media-then-template pooling, TAR at FAR 1e-5 … 1e-1
- the held-out identities: closed-set identification rank-1/5 (gallery vs probe split)
- reference baselines on the same pairs: raw-pixel cosine and a linear probe on raw pixels (trained on the
  training identities), to show the benchmark is not solvable by pixel matching

- generalized face discovery on the GFD split (``tasks/evaluate/discovery.py``): FaceGCD, its GCD control (no
  prefixes) and FR features with semi-supervised k-means, and unsupervised clustering baselines; All / Known / Novel

Writes ``metrics/evaluate.json``, ``plots/roc.png``, ``plots/roc_templates.csv`` and ``reports/benchmark.md``
(plus ``metrics/discovery.json``, ``plots/discovery_embedding.png``, ``reports/discovery_predictions.csv``,
``metrics/sets.json``, ``plots/fusion_gain.png``).
- set and video fusion (``tasks/evaluate/fusion.py``): average, norm-weighted, landmark-score and CAFace templates on the
  IJB-style template set and IJB-S-style video probes
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from tasks.common import (
    Paths, StageResult, load_params, section, write_json, write_text, pyplot, save_figure,
)
from tasks.evaluate.cells import FEW_FALSE_ACCEPTS_NOTE, few_false_accepts, thin
from tasks.evaluate.report import aligner_section, data_section, preset_note, render_report
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)

OWN_FILES = ("discovery/", "sets/")  # metric prefixes whose numbers live in metrics/discovery.json, metrics/sets.json


@dataclass(frozen=True)
class EvaluateConfig:
    """``params.yaml`` section ``evaluate``."""

    fars: tuple[float, ...] = (1e-4, 1e-3, 1e-2)
    ranks: tuple[int, ...] = (1, 5)
    fpirs: tuple[float, ...] = (0.01,)          # open-set 1:N (IJB-S style): TPIR at these FPIRs
    distractor_ranks: tuple[int, ...] = (1, 5, 20)  # TinyFace-style gallery with distractors
    n_folds: int = 10
    flip: bool = True
    batch_size: int = 256
    baselines: bool = True
    probe_epochs: int = 20
    # generalized face discovery (tasks/evaluate/discovery.py): semi-supervised k-means and clustering baselines
    discovery: bool = True
    discovery_fr_source: str = "real"  # models/fr/<source> behind the FR + SSK row and the clustering baselines
    ssk_n_init: int = 10
    ssk_max_iter: int = 500
    nnc_k: int = 5
    dbscan_eps: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # chord distance on unit vectors
    dbscan_min_samples: tuple[int, ...] = (2, 3, 5)
    embedding_plot_identities: int = 5  # per group (known, novel) in plots/discovery_embedding.png
    # set and video fusion (tasks/evaluate/fusion.py)
    sets: bool = True
    fusion_chunk_size: int = 64  # CAFace streams each probe in chunks of this many frames (memory O(chunk))
    bin_dir: str = ""  # a folder of InsightFace verification .bin files (lfw.bin, cfp_fp.bin, agedb_30.bin, ...)
    ijb_dir: str = ""  # an IJB-B/C folder (meta/ + loose_crop/) or the folder holding IJBB/ and IJBC/


def _fmt_far(far: float) -> str:
    return f"{far:.0e}".replace("e-0", "e-")


def verification_bins(paths: Paths, bin_dir: str = "") -> list[Path]:
    """Every ``.bin`` in ``data/prepared/verification``, then every one in ``evaluate.bin_dir`` (the user's LFW,
    CFP-FP, AgeDB-30, ... as InsightFace ships them); each name (file stem) is one column of the report."""
    from ml.errors import DataError

    bins = sorted(paths.verification_dir.glob("*.bin"))
    if bin_dir:
        folder = Path(bin_dir)
        if not folder.is_dir():
            raise DataError(f"evaluate.bin_dir: {bin_dir} is not a directory; point it at a folder of InsightFace "
                            "verification .bin files (lfw.bin, cfp_fp.bin, agedb_30.bin, ...) or set it to ''")
        extra = sorted(folder.glob("*.bin"))
        if not extra:
            raise DataError(f"evaluate.bin_dir: {bin_dir} holds no .bin file; add the verification sets or set it to ''")
        taken = {b.stem: b for b in bins}
        for b in extra:
            if b.stem in taken:
                raise DataError(f"{b}: its name {b.stem!r} is also {taken[b.stem]}; rename it (each .bin's name is "
                                "one column of the report)")
        bins += extra
    return bins


def _verification_sets(bins: list[Path], aligned_dir: Path | None = None
                       ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray | None]]:
    """(name, images, issame, landmarks or None) for every ``.bin`` of ``bins`` (:func:`verification_bins`). The
    landmarks are the ``<stem>.landmarks.npy`` beside the bin, else the align stage's predictions for it
    (``<aligned_dir>/verification/<stem>.landmarks.npy``: the ingested real faces)."""
    from ml.data.formats import read_verification_bin

    sets = []
    for bin_path in bins:
        images, issame = read_verification_bin(bin_path)
        sidecar = bin_path.with_suffix(".landmarks.npy")
        if not sidecar.is_file() and aligned_dir is not None:
            sidecar = aligned_dir / "verification" / sidecar.name
        landmarks = _landmarks_sidecar(sidecar, len(images)) if sidecar.is_file() else None
        sets.append((bin_path.stem, images, issame, landmarks))
    return sets


def _landmarks_sidecar(path: Path, n_images: int) -> np.ndarray:
    """The (2P, 5, 2) finite pixel landmarks beside a ``.bin``; DataError naming the file otherwise."""
    from ml.errors import DataError

    bin_name = path.name.removesuffix(".landmarks.npy") + ".bin"
    try:
        with path.open("rb") as fh:
            if fh.read(6) != b"\x93NUMPY":
                raise ValueError("not a .npy file: no NumPy header")
        landmarks = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        detail = " ".join(str(exc).split())
        raise DataError(f"{path}: cannot read the landmarks beside {bin_name} ({detail}); rebuild it with the "
                        "prepare stage or remove it") from exc
    if landmarks.shape != (n_images, 5, 2) or not np.issubdtype(landmarks.dtype, np.number):
        raise DataError(f"{path}: landmarks of shape {landmarks.shape} ({landmarks.dtype}), expected "
                        f"({n_images}, 5, 2): one row of 5 (x, y) points per image of the .bin, in its order")
    if not np.isfinite(landmarks).all():
        row = int(np.flatnonzero(~np.isfinite(landmarks).reshape(n_images, -1).all(axis=1))[0])
        raise DataError(f"{path}: landmarks of image {row} contain NaN/inf; rebuild it with the prepare stage")
    return landmarks.astype(np.float32)


def _pair_metrics(feats: np.ndarray, issame: np.ndarray, cfg: EvaluateConfig) -> tuple[dict[str, float], tuple]:
    """10-fold accuracy ± std and TAR at each of ``cfg.fars`` over all pairs of one ``.bin``."""
    from ml.eval.metrics import pair_scores, roc_curve, tar_at_far, verification_accuracy

    acc = verification_accuracy(feats[0::2], feats[1::2], issame, n_folds=cfg.n_folds)
    scores = pair_scores(feats[0::2], feats[1::2])  # cosine: it normalises the rows
    fpr, tpr, _ = roc_curve(scores, issame.astype(int))
    values = {"accuracy": acc["accuracy"], "std": acc["std"]}
    values.update({f"tar@far={_fmt_far(far)}": tar for far, tar in tar_at_far(scores, issame.astype(int),
                                                                             fars=cfg.fars).items()})
    return values, (fpr, tpr)


def ijb_sets(cfg: EvaluateConfig) -> list:
    """The IJB-B/C protocols of ``evaluate.ijb_dir`` (``ml.eval.ijb.IJBSet``), read and cross-checked before any
    model runs; ``[]`` when it is empty."""
    if not cfg.ijb_dir:
        return []
    from ml.eval.ijb import load_ijb_sets

    return load_ijb_sets(cfg.ijb_dir, what="evaluate.ijb_dir")


def evaluate_ijb(model: Any, tag: str, cfg: EvaluateConfig, sets: list) -> dict[str, float]:
    """IJB-B/C 1:1 verification of one model on every set of :func:`ijb_sets`: ``<tag>/ijb/<set>/tar@far=1e-5``
    … ``1e-1``, ``pairs``, ``impostor_pairs``, ``images``, ``templates``."""
    from ml.eval.ijb import ijb_verification

    metrics: dict[str, float] = {}
    for ijb in sets:
        values = ijb_verification(model, ijb, batch_size=cfg.batch_size, flip=cfg.flip, progress=True)
        metrics.update({f"{tag}/ijb/{ijb.name}/{k}": v for k, v in values.items()})
    return metrics


def ijb_section(metrics: dict[str, float], models: dict[str, dict], sets: list) -> list[str]:
    """Markdown for the user's IJB-B/C folders: one table per set, one row per model, one column per FAR."""
    pct = lambda v: "—" if v is None else f"{100 * v:.2f} %"  # noqa: E731
    lines = []
    for ijb in sets:
        prefix = f"/ijb/{ijb.name}/"
        fars = sorted({k.rsplit("/", 1)[1] for k in metrics if prefix + "tar@" in k},
                      key=lambda f: float(f.split("=")[1]))
        counts = next((t for t in models if f"{t}{prefix}pairs" in metrics), None)
        if counts is None:
            continue
        c = lambda key: int(metrics[f"{counts}{prefix}{key}"])  # noqa: E731
        lines += ["", f"## IJB 1:1 verification: `{ijb.name}` from `{ijb.root}`", "",
                  f"{c('images')} loose crops aligned on their 5 landmarks to each model's input size, flip TTA; "
                  f"faceness-weighted media mean → template mean over {c('templates')} templates; cosine on "
                  f"{c('pairs')} pairs ({c('impostor_pairs')} impostor).", "",
                  "| model | " + " | ".join(f.replace("tar@far", "TAR@FAR") for f in fars) + " |",
                  "|---|" + "---|" * len(fars)]
        for tag in models:
            lines.append(f"| `{tag}` | " + " | ".join(few_false_accepts(pct(metrics.get(f"{tag}{prefix}{f}")), f,
                                                                          c("impostor_pairs")) for f in fars) + " |")
        if any(thin(f, c("impostor_pairs")) for f in fars):
            lines += ["", FEW_FALSE_ACCEPTS_NOTE]
    return lines


def evaluate_baselines(cfg: EvaluateConfig, paths: Paths, data: DataConfig, sets: list) -> tuple[dict, dict]:
    """Raw-pixel cosine and a linear probe on pixels (fitted on the training identities) on every ``.bin``."""
    from ml.data.dataset import load_images, read_manifest
    from ml.eval.baselines import LinearProbe, raw_pixels

    manifest = read_manifest(paths.train_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    probe = LinearProbe(epochs=cfg.probe_epochs, seed=data.seed).fit(
        load_images(paths.train_set, rows), rows["label"].to_numpy()
    )
    metrics: dict[str, float] = {}
    curves: dict[str, tuple] = {}
    for name, images, issame, _ in sets:
        for method, feats in (("raw_pixels", raw_pixels(images)), ("linear_probe", probe.embed(images))):
            values, curves[f"{name}: {method}"] = _pair_metrics(feats, issame, cfg)
            for k, v in values.items():
                metrics[f"baseline/{method}/verification/{name}/{k}"] = v
    return metrics, curves


def unique_rows(images: np.ndarray, landmarks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the first occurrence of each distinct (image, landmarks) row, the distinct row of every row):
    ``x[first][inverse]`` equals ``x`` row for row."""
    import hashlib

    seen: dict[bytes, int] = {}
    first: list[int] = []
    inverse = np.empty(len(images), dtype=np.int64)
    for i, image in enumerate(images):
        h = hashlib.blake2b(image.tobytes(), digest_size=16)
        if landmarks is not None:
            h.update(np.ascontiguousarray(landmarks[i]).tobytes())
        inverse[i] = seen.setdefault(h.digest(), len(first))
        if inverse[i] == len(first):
            first.append(i)
    return np.asarray(first, dtype=np.int64), inverse


def evaluate_model(model: Any, tag: str, cfg: EvaluateConfig, paths: Paths, sets: list) -> tuple[dict, dict]:
    """All benchmark numbers of one model, keyed ``<tag>/...``; returns (metrics, ROC curves)."""
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.data.landmarks import manifest_keypoints
    from ml.eval.metrics import (
        identification_rank, identification_with_distractors, open_set_identification, pair_scores, roc_curve,
        tar_at_far, template_features,
    )
    from ml.fr.train import embed, needs_keypoints

    from tasks.train_generator import resize_faces

    size = int(model.input_contract["size"])

    def emb(images: np.ndarray, keypoints: np.ndarray | None = None) -> np.ndarray:
        """Embeddings of the benchmark's faces at the model's own input size (a pretrained 112-px recogniser on the
        64-px procedural faces: upsampled, landmarks with them)."""
        kp = keypoints if needs_keypoints(model) else None
        if kp is not None and images.shape[1] != size:
            kp = kp * (size / images.shape[1])
        return embed(model, resize_faces(images, size), batch_size=cfg.batch_size, flip=cfg.flip, progress=True,
                     keypoints=kp)

    metrics: dict[str, float] = {}
    curves: dict[str, tuple] = {}
    for name, images, issame, landmarks in sets:
        if needs_keypoints(model) and landmarks is None:
            log.warning("%s.bin has no landmarks sidecar; the KP-RPE model %s is not evaluated on it", name, tag)
            metrics[f"{tag}/verification/{name}/skipped_no_landmarks"] = 1.0
            continue
        first, inverse = unique_rows(images, landmarks)  # a .bin repeats each face in many pairs: embed it once
        feats = emb(images[first], None if landmarks is None else landmarks[first])[inverse]
        values, curves[f"{name}: {tag}"] = _pair_metrics(feats, issame, cfg)
        for k, v in values.items():
            metrics[f"{tag}/verification/{name}/{k}"] = v

    # IJB-style templates: media mean → template mean → cosine per listed pair
    tdir = paths.template_set
    manifest = read_manifest(tdir / "manifest.parquet")
    feats = emb(load_images(tdir, manifest), landmarks_array(manifest))
    tids, tfeats = template_features(feats, manifest["template"].to_numpy(), manifest["media"].to_numpy())
    pairs = np.loadtxt(tdir / "meta" / "template_pair_label.txt", dtype=np.int64, ndmin=2)
    index = {int(t): i for i, t in enumerate(tids)}
    scores = pair_scores(tfeats[[index[int(t)] for t in pairs[:, 0]]], tfeats[[index[int(t)] for t in pairs[:, 1]]])
    labels = pairs[:, 2]
    for far, tar in tar_at_far(scores, labels, fars=cfg.fars).items():
        metrics[f"{tag}/templates/tar@far={_fmt_far(far)}"] = tar
    fpr, tpr, _ = roc_curve(scores, labels)
    curves[f"templates: {tag}"] = (fpr, tpr)
    metrics[f"{tag}/templates/pairs"] = float(len(labels))
    metrics[f"{tag}/templates/impostor_pairs"] = float((labels == 0).sum())

    # closed-set identification on held-out identities (gallery vs probe split)
    hdir = paths.heldout_set
    manifest = read_manifest(hdir / "manifest.parquet")
    # ingested real faces carry no landmarks: a KP-RPE model gets the align stage's predictions for them
    keypoints = manifest_keypoints(hdir, manifest, paths.aligned_set)[0] if needs_keypoints(model) else None
    feats = emb(load_images(hdir, manifest), keypoints)
    gallery = (manifest["split"] == "gallery").to_numpy()
    label = manifest["label"].to_numpy()
    for r, v in identification_rank(feats[~gallery], label[~gallery], feats[gallery], label[gallery], ranks=cfg.ranks).items():
        metrics[f"{tag}/identification/rank{r}"] = v

    # Open set: only even-labelled held-out identities are enrolled. Probes of the others are non-mated
    # (IJB-S style TPIR@FPIR), and all their images serve as distractors for the enrolled probes (TinyFace style).
    enrolled = label % 2 == 0
    if enrolled.any() and (~enrolled).any():
        g = gallery & enrolled
        open_set = open_set_identification(feats[~gallery], label[~gallery], feats[g], label[g], fpirs=cfg.fpirs, ranks=(1,))
        for f in cfg.fpirs:
            metrics[f"{tag}/open_set/tpir@fpir={_fmt_far(f)}"] = open_set[f"tpir@fpir={float(f)!r}/rank1"]
        p = ~gallery & enrolled
        ranks = identification_with_distractors(feats[p], label[p], feats[g], label[g], feats[~enrolled],
                                                ranks=cfg.distractor_ranks)
        for r, v in ranks.items():
            metrics[f"{tag}/distractors/rank{r}"] = v
        metrics[f"{tag}/distractors/count"] = float((~enrolled).sum())
    return metrics, curves


def chance_metrics(cfg: EvaluateConfig, paths: Paths, sets: list) -> dict[str, float]:
    """What random scores get on each benchmark, keyed ``chance/...`` like a model's numbers: verification the
    majority share of the pairs, TAR@FAR the FAR, closed-set rank-r r/G over G gallery identities, open-set
    TPIR@FPIR FPIR/G_enrolled, rank-r with distractors r/(G_enrolled + distractor images)."""
    from ml.data.dataset import read_manifest

    out: dict[str, float] = {}
    for name, _, issame, _ in sets:
        share = float(np.mean(issame))
        out[f"chance/verification/{name}/accuracy"] = max(share, 1.0 - share)
        out[f"chance/verification/{name}/std"] = 0.0
    for far in cfg.fars:
        out[f"chance/templates/tar@far={_fmt_far(far)}"] = float(far)
    manifest = read_manifest(paths.heldout_set / "manifest.parquet")
    gallery = (manifest["split"] == "gallery").to_numpy()
    label = manifest["label"].to_numpy()
    identities = len(np.unique(label[gallery]))
    for r in cfg.ranks:
        out[f"chance/identification/rank{r}"] = min(1.0, r / identities)
    enrolled = label % 2 == 0  # as evaluate_model's open set
    if enrolled.any() and (~enrolled).any():
        g = len(np.unique(label[gallery & enrolled]))
        for f in cfg.fpirs:
            out[f"chance/open_set/tpir@fpir={_fmt_far(f)}"] = float(f) / g
        for r in cfg.distractor_ranks:
            out[f"chance/distractors/rank{r}"] = min(1.0, r / (g + int((~enrolled).sum())))
    return out


def model_dirs(paths: Paths) -> list[tuple[str, Path]]:
    """``(source, directory)`` of every trained FR model under ``models/fr/``."""
    found = sorted((d.name, d) for d in paths.fr_models.glob("*") if (d / "config.json").is_file())
    if not found:
        from ml.errors import DataError

        raise DataError(f"no trained FR model under {paths.fr_models}; run `dvc repro train_fr` first.")
    return found


def pretrained_references(loaded: dict[str, Any], configs: dict[str, dict], own: str) -> dict[str, Any]:
    """The imported recognisers (``faceops import``: ``extra.training_source`` pretrained) among ``loaded`` other
    than ``own``, the model a table's methods stand on: each gets a reference row there."""
    return {tag: model for tag, model in loaded.items()
            if tag != own and configs[tag].get("extra", {}).get("training_source") == "pretrained"}


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, (fpr, tpr) in curves.items():
        ax.plot(np.clip(fpr, 1e-6, 1), tpr, label=label, lw=1.6 if "model" in label else 1.0,
                ls="-" if "model" in label else "--")
    ax.set(xscale="log", xlim=(1e-4, 1), ylim=(0, 1.01), xlabel="false accept rate", ylabel="true accept rate",
           title="ROC (held-out identities)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)


def run(cfg: EvaluateConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    import json

    from tasks.evaluate.synthetic import synthetic_gap, synthetic_section

    from ml.models.io import load_model

    bins = verification_bins(paths, cfg.bin_dir)
    ijb = ijb_sets(cfg)  # read before any model runs: a broken folder fails in seconds, not after the models
    sets = _verification_sets(bins, paths.aligned_set)
    metrics: dict[str, float] = {}
    curves: dict[str, tuple] = {}
    models: dict[str, dict] = {}
    loaded: dict[str, Any] = {}
    for tag, directory in model_dirs(paths):
        loaded[tag], models[tag] = load_model(directory)
        m, c = evaluate_model(loaded[tag], tag, cfg, paths, sets)
        metrics.update(m)
        curves.update(c)
        metrics.update(evaluate_ijb(loaded[tag], tag, cfg, ijb))
    if cfg.discovery and paths.gfd_split.is_file():
        from tasks.evaluate.discovery import evaluate_discovery

        if cfg.discovery_fr_source not in loaded:
            from ml.errors import DataError

            raise DataError(f"evaluate.discovery_fr_source is {cfg.discovery_fr_source!r} but models/fr/ holds "
                            f"{', '.join(loaded)}: import it (`faceops import`) or train it first")
        metrics.update(evaluate_discovery(cfg, data, paths, loaded[cfg.discovery_fr_source],
                                          pretrained_references(loaded, models, cfg.discovery_fr_source)))
    if cfg.sets and paths.video_set.is_dir():
        from tasks.evaluate.fusion import evaluate_sets, fusion_fr_source

        source = fusion_fr_source(paths)
        if source not in loaded and source != "real":
            from ml.errors import DataError

            raise DataError(f"models/fusion was trained on models/fr/{source}, which models/fr/ no longer holds "
                            f"({', '.join(loaded)}): import it again or retrain with `dvc repro train_fusion`")
        metrics.update(evaluate_sets(cfg, data, paths, loaded.get(source, next(iter(loaded.values()))),
                                     chunk_size=cfg.fusion_chunk_size,
                                     references=pretrained_references(loaded, models, source)))
    metrics.update(chance_metrics(cfg, paths, sets))
    if cfg.baselines:
        m, c = evaluate_baselines(cfg, paths, data, sets)
        metrics.update(m)
        curves.update(c)
    metrics.update(synthetic_gap(metrics))
    # one file per concern: the discovery and set-fusion numbers are in metrics/discovery.json and sets.json only
    write_json(paths.metrics / "evaluate.json",
               {k: v for k, v in metrics.items() if not k.startswith(OWN_FILES)})
    plot_roc(curves, paths.plots / "roc.png")
    first = next(iter(models))
    fpr, tpr = curves[f"templates: {first}"]
    write_text(paths.plots / "roc_templates.csv", "fpr,tpr\n" + "".join(f"{f:.6g},{t:.6g}\n" for f, t in zip(fpr, tpr)))
    train_metrics = {}
    for tag in models:
        path = paths.metrics / f"train_fr_{tag}.json"
        train_metrics[tag] = json.loads(path.read_text()) if path.is_file() else {}
    stage_json = {n: json.loads((paths.metrics / f"{n}.json").read_text()) if (paths.metrics / f"{n}.json").is_file()
                  else {} for n in ("train_aligner", "align", "synthesize", "train_generator")}
    write_text(paths.benchmark_report, render_report(
        metrics, models, train_metrics,
        data_section(paths, bins, metrics, models)
        + ijb_section(metrics, models, ijb)
        + aligner_section(stage_json["train_aligner"], stage_json["align"])
        + synthetic_section(stage_json["synthesize"], metrics, models, stage_json["train_generator"]),
        note=preset_note(load_params(paths.params), paths.root)))
    result = StageResult("evaluate", metrics=metrics,
                         outputs=[paths.metrics / "evaluate.json", paths.plots / "roc.png", paths.benchmark_report])
    result.summary = "; ".join(
        f"{tag}: procedural.bin {100 * metrics.get(f'{tag}/verification/procedural/accuracy', float('nan')):.2f}%, "
        f"rank-1 {100 * metrics.get(f'{tag}/identification/rank1', float('nan')):.2f}%" for tag in models
    ) + f" → {paths.benchmark_report}"
    if tracker is not None:
        for sub in ("heldout", "templates"):
            tracker.log_dataset(paths.prepared / sub, context=f"eval-{sub}")
        tracker.log_metrics(metrics)
        tracker.log_artifact(paths.plots / "roc.png", artifact_path="plots")
        for extra in (paths.plots / "discovery_embedding.png", paths.root / "reports" / "discovery_predictions.csv"):
            if extra.is_file():
                tracker.log_artifact(extra, artifact_path="discovery")
        if (paths.plots / "fusion_gain.png").is_file():
            tracker.log_artifact(paths.plots / "fusion_gain.png", artifact_path="plots")
        tracker.log_artifact(paths.benchmark_report, artifact_path="reports")
        tracker.set_tags({f"model.{tag}.digest": c.get("extra", {}).get("training_data_digest", "") for tag, c in models.items()})
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(EvaluateConfig, section(params, "evaluate"), "evaluate")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("evaluate", {"evaluate": section(params, "evaluate")}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)
