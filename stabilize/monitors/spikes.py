"""Robust spike detection for a scalar series (loss, grad norm).

Median and MAD over a rolling window: one outlier moves neither, unlike mean and std
(a 100x spike inflates the std it is judged against). A value is judged against the window
before it enters it, and then enters it whatever the verdict, so the window is always the
last ``window`` finite values and an event's "median of the last N steps" is that. A spike
kept out for good (as before) froze the baseline: after a lasting level shift (a memorizing
run's loss 0.006 -> 8.1, still 0.1-1 for 400 steps) every later step was judged against the
pre-shift median, 451 verdicts for one spike; now a lasting shift is the baseline once it
fills half the window. Non-finite values never enter the window: they are the NaN monitor's
business, and one inf would poison every later median.
A value is a spike when (value - median) / (1.4826 * MAD) > threshold, 1.4826 making the
MAD a consistent estimate of sigma for Gaussian noise; and only above the median (a
sudden drop in loss is not a fault).

A flat window (a constant series: a dead network's grad norm of exactly 0, a loss stuck at
ln 256) has MAD 0, and dividing by it reported "1.5e11 robust sigmas". sigma is
floored: max(1.4826 MAD, REL_FLOOR |median|, ABS_FLOOR). REL_FLOOR = 1% sits above the
rounding of a 16-bit value (fp16 2^-11, bf16 2^-9 relative), so a few ulps of jitter is never
many sigmas, and far below the min_ratio gap (50% at the default 1.5): a value that passes
min_ratio over a flat window scores at least (min_ratio - 1) / REL_FLOOR = 50 sigmas, a finite
score that still clears any usual threshold; the event then says the sigma was floored.
ABS_FLOOR keeps a series at exactly 0 finite.

A series with a trend (a loss early in a run falls by 2 nats in 30 steps) has a window MAD
made of the trend, not the noise: a 3x loss jump at step 30 scored under 8 sigmas, and a
warm-up of 50 steps hid it anyway. With ``trend_robust`` (the loss's detector) sigma is
estimated from the successive differences instead, 1.4826 MAD(diff) / sqrt(2), which a
smooth trend does not inflate and which equals sigma for noise without one; the warm-up is
then a few values, enough for a median of differences. Values below the median (a descent)
are never spikes either way.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from stabilize.monitors.events import ROLLBACK, WARN, Event, StepStats
from stabilize.validate import check_choice, check_positive

MAD_TO_SIGMA = 1.4826
REL_FLOOR = 0.01  # sigma >= 1% of |median| (see above)
ABS_FLOOR = 1e-6  # ... and >= 1e-6: a window of zeros still gives a finite score


class SpikeDetector:
    enter_flagged: ClassVar[bool] = True
    """A flagged value enters the window after its verdict (module docstring); False keeps
    it out for good, the rule before (the spike evaluation's labels keep it: their
    definition does not move with the monitor's)."""

    def __init__(self, c: SpikeConfig, name: str | None = None):
        """Built from a spike section's settings (``GradSpikeConfig``, ``LossSpikeConfig``:
        ``window``, ``warmup``, ``threshold``, ``min_ratio``, ``action``, and the class's
        ``trend_robust``); ``name``: the section its events are named by (default
        ``c.section``). ``min_ratio``: also require value > min_ratio * median, so that a
        near-constant series (MAD ~ 0) does not call every wiggle a spike."""
        name = c.section if name is None else name
        window, warmup = c.window, c.warmup
        if warmup > window:
            raise ValueError(
                f"monitor.{name}.warmup={warmup} is not allowed; must be <= window={window}"
            )
        self.name, self.window, self.warmup = name, window, warmup
        self.threshold, self.min_ratio = c.threshold, c.min_ratio
        self.kind = ROLLBACK if c.action == "rollback" else WARN
        self.trend_robust = c.trend_robust
        self.values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the window's values in order: the median is O(1)

    def median(self) -> float:
        v, n = self._sorted, len(self._sorted)
        return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

    def score(self, value: float) -> float | None:
        """Robust z-score of ``value`` against the window, or None during warm-up."""
        if len(self.values) < self.warmup:
            return None
        med = self.median()
        return (value - med) / self.sigma(med)[0]

    def sigma(self, med: float) -> tuple[float, bool]:
        """(the window's robust sigma, whether the floor set it): a flat window's MAD is 0
        (module docstring)."""
        if self.trend_robust and len(self.values) > 2:
            v = list(self.values)
            diffs = [b - a for a, b in zip(v, v[1:], strict=False)]
            dmed = statistics.median(diffs)
            raw = MAD_TO_SIGMA * statistics.median(abs(d - dmed) for d in diffs) / math.sqrt(2)
        else:
            raw = MAD_TO_SIGMA * statistics.median(abs(v - med) for v in self.values)
        floor = max(REL_FLOOR * abs(med), ABS_FLOOR)
        return max(raw, floor), raw < floor

    def _append(self, value: float) -> None:
        if len(self.values) == self.values.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.values[0])]
        self.values.append(value)
        bisect.insort(self._sorted, value)

    def update(self, step: int, value: float | None) -> list[Event]:
        if value is None or not math.isfinite(value):
            return []
        events = []
        # Both tests must pass; the ratio against the (kept sorted) median is the cheap one,
        # so the MAD is only computed for a value already min_ratio x above the median.
        n = len(self.values)
        if n and n >= self.warmup and value > self.min_ratio * (med := self.median()):
            sigma, floored = self.sigma(med)
            z = (value - med) / sigma
            if z > self.threshold:
                flat = f" (flat window: sigma floored at {sigma:.3g})" if floored else ""
                events.append(
                    Event(
                        self.kind,
                        self.name,
                        step,
                        f"{self.name} spike: {value:.4g} is {z:.1f} robust sigmas above the "
                        f"median {med:.4g} of the last {len(self.values)} steps{flat}",
                        value=value,
                        threshold=self.threshold,
                        extra={"median": med, "z": z, "sigma": sigma, "floored": floored},
                    )
                )
                if not self.enter_flagged:
                    return events
        self._append(value)  # judged first, then part of the last ``window`` steps
        return events

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=self.window)
        self._sorted = sorted(self.values)


