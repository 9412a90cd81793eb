"""When will a layer cross a 16-bit reduction's line? A per-step forecast with a noise floor
learned from the run.

Two lines, both in log space as ``y = log(value / line)`` (0 at the line; growth is
multiplicative, so a constant rate is a straight line):

- ``abs``: |x| max against 256 (one fp16 square overflows: outlier features);
- ``rms``: a norm's largest row RMS against 255.94 / sqrt(D) (the fp16 sum of D squares
  overflows: growth spread over all channels, which crosses this line long before 256).

Each unit (layer, line) is modelled as a random walk with drift: ``y_{t+h} = y_t + mu h +
noise``, the noise's one-step scale ``sigma`` learned from the unit's own increments. Every
step (the values are already on the host; a few small numpy calls for all units at once):

- ``mu``: the Theil-Sen slope over the last ``window`` points (robust: one spike does not
  move it; Sen 1968), from ``min_points`` points on, so the forecast works from the first
  steps;
- ``sigma``: 1.4826 x the median absolute deviation of the unit's increments from the slope
  fitted when each was made, over the last ``noise_window`` steps: the unit's own
  fluctuation, a noise floor that follows the run instead of a fixed level;
- the crossing is *significant* within ``horizon`` steps when even the pessimistic path
  ``y - z sigma + (mu - z se) h`` reaches 0 by then (``se``: the slope's standard error
  over the window; the margin is one z sigma at any distance, chosen on the eval's runs
  over a random walk's z sigma sqrt(h): docs/forecast.md). A layer that only fluctuates,
  or grows slowly against its own noise, is not warned; a steady climb is, however low it starts;
- climb: no crossing is warned that needs more rise (in log) than the layer has made since
  its lowest point, x ``climb`` (early training's first rise mostly levels off: a layer at
  1/7 of the line that has tripled is not projected to climb 7x);
- reach: no crossing is warned further ahead than ``reach`` x the steps seen so far (a
  projection reaches at most twice as far as its data by default): the first points of a
  run rise fast and mostly level off (eval: every early false warning came at steps 4-7);
- deceleration: the slope used is the smaller of the window's and its recent half's
  (``speedup``, off by default: the recent half's where it is that many times the
  older half's), and
  (``damped``) the rate is projected to keep decaying as it did from the older half to the
  recent one (a damped trend), so early training's levelling-off is not extrapolated.

The monitor (activations.py) warns per layer, on whichever line comes first: either
overflows a 16-bit reduction of that tensor.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from stabilize.validate import check_positive, check_range

Unit = tuple[str, str]  # (layer, "abs" | "rms")
_PAIRS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # W -> (i, j, j - i)
_MAD = 1.4826  # MAD -> standard deviation for Gaussian noise
MIN_SIGMA = 0.01  # the one-step noise is never taken below this (in log: a 1% fluctuation)


@dataclass
class ForecastConfig:
    """``monitor.activation.forecast``: when a layer will cross its line (``LineForecaster``,
    stabilize/monitors/forecast.py) and when that is warned (the activation monitor)."""

    horizon: int = 40
    """A crossing significant within this many steps is warned (both lines: |x| max vs
    ``monitor.activation.threshold`` and row RMS vs 255.94/sqrt(D))."""
    window: int = 8
    """Steps in the robust (Theil-Sen) fit, refitted every step."""
    start: int = 4
    """Points a layer needs before its first forecast."""
    z: float = 3.0
    """How many of the layer's own noise sigmas (learned from its step-to-step increments)
    the projected crossing must clear to be warned."""
    noise_window: int = 32
    """Steps of increments the noise sigma is learned over."""
    reach: float = 2.0
    """Warn no further ahead than this many times the steps a layer has been seen."""
    climb: float = 1.0
    """Warn only of a crossing that needs no more rise (in log) than this many times what the
    layer has risen since its lowest point (0: off): early training's first rise mostly
    levels off."""
    damped: bool = True
    """Project a slowing rate as slowing (a damped trend: the recent half-window's rate
    against the older half's), so early training's levelling-off is not extrapolated."""
    speedup: float = 0.0
    """Project a rate that has sped up: where the recent half-window's slope is more than
    this many times the older half's (or the older half fell), the recent one is used (0:
    off: the smaller of the window's slope and the recent half's, as early training's first
    rise mostly levels off). Not a default: docs/forecast.md has its trade-off."""
    slow_steps: float = 6.0
    """The warning gives two distances: ~N x (1 + this / step), as natural growth slows (the
    one it leads with, the event's value), and ~N steps at the current rate (the projection):
    early in training it slows with the step (on the eval's natural runs the real distance
    was 2.0x the projection's for warnings up to step 8, 1.4x at steps 9-20, 1.2x later),
    and 6 is the value that calibrates the core set's (5.8; docs/forecast.md). A steady
    drift arrives at ~N. It changes no decision (0: the two are the same)."""
    confirm: int = 1
    """Steps in a row a crossing must be significant before it is warned."""
    within: float = 20.0
    """Warn only when the distance the warning leads with (the slowed one) is at most this
    many steps (0: any within ``horizon``): far projections of early growth mostly level
    off before the line. Chosen at 20 on holdout3 and scored on holdout4, recorded before
    it; the default since the 141-run set was scored with it (docs/forecast.md)."""
    rate_noise: float = 0.0
    """How much of the rate's own step-to-step drift the pessimistic path allows for (0: off,
    the rate is known up to its fit's error; 1: a rate that wandered by tau a step may
    wander as much ahead, ~tau h^1.5 in h steps). docs/forecast.md has the trade-off."""

    def __post_init__(self) -> None:
        check_positive("monitor.activation.forecast.horizon", self.horizon, integer=True)
        check_positive("monitor.activation.forecast.window", self.window, integer=True)
        check_positive("monitor.activation.forecast.start", self.start, integer=True)
        check_positive("monitor.activation.forecast.z", self.z)
        check_positive("monitor.activation.forecast.noise_window", self.noise_window, integer=True)
        check_positive("monitor.activation.forecast.reach", self.reach)
        check_range("monitor.activation.forecast.climb", self.climb, 0.0, 100.0)
        check_range("monitor.activation.forecast.slow_steps", self.slow_steps, 0.0, 1e6)
        check_range("monitor.activation.forecast.speedup", self.speedup, 0.0, 100.0)
        check_positive("monitor.activation.forecast.confirm", self.confirm, integer=True)
        check_range("monitor.activation.forecast.rate_noise", self.rate_noise, 0.0, 100.0)
        check_range("monitor.activation.forecast.within", self.within, 0.0, 1e6)


# A saved config's flat ``monitor.activation`` keys (before the forecast had its own section)
# -> their names in ``monitor.activation.forecast``.
FLAT_KEYS = {
    "horizon": "horizon",
    "window": "window",
    "noise_window": "noise_window",
    **{f"forecast_{k}": k for k in ("start", "z", "reach", "climb", "damped", "speedup",
                                     "slow_steps", "confirm", "within", "rate_noise")},
}  # fmt: skip


def nest_forecast_keys(section: dict) -> dict:
    """A ``monitor.activation`` mapping with any flat forecast key (``FLAT_KEYS``: an older
    bundle's or run dir's config) moved into its ``forecast`` section; a key set both ways
    keeps the nested value."""
    flat = {k: v for k, v in section.items() if k in FLAT_KEYS}
    if not flat:
        return section
    out = {k: v for k, v in section.items() if k not in FLAT_KEYS}
    nested = out.get("forecast")
    nested = dict(nested) if isinstance(nested, dict) else {}
    out["forecast"] = {**{FLAT_KEYS[k]: v for k, v in flat.items()}, **nested}
    return out


def theil_sen_slope(y: np.ndarray) -> np.ndarray:
    """Median of pairwise slopes along the last axis (steps equally spaced).

    y: [series, W]. Robust to outliers: up to ~29% of the points can be wild without moving
    the estimate (Sen 1968). Returns [series]. The pair indices are made once per W, the
    slopes computed in one buffer and the median taken by an in-place partition (the same
    numbers as ``np.median``, ~2.5x cheaper).
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


@dataclass(frozen=True)
class Projection:
    """A unit's forecast: ``level`` and ``slope`` in log(value / line) (per step), ``sigma``
    its learned one-step noise, ``left`` the central estimate of steps to the line (inf: not
    rising), ``within`` the first h at which the pessimistic path reaches the line (inf:
    not within the horizon), ``phi`` the rate's decay per step (1: steady)."""

    level: float
    slope: float
    sigma: float
    left: float
    within: float
    phi: float = 1.0

    @property
    def significant(self) -> bool:
        return math.isfinite(self.within)


def first_significant(
    level: float,
    slope: float,
    sigma: float,
    z: float,
    horizon: float,
    phi: float = 1.0,
    tau: float = 0.0,
) -> float:
    """The first h in [0, horizon] where the pessimistic path reaches 0, else inf.

    The path is level - z sqrt(sigma^2 + tau^2 h^3 / 3) + slope S(h): the layer's trend less
    z of its one-step fluctuations. The margin does not widen with h as a random walk's z
    sigma sqrt(h) would: that is an empirical choice, not a noise model (the layers'
    fluctuation does wander, near a random walk's; docs/forecast.md), made because sigma,
    learned from increments around a lagging slope, already holds early growth's curvature,
    and the sqrt(h) margin on it left slow steady climbs unwarned; on the eval's holdout it
    raised warnable recall 0.67 -> 0.86 (0.84 with ``climb``). S(h) = h for a steady rate
    (phi = 1) and phi (1 - phi^h) / (1 - phi) for one that decays by phi per step (a damped
    trend, Gardner & McKenzie 1985). ``tau``: the rate's own step-to-step drift (a local
    linear trend, Harvey 1989: a rate that wanders by tau a step moves the level by ~tau
    h^1.5 / sqrt(3) in h steps), so a long extrapolation of a rate that has not held needs
    more margin than a short one. A layer that is not rising is not warned, however near it
    sits (its noise alone is not a forecast). For phi = 1 and tau = 0 the crossing is (z
    sigma - level) / slope; otherwise the path is read step by step."""
    if level >= 0:
        return 0.0
    if slope <= 0:
        return math.inf
    margin = level - z * sigma
    if phi >= 1.0 and tau <= 0.0:
        h = max(0.0, -margin / slope)
        return h if h <= horizon else math.inf
    h = np.arange(1, int(horizon) + 1, dtype=np.float64)
    rise = slope * h if phi >= 1.0 else slope * phi * (1 - phi**h) / (1 - phi)
    path = level + rise - z * np.sqrt(sigma * sigma + tau * tau * h**3 / 3.0)
    hit = np.flatnonzero(path >= 0)
    return float(h[hit[0]]) if hit.size else math.inf


def steps_left(level: float, slope: float, phi: float = 1.0) -> float:
    """The central path's crossing: -level / slope, or for a damped rate the h where
    slope phi (1 - phi^h) / (1 - phi) = -level (inf when its asymptote stays below)."""
    if level >= 0:
        return 0.0
    if slope <= 0:
        return math.inf
    if phi >= 1.0:
        return -level / slope
    rest = 1 + level * (1 - phi) / (slope * phi)  # = phi^h
    return math.log(rest) / math.log(phi) if rest > 0 else math.inf


class LineForecaster:
    """Per-unit history and learned noise; ``update`` once per step with every unit's
    (value, line); returns the units' projections."""

    def __init__(self, c: ForecastConfig | None = None):
        """Built from ``monitor.activation.forecast`` (None: its defaults): ``horizon``,
        ``window``, ``start`` (at least 3 and at most ``window`` points), ``z``,
        ``noise_window``, ``damped``, ``reach``, ``rate_noise``, ``climb`` and ``speedup``."""
        c = c or ForecastConfig()
        self.horizon, self.window, self.z = c.horizon, c.window, c.z
        self.damped, self.reach = c.damped, c.reach
        self.rate_noise, self.climb = c.rate_noise, c.climb
        self.speedup = c.speedup
        self.min_points = max(3, min(c.start, c.window))
        self.noise_window, self.min_sigma = c.noise_window, MIN_SIGMA
        self.hist: dict[Unit, deque[float]] = {}
        self.dev: dict[Unit, deque[float]] = {}  # |increment - slope| as each was seen
        self.slope: dict[Unit, float] = {}  # last fitted slope per unit
        self.rates: dict[Unit, deque[float]] = {}  # the fitted slopes, step by step
        self.seen: dict[Unit, int] = {}  # points seen per unit (the reach grows with it)
        self.low: dict[Unit, float] = {}  # the lowest y seen per unit (the climb so far)

    def update(self, values: dict[Unit, tuple[float, float]]) -> dict[Unit, Projection]:
        ready: dict[int, list[Unit]] = {}  # points in the window -> units
        for unit, (value, line) in values.items():
            if not (math.isfinite(value) and value > 0):
                continue  # not a measurement (an overflowed statistic is inf: past the line)
            y = math.log(value / line)
            h = self.hist.get(unit)
            if h is None:
                h = self.hist[unit] = deque(maxlen=self.window)
                self.dev[unit] = deque(maxlen=self.noise_window)
            if h and unit in self.slope:
                self.dev[unit].append(abs(y - h[-1] - self.slope[unit]))
            h.append(y)
            self.seen[unit] = self.seen.get(unit, 0) + 1
            self.low[unit] = min(y, self.low.get(unit, y))
            if len(h) >= self.min_points:
                ready.setdefault(len(h), []).append(unit)
        out: dict[Unit, Projection] = {}
        for n, units in ready.items():
            y = np.array([self.hist[u] for u in units])  # [units, n] of log(value / line)
            slope = theil_sen_slope(y)
            m = n // 2
            if n >= 6:  # the older and the recent half: how fast the rate is changing
                old, new = theil_sen_slope(y[:, : n - m]), theil_sen_slope(y[:, m:])
            else:
                old = new = slope
            s_all = np.minimum(slope, new)
            if self.speedup > 0:  # a rate that sped up is projected at its recent value
                s_all = np.where((new > 0) & (new > self.speedup * old), new, s_all)
            # the level now: the fit's median intercept, read at the last point (all units of
            # the group in one call: a median per unit was most of the refit's time)
            levels = np.median(y - s_all[:, None] * np.arange(n), axis=1) + s_all * (n - 1)
            for k, u in enumerate(units):
                self.slope[u] = s = float(s_all[k])
                rates = self.rates.get(u)
                if rates is None:
                    rates = self.rates[u] = deque(maxlen=self.noise_window)
                rates.append(s)
                phi = 1.0
                if self.damped and 0 < new[k] < old[k] * (1 - 1e-9):
                    # the rate fell from old to new over the halves' distance (n - m) steps
                    # (rates equal but for rounding are steady: a phi of 1 - 1e-16 makes the
                    # damped crossing's log(rest) / log(phi) noise)
                    phi = float((new[k] / old[k]) ** (1.0 / (n - m)))
                out[u] = self._project(u, float(levels[k]), s, phi, y[k])
        return out

    def _project(self, u: Unit, level: float, s: float, phi: float, y: np.ndarray) -> Projection:
        dev = self.dev[u]
        if len(dev) >= self.min_points:
            sigma = _MAD * statistics.median(dev)  # <= noise_window floats: Python's is cheaper
        else:  # too few increments seen against a slope yet: the window's own spread
            inc = np.diff(y)
            sigma = _MAD * float(np.median(np.abs(inc - np.median(inc))))
        sigma = max(sigma, self.min_sigma)
        # the slope's own uncertainty: a least-squares slope over n points with noise sigma
        # has standard error sigma sqrt(12 / (n^3 - n)); the pessimistic path takes z of them
        n = len(y)
        s_low = s - self.z * sigma * math.sqrt(12.0 / (n**3 - n))
        # no further ahead than ``reach`` times the steps seen: early training's first few
        # points say little about 40 steps on (its fast rise mostly levels off)
        ahead = min(self.horizon, self.reach * self.seen[u])
        tau = 0.0
        rates = self.rates[u]
        if self.rate_noise > 0 and len(rates) >= 3:  # the rate's step-to-step drift, robust
            d = np.diff(np.fromiter(rates, np.float64))
            tau = self.rate_noise * _MAD * float(np.median(np.abs(d - np.median(d))))
        within = first_significant(level, s_low, sigma, self.z, ahead, phi, tau)
        if self.climb > 0 and -level > self.climb * (y[-1] - self.low[u]):
            within = math.inf  # more rise to the line than the layer has made so far
        return Projection(level, s, sigma, steps_left(level, s, phi), within, phi)

    def state_dict(self) -> dict:
        key = "|".join
        return {
            "hist": {key(u): list(h) for u, h in self.hist.items()},
            "dev": {key(u): list(d) for u, d in self.dev.items()},
            "slope": {key(u): s for u, s in self.slope.items()},
            "seen": {key(u): n for u, n in self.seen.items()},
            "rates": {key(u): list(r) for u, r in self.rates.items()},
            "low": {key(u): v for u, v in self.low.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        def unit(k: str) -> Unit:
            layer, _, line = k.rpartition("|")
            return (layer, line)

        self.hist = {unit(k): deque(v, maxlen=self.window) for k, v in state["hist"].items()}
        self.dev = {unit(k): deque(v, maxlen=self.noise_window) for k, v in state["dev"].items()}
        self.slope = {unit(k): float(s) for k, s in state["slope"].items()}
        self.seen = {unit(k): int(n) for k, n in state["seen"].items()}
        rates = state.get("rates", {})  # an older checkpoint: the drift is learned again
        self.rates = {unit(k): deque(v, maxlen=self.noise_window) for k, v in rates.items()}
        # an older checkpoint: the lowest point seen is the oldest one still held
        low = state.get("low") or {k: min(v) for k, v in state["hist"].items() if v}
        self.low = {unit(k): float(v) for k, v in low.items()}
