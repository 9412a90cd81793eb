"""The activation forecast on synthetic per-step series whose crossings are
computed in float64 here, its silence where no 16-bit reduction can overflow, and its scores."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.forecast_score import RunScore, first_crossings, row_metrics
from stabilize.monitors import ActivationConfig, ActivationMonitor, StepStats
from stabilize.monitors.activations import resolve_line
from stabilize.monitors.forecast import ForecastConfig, LineForecaster, first_significant

from conftest import compose_run

D = 128
RMS_LINE = math.sqrt(65504.0) / math.sqrt(D)  # 22.62: the fp16 sum of 128 squares overflows


@functools.cache
def users() -> ActivationConfig:
    """``monitor.activation`` as users run it where the line is a danger: composed as the CLI
    does for experiment=nan_repro (fp16 autocast, norms reduced in fp16), so ``line=auto``
    resolves to fp16_square and the forecast runs."""
    c = compose_run("unused", ["experiment=nan_repro"]).monitor.activation
    assert c.line == "fp16_square"
    return c


def monitor(**changes) -> ActivationMonitor:
    """The monitor users run (``users()``), with exactly the changes a test names to its
    forecast (``monitor.activation.forecast``)."""
    c = users()
    return ActivationMonitor(replace(c, forecast=replace(c.forecast, **changes)))


def series(n, start, rate, noise, seed=0, plateau=None):
    """Geometric growth from ``start`` at ``rate`` per step (levelling off at ``plateau``),
    with multiplicative noise of one-step sd ``noise``, in float64."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1, dtype=np.float64)
    y = math.log(start) + math.log(rate) * (t - 1)
    if plateau is not None:  # a smooth approach to log(plateau): early training's levelling
        top = math.log(plateau)
        y = top - np.logaddexp(0.0, top - y)
    return np.exp(y + noise * rng.standard_normal(n))


def run_monitor(mon, abs_vals=None, rms_vals=None):
    """Feed one layer's series; returns the forecast events as (step, line)."""
    out = []
    n = len(abs_vals if abs_vals is not None else rms_vals)
    for i in range(n):
        s = StepStats(step=i + 1, loss=1.0, norm_dim={"h.1.ln_1": D})
        if abs_vals is not None:
            s.act_max = {"h.1.ln_1": float(abs_vals[i])}
        if rms_vals is not None:
            s.norm_rms_max = {"h.1.ln_1": float(rms_vals[i])}
            s.act_max.setdefault("h.1.ln_1", 3.0 * float(rms_vals[i]))
        out += [(e.step, e.extra["line"]) for e in mon.update(s) if e.monitor == "forecast"]
    return out


def crossing(values, line) -> int:
    """First 1-based step past the line, in float64."""
    return int(np.argmax(np.asarray(values, dtype=np.float64) > line)) + 1


@pytest.mark.parametrize("seed", range(5))
def test_outlier_growth_is_warned_ahead_of_the_256_crossing(seed):
    v = series(60, 2.0, 1.15, 0.03, seed)  # x1.15 per step: 256 near step 36
    c = crossing(v, 256.0)
    warned = run_monitor(monitor(), abs_vals=v)
    assert warned and warned[0][1] == "abs"
    assert 5 <= c - warned[0][0] <= 40  # ahead by at least 5 steps, within the horizon


@pytest.mark.parametrize("seed", range(5))
def test_spread_growth_is_warned_on_the_rms_line_before_any_element_reaches_256(seed):
    """Growth over all channels: the row RMS crosses 255.94/sqrt(D) while |x| max (3x the
    RMS here) is still far below 256; the RMS line is the one warned, early enough."""
    rms = series(40, 0.05, 1.35, 0.05, seed)
    c = crossing(rms, RMS_LINE)
    assert 3.0 * rms[c - 1] < 256.0
    warned = run_monitor(monitor(), rms_vals=rms)
    rms_warn = [s for s, line in warned if line == "rms"]
    assert rms_warn and c - rms_warn[0] >= 5


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_layer_at_a_high_level_is_not_warned(seed):
    """|x| max 150 with 15% step-to-step noise: the old fixed floor (8) warned on such layers;
    the noise learned from the layer's own increments keeps it quiet."""
    v = series(200, 150.0, 1.0, 0.15, seed)
    assert (v < 256).all()
    assert run_monitor(monitor(), abs_vals=v) == []


