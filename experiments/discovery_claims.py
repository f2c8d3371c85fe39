"""FaceGCD's claims at embedded scale, with the default run's recipe: ``python -m experiments.discovery_claims``.

Paired comparisons on the same discovery set, seed and FR model: FaceGCD ≥ GCD (the same training without prefixes)
≥ FR features + SSK, above all on Novel (paper Tables 1–2), and FaceGCD > the static-prefix ablation (Table 3). On
request (``--arms``): ``oracle``, FaceGCD with every training image labelled (the headroom the trainer can reach), and
``embedding``, the loss on the clustered embedding (``discovery.loss_on: embedding``, a diagnostic).

One ``vit_tiny`` ArcFace model on procedural identities (``--backbone strong``: LVFace on 2,000, ``STRONG``, the
strongest FR model the CPU budget trains, since the paper's FaceGCD adapts a pretrained one); each data seed
(``--data-seeds``) draws further unseen identities and their GFD split, an independent test set; each training seed
(``--seeds``) trains every arm from the FR model with ``params.yaml`` ``discovery`` and seeds SSK (K = all
identities). The default data seeds are
``experiments.test_sets.DATA_SEEDS``: the recipe was set on data seed 0 and 1 was looked at. Each run records per-epoch
curves: both losses and the selection score (nearest class mean of held-out labelled images), the FR features' score
as epoch 0. Beside the arms, ``chance``: random partitions with the true cluster sizes, scored alike. Reported: mean ±
sample std over the (data seed, seed) runs and each claim's paired difference with its sign count; the verdict takes
the data seed as its unit (``experiments.test_sets.across_test_sets``): the difference per test set, and a bootstrap
interval over the scored images with each run's cluster-to-identity matching held fixed (``cluster_correct``). Writes
``reports/discovery_claims.md``, ``reports/discovery_claims_curves.png`` and ``metrics/discovery_claims.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.claims import mean_std, paired
from experiments.test_sets import DATA_SEEDS, LOOKED_AT, across_test_sets, holm, now_utc
from ml.config import from_mapping
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.discovery.protocol import GFDOutcome, gfd_baselines, gfd_chance, gfd_ssk
from ml.discovery.split import gfd_split
from ml.errors import ConfigError
from ml.eval.metrics import cluster_correct
from ml.models.io import save_model
from ml.train.device import resolve_precision
from ml.discovery.train import DiscoveryConfig, nearest_mean_accuracy, train_discovery, validation_split
from ml.fr.train import FRConfig, embed, train_fr

log = logging.getLogger("experiments.discovery_claims")
ROOT = Path(__file__).resolve().parents[1]
KEYS = ("test/all", "test/known", "test/novel", "transductive/all", "transductive/known", "transductive/novel")


@dataclasses.dataclass(frozen=True)
class Scale:
    fr_identities: int = 150
    fr_images_per_identity: int = 12
    fr_epochs: int = 10
    discovery_identities: int = 80
    discovery_images_per_identity: int = 20
    discovery_epochs: int = 0  # 0: params.yaml discovery.epochs (the default run's)
    image_size: int = 64
    fr_lvface: bool = False  # the FR model with LVFace's staged schedule (PartialFC 0.5) instead of plain ArcFace


# the strongest backbone the CPU budget trains: LVFace on 2,000 identities × 3 images, the recipe of
# experiments.claims' condition many (where it beats ArcFace beyond noise); the paper's FaceGCD adapts a pretrained one
STRONG = {"fr_identities": 2000, "fr_images_per_identity": 3, "fr_lvface": True}


# toy size, to check the code end to end in a minute or two (numbers mean nothing)
QUICK = Scale(fr_identities=16, fr_images_per_identity=4, fr_epochs=1, discovery_identities=12,
              discovery_images_per_identity=12, discovery_epochs=2)

ARMS = {
    "fr_ssk": "FR features + SSK",
    "facegcd": "FaceGCD (hypernetwork prefixes) + SSK",
    "gcd": "GCD (no prefixes) + SSK",
    "static_prefix": "static prefix (ablation) + SSK",
    "oracle": "oracle (FaceGCD, every training image labelled: the headroom) + SSK",
    "embedding": "loss on the embedding (FaceGCD without its head: a diagnostic) + SSK",
    "kmeans": "k-means (FR features, K = all identities, no labels)",
    "agglomerative": "agglomerative (FR features, no labels; the linkage chosen on the labelled images)",
    "chance": "chance (random partitions with the true cluster sizes)",
}
UNSUPERVISED = ("kmeans", "agglomerative")  # the default run's clustering baselines, on the FR features
TRAINED = {"facegcd": {}, "gcd": {"prefix_length": 0}, "static_prefix": {"static_prefix": True}, "oracle": {},
           "embedding": {"loss_on": "embedding"}}
ORACLES = frozenset({"oracle"})  # trained with the labels of every training image, the novel identities' too
REFERENCES = ORACLES | {"embedding"}  # rows that explain the claims rather than make one: run on request
CLAIMED = tuple(arm for arm in TRAINED if arm not in REFERENCES)  # the arms run unless others are asked for
# (arm, reference): the claims, each a paired difference per run; the last is the headroom, not a claim
CLAIMS = (("facegcd", "gcd"), ("gcd", "fr_ssk"), ("facegcd", "fr_ssk"), ("facegcd", "static_prefix"),
          ("facegcd", "kmeans"), ("facegcd", "agglomerative"), ("oracle", "fr_ssk"), ("embedding", "fr_ssk"))


def _render_set(gen: ProceduralFaces, ids: range, per: int) -> tuple[np.ndarray, np.ndarray]:
    samples = [(k, gen.sample(i, j).image) for k, i in enumerate(ids) for j in range(per)]
    return np.stack([im for _, im in samples]), np.array([k for k, _ in samples])


def _generator(scale: Scale) -> ProceduralFaces:
    return ProceduralFaces(ProceduralConfig(image_size=scale.image_size), seed=0)


def make_data(scale: Scale, data_seed: int = 0) -> dict[str, np.ndarray]:
    """The FR training set (identities 0..fr_identities−1) and, for ``data_seed``, the discovery set of
    :func:`discovery_data`."""
    x, y = _render_set(_generator(scale), range(scale.fr_identities), scale.fr_images_per_identity)
    return {"x": x, "y": y, **discovery_data(scale, data_seed)}


def scored_identities(scale: Scale, data_seed: int) -> dict[str, tuple[int, range]]:
    """The identities ``data_seed``'s discovery set renders, as {name: (procedural seed, identities)}: the
    ``data_seed``-th block after the FR model's, drawn with procedural seed ``data_seed``, so a data seed other than
    the default run's ``data.seed`` shares no face with it (``experiments.test_sets.shared_faces``). Data seed 0 is
    the FR model's own seed: its block follows the FR identities, as the recipe experiments saw it."""
    first = scale.fr_identities + data_seed * scale.discovery_identities
    return {"discovery": (data_seed, range(first, first + scale.discovery_identities))}


