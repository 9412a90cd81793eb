"""``monitor.quant``: a quantized GEMM's operands (stability/quant_sites.py), where a drift
does not end in NaN but in a clipped tensor and a quiet gap.

Per operand (``<layer>.x``, ``.w``, ``.dy``), from its series on the probe's measured steps:

- saturation: the share of its elements that saturation changed (counted before the cast,
  which hides them: E4M3 has no inf and turns 480 into 448) above ``saturated`` on a log
  step; between log steps (read off the cast's group maxima, no pass over the tensor) any
  scale group whose largest value clips: a WARN, or
  with ``on_saturation=rollback`` a ROLLBACK whose rungs (rollback/quant_remedies.py) change
  the layer or the recipe;
- underflow: the share of non-zero elements that come back 0 above ``underflow`` (5%,
  Transformer Engine's AutoswitchGemm rule): a WARN;
- the forecast: an operand whose amax over the format's max (after its scaling) climbs
  towards 1, as delayed scaling's does when a tensor's growth outruns its amax history, is
  fitted by a robust log-linear line over ``window`` measured steps (``loglinear_forecast``,
  as the attention-logit bound's); a WARN when it reaches 1 within ``horizon`` steps. Under
  current scaling the ratio sits at 1 by construction and is not forecast.

One event per episode and operand; the layer's name rides in ``extra["site"]`` (the rungs
act on it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from stabilize.monitors.events import ROLLBACK, WARN, Event, StepStats
from stabilize.monitors.logits import loglinear_forecast
from stabilize.validate import check_choice, check_positive, check_range

CURRENT = 0.999  # an amax ratio this close to 1: scaled by its own amax, nothing to forecast


@dataclass
class QuantMonitorConfig:
    """``monitor.quant``: the quantized GEMMs' operands: saturation, underflow, the amax
    forecast."""

    enabled: bool = True
    """Run this monitor (it reads nothing on a run with no quantized Linear)."""
    saturated: float = 1e-4
    """A share of an operand's elements changed by saturation above this: the verdict."""
    underflow: float = 0.05
    """A share of an operand's non-zero elements flushed to 0 above this: a warning."""
    on_saturation: str = "warn"
    """warn | rollback, when an operand saturates past ``saturated``."""
    horizon: int = 50
    """Forecast: warn when the amax ratio is expected to reach the format's max within this
    many measured steps."""
    window: int = 8
    """Measured steps in the forecast's robust log-linear fit."""

    def __post_init__(self):
        for k in ("saturated", "underflow"):
            check_range(f"monitor.quant.{k}", getattr(self, k), 0.0, 1.0)
        for k in ("horizon", "window"):
            check_positive(f"monitor.quant.{k}", getattr(self, k), integer=True)
        if self.window < 4:
            raise ValueError(f"monitor.quant.window={self.window!r} is not allowed; allowed: >= 4")
        check_choice("monitor.quant.on_saturation", self.on_saturation, ("warn", "rollback"))


class QuantMonitor:
    name = "quant"
    needs = ("quant_saturated", "quant_underflow", "quant_amax_ratio", "quant_clipped")

    @classmethod
    def from_config(cls, name: str, c: QuantMonitorConfig) -> QuantMonitor:
        return cls(c)

    def __init__(self, c: QuantMonitorConfig | None = None):
        self.c = c or QuantMonitorConfig()
        self.kind = ROLLBACK if self.c.on_saturation == "rollback" else WARN
        self.ratios: dict[str, deque[float]] = {}  # operand -> log amax ratio, measured steps
        self.open: set[tuple[str, str]] = set()  # (what, operand) episodes open
        self.forecast: dict[str, float] = {}  # operand -> measured steps left

    def _once(self, what: str, op: str, now: bool) -> bool:
        """True at an episode's first step; the episode ends when ``now`` is false."""
        key = (what, op)
        if not now:
            self.open.discard(key)
            return False
        first = key not in self.open
        self.open.add(key)
        return first

    def update(self, stats: StepStats) -> list[Event]:
        c, events = self.c, []
        for op in sorted(set(stats.quant_saturated) | set(stats.quant_clipped)):
            share = stats.quant_saturated.get(op)
            if share is not None:  # a log step: the share of elements
                now, value, line = share > c.saturated, share, c.saturated
                what = f"{share:.3%} of its elements saturated"
            else:  # between them: the share of scale groups whose largest value clips
                value, line = stats.quant_clipped[op], 0.0
                now, what = value > 0, f"{value:.3%} of its scale groups clipped"
            if self._once("saturated", op, now):
                msg = (f"{op}: {what} (changed by the cast to the format's max, no inf, no "
                       "NaN: a quiet clip)")  # fmt: skip
                events.append(self._event(self.kind, stats.step, op, msg, value, line))
        for op, share in stats.quant_underflow.items():
            if self._once("underflow", op, share > c.underflow):
                msg = f"{op}: {share:.2%} of its elements flushed to 0 by the cast"
                events.append(self._event(WARN, stats.step, op, msg, share, c.underflow))
        for op, ratio in stats.quant_amax_ratio.items():
            events += self._forecast(stats.step, op, ratio)
        return events

    def _forecast(self, step: int, op: str, ratio: float) -> list[Event]:
        if not (math.isfinite(ratio) and 0 < ratio < CURRENT):
            self.ratios.pop(op, None)  # at or past the max (saturation says it), or current
            self.forecast.pop(op, None)
            self.open.discard(("forecast", op))
            return []
        h = self.ratios.setdefault(op, deque(maxlen=self.c.window))
        h.append(math.log(ratio))
        if len(h) < self.c.window:
            return []
        level, slope, left = loglinear_forecast(list(h), 0.0)
        self.forecast[op] = left
        if not self._once("forecast", op, left < self.c.horizon):
            return []
        msg = (
            f"{op}: amax at {ratio:.3f} of the format's max after its scaling, "
            f"x{math.exp(slope):.4f}/step; reaches it in ~{left:.0f} measured steps"
        )
        return [self._event(WARN, step, op, msg, left, float(self.c.horizon))]

    @staticmethod
    def _event(kind: str, step: int, op: str, msg: str, value: float, threshold: float) -> Event:
        site = op.rpartition(".")[0]  # the Linear (the rungs act on it)
        return Event(kind, "quant", step, msg, layer=op, value=value, threshold=threshold,
                     extra={"site": site})  # fmt: skip

    def state_dict(self) -> dict:
        return {"ratios": {k: list(v) for k, v in self.ratios.items()},
                "open": sorted(list(k) for k in self.open)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.ratios = {k: deque(v, maxlen=self.c.window) for k, v in state["ratios"].items()}
        self.open = {tuple(k) for k in state["open"]}
