"""scripts/bench_cost.py: its estimators against times planted by hand, and one real run."""

from __future__ import annotations

import re
import shlex
import statistics
import sys

import pytest

from benchmarks.harness_cost import ALL_OFF, PARTS, boot, cost_of, part_rows, ratio_of, robust_ms

from conftest import ROOT, run_cli


def _rounds(n: int = 9, steps: int = 10) -> list[dict[str, list[float]]]:
    """Per round, every arm's step times: bare 100 ms a step with a 130 ms log step at
    position 0, the others a planted fraction more; the machine drifts round to round
    (x 1.00 .. 1.08), and one stall of +400 ms hits the full Guard at one position."""
    slower = {"bare": 0.0, "twin": 0.0, "guard": 0.03, ALL_OFF.arm: 0.0}
    slower.update({p.arm: 0.03 - 0.005 * (i + 1) for i, p in enumerate(PARTS)})
    out = []
    for r in range(n):
        drift = 1 + 0.01 * r
        base = [0.130 if i == 0 else 0.100 for i in range(steps)]
        rnd = {a: [drift * t * (1 + s) for t in base] for a, s in slower.items()}
        out.append(rnd)
    out[8]["guard"][3] += 0.400  # the slowest round: a median moves not at all
    return out


def test_robust_time_keeps_periodic_work_and_drops_a_stall():
    rounds = _rounds()
    # by hand: the mean over positions of the median over rounds (drift 1.04 in the middle)
    assert robust_ms(rounds, "bare") == pytest.approx(1.04 * (0.130 + 9 * 0.100) / 10)
    assert robust_ms(rounds, "guard") == pytest.approx(1.03 * robust_ms(rounds, "bare"))
    assert ratio_of("guard")(rounds) == pytest.approx(1 / 1.03)
    point, lo, hi = boot(rounds, ratio_of("twin"))
    assert point == pytest.approx(1.0) and lo <= 1.0 <= hi


def test_the_parts_shares_and_what_no_switch_separates_add_up():
    rounds = _rounds()
    rows, m = part_rows(rounds, list(PARTS))
    assert m["full"] == pytest.approx(3.0)  # points of a bare step
    # part i off leaves 3 - 0.5 (i + 1) points: its share is 0.5 (i + 1)
    shares = [float(r[3]) for r in rows[: len(PARTS)]]
    assert shares == pytest.approx([0.5 * (i + 1) for i in range(len(PARTS))], abs=0.006)
    assert m["engine"] == pytest.approx(3.0) and m["left"] == pytest.approx(0.0)
    rest = float(rows[-1][3])
    assert rest == pytest.approx(3.0 - sum(0.5 * (i + 1) for i in range(len(PARTS))), abs=0.02)
    assert cost_of(ALL_OFF.arm)(rounds) == pytest.approx(0.0)


def _shrunk(name: str, tmp_path, *extra: str) -> str:
    """docs/guide.md's command ``name``, run with its size shrunk (two rounds of two-step
    blocks); its stdout."""
    from doc_commands import doc_command

    shown = shlex.split(doc_command(name))
    args = [*shown[2:], "--rounds", "2", "--block", "2", "--warmup", "2", *extra]
    r = run_cli([sys.executable, str(ROOT / shown[1]), *args], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _verdicts_match_their_numbers(out: str, config: str, target: float) -> None:
    pattern = rf"target {config}: ([\w+]+) / (\w+) = ([\d.]+) \(>= ([\d.]+)\) (PASS|FAIL)"
    verdicts = re.findall(pattern, out)
    assert {v[:2] for v in verdicts} == {("lightning", "bare"), ("guard", "bare"),
                                         ("hf+callback", "hf")}  # fmt: skip
    for _, _, ratio, shown, verdict in verdicts:
        assert float(shown) == target
        assert (verdict == "PASS") == (float(ratio) >= target)


def test_the_tiny_command_prints_every_table_and_verdicts_that_match_their_numbers(tmp_path):
    out = _shrunk("bench-cost-tiny", tmp_path)
    for words in ("Lightning path", "plain loop under Guard", "HFStabilityCallback",
                  "a second bare loop", "their sum", "the C++ pass"):  # fmt: skip
        assert words in out
    for p in [*PARTS, ALL_OFF]:
        assert p.name in out
    _verdicts_match_their_numbers(out, "tiny", 0.95)


def test_the_wide_command_judges_each_adapter_at_its_own_target(tmp_path):
    out = _shrunk("bench-cost-wide", tmp_path, "--set", "model.d_model=64")
    assert "one part off at a time" not in out  # --no-parts
    _verdicts_match_their_numbers(out, "wide", 0.985)


def test_runs_judge_on_the_median_of_the_runs_ratios_printed_beside_it(tmp_path):
    out = _shrunk("bench-cost-tiny", tmp_path, "--runs", "2", "--no-parts", "--no-hf")
    table = out[out.index("the ratio in each of 2 independent runs") :]
    row = next(line for line in table.splitlines() if line.startswith("| plain loop under Guard"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    runs, median = [float(c) for c in cells[1:3]], float(cells[3])
    assert median == pytest.approx(statistics.median(runs), abs=0.0015)  # each shown rounded
    verdict = next(line for line in out.splitlines() if line.startswith("target tiny: guard"))
    assert f"= {median:.3f}, the median of 2 runs (>= 0.95)" in verdict
    assert verdict.endswith("PASS" if median >= 0.95 else "FAIL")
