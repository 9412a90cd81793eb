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
  towards its saturation edge, as delayed scaling's does when a tensor's growth outruns its
  amax history, is
  projected by the activation forecast's own ``LineForecaster`` (monitors/forecast.py: a
  robust fit over ``window`` measured steps, the operand's learned noise, a crossing
  significant at ``z`` sigmas) against the ratio past which its cast saturates (the
  format's overflow edge over its max: 464 / 448 for E4M3, ``StepStats.quant_edge``): a
  WARN when one is significant within ``horizon`` steps and at most ``within`` away, once
  per ``horizon`` steps. Only delayed scaling is forecast: current and block scaling follow
  the tensor itself. Off by default (``forecast``): scored on recorded runs
  (scripts/eval_quant_forecast.py, docs/forecast.md), a planted growth's acceleration was
  buried in the amax's own step-to-step noise: no planted crossing was warned in time
  except by coincidence, and its warnings came as often in runs with no growth.

One event per episode and operand; the layer's name rides in ``extra["site"]`` (the rungs
act on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.monitors.events import ROLLBACK, WARN, Event, StepStats
from stabilize.monitors.forecast import ForecastConfig, LineForecaster
from stabilize.validate import check_choice, check_positive, check_range

# measured steps of an operand not forecast from: delayed scaling's cold start (the first step
# is scaled from an empty history, the second from one step's amax)
COLD_STEPS = 2


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
    forecast: bool = False
    """Forecast a delayed-scaling operand's amax ratio reaching its saturation edge. Off by
    default: on recorded runs (docs/forecast.md) it warned of no planted growth in time."""
    horizon: int = 50
    """Forecast: warn when the amax ratio is expected to reach its saturation edge within
    this many measured steps."""
    window: int = 8
    """Measured steps in the forecast's robust fit."""
    z: float = 3.0
    """How many of the operand's own noise sigmas the projected crossing must clear."""
    within: float = 20.0
    """Warn only when the projected crossing is at most this many measured steps away (0: any
    within ``horizon``)."""

    def __post_init__(self):
        for k in ("saturated", "underflow"):
            check_range(f"monitor.quant.{k}", getattr(self, k), 0.0, 1.0)
        for k in ("horizon", "window"):
            check_positive(f"monitor.quant.{k}", getattr(self, k), integer=True)
        check_positive("monitor.quant.z", self.z)
        check_range("monitor.quant.within", self.within, 0.0, 1e6)
        if self.window < 4:
            raise ValueError(f"monitor.quant.window={self.window!r} is not allowed; allowed: >= 4")
        check_choice("monitor.quant.on_saturation", self.on_saturation, ("warn", "rollback"))


class QuantMonitor:
    name = "quant"
    needs = ("quant_saturated", "quant_underflow", "quant_amax_ratio", "quant_clipped",
             "quant_edge")  # fmt: skip

    @classmethod
    def from_config(cls, name: str, c: QuantMonitorConfig) -> QuantMonitor:
        return cls(c)

    def __init__(self, c: QuantMonitorConfig | None = None):
        self.c = c or QuantMonitorConfig()
        self.kind = ROLLBACK if self.c.on_saturation == "rollback" else WARN
        self.forecaster = self._forecaster()
        self.warned: dict[str, int] = {}  # operand -> the step its last forecast was warned
        self.seen: dict[str, int] = {}  # operand -> measured steps seen
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
        if c.forecast:
            events += self._forecast(stats.step, stats.quant_amax_ratio, stats.quant_edge)
        return events

    def _forecaster(self) -> LineForecaster:
        c = self.c
        return LineForecaster(ForecastConfig(horizon=c.horizon, window=c.window, z=c.z))

    def _forecast(self, step: int, ratios: dict[str, float], edges: dict[str, float]):
        """Each delayed-scaling operand's amax ratio against its saturation edge (``edges``:
        the format's overflow edge over its max, 464 / 448 for E4M3): a Projection a step;
        an operand scaled by its own amax (current, block) has no edge and is not forecast."""
        live = {}
        for op, ratio in ratios.items():
            edge = edges.get(op)
            if edge is None:
                continue
            self.seen[op] = self.seen.get(op, 0) + 1
            if self.seen[op] <= COLD_STEPS:
                continue
            if math.isfinite(ratio) and 0 < ratio < edge:
                live[(op, "ratio")] = (ratio, edge)
            else:  # past the edge: saturation says it
                self.forecast.pop(op, None)
        events = []
        for (op, _), p in self.forecaster.update(live).items():
            self.forecast[op] = p.left
            last = self.warned.get(op)
            if not p.significant or (last is not None and step - last < self.c.horizon):
                continue
            if self.c.within and p.left > self.c.within:
                continue  # too far yet: warned once it comes within reach
            self.warned[op] = step
            ratio, edge = live[(op, "ratio")]
            msg = (f"{op}: amax at {ratio:.3f} of the format's max after its scaling, "
                   f"x{math.exp(p.slope):.4f}/step (noise x{math.exp(p.sigma):.3f}); reaches "
                   f"{edge:.4f}, where its cast saturates, in ~{p.left:.0f} measured "
                   "steps")  # fmt: skip
            events.append(self._event(WARN, step, op, msg, p.left, float(self.c.horizon)))
        return events

    @staticmethod
    def _event(kind: str, step: int, op: str, msg: str, value: float, threshold: float) -> Event:
        site = op.rpartition(".")[0]  # the Linear (the rungs act on it)
        return Event(kind, "quant", step, msg, layer=op, value=value, threshold=threshold,
                     extra={"site": site})  # fmt: skip

    def state_dict(self) -> dict:
        return {"forecaster": self.forecaster.state_dict(), "warned": dict(self.warned),
                "seen": dict(self.seen),
                "open": sorted(list(k) for k in self.open)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.forecaster = self._forecaster()  # an older state (its "ratios"): learned again
        if "forecaster" in state:
            self.forecaster.load_state_dict(state["forecaster"])
        self.warned = {k: int(v) for k, v in state.get("warned", {}).items()}
        self.seen = {k: int(v) for k, v in state.get("seen", {}).items()}
        self.open = {tuple(k) for k in state["open"]}
