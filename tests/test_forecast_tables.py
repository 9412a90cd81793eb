"""benchmarks/forecast_tables.py's noise line and near misses on synthetic runs whose kind is
known by construction: a random walk's segments read as its simulated reference, independent
noise as its own, and a warning is a near miss exactly when its layer rose past half its line
within the horizon (by hand)."""

from __future__ import annotations

import re

import numpy as np

from benchmarks.forecast_tables import near_warnings, noise_growth, recall_by_step  # noqa: E402


def _run(logs: list[np.ndarray]) -> dict:
    """A recorded run in eval_forecast's format: layer i's |x| max is 256 exp(logs[i][t])."""
    steps = [
        {"stats": {"step": t + 1}, "truth": {f"h.{i}": (256.0 * float(np.exp(y[t])), -1.0)
                                             for i, y in enumerate(logs)}}
        for t in range(len(logs[0]))
    ]  # fmt: skip
    return {"steps": steps, "alias": {}, "dims": {}}


def _medians(line: str) -> dict[int, tuple[float, float, float]]:
    pat = r"h=(\d+): median ([\d.]+) \(a random walk ([\d.]+), independent noise ([\d.]+)\)"
    return {int(h): (float(a), float(b), float(c)) for h, a, b, c in re.findall(pat, line)}


def test_the_noise_line_tells_a_random_walk_from_independent_noise():
    rng = np.random.default_rng(1)
    n = 20 + 24 * 4  # past the skipped first 20 steps: 4 segments of 24 per layer
    walk = [_run([-4.0 + 0.05 * np.cumsum(rng.standard_normal(n)) for _ in range(10)])
            for _ in range(10)]  # fmt: skip
    noise = [_run([-4.0 + 0.05 * rng.standard_normal(n) for _ in range(10)]) for _ in range(10)]
    for runs, kind in ((walk, 1), (noise, 2)):
        got = _medians(noise_growth(runs, 256.0))
        assert set(got) == {4, 8}
        for h, (_, walk_ref, iid_ref) in got.items():
            # by hand: independent noise's h-step difference varies as its 1-step one (1; a
            # quadratic fit over 24 points takes a little off), a random walk's h times (the
            # fit absorbs part of the wander, so between 1.5 and h)
            assert 0.8 < iid_ref < 1.05 and 1.5 < walk_ref < h
        for measured, *refs in got.values():
            # within 15% of its own kind's reference, and nearer it than the other's
            assert abs(measured / refs[kind - 1] - 1) < 0.15
            assert abs(measured - refs[kind - 1]) < abs(measured - refs[2 - kind])


def test_a_near_miss_is_a_rise_past_half_the_line_within_the_horizon_by_hand():
    # layer h.0: ratio 0.1 until step 10, 0.6 at step 12, then 0.2; h.1 stays at 0.3
    y0 = np.log([0.1] * 10 + [0.3, 0.6] + [0.2] * 8)
    y1 = np.log([0.3] * 20)
    r = _run([y0, y1])
    warned = [("h.0", 2), ("h.0", 12), ("h.1", 3)]
    # h.0 at 2: step 12 (0.6) is within 10 steps; at 12: only later steps count (0.2)
    assert near_warnings(r, warned, horizon=10, threshold=256.0) == {("h.0", 2)}
    assert near_warnings(r, warned, horizon=9, threshold=256.0) == set()  # 12 > 2 + 9


def test_recall_by_step_splits_early_crossings_from_later_ones_by_hand():
    """Crossings at steps first+5 .. first+8 and later ones, counted apart: three runs whose
    crossings and warnings are set by hand (first forecast at step 4, so 9-12 is early)."""
    from benchmarks.forecast_score import RunScore

    a = RunScore("a", "natural", 40, {"x": 9, "y": 20}, [("x", 4), ("y", 10)], 40, first=4)
    b = RunScore("b", "natural", 40, {"x": 12, "y": 30}, [("x", 9), ("y", 29)], 40, first=4)
    c = RunScore("c", "natural", 40, {"x": 8}, [("x", 2)], 40, first=4)  # not warnable
    text = recall_by_step([a, b, c], key=lambda s: "all", early=12)
    # early: a.x (lead 5: timely), b.x (lead 3: not); later: a.y (lead 10), b.y (lead 1)
    assert text.splitlines()[-1] == "| all | 4 | 2 | 1 | 0.50 | 2 | 1 | 0.50 |"
    text = recall_by_step([a, b], key=lambda s: s.name, early=12)
    assert text.splitlines()[-2:] == ["| a | 2 | 1 | 1 | 1.00 | 1 | 1 | 1.00 |",
                                      "| b | 2 | 1 | 0 | 0.00 | 1 | 0 | 0.00 |"]  # fmt: skip


def test_a_healthy_labelled_run_that_crossed_is_scored_as_natural():
    """Only a run labelled healthy whose truth crossed a line moves; the input is not changed."""
    from benchmarks.forecast_tables import relabel_crossed

    runs = [{"name": "h0", "group": "healthy"}, {"name": "h1", "group": "healthy"},
            {"name": "n0", "group": "natural"}]  # fmt: skip
    got, moved = relabel_crossed(runs, {"h0": {}, "h1": {"h.0": 49}, "n0": {"h.0": 9}})
    assert moved == ["h1"] and [r["group"] for r in got] == ["healthy", "natural", "natural"]
    assert runs[1]["group"] == "healthy"


def test_missed_crossings_show_the_value_five_and_ten_steps_before_by_hand():
    """Layer h.0 climbs steadily and is warned 8 ahead (timely: not listed); h.1 sits flat at
    exp(-2) of its line, then jumps past it at step 30 and is warned 2 ahead; h.2 doubles
    from step 20 to 25 and crosses at 30, never warned: the table lists h.1 and h.2 with the
    values by hand, and counts h.1 as flat."""
    from benchmarks.forecast_score import RunScore
    from benchmarks.forecast_tables import missed

    t = np.arange(40, dtype=np.float64)
    h0 = -2.0 + (t - 1) * 2.0 / 30  # past the line (> 0) from t = 32: step 33
    h1 = np.where(t >= 29, 0.1, -2.0)  # step s = t + 1: past the line from step 30
    h2 = np.where(t >= 29, 0.1, np.where(t >= 20, -2.0 + np.log(2.0), -2.0))
    run = {**_run([h0, h1, h2]), "name": "r"}
    crossings = {"h.0": 33, "h.1": 30, "h.2": 30}
    s = RunScore("r", "natural", 40, crossings, [("h.0", 25), ("h.1", 28)], 40, first=4)
    text = missed([run], [s], 256.0, early=12)
    e2 = float(np.exp(-2.0))
    assert text.splitlines()[0].startswith("Missed crossings after step 12 (2; 1 of them")
    up = float(np.exp(0.1))  # past the line at c
    assert (f"| r | h.1 | 30 | {e2:.2f} | {e2:.2f} | 1.00x | {up:.2f} | {up / e2:.2f}x | "
            "2 steps ahead |") in text  # fmt: skip
    assert (f"| r | h.2 | 30 | {e2:.2f} | {2 * e2:.2f} | 2.00x | {up:.2f} | "
            f"{up / (2 * e2):.2f}x | none in the horizon |") in text  # fmt: skip
    assert "h.0" not in text
