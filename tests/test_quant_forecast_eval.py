"""The delayed-scaling forecast's scoring (benchmarks/quant_forecast.py,
scripts/eval_quant_forecast.py): crossings, the chance rules and the score by hand, and the
script's quick command on real runs, its crossings against an independent scan."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.quant_forecast import COLD, chance, crossings, score
from stabilize.monitors.quant import QuantMonitorConfig

from conftest import ROOT, run_cli


def _steps(series: dict[str, list[float]], ratio: float = 0.5) -> list[dict]:
    n = len(next(iter(series.values())))
    return [{"step": t + 1, "quant_saturated": {op: s[t] for op, s in series.items()},
             "quant_amax_ratio": dict.fromkeys(series, ratio)}
            for t in range(n)]  # fmt: skip


def test_a_crossing_is_an_onset_past_the_line_after_the_cold_start_by_hand():
    line = 1e-4
    cold = [1.0] * (COLD + 2) + [0.0] * 10  # saturated from the start into step COLD: no onset
    late = [0.0] * 14 + [2e-4] + [0.0] * 7  # an onset at step 15
    under = [5e-5] * 22  # never past the line
    got = crossings(_steps({"a.x": cold, "b.x": late, "c.w": under}), line)
    assert got == {"b.x": 15}


def test_the_chance_rules_warn_every_operand_by_the_step_alone():
    steps = _steps({"a.x": [0.0] * 70, "b.w": [0.0] * 70})
    assert chance(steps, "always", 25) == [(op, s) for s in (10, 35, 60) for op in ("a.x", "b.w")]
    assert chance(steps, "clock 40", 25) == [("a.x", 40), ("b.w", 40)]
    assert chance(steps, "clock 80", 25) == []  # past the run's end


def test_the_always_rule_is_scored_as_a_forecast_is_by_hand():
    """One operand crossing at 30, horizon 25: the always rule's warnings at 10 (20 ahead:
    timely, true) and 35 (its operand crossed before it, none after: false, not
    undetermined, though its horizon passes the 50-step run's end)."""
    steps = _steps({"a.x": [0.0] * 29 + [1e-3] + [0.0] * 20})
    cfg = QuantMonitorConfig(horizon=25)
    (s,) = score([{"name": "r", "group": "rising", "steps": steps}], "always", cfg)
    assert s.crossings == {"a.x": 30} and s.warnings == [("a.x", 10), ("a.x", 35)]
    assert s.timely == {"a.x": 20} and (s.true_warnings, s.false_warnings) == (1, 1)


@pytest.mark.timeout(300)
def test_the_quick_command_records_real_runs_and_counts_their_crossings(tmp_path):
    """``eval_quant_forecast.py --quick``: two real 60-step runs of the formats scenario
    under fp8 delayed scaling (one with the planted rising growth), saved; the table's
    crossings equal an independent scan of the saved saturated shares (the first step from
    COLD on past the line from at or under it), and the planted run's grown input reads
    larger than the twin's from the growth on (it has one to forecast)."""
    save = tmp_path / "runs.json"
    script = ROOT / "scripts" / "eval_quant_forecast.py"
    r = run_cli([sys.executable, str(script), "--quick", "--save", str(save)], cwd=tmp_path,
                timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| forecast: all |" in r.stdout and "| always: all |" in r.stdout
    runs = json.loads(save.read_text())
    assert [r["group"] for r in runs] == ["rising", "healthy"]
    line, n = QuantMonitorConfig().saturated, 0
    for r in runs:
        for op in r["steps"][0]["quant_saturated"]:
            shares = [st["quant_saturated"][op] for st in r["steps"]]
            n += any(shares[t] > line >= shares[t - 1] for t in range(COLD - 1, len(shares)))
    assert sum(len(s.crossings) for s in score(runs, "forecast", QuantMonitorConfig())) == n
    op = "h.0.attn.c_proj.x"  # grown x1.2 to x1.5 over steps 50-59 (accel 0.001 from 30)
    grown, twin = ([st["quant_amax"][op] for st in run["steps"]] for run in runs)
    assert sum(g > t for g, t in zip(grown[49:], twin[49:], strict=True)) >= 8
