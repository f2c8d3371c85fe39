"""The paper-claim experiments as Prefect flows, so an ablation runs (and is scheduled, or triggered from the UI)
like any other flow run. Each flow only wraps the experiment's own entry point; the numbers and the report come from
there (``experiments/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger


@flow(name="uiface-ablation")
def uiface_ablation(seeds: list[int] = [2, 3, 4, 5, 6], generator_seeds: list[int] = [0, 1, 2], quick: bool = False,
                    resume: bool = False, out_dir: str = ".") -> dict[str, Any]:
    """UIFace Table 2 over the five sampler modes (baseline, two-stage fixed with and without attention injection,
    two-stage adaptive with and without it) and the Table 3 synthetic–real gap, mean ± sample std over ``seeds``,
    each seed's numbers the mean over ``generator_seeds``.

    Args:
        seeds: data seeds; one full synthesis + FR training per mode, generator and seed, each seed scored on its
            own held-out identities (an independent test set; the defaults are experiments.test_sets.DATA_SEEDS).
            ``python -m experiments.uiface_claims --estimate-only`` prints the time.
        generator_seeds: one generator trained per seed (the spread a training run adds: the report's stability
            section).
        quick: toy scale, to check the code end to end in under two minutes (numbers mean nothing).
        resume: keep the parts a stopped run finished (metrics/uiface_claims_units.jsonl) and run the rest.
        out_dir: writes reports/uiface_claims.md and metrics/uiface_claims.json under it.
    """
    from experiments.uiface_claims import ablation

    results = ablation(list(seeds), quick=quick, out_dir=Path(out_dir), generator_seeds=list(generator_seeds),
                       resume=resume)
    claim = results["summary"]["claim_holds"]
    get_run_logger().info("UIFace Table 2 claim %s at this scale → %s", "holds" if claim else "does not hold",
                          Path(out_dir) / "reports" / "uiface_claims.md")
    return {"claim_holds": claim, "seconds": results["seconds"], "seeds": list(seeds),
            "generator_seeds": list(generator_seeds)}


@flow(name="paper-claims")
def paper_claims(seeds: list[int] = [0], only: str | None = "kprpe",
                 conditions: list[str] = ["misaligned"], lvface_conditions: list[str] = ["aligned", "noisy", "many"],
                 data_seeds: list[int] = [2, 3, 4, 5, 6], epochs: int = 10, kprpe_epochs: int = 25, pairs: int = 6000,
                 out_dir: str = ".") -> dict[str, Any]:
    """KP-RPE against the plain ViT (on the condition and on its low-quality probes, with the keypoint diagnostics
    and the template-keypoint ablation) and LVFace against ArcFace, mean ± sample
    std over every (data seed, seed) run with paired per-run differences; the numbers go to reports/claims.md,
    metrics/claims.json and one MLflow run ``claims`` (each arm's mean, std and paired difference as metrics, the
    report as an artifact).

    Args:
        seeds: training seeds (initialisation, data order, augmentation); one FR training per arm, condition, seed
            and data seed.
        only: ``kprpe`` or ``lvface``; None runs both claims.
        conditions: KP-RPE's face conditions (aligned, misaligned, unaligned).
        lvface_conditions: LVFace's (aligned; noisy: many identities, few images, wrong labels; many: thousands of
            classes, clean labels).
        data_seeds: the procedural identities and pairs drawn, each an independent test set: the unit of the
            verdicts (``experiments.test_sets.across_test_sets``); 0 and 1 were looked at while recipes were set.
        epochs: FR training epochs of LVFace's arms.
        kprpe_epochs: FR training epochs of KP-RPE's arms (the paper's AdaFace recipe).
        pairs: verification pairs of held-out identities (half genuine).
        out_dir: writes reports/claims.md and metrics/claims.json under it (the claims and conditions not run keep
            their rows from the metrics/claims.json there).
    """
    import dataclasses

    from experiments.claims import Scale, run_claims, write_results

    scale = dataclasses.replace(Scale(), epochs=epochs, kprpe_epochs=kprpe_epochs, pairs=pairs)
    results = run_claims(list(seeds), scale, only, tuple(conditions), tuple(lvface_conditions),
                         data_seeds=tuple(data_seeds))
    results, report = write_results(results, list(seeds), scale, Path(out_dir), keep_others=True)
    run_id = _log_claims(results, report, {"seeds": list(seeds), "data_seeds": list(data_seeds), "only": only,
                                           "conditions": list(conditions), "lvface_conditions": list(lvface_conditions),
                                           "epochs": epochs, "kprpe_epochs": kprpe_epochs, "pairs": pairs})
    get_run_logger().info("paper claims → %s (MLflow run %s)", report, run_id)
    return {"report": str(report), "mlflow_run": run_id}


@flow(name="discovery-claims")
def discovery_claims(seeds: list[int] = [0], data_seeds: list[int] = [2, 3, 4, 5, 6],
                     arms: list[str] = ["facegcd", "gcd", "static_prefix"], epochs: int = 0, quick: bool = False,
                     backbone: str = "default", out_dir: str = ".") -> dict[str, Any]:
    """FaceGCD against GCD, the FR features + SSK and the static-prefix ablation with the default run's recipe, mean ±
    sample std over every (data seed, seed) run with paired differences judged over test sets (data seeds); the
    numbers go to reports/discovery_claims.md, metrics/discovery_claims.json and one MLflow run ``discovery_claims``
    (``<claim>/<key>/paired_mean``, ``…/higher`` and ``…/test_sets_mean``; the intervals ``…/test_sets_ci_{low,high}``
    and the arms' ``…/std`` in its ``metrics/details.json``).

    Args:
        seeds: training seeds; every trained arm runs once per seed and data seed.
        data_seeds: discovery sets (other unseen identities, another GFD split), each an independent test set; the
            default ones were not looked at while the recipe was set (experiments.test_sets.DATA_SEEDS).
        arms: the trained arms (FR features + SSK always runs); ``oracle`` adds the headroom row (every training
            image labelled), ``embedding`` the diagnostic with the loss on the clustered features.
        epochs: epochs per trained arm (0: params.yaml discovery.epochs).
        quick: toy size, to check the code end to end in a minute or two (numbers mean nothing).
        backbone: the FR model every arm starts from: ``default`` (ArcFace on 150 identities) or ``strong`` (LVFace
            on 2,000: experiments.discovery_claims.STRONG), written as reports/discovery_claims_strong.md and
            metrics/discovery_claims_strong.json.
        out_dir: writes reports/ and metrics/ under it.
    """
    import time

    from experiments.discovery_claims import choose_scale, run_claims, write_results

    scale, name = choose_scale(quick, epochs, backbone)
    start = time.perf_counter()
    results = run_claims(list(seeds), scale, list(data_seeds), tuple(arms))
    report = write_results(results, list(seeds), list(data_seeds), scale, time.perf_counter() - start, Path(out_dir),
                           name)
    metrics: dict[str, float] = {}
    for arm, stats in results["summary"]["arms"].items():
        for key, ms in stats.items():
            metrics[f"{arm}/{key}/mean"], metrics[f"{arm}/{key}/std"] = ms["mean"], ms["std"]
    for claim, keys in results["summary"]["claims"].items():
        for key, d in keys.items():
            metrics[f"{claim}/{key}/paired_mean"], metrics[f"{claim}/{key}/higher"] = d["mean"], float(d["higher"])
            if "test_sets" in d:
                for stat in ("mean", "ci_low", "ci_high"):
                    metrics[f"{claim}/{key}/test_sets_{stat}"] = d["test_sets"][stat]
    run_id = _log_run(name, metrics, report, {"seeds": list(seeds), "data_seeds": list(data_seeds), "arms": list(arms),
                                              "epochs": epochs, "quick": quick, "backbone": backbone},
                      figures=(report.with_name(f"{name}_curves.png"),))
    get_run_logger().info("discovery claims → %s (MLflow run %s)", report, run_id)
    return {"report": str(report), "mlflow_run": run_id, "claims": results["summary"]["claims"]}


def _log_claims(results: dict, report: Path, params: dict[str, Any]) -> str:
    """One MLflow run ``claims``: ``<claim>/<condition>/<arm>/mean``, ``…/paired_mean``, ``…/test_sets_mean``, the
    keypoint diagnostics ``…/swap_mean``, ``…/noise_mean``, ``…/shuffled_mean`` and ``…/keypoints_part_mean``;
    ``…/std``, ``…/test_sets_ci_low`` and ``…/test_sets_ci_high`` in its ``metrics/details.json``."""
    from ops.tracking import mlflow_metric_name

    metrics: dict[str, float] = {}
    for claim, conds in results.items():
        for cond, arms in conds.items():
            for arm, r in arms.items():
                key = mlflow_metric_name(f"{claim}/{cond}/{arm.replace(' ', '')}")
                metrics[f"{key}/mean"], metrics[f"{key}/std"] = r["mean"], r["std"]
                for part in ("paired", "swap", "noise", "shuffled", "test_sets", "keypoints_part"):
                    if part in r:
                        metrics[f"{key}/{part}_mean"] = r[part]["mean"]
                if "test_sets" in r:
                    for bound in ("ci_low", "ci_high"):
                        metrics[f"{key}/test_sets_{bound}"] = r["test_sets"][bound]
    return _log_run("claims", metrics, report, params)


def _log_run(name: str, metrics: dict[str, float], report: Path, params: dict[str, Any],
             figures: tuple[Path, ...] = ()) -> str:
    """One MLflow run ``name`` (tag ``faceops.stage``) with ``params``, ``metrics``, the report and the ``figures``
    that exist as artifacts."""
    import mlflow

    from ops.run_store import configure
    from ops.tracking import log_summary

    configure(Path.cwd())
    with mlflow.start_run(run_name=name, tags={"faceops.stage": name}) as run:
        mlflow.log_params({k: str(v) for k, v in params.items()})
        log_summary(metrics)  # bounds and spreads go to the run's metrics/details.json
        mlflow.log_artifact(str(report))
        for figure in figures:
            if figure.is_file():
                mlflow.log_artifact(str(figure))
    return run.info.run_id