@pytest.mark.parametrize(
    "precision, reduction", [("fp32", "fp32"), ("fp16-mixed", "fp32"), ("bf16-mixed", "bf16")]
)
def test_silent_where_no_16_bit_reduction_can_overflow_unless_asked(precision, reduction):
    v = series(40, 2.0, 1.3, 0.02)
    quiet = ActivationMonitor.from_config(
        "a", resolve_line(ActivationConfig(), precision, reduction)
    )
    assert run_monitor(quiet, abs_vals=v, rms_vals=v / 3) == [] and quiet.forecast == {}
    asked = ActivationConfig(line="fp16_square")
    loud = ActivationMonitor.from_config("a", resolve_line(asked, precision, reduction))
    assert run_monitor(loud, abs_vals=v, rms_vals=v / 3)


def test_first_significant_solves_the_pessimistic_path_by_hand():
    # level -2, slope 0.25, sigma 0.1, z 2: -2 - 0.2 + 0.25 h = 0 -> h = 2.2 / 0.25 = 8.8
    h = first_significant(-2.0, 0.25, 0.1, 2.0, 100)
    assert h == pytest.approx(8.8, rel=1e-12)
    assert first_significant(-2.0, 0.25, 0.1, 2.0, 8) == math.inf  # beyond the horizon
    assert first_significant(-2.0, -0.1, 0.1, 2.0, 100) == math.inf  # falling
    assert first_significant(-0.1, 0.0, 0.1, 2.0, 100) == math.inf  # near, not rising
    # the margin is z sigma at any distance: (0.1 + 0.2) / 0.01 = 30 (a random walk's
    # sqrt(h) margin would want 0.01 h - 0.2 sqrt(h) - 0.1 = 0: h = 417)
    assert first_significant(-0.1, 0.01, 0.1, 2.0, 100) == pytest.approx(30.0, rel=1e-12)
    assert first_significant(0.1, 0.0, 0.1, 2.0, 100) == 0.0  # already past


def test_a_wandering_rate_needs_more_margin_by_hand():
    """tau > 0: the path is level + slope h - z sqrt(sigma^2 + tau^2 h^3 / 3), read step by
    step; the first h where it reaches 0, computed here in float64."""
    level, slope, sigma, z, tau = -2.0, 0.25, 0.1, 2.0, 0.02
    h = np.arange(1, 101, dtype=np.float64)
    path = level + slope * h - z * np.sqrt(sigma**2 + tau**2 * h**3 / 3)
    want = float(h[np.argmax(path >= 0)])
    got = first_significant(level, slope, sigma, z, 100, tau=tau)
    assert got == want and got > first_significant(level, slope, sigma, z, 100)


def test_no_crossing_needs_more_climb_than_the_layer_has_made():
    """``forecast.climb``: a layer that rose x2.7 (1 in log) from its lowest point, now at
    e^-2 of the line and climbing steadily, needs 2 more: not warned at climb 1, warned at 2
    (and with the rule off). Later, once it has climbed more than what is left, it is."""
    t = np.arange(1, 31, dtype=np.float64)
    y = -3.0 + (t - 1) / 9.0  # log(value / line): 1 by step 10, 2 by 19, the line at 28
    v = np.exp(y) * 256.0

    def first(climb):
        f = LineForecaster(replace(users().forecast, climb=climb))
        for i, x in enumerate(v):
            p = f.update({("h.0", "abs"): (float(x), 256.0)})
            if p and p[("h.0", "abs")].significant:
                return i + 1, y[i] - y[0], -y[i]  # step, climb so far, rise left

    step1, climbed, left = first(1.0)
    assert climbed >= left and (y[step1 - 2] - y[0]) < -y[step1 - 2]  # the first step it holds
    step2, _, _ = first(2.0)
    step0, _, _ = first(0.0)
    assert step0 <= step2 < step1


def first_warning(v, **kw):
    """The first forecast warning of a monitor (``monitor(**kw)``) fed ``v`` as one layer's
    |x| max, step by step."""
    mon = monitor(**kw)
    for i, x in enumerate(v):
        for e in mon.update(StepStats(step=i + 1, loss=1.0, act_max={"h.1.ln_1": float(x)})):
            if e.monitor == "forecast":
                return e


