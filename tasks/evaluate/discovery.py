"""The ``evaluate`` stage's generalized face discovery part (FaceGCD paper Tables 1–2 layout).

Methods, all on the images of ``data/prepared/gfd/split.parquet`` with K = known + novel identities:

- ``FaceGCD + SSK``: the discovery model's features (``models/discovery``, flip TTA like the FR features), semi-supervised k-means;
- ``GCD + SSK``: the control trained the same way without prefixes (``models/discovery_gcd``, when the
  ``train_discovery`` stage trained it: ``discovery.gcd_arm``), the same features and clustering;
- ``FR features + SSK``: the FR model's features (flip TTA), semi-supervised k-means (the paper's ArcFace row);
- ``k-means`` / ``agglomerative`` / ``DBSCAN`` on the FR features, no labels (best linkage / grid point chosen on
  the labelled images, never on the labels the table scores; the paper chooses on its evaluation labels);
- ``chance``: random partitions with the true cluster sizes, scored the same way (Hungarian matching of two test
  images per identity sits far above 1/K).

Writes ``metrics/discovery.json``, ``reports/discovery_predictions.csv`` (per test image: the known identity it
was assigned to or a new cluster id) and ``plots/discovery_embedding.png`` (2-D t-SNE of a few known and novel
identities, FR features beside FaceGCD's and GCD's). ``render_section`` is the Markdown for ``reports/benchmark.md``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ml.atomic import atomic_path
from tasks.common import Paths, pyplot, save_figure, write_json

log = logging.getLogger(__name__)

METHODS = {  # metrics prefix → table label
    "facegcd": "FaceGCD + SSK",
    "gcd": "GCD (no prefixes) + SSK",
    "fr_ssk": "FR features + SSK",
    "kmeans": "k-means (FR features)",
    "agglomerative": "agglomerative, best linkage (FR features)",
    "dbscan": "DBSCAN, best of grid (FR features)",
    "chance": "chance (random partition, true cluster sizes)",
}


class GFDInputs(NamedTuple):
    """The images of the GFD split and its per-image masks, in the split's row order."""

    rows: pd.DataFrame
    images: np.ndarray    # uint8 (N, S, S, 3)
    labels: np.ndarray    # (N,) int identity labels, known and novel
    labelled: np.ndarray  # (N,) bool: the label may be used (labelled images of known identities)
    known: np.ndarray     # (N,) bool: the identity is known
    test: np.ndarray      # (N,) bool: held out for the test subset


def gfd_inputs(paths: Paths, data: Any) -> GFDInputs:
    """Load ``data/prepared/gfd/split.parquet``'s images (at ``data.image_size``) and masks."""
    from ml.data.dataset import load_images
    from tasks.train_discovery import gfd_rows

    dataset, rows = gfd_rows(paths)
    images = load_images(dataset, rows, expected_size=(data.image_size, data.image_size), progress=True)
    return GFDInputs(rows, images, rows["label"].to_numpy(np.int64), rows["labelled"].to_numpy(bool),
                     rows["known"].to_numpy(bool), (rows["subset"] == "test").to_numpy())


def facegcd_ssk(model: Any, gfd: GFDInputs, cfg: Any, data: Any) -> tuple[np.ndarray, Any]:
    """A FaceGCD (or GCD) model's features of the GFD images (flip TTA when ``evaluate.flip``, as for the FR
    features) and semi-supervised k-means on them → (features, outcome);
    ``outcome.metrics`` are the ``discovery/facegcd/...`` (``discovery/gcd/...``) numbers without that prefix."""
    from ml.discovery.protocol import gfd_ssk

    features = model.embed(gfd.images, batch_size=cfg.batch_size, flip=cfg.flip)  # the TTA the FR features get
    return features, gfd_ssk(features, gfd.labels, gfd.labelled, gfd.known, gfd.test, n_init=cfg.ssk_n_init,
                             max_iter=cfg.ssk_max_iter, seed=data.seed, nnc_k=cfg.nnc_k)


def reference_method(name: str) -> str:
    """The metrics prefix of a pretrained recogniser's FR + SSK reference row (``models/fr/<name>``)."""
    return f"pretrained_{name}_ssk"


