"""The UIFace ablation's runs and their parts, without torch: ``Units``, the parts file a run writes as each part
finishes (so ``--resume`` goes on from a stopped run), and the aggregation of the parts over generator seeds into
what ``uiface_summary`` judges: a data seed's numbers as the mean over its generators (``by_data_seed``), the spread
over generators (``over_generators``), and the results a run writes (``aggregate``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from experiments.uiface_summary import Scale, _mean_std, present, summarize

log = logging.getLogger("experiments.uiface_claims")


class Units:
    """The experiment's finished parts, one JSON line each (``metrics/uiface_claims_units.jsonl`` under the output
    folder): the teacher's and each generator's numbers, each (generator seed, data seed)'s modes, each data seed's
    real arms, pair outcomes packed as bits. A line is written as soon as its part is done, so ``--resume`` goes on
    where a stopped run left off; only lines of the same scale (``key``) are read back."""

    def __init__(self, path: Path, scale: Scale, resume: bool) -> None:
        import hashlib
        import json

        self.path = path
        fields = {k: v for k, v in dataclasses.asdict(scale).items() if k != "generator_seeds"}
        self.key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode()).hexdigest()[:16]
        self.done: dict[str, dict[str, Any]] = {}
        if resume and path.is_file():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row.get("scale") == self.key:
                    self.done[row["unit"]] = self._unpack(row["result"])
            log.info("resuming: %d finished parts of this scale in %s", len(self.done), path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def add(self, unit: str, result: dict[str, Any]) -> dict[str, Any]:
        import json

        with self.path.open("a") as f:
            f.write(json.dumps({"scale": self.key, "unit": unit, "result": self._pack(result)}, sort_keys=True) + "\n")
        self.done[unit] = result
        return result

    @staticmethod
    def _pack(result: dict[str, Any]) -> dict[str, Any]:
        import base64

        def arr(a: np.ndarray) -> dict[str, Any]:
            a = np.asarray(a)
            if a.dtype == bool:
                return {"bits": base64.b64encode(np.packbits(a).tobytes()).decode(), "n": int(a.size)}
            return {"ints": a.astype(np.int64).tolist()}

        out = {k: v for k, v in result.items() if not k.startswith("_")}
        if "_correct" in result:
            out["_correct"] = {k: arr(v) for k, v in result["_correct"].items()}
        if "_identities" in result:
            out["_identities"] = arr(result["_identities"])
        return out

    @staticmethod
    def _unpack(stored: dict[str, Any]) -> dict[str, Any]:
        import base64

        def arr(d: dict[str, Any]) -> np.ndarray:
            if "bits" in d:
                return np.unpackbits(np.frombuffer(base64.b64decode(d["bits"]), dtype=np.uint8))[:d["n"]].astype(bool)
            return np.asarray(d["ints"], dtype=np.int64)

        out = dict(stored)
        if "_correct" in out:
            out["_correct"] = {k: arr(v) for k, v in out["_correct"].items()}
        if "_identities" in out:
            out["_identities"] = arr(out["_identities"])
        return out


def by_data_seed(per_run: dict[str, dict], reals: dict[str, dict]) -> dict[str, dict]:
    """One entry per data seed from the runs of every generator seed on it: each mode metric averaged over the
    generators, the pair outcomes too (a fraction correct per pair: the data seed's accuracy difference is then
    the mean over its generators, ``experiments.test_sets.across_test_sets``), beside the seed's real arms.

    ``per_run[key] = {"generator_seed", "data_seed", "identities_found", "recall_k", "modes", "d_profile",
    "_correct": {mode: (pairs,) bool}}``; ``reals[data seed] = {"real", "real_stats", "_correct", "_identities"}``.
    A data seed without its real arms is left out."""
    out: dict[str, dict] = {}
    for data_seed, real in reals.items():
        runs = sorted((r for r in per_run.values() if str(r["data_seed"]) == str(data_seed)),
                      key=lambda r: r["generator_seed"])
        if not runs:
            continue
        modes = {m: {k: float(np.mean([r["modes"][m][k] for r in runs])) for k in runs[0]["modes"][m]}
                 for m in present(runs[0]["modes"])}
        entry = {"identities_found": int(min(r["identities_found"] for r in runs)),
                 "recall_k": int(min(r["recall_k"] for r in runs)), "modes": modes,
                 "generator_seeds": [int(r["generator_seed"]) for r in runs],
                 "real": real["real"], "real_stats": real["real_stats"]}
        if "d_profile" in runs[0]:
            entry["d_profile"] = runs[0]["d_profile"]  # the first generator's
        if all("_correct" in r for r in runs) and "_correct" in real:
            entry["_correct"] = {**{m: np.mean([r["_correct"][m].astype(np.float64) for r in runs], axis=0)
                                    for m in modes}, **real["_correct"]}
            if "_identities" in real:
                entry["_identities"] = real["_identities"]
        out[str(data_seed)] = entry
    return out


def over_generators(per_run: dict[str, dict], metrics: tuple[str, ...] = ("accuracy", "identity_consistency",
                                                                          "ssim_diversity")) -> dict[str, Any]:
    """Stability over generator training seeds: per generator, each mode metric's mean over its data seeds;
    their mean ± sample std over the generators, and each mode − baseline per generator (how many are higher).
    Not a test of an effect (the data seeds are): whether one training run could have told another story."""
    gens = sorted({int(r["generator_seed"]) for r in per_run.values()})

    def mean_of(g: int, mode: str, metric: str) -> float:
        return float(np.mean([r["modes"][mode][metric] for r in per_run.values()
                              if int(r["generator_seed"]) == g]))

    first = next(iter(per_run.values()))["modes"]
    metrics = tuple(m for m in metrics if m in first["baseline"])
    modes = {mode: {m: _mean_std([mean_of(g, mode, m) for g in gens]) for m in metrics} for mode in present(first)}
    versus = {}
    for mode in present(first):
        if mode == "baseline":
            continue
        versus[mode] = {}
        for m in metrics:
            d = [a - b for a, b in zip(modes[mode][m]["values"], modes["baseline"][m]["values"])]
            versus[mode][m] = {**_mean_std(d), "higher": int(sum(x > 0 for x in d)), "units": len(d)}
    return {"generator_seeds": gens, "modes": modes, "versus_baseline": versus}


def aggregate(done: dict[str, dict[str, Any]], seeds: list[int], gens: list[int]) -> dict[str, Any]:
    """The results of the finished parts ``done`` (``Units``): per-run and per-data-seed numbers, the summary over
    data seeds, the stability over generator seeds and the setup (generator numbers: each, and their means)."""
    per_run = {f"{g}:{s}": done[f"modes {g} {s}"] for g in gens for s in seeds}
    reals = {str(s): done[f"real {s}"] for s in seeds}
    per_seed = by_data_seed(per_run, reals)
    summary = summarize(per_seed)
    stability = over_generators(per_run)
    generators = {str(g): done[f"generator {g}"] for g in gens}
    setup = {**done["teacher"], "generator_seeds": gens, "generators": generators,
             "recall_k": min(r["recall_k"] for r in per_run.values()),
             **{k: float(np.mean([n[k] for n in generators.values()]))
                for k in ("generator_seconds", "generator_loss", "autoencoder_seconds", "autoencoder_psnr",
                          "autoencoder_fr_cosine") if all(k in n for n in generators.values())},
             "generator_steps": next(iter(generators.values()))["generator_steps"]}

    def public(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if not k.startswith("_")}

    return {"seeds": seeds, "setup": setup, "per_seed": {s: public(r) for s, r in per_seed.items()},
            "per_run": {k: public(r) for k, r in per_run.items()}, "stability": stability, "summary": summary}