def test_the_warning_leads_with_the_slowed_distance_and_a_confirmed_warning_comes_later():
    """The warning leads with (its value is) the slowed distance, N x (1 + s / step) with
    s = ``forecast.slow_steps``, and gives the projection at this rate second;
    ``forecast.confirm`` = k warns k - 1 steps after k = 1 on a steady climb (each with
    ``forecast.within`` off: it would hold the two distances' warnings apart)."""
    v = series(60, 2.0, 1.15, 0.03, 1)

    plain = first_warning(v, slow_steps=0.0, within=0.0)
    scaled = first_warning(v, slow_steps=6.0, within=0.0)
    rate = plain.extra["at_this_rate"]
    assert plain.step == scaled.step and scaled.extra["at_this_rate"] == rate
    k = 1 + 6.0 / scaled.step  # by hand: the step the warning came at
    assert scaled.value == pytest.approx(k * rate) and plain.value == pytest.approx(rate)
    assert (
        f"in ~{k * rate:.0f} steps as natural growth slows, ~{rate:.0f} at this rate"
        in scaled.message
    )
    # a steady climb: the projection at this rate is the calibrated one, in float64
    assert 0.8 <= rate / (crossing(v, 256.0) - plain.step) <= 1.25
    assert first_warning(v, confirm=3, within=0.0).step == plain.step + 2


def test_forecast_within_holds_a_far_warning_until_it_leads_with_that_many_steps():
    """``forecast.within`` = W: no warning whose slowed distance exceeds W; on a steady climb
    the layer is warned later, when its distance has come within W, still ahead of the
    crossing (float64 truth: the series itself)."""
    v = series(60, 2.0, 1.15, 0.03, 1)

    free = first_warning(v, within=0.0)
    assert free.value > 20  # with the rule off this climb is warned further out than 20
    held = first_warning(v, within=10.0)
    assert held.value <= 10 and held.step > free.step
    assert crossing(v, 256.0) - held.step >= 5  # still a 5-step lead
    default = first_warning(v)  # the default holds it until 20 steps
    assert default.value <= 20 and free.step < default.step <= held.step


def test_a_layer_measured_past_a_line_is_not_warned_of_that_crossing():
    """A layer whose row RMS overflowed this step (the statistic is inf) has crossed: its
    |x| max climb, whose fitted level lags below the line, is not warned then. The same
    climb without the overflow is warned at that step (so the check can fail)."""
    v = series(60, 2.0, 1.15, 0.03, 1)
    mon = monitor()
    first = run_monitor(mon, abs_vals=v)[0][0]  # the step the climb is first warned at
    mon = monitor()
    got = []
    for i, x in enumerate(v[:first]):
        st = StepStats(step=i + 1, loss=1.0, act_max={"h.1.ln_1": float(x)},
                       norm_dim={"h.1.ln_1": D})  # fmt: skip
        if i + 1 == first:  # that step, the sum of squares overflowed: the RMS is inf
            st.norm_rms_max = {"h.1.ln_1": math.inf}
        got += [e for e in mon.update(st) if e.monitor == "forecast"]
    assert got == []


def test_a_warning_whose_horizon_passed_is_given_again_when_the_crossing_nears():
    """Once per approach, but a warning expires with its horizon: a climb (x1.15/step) that
    slows to x1.01 for 45 steps, then climbs again, is warned first far ahead (its horizon
    passes with no crossing) and warned again 5-40 steps before the real crossing; state
    round-trips across the gap."""
    rng = np.random.default_rng(0)
    rates = [1.15] * 20 + [1.01] * 45 + [1.15] * 40
    v = np.exp(math.log(2.0) + np.cumsum(np.log(rates)) + 0.005 * rng.standard_normal(105))
    c = crossing(v, 256.0)
    mon = monitor()
    warned = run_monitor(mon, abs_vals=v[:40])
    again = monitor()
    again.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    later = [e.step for i in range(40, len(v)) for e in again.update(
        StepStats(step=i + 1, loss=1.0, act_max={"h.1.ln_1": float(v[i])})
    ) if e.monitor == "forecast"]  # fmt: skip
    steps = [s for s in [s for s, _ in warned] + later if s < c]
    assert len(steps) == 2 and c - steps[0] > 40  # the first warning expired unfulfilled
    assert steps[1] - steps[0] >= 40 and 5 <= c - steps[1] <= 40