def evaluate_discovery(cfg: Any, data: Any, paths: Paths, fr_model: Any,
                       references: dict[str, Any] | None = None) -> dict[str, float]:
    """Run every method, write the predictions, the plot and ``metrics/discovery.json``; → flat metrics
    ``discovery/<method>/<subset>/<all|known|novel>`` and ``discovery/<method>/nnc``. ``references``: pretrained
    recognisers (``faceops import``) other than ``fr_model``, each a reference row of its features + SSK
    (``reference_method``), beside the run's own."""
    from ml.data.dataset import landmarks_array
    from ml.discovery.protocol import gfd_baselines, gfd_chance, gfd_ssk, known_or_new_names
    from ml.discovery.facegcd import load_facegcd
    from ml.fr.train import embed, needs_keypoints
    from tasks.train_discovery import gcd_model_dir

    gfd = gfd_inputs(paths, data)
    rows, images, labels, labelled, known, test = gfd
    from tasks.train_generator import resize_faces

    def fr_features(model: Any) -> np.ndarray:
        size = int(model.input_contract["size"])  # a pretrained 112-px model on 64-px faces: upsampled
        keypoints = landmarks_array(rows) * (size / images.shape[1]) if needs_keypoints(model) else None
        return embed(model, resize_faces(images, size), batch_size=cfg.batch_size, flip=cfg.flip, keypoints=keypoints)

    def ssk(feats: np.ndarray) -> Any:
        return gfd_ssk(feats, labels, labelled, known, test, n_init=cfg.ssk_n_init, max_iter=cfg.ssk_max_iter,
                       seed=data.seed, nnc_k=cfg.nnc_k)

    features = {"fr": fr_features(fr_model)}
    outcomes = {"fr_ssk": ssk(features["fr"])}
    for name, model in (references or {}).items():
        outcomes[reference_method(name)] = ssk(fr_features(model))
    for name, directory in (("facegcd", paths.discovery_model), ("gcd", gcd_model_dir(paths))):
        if (directory / "config.json").is_file():
            model, _ = load_facegcd(directory)
            features[name], outcomes[name] = facegcd_ssk(model, gfd, cfg, data)
        else:
            log.warning("no discovery model at %s: the %s rows are left out", directory, METHODS[name])
    if cfg.baselines:
        outcomes.update(gfd_baselines(features["fr"], labels, labelled, known, test, eps_grid=cfg.dbscan_eps,
                                      min_samples_grid=cfg.dbscan_min_samples, seed=data.seed, nnc_k=cfg.nnc_k))
    outcomes["chance"] = gfd_chance(labels, labelled, known, test, seed=data.seed)
    metrics: dict[str, float] = {}
    for name, outcome in outcomes.items():
        metrics.update({f"discovery/{name}/{k}": v for k, v in outcome.metrics.items()})
    metrics["discovery/k"] = float(len(np.unique(labels)))
    metrics["discovery/test_images"] = float(test.sum())
    metrics["discovery/nnc_k"] = float(cfg.nnc_k)
    settings = {name: o.setting for name, o in outcomes.items()}
    write_json(paths.metrics / "discovery.json", {"metrics": metrics, "settings": settings})

    names = rows.groupby("label")["identity"].first().to_dict()
    best = outcomes.get("facegcd", outcomes["fr_ssk"])
    assigned = np.asarray(known_or_new_names(best, names))
    predictions = pd.DataFrame({
        "path": rows["path"], "identity": rows["identity"], "known": known,
        "assigned": assigned, "cluster": best.pred, "correct_if_known": assigned == rows["identity"].to_numpy(),
    })[test]
    with atomic_path(paths.root / "reports" / "discovery_predictions.csv") as tmp:
        predictions.to_csv(tmp, index=False)
    plot_embedding(features, labels, known, paths.plots / "discovery_embedding.png", seed=data.seed,
                   per_group=cfg.embedding_plot_identities)
    return metrics