def discovery_data(scale: Scale, data_seed: int) -> dict[str, np.ndarray]:
    """The discovery set of ``scored_identities``, with its GFD split drawn with ``data_seed``."""
    seed, ids = scored_identities(scale, data_seed)["discovery"]
    gen = ProceduralFaces(ProceduralConfig(image_size=scale.image_size), seed=seed)
    dx, dy = _render_set(gen, ids, scale.discovery_images_per_identity)
    manifest = pd.DataFrame({"path": [f"{i:06d}.png" for i in range(len(dy))], "identity": [f"id{k:04d}" for k in dy],
                             "label": dy})
    split = gfd_split(manifest, seed=data_seed)
    return {"dx": dx, "dy": dy, "known": split["known"].to_numpy(bool),
            "labelled": split["labelled"].to_numpy(bool), "test": (split["subset"] == "test").to_numpy()}


def default_recipe(scale: Scale) -> DiscoveryConfig:
    """``params.yaml`` ``discovery`` (the stage's recipe), with the scale's epochs when it sets them."""
    from tasks.common import load_params, section

    cfg = from_mapping(DiscoveryConfig, section(load_params(ROOT / "params.yaml"), "discovery"), "discovery")
    return dataclasses.replace(cfg, epochs=scale.discovery_epochs) if scale.discovery_epochs else cfg


