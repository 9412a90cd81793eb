"""The spike forecast (monitor.curvature.forecast) and its scoring, against hand calculations
(docs/forecast.md's spike table; benchmarks/spike_eval.py)."""

from __future__ import annotations

import math

import pytest

from benchmarks import spike_eval as S
from stabilize.monitors.curvature import CurvatureConfig, CurvatureMonitor
from stabilize.monitors.events import StepStats
from stabilize.monitors.spikes import LossSpikeConfig

LR = 1e-2
EDGE_ADAM, EDGE_GD = 38 / LR, 2 / LR


def stats(step: int, ratio: float, loss: float = 3.0) -> StepStats:
    """A step whose preconditioned quotient is ``ratio`` x Adam's line (the plain one far
    below its own)."""
    opt = {
        "curv_pre": ratio * EDGE_ADAM,
        "edge_adam": EDGE_ADAM,
        "curv_u": 1e-3,
        "edge_gd": EDGE_GD,
    }
    return StepStats(step=step, loss=loss, opt=opt)


def rising(n: int, spacing: int = 1, start: float = 0.3, rate: float = 1.1):
    return [stats(k * spacing, start * rate**k) for k in range(n)]


def feed(mon: CurvatureMonitor, steps) -> list:
    return [e for s in steps for e in mon.update(s)]


def test_a_quotient_rising_toward_adams_line_is_warned_when_its_rise_covers_the_distance():
    # 0.3 x the line, x1.1 a point: it crosses at point ln(1/0.3) / ln 1.1 = 12.6. The
    # forecaster's climb rule (activation defaults, climb 1) warns once the rise since the
    # lowest point covers the distance left: k ln 1.1 >= -ln 0.3 - k ln 1.1, k >= 6.3 -> 7
    mon = CurvatureMonitor(CurvatureConfig(every=1, forecast=True, horizon=40))
    events = feed(mon, rising(13))
    assert [(e.step, e.layer, e.monitor, e.kind) for e in events] == [
        (7, "preconditioned", "curvature", "warn")
    ]
    left = -math.log(0.3 * 1.1**7) / math.log(1.1)  # 5.63 steps, the central path
    assert events[0].value == pytest.approx(left, rel=1e-6)
    assert f"{EDGE_ADAM:.4g}" in events[0].message


def test_points_ten_steps_apart_are_read_in_steps_and_the_horizon_counts_steps():
    # the same series with a point every 10 steps: the horizon of 40 steps is 4 points. The
    # pessimistic path (z 3, the noise floored at 0.01, the slope less 3 standard errors over
    # 8 points) reaches the line in (3 sigma - level) / (ln 1.1 - 3 sigma sqrt(12 / 504))
    # points: 4.15 at point 9, 3.10 at point 10 -> warned at step 100, 26.3 steps ahead
    sigma, slope = 0.01, math.log(1.1) - 3 * 0.01 * math.sqrt(12 / 504)
    within = [(3 * sigma - math.log(0.3 * 1.1**k)) / slope for k in (9, 10)]
    assert within[0] > 4 >= within[1]
    mon = CurvatureMonitor(CurvatureConfig(every=1, forecast=True, horizon=40))
    events = feed(mon, rising(13, spacing=10))
    assert [e.step for e in events] == [100]
    assert events[0].value == pytest.approx(10 * -math.log(0.3 * 1.1**10) / math.log(1.1))


def test_off_by_default_non_positive_quotients_are_not_points_and_the_state_round_trips():
    assert feed(CurvatureMonitor(), rising(13)) == []  # forecast=false, the default
    mon = CurvatureMonitor(CurvatureConfig(every=1, forecast=True))
    assert feed(mon, [stats(k, -0.5) for k in range(20)]) == []
    assert ("preconditioned", "line") not in mon.forecaster.hist  # no log of a curvature <= 0
    a = CurvatureMonitor(CurvatureConfig(every=1, forecast=True))
    b = CurvatureMonitor(CurvatureConfig(every=1, forecast=True))
    series = rising(13)
    feed(a, series[:5])
    b.load_state_dict(a.state_dict())
    assert [e.step for e in feed(b, series[5:])] == [7]


