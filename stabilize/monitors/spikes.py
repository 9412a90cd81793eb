"""Robust spike detection for a scalar series (loss, grad norm).

Median and MAD over a rolling window: one outlier moves neither, unlike mean and std
(a 100x spike inflates the std it is judged against). Non-finite values never enter the
window: they are the NaN monitor's business, and one inf would poison every later median.
A value is a spike when (value - median) / (1.4826 * MAD) > threshold, 1.4826 making the
MAD a consistent estimate of sigma for Gaussian noise; and only above the median (a
sudden drop in loss is not a fault).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from stabilize.monitors.events import ROLLBACK, Event

MAD_TO_SIGMA = 1.4826


class SpikeDetector:
    def __init__(
        self,
        name: str,
        window: int = 100,
        warmup: int = 20,
        threshold: float = 6.0,
        min_ratio: float = 1.5,
        kind: str = ROLLBACK,
    ):
        """``min_ratio``: also require value > min_ratio * median, so that a near-constant
        series (MAD ~ 0) does not call every wiggle a spike."""
        if warmup > window:
            raise ValueError(
                f"monitor.{name}.warmup={warmup} is not allowed; must be <= window={window}"
            )
        self.name, self.window, self.warmup = name, window, warmup
        self.threshold, self.min_ratio, self.kind = threshold, min_ratio, kind
        self.values: deque[float] = deque(maxlen=window)

    def score(self, value: float) -> float | None:
        """Robust z-score of ``value`` against the window, or None during warm-up."""
        if len(self.values) < self.warmup:
            return None
        med = statistics.median(self.values)
        mad = statistics.median(abs(v - med) for v in self.values)
        sigma = max(MAD_TO_SIGMA * mad, 1e-12 * max(abs(med), 1.0))
        return (value - med) / sigma

    def update(self, step: int, value: float | None) -> list[Event]:
        if value is None or not math.isfinite(value):
            return []
        events = []
        z = self.score(value)
        if z is not None and z > self.threshold:
            med = statistics.median(self.values)
            if value > self.min_ratio * med:
                events.append(
                    Event(
                        self.kind,
                        self.name,
                        step,
                        f"{self.name} spike: {value:.4g} is {z:.1f} robust sigmas above the "
                        f"median {med:.4g} of the last {len(self.values)} steps",
                        value=value,
                        threshold=self.threshold,
                        extra={"median": med, "z": z},
                    )
                )
                return events  # a spike does not enter the window it is judged against
        self.values.append(value)
        return events

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=self.window)