def run_claims(seeds: list[int], scale: Scale, data_seeds: list[int] = list(DATA_SEEDS),
               arms: tuple[str, ...] = CLAIMED) -> dict:
    """Every trained arm for every (data seed, seed), and chance; → {"recipe", "runs": one row per run and arm,
    "summary"}. A row's ``_correct`` (per ``CLAIM_KEYS`` key, each scored image's outcome) feeds the summary and is
    not written out."""
    recipe = default_recipe(scale)
    first = make_data(scale, data_seeds[0])
    schedule = {"lvface": True, "sample_rate": 0.5} if scale.fr_lvface else {}
    fr = train_fr(FRConfig(backbone=recipe.backbone, epochs=scale.fr_epochs, batch_size=64, **schedule), first["x"],
                  first["y"], progress=False)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        fr_dir = Path(tmp) / "fr"
        save_model(fr_dir, fr.model, backbone=fr.backbone, kwargs=fr.backbone_kwargs)
        for data_seed in data_seeds:
            data = first if data_seed == data_seeds[0] else discovery_data(scale, data_seed)
            train_mask = ~data["test"]
            given = {False: (np.where(data["labelled"], data["dy"], -1)[train_mask], data["labelled"][train_mask]),
                     True: (data["dy"][train_mask], np.ones(int(train_mask.sum()), bool))}  # oracle: all labelled
            fr_feats = embed(fr.model, data["dx"], flip=True, progress=False)
            for seed in seeds:
                feats = {"fr_ssk": (fr_feats, {})}
                for arm in arms:
                    cfg = dataclasses.replace(recipe, seed=seed, **TRAINED[arm])
                    start = time.perf_counter()
                    labels, labelled = given[arm in ORACLES]
                    score0 = initial_score(fr_feats[train_mask], labels, labelled, cfg)
                    res = train_discovery(cfg, data["dx"][train_mask], labels, labelled, init_model_dir=fr_dir,
                                          progress=False, anchor=(first["x"], first["y"]))
                    h0, h1 = res.history[0], res.history[-1]
                    feats[arm] = (res.model.embed(data["dx"], flip=True),  # the flip TTA the FR features get
                                  {"seconds": time.perf_counter() - start, "best_epoch": res.best_epoch,
                                   "epochs": len(res.history), "val/accuracy/fr": score0,
                                   "curve": [{k: float(h[k]) for k in CURVE_KEYS if k in h} for h in res.history],
                                   **{f"{k}/{w}": float(h[k]) for k in ("loss/unsup", "loss/sup", "loss/anchor")
                                      for w, h in (("first", h0), ("last", h1)) if k in h}})
                for arm, (f, extra) in feats.items():
                    out = gfd_ssk(f, data["dy"], data["labelled"], data["known"], data["test"], seed=seed)
                    runs.append({"arm": arm, "data_seed": data_seed, "seed": seed, **{k: float(out.metrics[k])
                                 for k in KEYS}, **extra, "_correct": point_outcomes(out, data)})
                    log.info("data %d seed %d %-13s test all %.3f novel %.3f", data_seed, seed, arm,
                             out.metrics["test/all"], out.metrics["test/novel"])
                for arm, out in unsupervised_baselines(fr_feats, data, seed).items():
                    runs.append({"arm": arm, "data_seed": data_seed, "seed": seed, **{k: float(out.metrics[k])
                                 for k in KEYS}, "setting": out.setting, "_correct": point_outcomes(out, data)})
                chance = gfd_chance(data["dy"], data["labelled"], data["known"], data["test"], seed=seed)
                runs.append({"arm": "chance", "data_seed": data_seed, "seed": seed,
                             **{k: float(chance.metrics[k]) for k in KEYS}})
    described = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(recipe).items()
                 if not isinstance(v, dict)}
    described["precision_trained"] = resolve_precision(recipe.accelerator, recipe.precision)  # "auto" on this machine
    return {"recipe": described, "runs": runs, "summary": summarise(runs)}


