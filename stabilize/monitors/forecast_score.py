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
- *false warnings per 1,000 healthy steps*: every warning in the runs labelled ``healthy``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

Unit = str  # a layer


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

    def __post_init__(self):
        for unit, step in self.warnings:
            c = self.crossings.get(unit)
            if c is not None and step < c <= step + self.horizon:
                self.true_warnings += 1
                lead = c - step
                if lead >= self.lead_min:
                    self.timely[unit] = max(self.timely.get(unit, 0), lead)
            elif c is None and step + self.horizon > self.steps:
                self.undetermined += 1

    @property
    def warnable(self) -> set[Unit]:
        return {u for u, c in self.crossings.items() if c >= self.first + self.lead_min}

    @property
    def false_warnings(self) -> int:
        return len(self.warnings) - self.true_warnings - self.undetermined


def table(scores: list[RunScore]) -> str:
    """A markdown table, one row per group and one for all groups but ``healthy``."""
    groups = sorted({s.group for s in scores}, key=lambda g: (g == "healthy", g))
    rows = [
        "| set | runs | steps | crossings | warned >= 5 ahead | recall | warnable crossings "
        "| recall (warnable) | warnings | "
        "followed by a crossing | undetermined | precision | (undetermined as false) | median lead "
        "| false warnings / 1k healthy steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    crossing_groups = [g for g in groups if g != "healthy"]
    parts = [(g, [s for s in scores if s.group == g]) for g in groups]
    if len(crossing_groups) > 1:
        parts.append(("all but healthy", [s for s in scores if s.group != "healthy"]))
    for name, ss in parts:
        n_cross = sum(len(s.crossings) for s in ss)
        n_timely = sum(len(s.timely) for s in ss)
        n_able = sum(len(s.warnable) for s in ss)
        n_able_ok = sum(len(s.warnable & set(s.timely)) for s in ss)
        n_warn = sum(len(s.warnings) for s in ss)
        n_true = sum(s.true_warnings for s in ss)
        n_open = sum(s.undetermined for s in ss)
        steps = sum(s.steps for s in ss)
        leads = [lead for s in ss for lead in s.timely.values()]
        # every warning in a healthy run is a false one (the undetermined included)
        false = sum(len(s.warnings) for s in ss if s.group == "healthy")
        healthy_steps = sum(s.steps for s in ss if s.group == "healthy")
        rows.append(
            f"| {name} | {len(ss)} | {steps} | {n_cross} | {n_timely} "
            f"| {_ratio(n_timely, n_cross)} | {n_able} | {_ratio(n_able_ok, n_able)} "
            f"| {n_warn} | {n_true} | {n_open} | {_ratio(n_true, n_warn - n_open)} "
            f"| {_ratio(n_true, n_warn)} "
            f"| {statistics.median(leads) if leads else '-'} "
            f"| {_per_k(false, healthy_steps)} |"
        )
    return "\n".join(rows)


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def _per_k(n: int, steps: int) -> str:
    return f"{1000 * n / steps:.1f}" if steps else "-"