def test_an_older_checkpoints_warned_layers_stay_warned_until_their_approach_ends():
    """Before warnings expired, the state held the warned layers as a list: loaded, they stay
    warned on the same steady climb (x1.08/step: warned at step 34, crosses at 65), as they
    did then (with ``forecast.within`` off, as then); the same state read as warned long ago
    would warn again."""
    v = series(100, 2.0, 1.08, 0.03, 1)
    mon = monitor(within=0.0)
    assert run_monitor(mon, abs_vals=v[:40])  # warned within the first 40 steps
    state = mon.state_dict()

    def resumed(warned):
        m = monitor(within=0.0)
        m.load_state_dict({**state, "forecast_warned": warned})
        return [e.step for i in range(40, 60) for e in m.update(
            StepStats(step=i + 1, loss=1.0, act_max={"h.1.ln_1": float(v[i])})
        ) if e.monitor == "forecast"]  # fmt: skip

    assert resumed(sorted(state["forecast_warned"])) == []  # the old format
    assert resumed({"h.1.ln_1": 0}) == [41]  # expired: warned again at once


def test_a_steady_rate_equal_in_both_halves_but_for_rounding_is_not_damped():
    """A straight line in log space: the window's halves have the same slope up to float
    rounding, so the rate is steady (phi 1) and the central crossing is -level / slope by
    hand. A phi of 1 - 1e-16 made log(rest) / log(phi) noise (6.0 for 5.63 here)."""
    f = LineForecaster(ForecastConfig())
    for k in range(8):
        p = f.update({("x", "abs"): (0.3 * 1.1**k, 1.0)}).get(("x", "abs"))
    assert p.phi == 1.0
    assert p.left == pytest.approx(-math.log(0.3 * 1.1**7) / math.log(1.1), rel=1e-9)


def test_forecast_speedup_projects_a_rate_that_sped_up_at_its_recent_value_by_hand():
    """Eight points whose log rises 0.05 a step, then 0.2 a step (the window's halves: four
    and four, exact lines): the recent half's Theil-Sen slope is 0.2 and the older half's
    0.05. Off (the default), the smaller of the window's slope and the recent half's is
    projected, below 0.2; at 1.5 (0.2 > 1.5 x 0.05) the recent 0.2, so the central crossing
    comes sooner; at 5 (0.2 < 5 x 0.05) the rule does not apply."""
    y = [-3.0 + 0.05 * k for k in range(4)]
    y += [y[-1] + 0.2 * (k + 1) for k in range(4)]

    def last(speedup: float):
        f = LineForecaster(ForecastConfig(speedup=speedup))
        for x in y:
            p = f.update({("x", "abs"): (math.exp(x), 1.0)}).get(("x", "abs"))
        return p

    off, on, high = last(0.0), last(1.5), last(5.0)
    assert on.slope == pytest.approx(0.2, rel=1e-12) and off.slope < 0.2
    assert high.slope == off.slope and on.left < off.left
    from stabilize.validate import ConfigError

    with pytest.raises(ConfigError, match=r"monitor\.activation\.forecast\.speedup=-1"):
        ActivationConfig(forecast={"speedup": -1})


def test_forecaster_state_round_trips_mid_series():
    v = series(30, 2.0, 1.2, 0.03)
    a, b = LineForecaster(users().forecast), LineForecaster(users().forecast)
    for x in v[:15]:
        a.update({("h.0", "abs"): (float(x), 256.0)})
    b.load_state_dict(a.state_dict())
    for x in v[15:]:
        pa = a.update({("h.0", "abs"): (float(x), 256.0)})
        pb = b.update({("h.0", "abs"): (float(x), 256.0)})
        assert pa == pb


def test_score_counts_timely_followed_and_undetermined_warnings_by_hand():
    truth = {s: {"a": (10.0 * 2**s, 256.0), "b": (1.0, 22.6)} for s in range(1, 9)}
    crossings = first_crossings(truth)  # 10 * 2^s > 256 first at s = 5
    assert crossings == {"a": 5}
    # a: warned 4 and 2 steps ahead; b never crosses: warned at 2 (its horizon 2..12 is
    # covered? no: the run ends at 8, so it is undetermined) and nothing else
    warnings = [("a", 1), ("a", 3), ("b", 2)]
    sc = RunScore("r", "natural", 8, crossings, warnings, horizon=10, lead_min=4)
    assert (sc.true_warnings, sc.undetermined, sc.false_warnings) == (2, 1, 0)
    assert sc.timely == {"a": 4} and sc.warnable == {"a"}
    # a first forecast at step 2 cannot warn 4 steps ahead of a crossing at 5: not warnable
    assert RunScore("r", "natural", 8, crossings, [], 10, lead_min=4, first=2).warnable == set()
    short = RunScore("r", "natural", 20, crossings, [("b", 2)], horizon=10)
    assert (short.true_warnings, short.undetermined, short.false_warnings) == (0, 0, 1)
    # a near miss (its layer rose past half the line: given by the caller) is a false warning
    # still, counted apart; a true warning in ``near`` is not a near miss
    calm = RunScore("h", "healthy", 20, {}, [("b", 2), ("b", 9)], horizon=10, near={("b", 2)})
    assert (calm.false_warnings, calm.near_misses) == (2, 1)
    m = row_metrics([calm])
    assert (m["false_per_k"], m["near"], m["false_per_k_far"]) == (100.0, 1, 50.0)
    hit = RunScore("r", "natural", 8, crossings, [("a", 1)], horizon=10, near={("a", 1)})
    assert (hit.true_warnings, hit.near_misses) == (1, 0)