CURVE_KEYS = ("loss/unsup", "loss/sup", "val/accuracy")


@functools.cache
def _evaluate_params() -> dict:
    """``params.yaml`` ``evaluate`` (the default run's clustering grid), read once per process."""
    from tasks.common import load_params, section

    return section(load_params(ROOT / "params.yaml"), "evaluate")


def unsupervised_baselines(features: np.ndarray, data: dict[str, np.ndarray], seed: int) -> dict[str, GFDOutcome]:
    """``UNSUPERVISED``: k-means and agglomerative clustering of the FR features with the default run's settings
    (``ml.discovery.protocol.gfd_baselines``: K = all identities, the linkage chosen on the labelled images, no label
    used to cluster), scored on the same subsets as the SSK arms."""
    grid = _evaluate_params()
    out = gfd_baselines(features, data["dy"], data["labelled"], data["known"], data["test"],
                        eps_grid=grid["dbscan_eps"], min_samples_grid=grid["dbscan_min_samples"], seed=seed)
    return {arm: out[arm] for arm in UNSUPERVISED}


def point_outcomes(out: GFDOutcome, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per ``CLAIM_KEYS`` key: each image's outcome in that subset (``cluster_correct`` with the subset's matching,
    as ``cluster_accuracy`` scores it; ``…/novel`` keeps the novel identities' images), so the key's accuracy is
    the mean."""
    subsets = {"test": data["test"], "transductive": ~data["test"] & ~data["labelled"]}
    outcomes = {}
    for key in CLAIM_KEYS:
        name, part = key.split("/")
        m = subsets[name]
        correct = cluster_correct(data["dy"][m], out.pred[m])
        outcomes[key] = correct if part == "all" else correct[~data["known"][m]]
    return outcomes


def initial_score(feats: np.ndarray, labels: np.ndarray, labelled: np.ndarray, cfg: DiscoveryConfig) -> float | None:
    """The selection score of the starting features: ``nearest_mean_accuracy`` on the held-out labelled images the
    trainer draws for ``cfg`` (None without a validation split)."""
    if cfg.val_per_identity <= 0:
        return None
    held = validation_split(labels, labelled, cfg.val_per_identity, cfg.seed)
    keep = labelled & ~held
    return nearest_mean_accuracy(feats[keep], labels[keep], feats[held], labels[held])


def mean_curves(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per trained arm: each curve key's mean over the runs, epoch by epoch, with ``val/accuracy`` led by the FR
    features' score (epoch 0)."""
    out: dict[str, dict[str, list[float]]] = {}
    for arm in TRAINED:
        rows = [r for r in runs if r["arm"] == arm and r.get("curve")]
        if not rows:
            continue
        n = min(len(r["curve"]) for r in rows)
        curves = {k: [float(np.mean([r["curve"][e][k] for r in rows])) for e in range(n)]
                  for k in CURVE_KEYS if all(k in r["curve"][0] for r in rows)}
        if "val/accuracy" in curves and all(r.get("val/accuracy/fr") is not None for r in rows):
            curves["val/accuracy"] = [float(np.mean([r["val/accuracy/fr"] for r in rows]))] + curves["val/accuracy"]
        out[arm] = curves
    return out


def plot_curves(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Three panels (L_unsup, L_sup, val/accuracy from epoch 0) with one line per arm, as a PNG at ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 3.6))
    titles = {"loss/unsup": "L_unsup (InfoNCE)", "loss/sup": "L_sup (SupCon)",
              "val/accuracy": "held-out accuracy, labelled identities\n(epoch 0: the FR features)"}
    for ax, key in zip(fig.subplots(1, 3), CURVE_KEYS):
        for arm, c in curves.items():
            if key in c:
                first = len(c["loss/sup"]) + 1 - len(c[key])  # 0 where the FR features' score leads the curve
                ax.plot(range(first, first + len(c[key])), c[key], marker="o", label=_short(arm))
        ax.set_title(titles[key])
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