def test_past_line_warns_of_one_point_past_its_line_once_per_horizon():
    """A quotient at 0.01 of Adam's line with one point at 1.5x (step 18), another at 1.2x
    within the horizon (step 30) and a third after it (step 70): off (the default), the
    trend forecaster's robust level does not move for one point and nothing is warned; on,
    steps 18 and 70, the event naming the line and the factor."""
    series = [stats(k, 0.01 * (1 + 0.01 * (k % 3))) for k in range(1, 90)]
    for k, r in ((18, 1.5), (30, 1.2), (70, 1.5)):
        series[k - 1] = stats(k, r)
    assert feed(CurvatureMonitor(CurvatureConfig(every=1, forecast=True)), series) == []
    on = CurvatureMonitor(CurvatureConfig(every=1, forecast=True, past_line=True))
    events = feed(on, series)
    assert [(e.step, e.layer) for e in events] == [(18, "preconditioned"), (70, "preconditioned")]
    assert "is past Adam's line" in events[0].message and "(x1.50)" in events[0].message
    assert events[0].extra["past_line"] is True


def test_bad_settings_are_refused_in_one_line_naming_the_key_and_value():
    from stabilize.validate import ConfigError

    with pytest.raises(ConfigError) as e:
        CurvatureConfig(horizon=0)
    assert "monitor.curvature.horizon=0 is not allowed" in str(e.value)
    with pytest.raises(ConfigError) as e:
        CurvatureConfig(forecast=True)  # every=0, the default: nothing to forecast on
    msg = str(e.value)
    assert "monitor.curvature.forecast=true" in msg and "every=0" in msg and "\n" not in msg
    assert "allowed: every >= 1" in msg


def test_points_further_apart_than_the_horizon_warn_nothing():
    # a point every 100 steps (a log step every 10, every=10) against a 40-step horizon:
    # the same climb that is warned at spacings of 1 and 10 is not warned at all
    mon = CurvatureMonitor(CurvatureConfig(every=10, forecast=True, horizon=40))
    assert feed(mon, rising(20, spacing=100)) == []
    assert len(mon.forecaster.hist[("preconditioned", "line")]) == 8  # still recorded


def noisy(n: int, level: float = 3.0) -> list[float]:
    return [level + (0.01 if k % 2 else -0.01) for k in range(n)]


def labelled(losses: list[float], cfg=S.LABEL) -> list[int]:
    return S.detected([{"step": k, "loss": x} for k, x in enumerate(losses)], "loss", cfg)


def test_a_loss_spike_is_labelled_by_hand():
    # a window alternating 2.99 / 3.01: its median 3.0; successive differences +-0.02, their
    # median one of them, so the MAD is 0 and sigma the 1% floor, 0.03. 3.6 is 1.2x the
    # median and 20 sigma above it: a spike (LABEL: 1.1x and 6 sigma)
    losses = noisy(80)
    losses[50] = 3.6
    assert labelled(losses) == [50]
    losses[55] = 3.6  # within GAP steps of the last labelled one: the same episode
    assert labelled(losses) == [50]
    losses[50] = losses[55] = 3.2  # 1.067x the median (6.7 sigma): below the 1.1x
    assert labelled(losses) == []
    losses[5] = 9.0  # before FIRST: not labelled
    assert labelled(losses) == []
    # the monitor at its defaults wants 1.5x the median: 3.6 is not a spike to it
    assert labelled([*noisy(30), 3.6], LossSpikeConfig()) == []
    assert labelled([*noisy(30), 4.6], LossSpikeConfig()) == [30]


def run_dict(spike: int | None, warn_at: int, n: int = 60) -> dict:
    """A recorded run whose quotient rises so that the monitor warns at ``warn_at`` and
    whose loss spikes at ``spike``."""
    losses = noisy(n)
    if spike is not None:
        losses[spike] = 4.0
    steps = []
    for k in range(n):
        ratio = 0.3 * 1.1 ** (k - (warn_at - 7)) if k >= warn_at - 7 else -1.0  # no point
        s = stats(k, ratio, losses[k])
        steps.append({"step": s.step, "loss": s.loss, "grad_norm": 1.0, "opt": s.opt})
    return {"name": "r", "group": "natural", "fault_step": None, "steps": steps}


