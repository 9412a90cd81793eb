"""Attention and output logits: the attention-logit line and its
forecast, attention entropy collapse, and the output logits' log Z.

- ``attn_logit``: the per-block upper bound on the attention logit (the probe's
  max|q| max|k| / sqrt(d), never below the exact max) against a line, 1e4 by default: the
  runs of Wortsman et al. (2023, "Small-scale proxies for large-scale Transformer training
  instabilities") whose max attention logit passed ~1e4 diverged. A robust log-linear fit
  over the last ``window`` steps forecasts the crossing; a warning comes ``horizon`` steps
  ahead. Measured on the tiny GPT (fp32): LR 3e-2 reaches 1.3e4-1.6e4, qk-norm
  keeps it ~12.
- ``attn_entropy``: the lowest head's mean attention entropy (nats), on log steps (Zhai et
  al. 2023: entropy collapse accompanies divergence). At LR 1e-2 it fell to 0.02 while the
  logit bound (786) was still 13x below the line: the two read different things.
- ``log_z``: logsumexp of the final logits, mean and max over the step's tokens. Nothing in
  the cross-entropy pins it (logits are defined up to a shift); PaLM's z-loss
  (``model.z_loss``, the ``z_loss`` remedy) pulls it to 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from stabilize.monitors.events import ROLLBACK, WARN, Event, StepStats
from stabilize.validate import check_choice, check_positive

ACTIONS = ("warn", "rollback")


def loglinear_forecast(logs: list[float], target: float) -> tuple[float, float, float]:
    """(level, slope, steps left) of a robust line through ``logs`` (log values, one per
    step): the slope is the median of the half-window differences (y[i + h] - y[i]) / h,
    h = n // 2 (each point in at most two pairs: a few wild steps cannot tip it), the level
    the median of the later half's points carried to the last step along it (a decelerating
    rise is not overshot by its steep start). Steps left until the level reaches
    ``target``: 0 past it, inf when not rising."""
    n = len(logs)
    h = n // 2
    slope = statistics.median((logs[i + h] - logs[i]) / h for i in range(n - h))
    level = statistics.median(logs[i] + slope * (n - 1 - i) for i in range(h, n))
    if level >= target:
        return level, slope, 0.0
    return level, slope, (target - level) / slope if slope > 0 else math.inf


@dataclass
class AttnLogitConfig:
    """``monitor.attn_logit``: the attention-logit bound (max|q| max|k| / sqrt(d)), its line
    and its forecast."""

    enabled: bool = True
    """Run this monitor (the bound is then measured every step, not only on log steps)."""
    threshold: float = 1e4
    """The line: Wortsman et al. (2023) saw runs diverge past a max attention logit ~1e4."""
    horizon: int = 100
    """Forecast warning: the crossing is expected within this many steps."""
    window: int = 16
    """Steps in the forecast's robust log-linear fit."""
    forecast_min: float = 100.0
    """No forecast below this bound (a healthy run sits at ~1-20; qk-norm keeps it ~12)."""
    action: str = "warn"
    """warn | rollback, when a block's bound crosses the line (a forecast only warns)."""

    def __post_init__(self):
        for k in ("threshold", "forecast_min"):
            check_positive(f"monitor.attn_logit.{k}", getattr(self, k))
        for k in ("horizon", "window"):
            check_positive(f"monitor.attn_logit.{k}", getattr(self, k), integer=True)
        if self.window < 4:
            raise ValueError(
                f"monitor.attn_logit.window={self.window!r} is not allowed; allowed: >= 4"
            )
        check_choice("monitor.attn_logit.action", self.action, ACTIONS)


class AttnLogitMonitor:
    name = "attn_logit"
    needs = ("attn_logit",)

    @classmethod
    def from_config(cls, name: str, c: AttnLogitConfig) -> AttnLogitMonitor:
        return cls(c)

    def __init__(self, c: AttnLogitConfig | None = None):
        """Built from ``monitor.attn_logit``'s settings (None: the dataclass's defaults)."""
        self.c = c or AttnLogitConfig()
        self.kind = ROLLBACK if self.c.action == "rollback" else WARN
        self.history: dict[str, deque[float]] = {}  # block -> log bound, recent steps
        self.above: set[str] = set()  # past the line (one event per crossing)
        self.warned: set[str] = set()  # forecast given (one per approach)
        self.forecast: dict[str, float] = {}  # block -> steps left (suite.forecast)

    def update(self, stats: StepStats) -> list[Event]:
        c, events = self.c, []
        target = math.log(c.threshold)
        for block, v in stats.attn_logit.items():
            if not (math.isfinite(v) and v > 0):  # not measured (0) or non-finite
                continue
            h = self.history.setdefault(block, deque(maxlen=c.window))
            h.append(math.log(v))
            if v > c.threshold:
                if block not in self.above:
                    self.above.add(block)
                    msg = f"{block}: attention logit bound {v:.4g} crossed {c.threshold:g}"
                    events.append(self._event(self.kind, stats.step, block, msg, v, c.threshold))
                continue
            self.above.discard(block)
            if len(h) < c.window:
                continue
            level, slope, left = loglinear_forecast(list(h), target)
            self.forecast[block] = left
            if left >= c.horizon:
                self.warned.discard(block)
            elif math.exp(level) >= c.forecast_min and block not in self.warned:
                self.warned.add(block)
                msg = (
                    f"{block}: attention logit bound {v:.4g} rising "
                    f"x{math.exp(slope):.4f}/step; crosses {c.threshold:g} in ~{left:.0f} steps"
                )
                events.append(self._event(WARN, stats.step, block, msg, left, float(c.horizon)))
        return events

    @staticmethod
    def _event(kind, step, block, msg, value, threshold) -> Event:
        return Event(kind, "attn_logit", step, msg, layer=block, value=value, threshold=threshold)

    def state_dict(self) -> dict:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "above": sorted(self.above),
            "warned": sorted(self.warned),
        }

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: deque(v, maxlen=self.c.window) for k, v in state["history"].items()}
        self.above, self.warned = set(state["above"]), set(state["warned"])