def plot_embedding(features: dict[str, np.ndarray], labels: np.ndarray, known: np.ndarray, path: Path, *,
                   seed: int, per_group: int = 5) -> None:
    """2-D t-SNE of ``per_group`` known and ``per_group`` novel identities, one panel per feature set:
    circles = known identities, triangles = novel; one colour per identity."""
    plt = pyplot()
    from sklearn.manifold import TSNE

    rng = np.random.default_rng(seed)
    ids_known = np.unique(labels[known])
    ids_novel = np.unique(labels[~known])
    chosen = np.concatenate([rng.permutation(ids_known)[:per_group], rng.permutation(ids_novel)[:per_group]])
    pick = np.isin(labels, chosen)
    titles = {"fr": "FR model features", "facegcd": "FaceGCD features", "gcd": "GCD features (no prefixes)"}
    fig, axes = plt.subplots(1, len(features), figsize=(4.6 * len(features), 4.4), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (name, feats) in zip(axes[0], features.items()):
        x = feats[pick] / np.linalg.norm(feats[pick], axis=1, keepdims=True).clip(1e-12)
        xy = TSNE(n_components=2, perplexity=min(15.0, max(2.0, (len(x) - 1) / 3)), init="pca",
                  random_state=seed).fit_transform(x)
        for c, ident in enumerate(chosen):
            m = labels[pick] == ident
            is_known = bool(known[pick][m][0])
            ax.scatter(xy[m, 0], xy[m, 1], s=18, color=cmap(c % 20), marker="o" if is_known else "^",
                       label=f"{'known' if is_known else 'novel'} {ident}")
        ax.set(title=titles.get(name, name), xticks=[], yticks=[])
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("Generalized face discovery: ● known identities, ▲ novel identities (t-SNE)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def render_section(metrics: dict[str, float]) -> list[str]:
    """Markdown lines for ``reports/benchmark.md``: All / Known / Novel per method, transductively (the headline)
    and on the test images."""
    pct = lambda v: "—" if v is None or v != v else f"{100 * v:.1f}"  # noqa: E731
    references = sorted({k.split("/")[1] for k in metrics if re.fullmatch(r"discovery/pretrained_.+_ssk/test/all", k)})
    labels = {**METHODS, **{m: f"`{m[len('pretrained_'):-len('_ssk')]}` features + SSK (pretrained reference)"
                            for m in references}}
    present = [m for m in METHODS if f"discovery/{m}/test/all" in metrics]
    present[present.index("fr_ssk") + 1 if "fr_ssk" in present else 0:0] = references
    if not present:
        return []
    lines = [
        "", "## Generalized face discovery (clustering accuracy %, Hungarian matching over all identities)", "",
        f"K = {int(metrics.get('discovery/k', 0))} identities (known + novel), unseen by the FR model. The headline "
        "is *transductive* (GCD's protocol): the unlabelled training images, clustered together with the labelled "
        f"ones. *Test*: {int(metrics.get('discovery/test_images', 0))} further images, a few per identity, so that "
        f"random clusters already score {pct(metrics.get('discovery/chance/test/all'))} % there (chance row): read it "
        "beside its chance, not as the headline. NNC: share of each test image's "
        f"{int(metrics.get('discovery/nnc_k', 5))} nearest test neighbours in its cluster.", "",
        "Chosen on: FaceGCD's and GCD's epoch on held-out labelled images of the known identities "
        "(`discovery.val_per_identity`), the baselines' linkage and DBSCAN grid point on the labelled images. "
        "Scored on: the unlabelled training images and the test images, whose labels nothing above reads.", "",
        "| method | transductive All | transductive Known | transductive Novel | test All | test Known | test Novel | NNC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in present:
        cells = [pct(metrics.get(f"discovery/{m}/{s}/{k}")) for s in ("transductive", "test") for k in ("all", "known", "novel")]
        lines.append(f"| {labels[m]} | " + " | ".join(cells) + f" | {pct(metrics.get(f'discovery/{m}/nnc'))} |")
    return lines + verdict(metrics) + ["", "![discovery embedding](../plots/discovery_embedding.png)"]


def verdict(metrics: dict[str, float]) -> list[str]:
    """One paragraph: FaceGCD against the best other method on the headline (transductive All), then against its
    own parts (the GCD control: what the prefixes add; FR features + SSK: what the contrastive training adds)."""
    score = {m: metrics.get(f"discovery/{m}/transductive/all") for m in METHODS if m != "chance"}
    score = {m: v for m, v in score.items() if v is not None and v == v}
    if "facegcd" not in score or len(score) < 2:
        return []
    ours = score.pop("facegcd")
    best = max(score, key=score.get)
    gap = 100 * (ours - score[best])
    head = (f"FaceGCD beats every other method here, the best being {METHODS[best]} by {gap:.1f} points"
            if gap > 0 else
            f"**FaceGCD does not beat {METHODS[best]}** here ({gap:+.1f} points)")
    parts = [f"{label} {100 * (ours - score[m]):+.1f} points" for m, label in
             (("gcd", "over the GCD control (what the prefixes add)"),
              ("fr_ssk", "over FR features + SSK (what the contrastive training adds)")) if m in score]
    return ["", f"Verdict on the headline (transductive All): {head}" + ("; " + ", ".join(parts) if parts else "")
            + ". One training run on one data seed: the spread over seeds, which says whether such differences are "
            "beyond noise, is in `reports/discovery_claims.md`."]