def test_scoring_counts_a_warning_5_to_40_steps_ahead_and_its_precision_by_hand():
    # the quotient starts rising at step 3 and is warned at 10 (7 points later, as above)
    r = run_dict(spike=20, warn_at=10)
    s = S.score(r, cadence=1, horizon=40)
    assert s.warned == [(10, "preconditioned")]
    assert s.spikes == [20] and s.lead(20) == 10 and s.verdict(10) is True
    late = S.score(run_dict(spike=13, warn_at=10), 1, 40)
    assert late.spikes == [13] and late.lead(13) is None  # 3 steps ahead: not in recall
    none = S.score(run_dict(spike=None, warn_at=10, n=100), 1, 40)
    assert none.verdict(10) is False  # its horizon ended in the run with no spike
    assert S.score(run_dict(spike=None, warn_at=10, n=45), 1, 40).verdict(10) is None
    table = S.row("natural", 1, [s, none])
    cells = [c.strip() for c in table.strip("|").split("|")]
    # spikes 1, warned 1, recall 1.00, lead 10; warnings 2, 1 true, precision 0.50; the
    # spike-free run: 1 warning in 100 steps = 10 per 1,000
    assert cells[4:] == ["1", "0", "0", "1", "1.00", "10.0", "2", "1", "0", "0.50", "10.0"]


def recorded(tmp_path, block: str) -> tuple[list[str], object]:
    """Two recorded runs (one spike at 20, one calm) in ``runs.json``, a doc whose ``block``
    holds STALE-BLOCK, and the script's command scoring the file: (command, doc path)."""
    import json
    import sys

    runs = [run_dict(spike=20, warn_at=10), {**run_dict(None, 10, n=100), "name": "calm"}]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    doc = tmp_path / "doc.md"
    doc.write_text(f"x\n<!-- {block}:begin -->\nSTALE-BLOCK\n<!-- {block}:end -->\n")
    return [sys.executable, "scripts/eval_spikes.py", "--load", str(tmp_path / "runs.json")], doc


def test_the_script_scores_recorded_runs_and_writes_its_block(tmp_path):
    import subprocess

    cmd, doc = recorded(tmp_path, "eval_spikes")
    out = subprocess.run([*cmd, "--doc", str(doc)], capture_output=True, text=True, check=True)
    assert "| natural | every step | 2 | 160 | 1 | 0 | 0 | 1 | 1.00 | 10.0 |" in out.stdout
    text = doc.read_text()
    assert "STALE-BLOCK" not in text and "Unplanted loss spikes: r: steps 20." in text
    assert "Measured by `python scripts/eval_spikes.py --load" in text
    twice = subprocess.run([*cmd, *cmd[-2:]], capture_output=True, text=True, check=True)
    assert "; 2 runs" in twice.stdout  # a run in two files (copies merged) is scored once
    assert "| natural | every step | 2 | 160 | 1 | 0 | 0 | 1 | 1.00 | 10.0 |" in twice.stdout
    bad = subprocess.run([*cmd, "--shard", "2/2"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "--shard '2/2': not I/N with 0 <= I < N"


def test_the_script_records_runs_with_a_curvature_point_on_every_step(tmp_path):
    """``eval_spikes.py --quick --save``: real runs of the set, trained in the script's own
    process, their StepStats recorded step by step (the input the table replays)."""
    import json
    import subprocess
    import sys

    save = tmp_path / "runs.json"
    cmd = [sys.executable, "scripts/eval_spikes.py", "--quick", "--save", str(save)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(save.read_text())
    assert [(r["group"], len(r["steps"])) for r in runs] == [("natural", 12), ("healthy", 12)]
    for r in runs:
        assert [d["step"] for d in r["steps"]] == list(range(1, 13)) and r["fault_step"] is None
        assert all(d["opt"]["g2_v"] > 0 for d in r["steps"])  # every step is a log step
        # a curvature point on every step that had a step to take (lr 0 at the warm-up's
        # start: no update direction, no point)
        assert sum("curv_pre" in d["opt"] for d in r["steps"]) >= 10
    assert "| natural | every step | 1 | 12 |" in out.stdout
