"""Per-layer |x| max against the fp16 danger line, norm overflow counts, and a forecast
of when each layer will cross the line.

One tensor, one unit: a pre-norm block's output *is* the next norm's input
(``StepStats.act_alias``: block -> norm), so it is judged once, under the name of the norm
that reads it (where an fp16 reduction of it overflows), on both its lines (|x| max, and the
norm's row RMS where that is measured): a crossing or a forecast is warned once, not once
per name the tensor has.

256 is the default because 256^2 = 65536 > 65504 = fp16 max: past it, one square
overflows. A norm that sums squares in fp16 overflows earlier, when the row RMS passes
255.94 / sqrt(D); its headroom is reported separately (``sum_headroom``).

The line is a danger only where an fp16 square is taken: an fp16 norm
reduction, or ``input`` under fp16-mixed. ``monitor.activation.line=auto`` follows the run
(``resolve_line``, called by the RunConfig): with an fp32/bf16 reduction the crossing and its
forecast become INFO events that say what the line means there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from stabilize.monitors.events import INFO, ROLLBACK, WARN, Event, StepStats
from stabilize.monitors.forecast import (  # noqa: F401
    ForecastConfig,
    LineForecaster,
    Projection,
    nest_forecast_keys,
    theil_sen_slope,
)
from stabilize.numerics import DANGER_LINE, sum_of_squares_rms_limit
from stabilize.validate import build_dataclass, check_choice, check_positive

LINES = ("auto", "fp16_square", "info", "off")
ACT_DTYPES = ("fp32", "bf16", "fp16")
FP16_MAX = 65504.0
_ACT_DTYPE = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


@dataclass
class ActivationConfig:
    """``monitor.activation``: the |x| max line, its forecast and norm overflows."""

    enabled: bool = True
    """Run this monitor."""
    threshold: float = DANGER_LINE
    """The |x| max line: 256, the fp16 square-overflow line (256^2 > 65504 = fp16 max)."""
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    """When a layer will cross the line (``monitor.activation.forecast``: monitors/forecast.py);
    a saved config's flat keys (``horizon``, ``forecast_z``, ...) load through
    ``nest_forecast_keys``."""
    on_overflow: str = "warn"
    """warn | rollback, when a norm's reduction overflows."""
    line: str = "auto"
    """What crossing ``threshold`` means. ``fp16_square``: a WARN (one fp16 square overflows
    past 255.94). ``info``: an INFO event (no fp16 square is taken in this run's norms).
    ``off``: no crossing or forecast events. ``auto``: the run picks (``resolve_line``):
    fp16_square with an fp16 reduction, info otherwise; a monitor built without a run
    treats auto as fp16_square, today's line."""
    activation_dtype: str = "fp32"
    """The dtype the run's activations are held in: fp32 | bf16 | fp16. Filled in by the run
    from ``precision.name`` (``resolve_line``; a value set here is replaced), it words the
    info message (fp16 activations overflow at 65504)."""

    def __post_init__(self):
        key = "monitor.activation.forecast"
        self.forecast = build_dataclass(ForecastConfig, self.forecast, key)
        check_positive("monitor.activation.threshold", self.threshold)
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
    needs = (
        "act_max", "norm_overflow", "norm_collapsed", "norm_nan_rows", "norm_rms_max", "norm_dim",
        "act_alias",
    )  # fmt: skip

    @classmethod
    def from_config(cls, name: str, c: ActivationConfig) -> ActivationMonitor:
        return cls(c)

    def __init__(self, c: ActivationConfig | None = None):
        """Built from ``monitor.activation``'s settings (None: the dataclass's defaults, the
        ones a run composes). ``line=auto`` (a monitor built without a run, whose
        ``resolve_line`` decides it) is treated as fp16_square, today's line. The forecast
        runs only where the line is a danger (``line=fp16_square``): with an fp32/bf16
        reduction nothing can overflow there, and it stays silent."""
        self.c = c = c or ActivationConfig()
        self.threshold, self.horizon = c.threshold, c.forecast.horizon
        self.on_overflow = ROLLBACK if c.on_overflow == "rollback" else WARN
        # the crossing's severity and wording follow the run (resolve_line)
        self.line = "fp16_square" if c.line == "auto" else c.line
        self.line_kind = WARN if self.line == "fp16_square" else INFO
        self.meaning = line_meaning(self.line, c.activation_dtype)
        self.forecaster = LineForecaster(c.forecast)
        self.above: set[str] = set()  # layers currently past the line (warn once per crossing)
        self.forecast: dict[str, float] = {}  # layer -> steps left (inf: not rising)
        # layer -> the step it was warned at: once per approach, and again once that
        # warning's horizon has passed with no crossing (it has expired)
        self.forecast_warned: dict[str, int] = {}
        self._rms_line: dict[int, float] = {}  # D -> 255.94 / sqrt(D)
        self.confirm, self.slow_steps = c.forecast.confirm, c.forecast.slow_steps
        self.within = c.forecast.within
        self._streak: dict[str, int] = {}  # layer -> consecutive steps with a significant crossing

    def update(self, stats: StepStats) -> list[Event]:
        events = []
        step = stats.step
        merged = set(stats.act_alias)  # judged as the norm that reads their output
        for layer, value in stats.act_max.items():
            if layer in merged:
                continue
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
        if self.line == "fp16_square":
            events += self._forecast(step, stats)
        for norm in sorted(set(stats.norm_overflow) | set(stats.norm_nan_rows)):
            n = stats.norm_overflow.get(norm, 0)
            nan = stats.norm_nan_rows.get(norm, 0)
            if n <= 0 and nan > 0:  # NaN rows with no overflow beside them: counted too
                events.append(
                    Event(
                        INFO,
                        "nan_rows",
                        step,
                        f"{norm}: {int(nan)} rows not finite in the reduction dtype output NaN",
                        layer=norm,
                        value=float(nan),
                        extra={"nan_rows": nan},
                    )
                )
            if n > 0:
                dead = stats.norm_collapsed.get(norm, 0)
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

    def _lines(self, stats: StepStats) -> dict[tuple[str, str], tuple[float, float]]:
        """Every unit's (value, line): |x| max vs the threshold; a norm's largest row RMS vs
        the fp16 sum-of-squares line, where the RMS is measured (the explicit backend). A
        block whose output a norm reads is that norm's unit (one tensor)."""
        out = {(k, "abs"): (v, self.threshold) for k, v in stats.act_max.items()
               if k not in stats.act_alias}  # fmt: skip
        for k, v in stats.norm_rms_max.items():
            d = stats.norm_dim.get(k)
            if d:
                line = self._rms_line.get(d)
                if line is None:
                    line = self._rms_line[d] = sum_of_squares_rms_limit(torch.float16, d)
                out[(k, "rms")] = (v, line)
        return out

    def _forecast(self, step: int, stats: StepStats) -> list[Event]:
        """Warn once per approach for each layer with a crossing significant within the
        horizon, on whichever of its lines comes first (either overflows a 16-bit reduction
        of that tensor), and again once a warning's horizon has passed with no crossing (it
        expired: holdout2's wide DeepNorm run, docs/forecast.md); ``self.forecast``: steps
        left per layer (the nearer line)."""
        lines = self._lines(stats)
        # a layer measured at or past one of its lines this step (an overflowed statistic is
        # inf) has crossed: that is the news, not a forecast. The fitted level lags the
        # measurement, so without this a layer could be warned of a crossing it had made.
        past = {layer for (layer, _), (v, line) in lines.items() if not v < line}
        by_layer: dict[str, list[tuple[str, Projection]]] = {}
        for (layer, kind), p in self.forecaster.update(lines).items():
            by_layer.setdefault(layer, []).append((kind, p))
        self.forecast = {}
        events = []
        for layer, ps in by_layer.items():
            self.forecast[layer] = min(p.left for _, p in ps)
            if layer in past or any(p.level >= 0 for _, p in ps):
                continue  # already past a line: the crossing itself is the news
            sig = [(p.within, kind, p) for kind, p in ps if p.significant]
            if not sig:
                self._streak.pop(layer, None)
                if all(p.slope <= 0 for _, p in ps):  # the approach is over
                    self.forecast_warned.pop(layer, None)
                continue
            self._streak[layer] = self._streak.get(layer, 0) + 1
            warned = self.forecast_warned.get(layer)
            if (warned is not None and step - warned < self.horizon) or (
                self._streak[layer] < self.confirm
            ):
                continue
            _, kind, p = min(sig, key=lambda t: t[0])
            if self.within and self._slowed(p, step) > self.within:
                continue  # too far yet: warned once it comes within reach
            self.forecast_warned[layer] = step
            value, line = lines[(layer, kind)]
            events.append(self._event(step, layer, kind, value, line, p))
        return events

    def _slowed(self, p: Projection, step: int) -> float:
        """The distance a warning leads with: the projection x (1 + slow_steps / step)."""
        return p.left * (1.0 + self.slow_steps / max(step, 1))

    def _event(self, step, layer, kind, value, line, p: Projection) -> Event:
        what = "|x| max" if kind == "abs" else "largest row RMS"
        why = "an fp16 square overflows" if kind == "abs" else "the fp16 sum of squares overflows"
        # The distance the warning leads with (its value) is the calibrated one: natural
        # growth slows with the step (forecast.slow_steps), so the projection at the current
        # rate alone comes ~2x early in the first steps (docs/forecast.md). The projection is
        # still given: a steady drift arrives at it.
        slowed = self._slowed(p, step)
        z = f"{self.forecaster.z:g} sigma"
        if p.within < 1:
            soon = f"within {z} of it now"
        else:
            soon = f"at {z} as soon as {math.ceil(p.within)}"
        return Event(
            WARN,
            "forecast",
            step,
            f"{layer}: {what} {value:.4g} rising x{math.exp(p.slope):.3f}/step (noise "
            f"x{math.exp(p.sigma):.3f}); crosses {line:.4g} ({why}) in ~{slowed:.0f} steps "
            f"as natural growth slows, ~{p.left:.0f} at this rate ({soon})",
            layer=layer,
            value=slowed,
            threshold=float(self.horizon),
            extra={
                "line": kind,
                "limit": line,
                "within": p.within,
                "sigma": p.sigma,
                "at_this_rate": p.left,
            },  # fmt: skip
        )

    def state_dict(self) -> dict:
        return {
            "forecaster": self.forecaster.state_dict(),
            "above": sorted(self.above),
            "forecast_warned": dict(sorted(self.forecast_warned.items())),
        }

    def load_state_dict(self, state: dict) -> None:
        if "forecaster" in state:  # an older checkpoint kept a "history": the
            self.forecaster.load_state_dict(state["forecaster"])  # forecast restarts instead
        self.above = set(state["above"])
        warned = state["forecast_warned"]
        if isinstance(warned, list):  # an older checkpoint: the layers alone; as then, they
            warned = dict.fromkeys(warned, 2**62)  # stay warned until their approach ends
        self.forecast_warned = {k: int(v) for k, v in warned.items()}
