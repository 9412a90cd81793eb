"""``monitor.curvature``: the optimizer-state series (docs/design-spikes.md).

On log steps the probe records, per block and for the whole model, AdamW's mean g^2 / v_hat
and the update/weight ratio; on one log step in ``every`` also the curvature along the
update and its preconditioned form (stability/curvature.py: two extra forward and backward
passes of the step's batches, in fp32), logged as ``opt/curv_u`` and ``opt/curv_pre`` beside their
stability lines ``opt/edge_gd`` (2 / lr) and ``opt/edge_adam`` ((2 + 2 beta1) / ((1 -
beta1) lr)).

The spike forecast (``forecast=true``; off by default): each quotient against its line is a
unit of the activation forecast's trend forecaster (monitors/forecast.py, its default
settings: log(value / line), a robust slope, a noise floor learned from the series, the
pessimistic path), fed one point per curvature step; a quotient projected to reach its
line within ``horizon`` steps is warned, and again once that warning's horizon has passed
(nothing is warned when the points are further apart than the horizon). A quotient at or
below 0 (the loss curves down along the update) is not a point: there is no log of it, and
the points on either side of it are read as consecutive. Off by default because its
measured precision is what docs/forecast.md's spike table says (scripts/eval_spikes.py):
on the tiny model's natural loss spikes (memorizing runs) it warned 0 of 5, and 1 of 10 held
out (2 of 10 with ``past_line``); crossings of the lines are routine at high LRs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.monitors.events import WARN, Event, StepStats
from stabilize.monitors.forecast import ForecastConfig, LineForecaster
from stabilize.validate import ConfigError, check_count, check_positive, check_range

# (quotient, its line, the unit's name, the line's name)
UNITS = (
    ("curv_pre", "edge_adam", "preconditioned", "Adam's line (2 + 2 beta1) / ((1 - beta1) lr)"),
    ("curv_u", "edge_gd", "plain", "gradient descent's line 2 / lr"),
)


@dataclass
class CurvatureConfig:
    """``monitor.curvature``: the curvature along the optimizer's update."""

    enabled: bool = True
    """Measure it (g^2 / v_hat and the update ratio are measured on every log step)."""
    every: int = 0
    """On one log step in this many: two extra forward and backward passes in fp32 then. 0
    (the default): never. Opt-in because of its cost at scale: +1.3% of a tiny run at 10 on
    this project's CPU, but on paper +16% to +32% of a gpt-1.3b run on an A100 at 10 (two fp32
    passes, TF32 off, every 100 steps: docs/monitors.md)."""
    rel: float = 1e-4
    """The difference quotient's step, ||h u|| / ||theta||."""
    forecast: bool = False
    """Warn when a quotient is projected to reach its stability line within ``horizon``
    steps (module docstring; off: its measured precision, docs/forecast.md)."""
    horizon: int = 40
    """The forecast's horizon, in steps."""
    past_line: bool = False
    """With ``forecast``: also warn when a quotient is measured at or past its line (Bai et
    al.'s condition itself, read off one point: the trend forecaster's robust level does
    not move for one point), once per ``horizon`` per quotient like the forecast's
    warnings. Off by default: docs/forecast.md has its measured precision."""

    def __post_init__(self):
        check_count("monitor.curvature.every", self.every)
        check_range("monitor.curvature.rel", self.rel, 1e-6, 1e-1)
        check_positive("monitor.curvature.horizon", self.horizon, integer=True)
        if self.forecast and not (self.enabled and self.every):
            raise ConfigError(
                f"monitor.curvature.forecast=true is not allowed with monitor.curvature."
                f"every={self.every} and enabled={self.enabled}: the curvature is never "
                "measured; allowed: every >= 1 and enabled=true, or forecast=false"
            )


def _forecaster() -> LineForecaster:
    """The activation forecast's trend forecaster with its default settings (none of them
    chosen on curvature series: the spike table scores them as they are)."""
    return LineForecaster(ForecastConfig())


class CurvatureMonitor:
    name = "curvature"
    needs = ("opt",)

    @classmethod
    def from_config(cls, name: str, c: CurvatureConfig) -> CurvatureMonitor:
        return cls(c)

    def __init__(self, c: CurvatureConfig | None = None):
        self.c = c or CurvatureConfig()
        self.horizon = self.c.horizon
        self.forecaster = _forecaster()
        self.last_point: int | None = None  # the step of the last curvature point
        self.spacing = 1  # steps between curvature points, as last seen
        self.warned: dict[str, int] = {}  # unit -> the step it was warned at

    def update(self, stats: StepStats) -> list[Event]:
        if not self.c.forecast or "curv_pre" not in stats.opt:
            return []
        step, opt = stats.step, stats.opt
        if self.last_point is not None and step > self.last_point:
            self.spacing = step - self.last_point
        self.last_point = step
        # the forecaster counts points: its horizon is the steps' at the points' spacing (0
        # points when they are further apart than the horizon: nothing can be warned then)
        points = self.horizon // self.spacing
        self.forecaster.horizon = max(1, points)
        values = {
            (unit, "line"): (opt[q], opt[line])
            for q, line, unit, _ in UNITS
            if q in opt and line in opt and math.isfinite(opt[line]) and opt[line] > 0
        }
        events = []
        projections = self.forecaster.update(values)  # the history grows either way
        for (unit, _), (value, line) in values.items():
            p = projections.get((unit, "line"))
            past = self.c.past_line and not value < line
            if not past and (points < 1 or p is None or not value < line or p.level >= 0
                             or not p.significant):  # fmt: skip
                continue  # past its line (that is a measurement, not a forecast), or no rise
            warned = self.warned.get(unit)
            if warned is not None and step - warned < self.horizon:
                continue
            self.warned[unit] = step
            events.append(self._past(step, unit, value, line) if past
                          else self._event(step, unit, value, line, p))  # fmt: skip
        return events

    def _past(self, step: int, unit: str, value: float, line: float) -> Event:
        what = next(w for _, _, u, w in UNITS if u == unit)
        return Event(
            WARN,
            "curvature",
            step,
            f"{unit} curvature along the update {value:.4g} is past {what} = {line:.4g} "
            f"(x{value / line:.2f}): a loss spike may follow within {self.horizon} steps "
            "(docs/forecast.md has this warning's measured precision)",
            layer=unit,
            value=0.0,
            threshold=float(self.horizon),
            extra={"line": line, "past_line": True},
        )

    def _event(self, step: int, unit: str, value: float, line: float, p) -> Event:
        what = next(w for _, _, u, w in UNITS if u == unit)
        left = p.left * self.spacing
        return Event(
            WARN,
            "curvature",
            step,
            f"{unit} curvature along the update {value:.4g} rising x{math.exp(p.slope):.3f} "
            f"per point (every {self.spacing} steps): reaches {what} = {line:.4g} in "
            f"~{left:.0f} steps at this rate (a loss spike forecast: docs/forecast.md has "
            "its measured precision)",
            layer=unit,
            value=left,
            threshold=float(self.horizon),
            extra={"line": line, "within": p.within * self.spacing, "sigma": p.sigma},
        )

    def state_dict(self) -> dict:
        return {
            "forecaster": self.forecaster.state_dict(),
            "warned": dict(self.warned),
            "last_point": self.last_point,
            "spacing": self.spacing,
        }

    def load_state_dict(self, state: dict) -> None:
        if "forecaster" not in state:  # an older checkpoint: the forecast starts again
            return
        self.forecaster.load_state_dict(state["forecaster"])
        self.warned = {k: int(v) for k, v in state["warned"].items()}
        self.last_point, self.spacing = state["last_point"], int(state["spacing"])
