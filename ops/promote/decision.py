"""A gate and its verdict: ``Gate`` (``promote.<model>``: benchmarks, primary metric and margin, guards, floors) and
``decide``, which applies it to the candidate's and the champion's numbers → a ``Decision`` with every ``Rule``,
rendered as a markdown table and a JSON summary. See ``ops/promote`` for the rules.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ops.promote.registry import CANDIDATE, MODELS, RegistryState

EPS = 1e-9  # comparisons of measured numbers with thresholds written in params


@dataclass(frozen=True)
class Gate:
    """``promote.<model>``: benchmarks to run and the rules a candidate must pass (see ``ops/promote``)."""

    benchmarks: tuple[str, ...]
    primary: str
    min_improvement: float = 0.0
    guards: dict = field(default_factory=dict)  # metric → tolerated regression (absolute, ≥ 0)
    floors: dict = field(default_factory=dict)  # metric → minimum (↑ metrics) or maximum (↓ metrics)


@dataclass(frozen=True)
class Rule:
    """One gate rule with its numbers. ``threshold``: the margin (primary), tolerance (guard) or bound (floor);
    ``passed`` None: not applicable (no champion to compare with)."""

    kind: str  # primary | guard | floor
    metric: str
    higher_is_better: bool
    candidate: float
    champion: float | None
    threshold: float
    passed: bool | None

    @property
    def check(self) -> str:
        """The comparison in numbers, e.g. ``+0.0125 ≥ 0.0020`` or ``0.7500 ≥ 0.8000 − 0.0200``."""
        c, p, t, up = _f(self.candidate), _f(self.champion), _f(self.threshold), self.higher_is_better
        if self.kind == "floor":
            return f"{c} {'≥' if up else '≤'} {t}"
        if self.passed is None:
            return "no champion to compare with"
        if self.kind == "primary":
            return f"improvement {_signed(self.improvement)} ≥ {t} ({c} vs {p})"
        return f"{c} ≥ {p} − {t}" if up else f"{c} ≤ {p} + {t}"

    @property
    def improvement(self) -> float:
        if self.champion is None:
            return float("nan")
        return self.candidate - self.champion if self.higher_is_better else self.champion - self.candidate

    @property
    def result(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]


def _f(x: float | None) -> str:
    return "—" if x is None else ("nan" if x != x else f"{x:.4f}")


def _signed(x: float) -> str:
    return "nan" if x != x else f"{x:+.4f}"


def _arrow(up: bool) -> str:
    return "↑" if up else "↓"


def _holds(value: float) -> bool:
    return math.isfinite(value) and value >= -EPS


@dataclass(frozen=True)
class Decision:
    """A gate's verdict on one candidate, with both models' numbers and every rule."""

    model: str                      # registered name
    key: str                        # params key of the gate
    outcome: str                    # promoted | rejected | unchanged
    candidate: str                  # version
    champion: str | None            # the version it was compared with (None: first candidate)
    candidate_alias: str
    rules: tuple[Rule, ...]
    metrics: dict                   # {"candidate": {metric: value}, "champion": {...}}
    directions: dict                # metric → higher is better
    benchmarks: tuple[str, ...]
    time: str                       # UTC, ISO 8601
    fr_model: str = ""              # the FR champion the benchmarks embedded with, if any
    run_id: str | None = None       # the MLflow ``promote`` run that records it
    dry_run: bool = False

    @property
    def promoted(self) -> bool:
        return self.outcome == "promoted"

    def headline(self) -> str:
        v, name = f"v{self.candidate}", self.model
        if self.outcome == "unchanged":
            return f"UNCHANGED: {name} {v} (@{self.candidate_alias}) already is @champion; nothing to promote."
        if self.promoted:
            text = (f"PROMOTED: {name} {v} is now @champion (v{self.champion} → @previous)" if self.champion
                    else f"PROMOTED: {name} {v} is the first @champion (it passed every floor)")
        else:
            failed = ", ".join(f"{r.kind} {r.metric}" for r in self.rules if r.passed is False)
            stays = f"@champion stays v{self.champion}" if self.champion else "there is still no @champion"
            text = f"REJECTED: {name} {v} failed {failed}; {stays}"
        return f"DRY RUN, nothing written — would be {text}" if self.dry_run else text

    def summary(self) -> dict[str, Any]:
        """JSON-ready record (NaN → null) for ``promotion.summary`` and ``decision.json``."""
        clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x  # noqa: E731
        return {
            "model": self.model, "decision": self.outcome, "candidate": self.candidate, "champion": self.champion,
            "candidate_alias": self.candidate_alias, "time": self.time, "benchmarks": list(self.benchmarks),
            "fr_model": self.fr_model, "run_id": self.run_id,
            "rules": [{**{k: clean(v) for k, v in dataclasses.asdict(r).items()}, "check": r.check}
                      for r in self.rules],
            "metrics": {who: {k: clean(v) for k, v in m.items()} for who, m in self.metrics.items()},
        }

    def version_tags(self) -> dict[str, str]:
        return {"promotion.decision": self.outcome, "promotion.time": self.time,
                "promotion.champion": self.champion or "none", "promotion.run_id": self.run_id or "",
                "promotion.summary": json.dumps(self.summary(), sort_keys=True)}

    def markdown(self) -> str:
        """Both models' numbers side by side, then every rule pass/fail with its numbers."""
        cand, champ = self.metrics.get("candidate", {}), self.metrics.get("champion", {})
        ch = f"champion v{self.champion}" if self.champion else "champion (none)"
        lines = [f"### {self.headline()}", "",
                 f"Gate `promote.{self.key}` · benchmarks: {', '.join(self.benchmarks) or '—'} · {self.time}"
                 + (f" · faces embedded by {self.fr_model}" if self.fr_model else "")
                 + (f" · MLflow run `{self.run_id}`" if self.run_id else ""), ""]
        if cand:
            lines += [f"| metric | candidate v{self.candidate} | {ch} | Δ |", "|---|---|---|---|"]
            for metric, value in cand.items():
                other = champ.get(metric)
                delta = _signed(value - other) if other is not None else "—"
                lines.append(f"| `{metric}` {_arrow(self.directions.get(metric, True))} | {_f(value)} | {_f(other)} "
                             f"| {delta} |")
            lines += ["", "| rule | metric | check | result |", "|---|---|---|---|"]
            for r in self.rules:
                lines.append(f"| {r.kind} | `{r.metric}` {_arrow(r.higher_is_better)} | {r.check} | **{r.result}** |")
        return "\n".join(lines) + "\n"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def decide(key: str, gate: Gate, directions: Mapping[str, bool], candidate: str, cand: Mapping[str, float],
           champion: str | None, champ: Mapping[str, float] | None, *, candidate_alias: str = CANDIDATE,
           fr_model: str = "", time: str | None = None, dry_run: bool = False) -> Decision:
    """Apply ``gate`` to the candidate's numbers ``cand`` and the champion's ``champ`` (None: no champion)."""
    rules: list[Rule] = []
    up = lambda m: bool(directions[m])  # noqa: E731
    if champion is None or champ is None:
        rules.append(Rule("primary", gate.primary, up(gate.primary), cand[gate.primary], None,
                          gate.min_improvement, None))
        rules += [Rule("guard", m, up(m), cand[m], None, float(t), None) for m, t in gate.guards.items()]
    else:
        c, p = cand[gate.primary], champ[gate.primary]
        gain = c - p if up(gate.primary) else p - c
        rules.append(Rule("primary", gate.primary, up(gate.primary), c, p, gate.min_improvement,
                          _holds(gain - gate.min_improvement)))
        for m, tol in gate.guards.items():
            c, p = cand[m], champ[m]
            slack = c - (p - tol) if up(m) else (p + tol) - c
            rules.append(Rule("guard", m, up(m), c, p, float(tol), _holds(slack)))
    for m, bound in gate.floors.items():
        c = cand[m]
        rules.append(Rule("floor", m, up(m), c, None if champ is None else champ.get(m), float(bound),
                          _holds(c - bound if up(m) else bound - c)))
    promoted = all(r.passed is not False for r in rules)
    return Decision(
        model=MODELS[key], key=key, outcome="promoted" if promoted else "rejected", candidate=str(candidate),
        champion=None if champion is None else str(champion), candidate_alias=candidate_alias, rules=tuple(rules),
        metrics={"candidate": dict(cand), **({"champion": dict(champ)} if champ is not None else {})},
        directions=dict(directions), benchmarks=tuple(gate.benchmarks), time=time or utc_now(), fr_model=fr_model,
        dry_run=dry_run,
    )


def unchanged(key: str, state: RegistryState) -> Decision:
    """The decision when ``@candidate`` already is ``@champion``: nothing to evaluate or write."""
    return Decision(model=MODELS[key], key=key, outcome="unchanged", candidate=str(state.candidate),
                    champion=state.champion, candidate_alias=state.candidate_alias, rules=(), metrics={},
                    directions={}, benchmarks=(), time=utc_now())