@dataclass
class SpikeConfig:
    """One spike detector on one series; each section that runs one has its subclass
    (``GradSpikeConfig``, ``LossSpikeConfig``): its own defaults, and its own key in errors.
    ``warmup`` and ``threshold`` have no default here: each section sets its own."""

    section: ClassVar[str] = "spike"
    """The ``monitor.<section>`` the settings are read from (named by every error)."""
    trend_robust: ClassVar[bool] = False
    """Estimate sigma from successive differences (module docstring): a falling loss early
    in a run does not inflate it; a grad norm falls less, and keeps the window's MAD."""

    enabled: bool = True
    """Run this monitor."""
    window: int = 100
    """Steps in the rolling median/MAD window."""
    warmup: int = field(kw_only=True)
    """No verdict before the window holds this many values."""
    threshold: float = field(kw_only=True)
    """Robust z-score (median / MAD) above which a value is a spike ..."""
    min_ratio: float = 1.5
    """... and only when value > min_ratio x median."""
    action: str = "rollback"
    """warn | rollback: the event a spike raises."""

    def __post_init__(self):
        key = f"monitor.{self.section}"
        for k in ("window", "warmup"):
            check_positive(f"{key}.{k}", getattr(self, k), integer=True)
        check_positive(f"{key}.threshold", self.threshold)
        check_positive(f"{key}.min_ratio", self.min_ratio)
        check_choice(f"{key}.action", self.action, ("warn", "rollback"))


@dataclass
class GradSpikeConfig(SpikeConfig):
    """``monitor.grad_spike``: the pre-clip gradient norm's spikes. Clipping absorbs most,
    and small batches have real 10-20x ones (measured on the tiny model): it warns by
    default. A loss spike is the PaLM case."""

    section: ClassVar[str] = "grad_spike"
    warmup: int = 50
    threshold: float = 8.0
    min_ratio: float = 4.0
    action: str = "warn"


@dataclass
class LossSpikeConfig(SpikeConfig):
    """``monitor.loss_spike``: the loss's spikes."""

    section: ClassVar[str] = "loss_spike"
    trend_robust: ClassVar[bool] = True
    warmup: int = 8
    """Its sigma comes from step-to-step differences (``trend_robust``): a falling loss does
    not blind it, and a few values suffice (module docstring)."""
    threshold: float = 8.0


class SpikeMonitor:
    """A ``SpikeDetector`` on one scalar StepStats series (``grad_norm``, ``loss``)."""

    def __init__(self, detector: SpikeDetector, series: str):
        self.detector, self.series = detector, series
        self.name = detector.name
        self.needs = (series,)

    @classmethod
    def from_config(cls, name: str, c: SpikeConfig, *, series: str) -> SpikeMonitor:
        return cls(SpikeDetector(c, name), series)

    @property
    def kind(self) -> str:
        return self.detector.kind

    def update(self, stats: StepStats) -> list[Event]:
        return self.detector.update(stats.step, getattr(stats, self.series))

    def state_dict(self) -> dict:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state)
