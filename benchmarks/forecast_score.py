"""Scoring a forecast against the crossings a run really made (scripts/eval_forecast.py).

A *unit* is a layer: it crosses when the nearer of its lines is passed, |x| max against 256
(one fp16 square overflows) or a norm's largest row RMS against 255.94 / sqrt(D) (the fp16
sum of squares overflows); either overflows a 16-bit reduction of that tensor. The ground
truth is the per-step value measured apart from the forecaster (the eval's float64 hooks);
the warnings are the ``forecast`` events, one per layer and approach. Scores:

- *recall*: crossings with a warning of the same unit at least ``lead_min`` steps before the
  crossing and at most ``horizon`` steps before it; also among the *warnable* crossings only,
  those after step ``first + lead_min`` (``first``: the step of the first possible forecast);
- *precision*: warnings followed by a crossing of their unit within ``horizon`` steps, among
  the warnings whose horizon the run covers (a warning not followed by a crossing before the
  run ended, with its horizon reaching past the end, is *undetermined*: counted apart);
- *lead*: steps from a crossing's first timely warning to the crossing;
- *calibration*: the distance the warning leads with ("crosses ... in ~N steps as natural
  growth slows", the event's value) over the real distance to the crossing, per true
  warning (its median should be near 1); and the same for its second one, the projection
  at the current rate ("~M at this rate");
- *false warnings per 1,000 healthy steps*: every warning in the runs labelled ``healthy``;
- *near misses*: warnings not followed by a crossing whose layer still rose past ``NEAR``
  (half) of its line within the horizon: shown apart (a run that came within 2x of an fp16
  overflow), and the false warnings per 1,000 healthy steps without them beside the
  target's own count, which keeps them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

Unit = str  # a layer
NEAR = 0.5  # a false warning whose layer rose past this fraction of its line: a near miss


def first_crossings(truth: dict[int, dict[Unit, tuple[float, float]]]) -> dict[Unit, int]:
    """{unit: first step its value passed its line}; ``truth``: step -> unit -> (value, line).
    A non-finite value counts as past the line (an overflowed statistic is inf)."""
    out: dict[Unit, int] = {}
    for step in sorted(truth):
        for unit, (value, line) in truth[step].items():
            if unit not in out and not value <= line:
                out[unit] = step
    return out


@dataclass
class RunScore:
    """One run's crossings and warnings, matched."""

    name: str
    group: str
    steps: int
    crossings: dict[Unit, int]
    warnings: list[tuple[Unit, int]]  # (unit, step), in order
    horizon: int
    lead_min: int = 5
    first: int = 0  # the first step a forecast can be made
    timely: dict[Unit, int] = field(default_factory=dict)  # crossing unit -> lead
    true_warnings: int = 0
    undetermined: int = 0  # not followed by a crossing, but the run ended within the horizon
    estimates: dict[tuple[Unit, int], float] = field(default_factory=dict)  # warning -> ~N
    at_rate: dict[tuple[Unit, int], float] = field(default_factory=dict)  # warning -> ~M
    ratios: list[float] = field(default_factory=list)  # estimate / real distance, true ones
    at_rate_ratios: list[float] = field(default_factory=list)
    near: set[tuple[Unit, int]] = field(default_factory=set)  # warnings whose layer rose
    # past NEAR of its line within the horizon (given by the caller, from the truth)
    near_misses: int = 0  # warnings in ``near`` not followed by a crossing

    def __post_init__(self):
        for unit, step in self.warnings:
            c = self.crossings.get(unit)
            if c is not None and step < c <= step + self.horizon:
                self.true_warnings += 1
                if (unit, step) in self.estimates:
                    self.ratios.append(self.estimates[(unit, step)] / (c - step))
                if (unit, step) in self.at_rate:
                    self.at_rate_ratios.append(self.at_rate[(unit, step)] / (c - step))
                lead = c - step
                if lead >= self.lead_min:
                    self.timely[unit] = max(self.timely.get(unit, 0), lead)
                continue
            if (unit, step) in self.near:
                self.near_misses += 1
            if c is None and step + self.horizon > self.steps:
                self.undetermined += 1

    @property
    def warnable(self) -> set[Unit]:
        return {u for u, c in self.crossings.items() if c >= self.first + self.lead_min}

    @property
    def false_warnings(self) -> int:
        return len(self.warnings) - self.true_warnings - self.undetermined