def test_a_natural_crossing_in_a_real_run_is_warned_ahead(tmp_path):
    """The tiny GPT at LR 3e-2 (nan_repro_natural, no injection) in fp32 with the explicit
    backend: its rows' RMS grows by itself past the fp16 sum-of-squares line 22.6 within 16
    steps. ``line=fp16_square`` asks for the forecast (an fp32 reduction cannot overflow). The
    crossing is read from the per-step logged values, apart from the forecast."""
    from stabilize.train import run

    from conftest import FAST, compose_run, read_csv_metrics

    overrides = [
        *FAST, "experiment=nan_repro_natural", "precision=fp32", "norm.reduction_dtype=fp32",
        "norm.backend=explicit", "optim.lr=3e-2", "optim.warmup_steps=20", "data.batch_size=8",
        "trainer.max_steps=16", "trainer.val_check_interval=100", "trainer.limit_val_batches=0",
        "trainer.checkpoint_every_n_steps=100", "logger=none", "audit.every=0",
        "monitor.activation.line=fp16_square",
    ]  # fmt: skip
    run(compose_run(tmp_path, overrides))
    rows = read_csv_metrics(tmp_path)
    rms = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("rms/") and "train/step" in r:
                rms.setdefault(k[4:], {})[int(r["train/step"])] = v
    first = {
        k: min((s for s, v in ser.items() if v > RMS_LINE), default=None) for k, ser in rms.items()
    }
    crossed = {k: s for k, s in first.items() if s is not None}
    assert crossed, rms
    evs = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    warned = {
        e["layer"]: e["step"] for e in reversed(evs)
        if e["monitor"] == "forecast" and e["extra"]["line"] == "rms"
    }  # fmt: skip
    ahead = {k: c - warned[k] for k, c in crossed.items() if k in warned}
    assert ahead and max(ahead.values()) >= 5, (crossed, warned)


def test_a_saved_config_with_the_flat_forecast_keys_still_loads():
    """Before the forecast had its own section (``monitor.activation.forecast``) its settings
    sat flat in ``monitor.activation`` (``horizon``, ``window``, ``noise_window``,
    ``forecast_z``, ...): a bundle's or run dir's config that holds them loads
    (``RunConfig.from_saved``) with the same values nested; a new config does not take them."""
    from stabilize.monitors.forecast import FLAT_KEYS
    from stabilize.run.config import RunConfig
    from stabilize.validate import ConfigError

    old = {"horizon": 15, "window": 6, "noise_window": 16, "forecast_start": 5,
           "forecast_z": 2.5, "forecast_reach": 1.5, "forecast_climb": 0.0,
           "forecast_damped": False, "forecast_speedup": 1.5, "forecast_slow_steps": 3.0,
           "forecast_confirm": 2, "forecast_within": 0.0, "forecast_rate_noise": 0.3}  # fmt: skip
    assert set(old) == set(FLAT_KEYS)  # every key the forecast ever had flat
    saved = {"monitor": {"activation": {"threshold": 128.0, **old}}}
    act = RunConfig.from_saved(saved).monitor.activation
    assert act.threshold == 128.0
    assert act.forecast == ForecastConfig(**{FLAT_KEYS[k]: v for k, v in old.items()})
    assert act.forecast != ForecastConfig()  # every value was taken, none defaulted
    with pytest.raises(ConfigError, match=r"monitor\.activation\.forecast_climb is not a known"):
        RunConfig.from_dict(saved)
