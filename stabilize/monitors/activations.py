"""Per-layer |x| max against the fp16 danger line, norm overflow counts, and a forecast
of when each layer will cross the line.

256 is the default because 256^2 = 65536 > 65504 = fp16 max: past it, one square
overflows. A norm that sums squares in fp16 overflows earlier, when the row RMS passes
255.94 / sqrt(D); its headroom is reported separately (``sum_headroom``).

The line is a danger only where an fp16 square is taken (issue 16, item 7): an fp16 norm
reduction, or ``input`` under fp16-mixed. ``monitor.activation.line=auto`` follows the run
(``resolve_line``, called by the RunConfig): with an fp32/bf16 reduction the crossing and its
forecast become INFO events that say what the line means there.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from stabilize.monitors.events import INFO, ROLLBACK, WARN, Event, StepStats
from stabilize.numerics import DANGER_LINE
from stabilize.validate import check_choice, check_positive

LINES = ("auto", "fp16_square", "info", "off")
ACT_DTYPES = ("fp32", "bf16", "fp16")
FP16_MAX = 65504.0
_ACT_DTYPE = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}

_PAIRS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # W -> (i, j, j - i)


def theil_sen_slope(y: np.ndarray) -> np.ndarray:
    """Median of pairwise slopes along the last axis (steps equally spaced).

    y: [series, W]. Robust to outliers: up to ~29% of the points can be wild without moving
    the estimate (Sen 1968). Returns [series].

    The pair indices are made once per W, the slopes computed in one buffer and the median
    taken by an in-place partition: the same numbers as ``np.median``, ~2.5x cheaper,
    which matters on the steps that refit (measured in a training run, where the forward's
    memory traffic has evicted numpy's working set: ~0.6 ms -> ~0.24 ms at 7 x 32).
    """
    w = y.shape[-1]
    pairs = _PAIRS.get(w)
    if pairs is None:
        i, j = np.triu_indices(w, k=1)
        pairs = _PAIRS[w] = (i, j, (j - i).astype(np.float64))
    i, j, dist = pairs
    slopes = y[:, j]  # [series, W(W-1)/2], a new array: worked on in place
    slopes -= y[:, i]
    slopes /= dist
    m = slopes.shape[-1]
    k = m // 2
    if m % 2:
        slopes.partition(k, axis=-1)
        return slopes[:, k].copy()
    slopes.partition((k - 1, k), axis=-1)
    return (slopes[:, k - 1] + slopes[:, k]) / 2


@dataclass
class ActivationConfig:
    """``monitor.activation``: the |x| max line, its forecast and norm overflows."""

    enabled: bool = True
    """Run this monitor."""
    threshold: float = 256.0
    """The |x| max line: the fp16 square-overflow line (256^2 > 65504)."""
    horizon: int = 100
    """Forecast warning: the crossing is expected within this many steps."""
    window: int = 32
    """Steps in the forecast's robust (Theil-Sen) fit."""
    forecast_min: float = 8.0
    """No forecast warning below this |x| max (early training noise)."""
    forecast_every: int = 10
    """Refit the forecast every N steps."""
    on_overflow: str = "warn"
    """warn | rollback, when a norm's reduction overflows."""
    line: str = "auto"
    """What crossing ``threshold`` means. ``fp16_square``: a WARN (one fp16 square overflows
    past 255.94). ``info``: an INFO event (no fp16 square is taken in this run's norms).
    ``off``: no crossing or forecast events. ``auto``: the run picks (``resolve_line``):
    fp16_square with an fp16 reduction, info otherwise; a monitor built without a run
    treats auto as fp16_square, today's line."""
    activation_dtype: str = "fp32"
    """The dtype the run's activations are held in; set by the run from ``precision.name``
    (``resolve_line``), it words the info message (fp16 activations overflow at 65504)."""

    def __post_init__(self):
        check_positive("monitor.activation.threshold", self.threshold)
        check_positive("monitor.activation.horizon", self.horizon, integer=True)
        check_positive("monitor.activation.window", self.window, integer=True)
        check_positive("monitor.activation.forecast_min", self.forecast_min)
        check_positive("monitor.activation.forecast_every", self.forecast_every, integer=True)
        check_choice("monitor.activation.on_overflow", self.on_overflow, ("warn", "rollback"))
        check_choice("monitor.activation.line", self.line, LINES)
        check_choice("monitor.activation.activation_dtype", self.activation_dtype, ACT_DTYPES)


def resolve_line(c: ActivationConfig, precision: str, reduction_dtype: str) -> ActivationConfig:
    """The run's ``monitor.activation`` with ``line=auto`` resolved and the activation dtype
    filled, from ``precision.name`` and ``norm.reduction_dtype`` (plain strings: this module
    stays Lightning-free; the RunConfig calls it where Hydra stops).

    An fp16 square is taken only by an fp16 reduction, or ``input`` whose input is fp16
    (fp16-mixed). fp32 and bf16 reductions square in a type with fp32's exponent range:
    256 is no danger there, so auto makes it INFO rather than off (the |x| max is still
    worth a line in the log). A user who wants the WARN anyway sets ``line=fp16_square``.
    """
    act = _ACT_DTYPE[precision]
    fp16_square = reduction_dtype == "fp16" or (reduction_dtype == "input" and act == "fp16")
    line = c.line
    if line == "auto":
        line = "fp16_square" if fp16_square else "info"
    return dataclasses.replace(c, line=line, activation_dtype=act)


def line_meaning(line: str, activation_dtype: str) -> str:
    """What crossing the line means for the run, for the event message."""
    if line == "fp16_square":
        return "an fp16 square overflows past 255.94"
    if activation_dtype == "fp16":
        # fp16 activations with a wider reduction: the norm is safe, the cast is not
        return (
            f"info: no fp16 square in this run's norms; its fp16 activations overflow "
            f"when cast past {FP16_MAX:g}"
        )
    return (
        f"info: no fp16 square in this run's norms; {activation_dtype} activations "
        f"have fp32's range"
    )


class ActivationMonitor:
    name = "activation"
    needs = ("act_max", "norm_overflow", "norm_collapsed", "norm_nan_rows")

    @classmethod
    def from_config(cls, name: str, c: ActivationConfig) -> ActivationMonitor:
        return cls(
            c.threshold,
            c.horizon,
            c.window,
            on_overflow=c.on_overflow,
            forecast_min=c.forecast_min,
            forecast_every=c.forecast_every,
            line="fp16_square" if c.line == "auto" else c.line,
            activation_dtype=c.activation_dtype,
        )

    def __init__(
        self,
        threshold: float = DANGER_LINE,
        horizon: int = 100,
        window: int = 32,
        min_points: int = 16,
        on_overflow: str = "warn",
        forecast_min: float = 8.0,
        forecast_every: int = 10,
        line: str = "fp16_square",
        activation_dtype: str = "fp32",
    ):
        """``forecast_min``: no forecast warning below this |x| max. Activations grow
        fast early in training from their ~0.5 start; a line fit there predicts a crossing
        that never comes (seen on the tiny model: "256 in ~40 steps" at |x| max 0.5)."""
        self.threshold, self.horizon = threshold, horizon
        self.window, self.min_points = window, min(min_points, window)
        self.forecast_min = forecast_min
        # The fit runs every few steps (the window still takes every value): its horizon is
        # ~100 steps, and numpy per step cost ~1% of a tiny-model step.
        self.forecast_every = forecast_every
        self.on_overflow = ROLLBACK if on_overflow == "rollback" else WARN
        # the crossing's and forecast's severity and wording follow the run (resolve_line)
        self.line = line
        self.line_kind = WARN if line == "fp16_square" else INFO
        self.meaning = line_meaning(line, activation_dtype)
        self.history: dict[str, deque[float]] = {}
        self.above: set[str] = set()  # layers currently past the line (warn once per crossing)
        self.forecast: dict[str, float] = {}  # layer -> steps left (inf: not rising)
        self.forecast_warned: set[str] = set()  # warn once per approach

    def update(self, stats: StepStats) -> list[Event]:
        events = []
        step = stats.step
        for layer, value in stats.act_max.items():
            h = self.history.setdefault(layer, deque(maxlen=self.window))
            if math.isfinite(value) and value > 0:
                h.append(math.log(value))
            if value > self.threshold and layer not in self.above:
                self.above.add(layer)
                if self.line != "off":
                    events.append(
                        Event(
                            self.line_kind,
                            "activation",
                            step,
                            f"{layer}: |x| max {value:.4g} crossed {self.threshold:g} "
                            f"({self.meaning})",
                            layer=layer,
                            value=value,
                            threshold=self.threshold,
                        )
                    )
            elif value <= self.threshold:
                self.above.discard(layer)
        if step % self.forecast_every == 0:
            events += self._forecast(step, stats)
        for norm, n in stats.norm_overflow.items():
            if n > 0:
                dead = stats.norm_collapsed.get(norm, 0)
                nan = stats.norm_nan_rows.get(norm, 0)
                events.append(
                    Event(
                        self.on_overflow,
                        "overflow",
                        step,
                        f"{norm}: {int(n)} rows' reduction overflowed, {int(dead)} tokens "
                        f"collapsed to zeros (zero gradient: silently dead); {int(nan)} rows "
                        f"not finite in the reduction dtype output NaN",
                        layer=norm,
                        value=float(n),
                        extra={"collapsed": dead, "nan_rows": nan},
                    )
                )
        return events

    def _forecast(self, step: int, stats: StepStats) -> list[Event]:
        """Steps until each rising layer crosses the threshold, from a log-linear robust fit."""
        full = [k for k, h in self.history.items() if len(h) >= self.min_points]
        self.forecast = {}
        if not full:
            return []
        n = min(len(self.history[k]) for k in full)
        y = np.array([list(self.history[k])[-n:] for k in full])  # [layers, n] of log|x|max
        slope = theil_sen_slope(y)  # log units per step
        level = np.median(y - slope[:, None] * np.arange(n), axis=1) + slope * (n - 1)
        events = []
        target = math.log(self.threshold)
        for k, s, lv in zip(full, slope, level, strict=True):
            left = (target - lv) / s if s > 0 and lv < target else math.inf
            if lv >= target:
                left = 0.0
            self.forecast[k] = left
            if left >= self.horizon:
                self.forecast_warned.discard(k)
            near = math.exp(lv) >= self.forecast_min
            if self.line == "off":
                continue
            if near and 0 < left < self.horizon and k not in self.above | self.forecast_warned:
                self.forecast_warned.add(k)
                events.append(
                    Event(
                        self.line_kind,
                        "forecast",
                        step,
                        f"{k}: |x| max {math.exp(lv):.4g} rising x{math.exp(s):.4f}/step; "
                        f"crosses {self.threshold:g} in ~{left:.0f} steps{self._forecast_note()}",
                        layer=k,
                        value=left,
                        threshold=float(self.horizon),
                    )
                )
        return events

    def _forecast_note(self) -> str:
        """The forecast's WARN reads as before; an INFO one says why it is no warning."""
        return "" if self.line_kind == WARN else f" ({self.meaning})"

    def state_dict(self) -> dict:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "above": sorted(self.above),
            "forecast_warned": sorted(self.forecast_warned),
        }

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: deque(v, maxlen=self.window) for k, v in state["history"].items()}
        self.above = set(state["above"])
        self.forecast_warned = set(state["forecast_warned"])