def table(scores: list[RunScore], key=None, total: str | None = "all but healthy") -> str:
    """A markdown table, one row per group and one for all groups but ``healthy``; or, with
    ``key`` (a run -> its row's name), one row per key over all of its runs, the healthy
    ones included: their warnings count against precision and per 1k healthy steps."""
    if key is None:
        groups = sorted({s.group for s in scores}, key=lambda g: (g == "healthy", g))
        parts = [(g, [s for s in scores if s.group == g]) for g in groups]
        if total and len([g for g in groups if g != "healthy"]) > 1:
            parts.append((total, [s for s in scores if s.group != "healthy"]))
    else:
        names = sorted({key(s) for s in scores})
        parts = [(k, [s for s in scores if key(s) == k]) for k in names]
    rows = [
        "| set | runs | steps | crossings | warned >= 5 ahead | recall | warnable crossings "
        "| recall (warnable) | warnings | followed by a crossing | undetermined | precision "
        "| (undetermined as false) | median lead | median estimate / real distance "
        "| the same, at this rate | false warnings / 1k healthy steps | near misses "
        "| the same, near misses apart |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ss in parts:
        m = row_metrics(ss)
        rows.append(
            f"| {name} | {len(ss)} | {m['steps']} | {m['crossings']} | {m['timely']} "
            f"| {fmt(m['recall'])} | {m['warnable']} | {fmt(m['recall_warnable'])} "
            f"| {m['warnings']} | {m['true']} | {m['undetermined']} | {fmt(m['precision'])} "
            f"| {fmt(m['precision_strict'])} | {fmt(m['lead'], '.1f')} "
            f"| {fmt(m['calibration'])} | {fmt(m['calibration_at_rate'])} "
            f"| {fmt(m['false_per_k'], '.1f')} | {m['near']} | {fmt(m['false_per_k_far'], '.1f')} |"
        )
    return "\n".join(rows)


def row_metrics(ss: list[RunScore]) -> dict[str, float | int | None]:
    """One row's counts and ratios (None where the denominator is 0)."""
    n_warn = sum(len(s.warnings) for s in ss)
    n_true = sum(s.true_warnings for s in ss)
    n_open = sum(s.undetermined for s in ss)
    n_cross = sum(len(s.crossings) for s in ss)
    n_timely = sum(len(s.timely) for s in ss)
    n_able = sum(len(s.warnable) for s in ss)
    n_able_ok = sum(len(s.warnable & set(s.timely)) for s in ss)
    leads = [lead for s in ss for lead in s.timely.values()]
    ratios = [r for s in ss for r in s.ratios]
    at_rate = [r for s in ss for r in s.at_rate_ratios]
    # every warning in a healthy run is a false one (the undetermined included)
    false = sum(len(s.warnings) for s in ss if s.group == "healthy")
    near_healthy = sum(s.near_misses for s in ss if s.group == "healthy")
    healthy_steps = sum(s.steps for s in ss if s.group == "healthy")
    return {
        "steps": sum(s.steps for s in ss),
        "crossings": n_cross,
        "timely": n_timely,
        "recall": _div(n_timely, n_cross),
        "warnable": n_able,
        "recall_warnable": _div(n_able_ok, n_able),
        "warnings": n_warn,
        "true": n_true,
        "undetermined": n_open,
        "precision": _div(n_true, n_warn - n_open),
        "precision_strict": _div(n_true, n_warn),
        "lead": statistics.median(leads) if leads else None,
        "calibration": statistics.median(ratios) if ratios else None,
        "calibration_at_rate": statistics.median(at_rate) if at_rate else None,
        "false_per_k": _div(1000 * false, healthy_steps),
        "near": sum(s.near_misses for s in ss),
        "false_per_k_far": _div(1000 * (false - near_healthy), healthy_steps),
    }


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


TARGETS = (
    ("recall (warnable)", "recall_warnable", ">=", 0.9),
    ("precision", "precision", ">=", 0.8),
    ("false warnings / 1k healthy steps", "false_per_k", "<=", 5.0),
    ("median estimate / real distance", "calibration", "in", (0.67, 1.5)),
)


def target_misses(name: str, ss: list[RunScore]) -> list[str]:
    """The targets one row (a placement, a precision) misses, each as one line; a metric
    with nothing to measure in the row is said so, not passed."""
    m = row_metrics(ss)
    out = []
    for label, k, op, want in TARGETS:
        v = m[k]
        if v is None:
            out.append(f"{name}: {label} not measured (no runs of that kind)")
            continue
        ok = v >= want if op == ">=" else v <= want if op == "<=" else want[0] <= v <= want[1]
        if not ok:
            out.append(f"{name}: {label} {v:.3f}, target {op} {want}")
    return out