# metric → its name in the verdict column. test all / novel: held-out images; transductive novel: the novel
# identities' unlabelled training images (GCD's own protocol, and 9× the images of test novel)
CLAIM_KEYS = {"test/all": "test all", "test/novel": "test novel", "transductive/novel": "transd. novel"}


def beyond_noise(diff: dict[str, float]) -> bool:
    """A paired difference whose mean is more than two standard errors from 0."""
    return diff["seeds"] > 1 and abs(diff["mean"]) > 2 * diff["std"] / math.sqrt(diff["seeds"])


def summarise(runs: list[dict]) -> dict:
    """Per arm: mean ± sample std of every key over the runs; per claim (arm − reference) on each ``CLAIM_KEYS``
    key: the paired difference over the runs they share, its sign count and whether it holds beyond noise over
    runs; with the runs' image outcomes, ``test_sets`` (``across_test_sets``: the data seed as the unit)."""
    by_arm: dict[str, dict[tuple[int, int], dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], {})[(r["data_seed"], r["seed"])] = r
    arms = {arm: {k: mean_std([r[k] for r in rows.values()]) for k in KEYS} for arm, rows in by_arm.items()}
    claims = {}
    for arm, ref in CLAIMS:
        if arm not in by_arm or ref not in by_arm:
            continue
        shared = sorted(set(by_arm[arm]) & set(by_arm[ref]))
        claims[f"{arm}-{ref}"] = {}
        for k in CLAIM_KEYS:
            d = paired([by_arm[arm][s][k] for s in shared], [by_arm[ref][s][k] for s in shared])
            claims[f"{arm}-{ref}"][k] = {**d, "beyond_noise": beyond_noise(d)}
            if all("_correct" in by_arm[a][s] for a in (arm, ref) for s in shared):
                claims[f"{arm}-{ref}"][k]["test_sets"] = across_test_sets(
                    [by_arm[arm][s]["_correct"][k] for s in shared], [by_arm[ref][s]["_correct"][k] for s in shared],
                    [ds for ds, _ in shared])
    family = [(c, k) for c in claims if c.split("-")[0] not in REFERENCES for k in CLAIM_KEYS
              if "test_sets" in claims[c][k]]
    for (c, k), rejected in zip(family, holm([claims[c][k]["test_sets"]["p"] for c, k in family])):
        claims[c][k]["test_sets"]["holm"] = rejected
    return {"arms": arms, "claims": claims}


def _family_size(summary: dict) -> int:
    """How many comparisons Holm's correction ran over (0 for results from before it)."""
    return sum("holm" in d.get("test_sets", {}) for c in summary["claims"].values() for d in c.values())


def _pct(ms: dict[str, float], signed: bool = False) -> str:
    return f"{100 * ms['mean']:{'+' if signed else ''}.1f} ± {100 * ms['std']:.1f}"


def _short(arm: str) -> str:
    """An arm's name without its note: "FaceGCD", "GCD", "FR features", "static prefix"."""
    return ARMS[arm].split(" (")[0].split(" +")[0]


def _difference(d: dict) -> str:
    """A claim's cell: over test sets with the image interval where measured, else over runs."""
    t = d.get("test_sets")
    if t is None:
        return f"{_pct(d, True)} ({d['higher']}/{d['seeds']} runs)"
    p = f"; p {t['p']:.3f}" if t.get("p") is not None else ""
    return (f"{_pct(t, True)} ({t['higher']}/{t['units']} test sets); "
            f"{100 * t['ci_low']:+.1f} to {100 * t['ci_high']:+.1f}{p}")


