"""Issue 37: the gap judge (stabilize/report/gap.py) against hand calculations, and
``stabilize-gap`` on real runs (tests/test_precision_gap.py)."""

from __future__ import annotations

import math

import pytest

from stabilize.report.gap import Gap, judge
from stabilize.report.load import Run


def _run(name: str, losses: dict[int, float], heldout: float | None = None) -> Run:
    rows = [{"x": float(s), "train/step": float(s), "train/loss": v}
            for s, v in sorted(losses.items())]  # fmt: skip
    return Run(name=name, arm=name, config={}, rows=rows,
               final_eval=None if heldout is None else {"loss": heldout})  # fmt: skip


def test_the_gap_in_noise_units_by_hand():
    # seeds 2.00, 2.02, 2.04: mean 2.02, s = 0.02, noise = 0.02 * sqrt(4/3) = 0.023094;
    # t(0.975, 2) = 4.303: the band is +-0.099374
    g = Gap("held-out loss", 2.15 - 2.02, 2.15, [2.00, 2.02, 2.04])
    assert g.noise == pytest.approx(0.02 * math.sqrt(4 / 3), rel=1e-12)
    assert g.sigma == pytest.approx(0.13 / 0.0230940, rel=1e-5)  # 5.63
    assert g.half == pytest.approx(4.303 * 0.0230940, rel=1e-5)
    assert g.real is True
    assert g.words() == ("held-out loss +0.1300 nats, +5.6 sigma of seed noise: a real gap "
                         "(the 3-seed band is +-0.0994)")  # fmt: skip
    inside = Gap("held-out loss", 0.05, 2.07, [2.00, 2.02, 2.04])  # 2.2 sigma < 4.303
    assert inside.real is False and "inside the noise" in inside.words()
    assert "+2.2 sigma" in inside.words()


def test_too_few_seeds_or_no_spread_is_said_not_divided():
    two = Gap("held-out loss", 0.1, 2.1, [2.0, 2.0 + 1e-3])
    assert two.real is None and "at least 3 are needed" in two.words()
    same = Gap("held-out loss", 0.1, 2.1, [2.0, 2.0, 2.0])
    assert same.real is None and same.sigma is None
    assert "score the same, no seed noise to measure" in same.words()


def test_per_step_gap_opens_where_it_leaves_the_band_for_good():
    # three references wobbling +-0.01 around 3.0 at every step; the run equal to their
    # mean up to step 10, then 0.2 above it: smoothed over 1 step the gap opens at 11
    refs = [_run(f"r{k}", {s: 3.0 + d for s in range(1, 21)}, 3.0 + d)
            for k, d in enumerate((-0.01, 0.0, 0.01))]  # fmt: skip
    run = _run("x", {s: 3.0 + (0.2 if s > 10 else 0.0) for s in range(1, 21)}, 3.2)
    j = judge(run, refs, window=1)
    assert j.steps.opens_at == 11
    assert j.steps.gap[-1] == pytest.approx(0.2) and j.steps.half[-1] == pytest.approx(
        4.303 * 0.01 * math.sqrt(4 / 3)
    )
    assert j.heldout.value == pytest.approx(0.2) and j.heldout.real
    # the last 20 steps' mean: 10 at +0 and 10 at +0.2
    assert j.last.value == pytest.approx(0.1)
    # a run inside the band throughout never opens
    same = judge(_run("y", {s: 3.001 for s in range(1, 21)}, 3.001), refs, window=1)
    assert same.steps.opens_at is None and same.heldout.real is False