@dataclass
class AttnEntropyConfig:
    """``monitor.attn_entropy``: the lowest attention-head entropy, on log steps."""

    enabled: bool = True
    """Run this monitor."""
    floor: float = 0.05
    """Warn when a block's lowest head entropy (nats, mean over query rows) falls below."""

    def __post_init__(self):
        check_positive("monitor.attn_entropy.floor", self.floor)


class AttnEntropyMonitor:
    name = "attn_entropy"
    needs = ("attn_entropy",)

    @classmethod
    def from_config(cls, name: str, c: AttnEntropyConfig) -> AttnEntropyMonitor:
        return cls(c)

    def __init__(self, c: AttnEntropyConfig | None = None):
        """Built from ``monitor.attn_entropy``'s settings (None: the dataclass's defaults)."""
        self.c = c = c or AttnEntropyConfig()
        self.floor = c.floor
        self.below: set[str] = set()  # one warning per fall (re-armed above 10x the floor)

    def update(self, stats: StepStats) -> list[Event]:
        events = []
        if not math.isfinite(stats.loss):  # a non-finite model: the NaN is the verdict
            return events
        for block, e in stats.attn_entropy.items():  # empty except on log steps
            if math.isnan(e):  # not a collapse: a NaN head, which the NaN monitor reports
                continue
            if e < self.floor:
                if block not in self.below:
                    self.below.add(block)
                    msg = (
                        f"{block}: lowest attention-head entropy {e:.3g} nats is below "
                        f"{self.floor:g} (entropy collapse)"
                    )
                    events.append(
                        Event(
                            WARN,
                            "attn_entropy",
                            stats.step,
                            msg,
                            layer=block,
                            value=e,
                            threshold=self.floor,
                        )
                    )
            elif e > 10 * self.floor:  # hysteresis: a collapsed head flickers around the floor
                self.below.discard(block)
        return events

    def state_dict(self) -> dict:
        return {"below": sorted(self.below)}

    def load_state_dict(self, state: dict) -> None:
        self.below = set(state["below"])


@dataclass
class LogZConfig:
    """``monitor.log_z``: the output logits' log-partition log Z (logsumexp), every step."""

    enabled: bool = True
    """Run this monitor (log Z is measured every step)."""
    threshold: float = 50.0
    """Warn when the step's largest |log Z| passes this (nats); ``model.z_loss`` pulls it
    to 0."""

    def __post_init__(self):
        check_positive("monitor.log_z.threshold", self.threshold)


class LogZMonitor:
    name = "log_z"
    needs = ("log_z",)

    @classmethod
    def from_config(cls, name: str, c: LogZConfig) -> LogZMonitor:
        return cls(c)

    def __init__(self, c: LogZConfig | None = None):
        """Built from ``monitor.log_z``'s settings (None: the dataclass's defaults)."""
        self.c = c = c or LogZConfig()
        self.threshold = c.threshold
        self.above = False

    def update(self, stats: StepStats) -> list[Event]:
        v = stats.log_z.get("max")
        # not measured, or non-finite: the NaN monitor's verdict, not a z-loss case
        if v is None or not math.isfinite(v) or not math.isfinite(stats.loss):
            return []
        if abs(v) > self.threshold:
            if not self.above:
                self.above = True
                msg = (
                    f"output log Z reached {v:.4g} (mean {stats.log_z['mean']:.4g}); line "
                    f"{self.threshold:g}: the z-loss (model.z_loss, remedy z_loss) pulls it to 0"
                )
                return [Event(WARN, "log_z", stats.step, msg, value=v, threshold=self.threshold)]
        else:
            self.above = False
        return []

    def state_dict(self) -> dict:
        return {"above": self.above}

    def load_state_dict(self, state: dict) -> None:
        self.above = state["above"]