def _verdict(*diffs: dict) -> str:
    """Whether a claim holds beyond noise on each of ``CLAIM_KEYS`` (over test sets where measured, else over runs)
    and survives Holm's correction over the table where it was applied, and whether the reverse does."""
    diffs = tuple(d.get("test_sets", d) for d in diffs)
    holds = [d["beyond_noise"] and d["mean"] > 0 and d.get("holm", True) for d in diffs]
    text = "yes" if all(holds) else "no: within noise" if not any(holds) else ", ".join(
        f"{n}: {'yes' if h else 'no'}" for n, h in zip(CLAIM_KEYS.values(), holds))
    uncorrected = [n for n, d, h in zip(CLAIM_KEYS.values(), diffs, holds)
                   if d["beyond_noise"] and d["mean"] > 0 and not h]
    if uncorrected:
        text += f" ({', '.join(uncorrected)}: beyond noise alone, not after Holm)"
    if any(d["beyond_noise"] and d["mean"] < 0 and d.get("holm", True) for d in diffs):
        text += " (the reverse beyond noise)"
    return text


def render(results: dict, seeds: list[int], data_seeds: list[int], scale: Scale, seconds: float) -> str:
    recipe, summary, runs = results["recipe"], results["summary"], results["runs"]
    cols = [f"{s}/{k}" for s in ("test", "transductive") for k in ("all", "known", "novel")]
    n = len({(r["data_seed"], r["seed"]) for r in runs})
    lines = [
        "# FaceGCD claims at embedded scale",
        "",
        f"Measured by `python -m experiments.discovery_claims{' --backbone strong' if scale.fr_lvface else ''}` on "
        f"{results.get('measured_at') or now_utc()} "
        f"in {seconds / 60:.0f} minutes: seeds {seeds} × data seeds {data_seeds} ({n} runs). "
        "Chosen on: each arm's epoch by the held-out labelled images of the known identities (val); the recipe "
        f"(`params.yaml` `discovery`) while data seeds {', '.join(map(str, LOOKED_AT))} were looked at "
        "(`reports/discovery_recipes.md`). Scored on: each data seed's unlabelled training images (transductive) "
        "and its test images, whose labels no choice reads. FR model: `vit_tiny` "
        f"{'LVFace (staged, PartialFC 0.5)' if scale.fr_lvface else 'ArcFace'} on {scale.fr_identities} × "
        f"{scale.fr_images_per_identity} procedural faces, {scale.fr_epochs} epochs. "
        f"Discovery set: {scale.discovery_identities} unseen identities × {scale.discovery_images_per_identity} "
        f"images ({scale.image_size}×{scale.image_size}) per data seed, drawn with the data seed as the procedural "
        "seed, so none shares a face with the default run's sets (`tests/stages/test_test_sets.py` renders both and "
        "compares); GFD split (half the identities known, half of their training images labelled, 10 % test). Every arm trained with the default run's recipe (`params.yaml` "
        f"`discovery`): {recipe['epochs']} epochs, lr {recipe['lr']:g}, InfoNCE τ {recipe['temperature']:g}, SupCon "
        f"τ {recipe['sup_temperature']:g}, λ {recipe['sup_weight']:g}, P × K = {recipe['labelled_identities_per_batch']} "
        f"× {recipe['images_per_identity']}, last block at {recipe['block_lr_scale']:g} × lr, the best epoch on "
        f"{recipe['val_per_identity']} held-out labelled images per known identity, in "
        f"{recipe.get('precision_trained', recipe.get('precision', '32-true'))}"
        + (f", with the anchor (ArcFace on the embedding over the FR model's {scale.fr_identities} training identities "
           f"and the known ones, {recipe['anchor_batch']} FR training images per step, weight "
           f"{recipe['anchor_weight']:g})" if recipe.get("anchor_weight") else ", without the anchor")
        + ". Clustering accuracy (%, one "
        "Hungarian matching over all identities) after semi-supervised k-means with K = all identities; mean ± sample "
        "std over the runs; chance: random partitions with the true cluster sizes, scored alike.",
        "",
        "| arm | " + " | ".join(c.replace("/", " ") for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for arm, stats in summary["arms"].items():
        lines.append(f"| {ARMS[arm]} | " + " | ".join(_pct(stats[c]) for c in cols) + " |")
    by_sets = all("test_sets" in d for c in summary["claims"].values() for d in c.values())
    lines += ["", (
        "Paired differences (pp) per test set, one per data seed (its training seeds averaged): mean ± sample std "
        "over the test sets, how many were higher, and a 95 % bootstrap interval over the scored images (each run's "
        "matching held fixed). Beyond noise: at least two test sets, the mean beyond 2 standard errors, every test "
        "set on its side and the interval excluding 0; p: a one-sample t-test over the test sets, and a claim holds "
        f"only where Holm's procedure over the table's {_family_size(summary)} comparisons (every claim but the "
        "headroom and the diagnostic, on each column) rejects at α = 0.05." if by_sets else
        "Paired per-run differences (pp; beyond noise: |mean| > 2 · std / √runs):"), "",
        "| claim | " + " | ".join(("transductive novel" if k == "transductive/novel" else n) for k, n in
                                  CLAIM_KEYS.items()) + " | holds beyond noise |", "|---|---|---|---|---|"]
    for key, c in summary["claims"].items():
        arm, ref = key.split("-")
        note = " (headroom)" if arm in ORACLES else " (diagnostic)" if arm in REFERENCES else ""
        cells = [_difference(c[k]) for k in CLAIM_KEYS]
        lines.append(f"| {_short(arm)} − {_short(ref)}{note} | " + " | ".join(cells)
                     + f" | {_verdict(*(c[k] for k in CLAIM_KEYS))} |")
    lines += ["", "Training per arm (mean over runs): the epoch kept, the losses of the first and the last epoch.", "",
              "| arm | epoch kept (of) | L_unsup first → last | L_sup first → last | train s/run |", "|---|---|---|---|---|"]
    for arm in TRAINED:
        rows = [r for r in runs if r["arm"] == arm]
        if rows:
            m = {k: float(np.mean([r[k] for r in rows])) for k in ("best_epoch", "epochs", "seconds", "loss/unsup/first",
                                                                   "loss/unsup/last", "loss/sup/first", "loss/sup/last")}
            lines.append(f"| {ARMS[arm]} | {m['best_epoch'] + 1:.1f} ({m['epochs']:.0f}) | {m['loss/unsup/first']:.2f} → "
                         f"{m['loss/unsup/last']:.2f} | {m['loss/sup/first']:.2f} → {m['loss/sup/last']:.2f} | "
                         f"{m['seconds']:.0f} |")
    curves = mean_curves(runs)
    if curves:
        n_ep = max(len(c.get("loss/sup", [])) for c in curves.values())
        lines += ["", "Curves (mean over runs; `reports/discovery_claims_curves.png`): the selection score — nearest "
                  "class mean of the held-out labelled images of the known identities, % — at epoch 0 (the FR "
                  "features) and after each epoch (the oracle's: held-out images of every identity), then L_sup per "
                  "epoch.", "",
                  "| arm | " + " | ".join(f"epoch {e}" for e in range(n_ep + 1)) + " |", "|---|" + "---|" * (n_ep + 1)]
        for arm, c in curves.items():
            if "val/accuracy" in c:
                scores = " | ".join(f"{100 * v:.1f}" for v in c["val/accuracy"])
                lines.append(f"| {_short(arm)}: score | {scores} |")
            lines.append(f"| {_short(arm)}: L_sup | | " + " | ".join(f"{v:.2f}" for v in c.get("loss/sup", [])) + " |")
    lines += ["", "Every run (test all / test novel, %):", "", "| data seed | seed | " + " | ".join(
        _short(a) for a in summary["arms"]) + " |", "|---|---|" + "---|" * len(summary["arms"])]
    for ds, s in sorted({(r["data_seed"], r["seed"]) for r in runs}):
        cells = []
        for arm in summary["arms"]:
            r = next(r for r in runs if (r["arm"], r["data_seed"], r["seed"]) == (arm, ds, s))
            cells.append(f"{100 * r['test/all']:.1f} / {100 * r['test/novel']:.1f}")
        lines.append(f"| {ds} | {s} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def write_results(results: dict, seeds: list[int], data_seeds: list[int], scale: Scale, seconds: float,
                  out_dir: Path, name: str = "discovery_claims") -> Path:
    """metrics/<name>.json (without the runs' image outcomes), reports/<name>.md and reports/<name>_curves.png under
    ``out_dir``; → the report."""
    (out_dir / "metrics").mkdir(parents=True, exist_ok=True)
    runs = [{k: v for k, v in r.items() if k != "_correct"} for r in results["runs"]]
    results = {"measured_at": now_utc(), **results}  # a re-render of stored results keeps their time
    payload = {**results, "runs": runs, "seeds": seeds, "data_seeds": data_seeds, "scale": dataclasses.asdict(scale),
               "seconds": seconds}
    (out_dir / "metrics" / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    report = out_dir / "reports" / f"{name}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(render(results, seeds, data_seeds, scale, seconds))
    curves = mean_curves(results["runs"])
    if curves:
        plot_curves(curves, report.with_name(f"{name}_curves.png"))
    return report


def choose_scale(quick: bool, epochs: int, backbone: str) -> tuple[Scale, str]:
    """(the scale, the name of its metrics and report) of ``quick`` (the toy size), ``epochs`` per trained arm (0: the
    recipe's) and ``backbone``: ``default`` or ``strong`` (``STRONG``; at the toy size only its schedule, to check
    the code path in a minute)."""
    if backbone not in ("default", "strong"):
        raise ConfigError(f"backbone must be default or strong, got {backbone!r}")
    scale = QUICK if quick else Scale(discovery_epochs=epochs)
    if backbone == "default":
        return scale, "discovery_claims"
    return dataclasses.replace(scale, **(STRONG if not quick else {"fr_lvface": True})), "discovery_claims_strong"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.discovery_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="training seeds (init, batch order, augmentation, SSK)")
    parser.add_argument("--data-seeds", type=int, nargs="+", default=list(DATA_SEEDS),
                        help="discovery sets: other unseen identities and another GFD split per data seed, each an "
                             "independent test set (default: the ones no recipe was chosen on)")
    parser.add_argument("--arms", nargs="+", choices=list(TRAINED), default=list(CLAIMED),
                        help="trained arms (FR features + SSK always runs; add oracle for the headroom row, embedding for "
                             "the loss on the clustered features)")
    parser.add_argument("--epochs", type=int, default=0, help="epochs per trained arm (0: params.yaml discovery.epochs)")
    parser.add_argument("--quick", action="store_true", help="toy size: checks the code end to end, numbers mean nothing")
    parser.add_argument("--backbone", choices=["default", "strong"], default="default",
                        help="the FR model every arm starts from: default, ArcFace on 150 identities; strong, "
                        "LVFace on 2,000 (STRONG; writes discovery_claims_strong.*; its test sets are the blocks "
                        "after those identities)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    scale, name = choose_scale(args.quick, args.epochs, args.backbone)
    start = time.perf_counter()
    results = run_claims(args.seeds, scale, args.data_seeds, tuple(args.arms))
    report = write_results(results, args.seeds, args.data_seeds, scale, time.perf_counter() - start, ROOT, name)
    log.info("done in %.0fs → %s", time.perf_counter() - start, report)


if __name__ == "__main__":
    main()
