"""Issue 37: the gap judge (stabilize/report/gap.py) against hand calculations, and
``stabilize-gap`` on real runs (tests/test_precision_gap.py)."""

from __future__ import annotations

import math
import statistics

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
    # t(0.975, 2) = 4.302653: the band is +-0.099366
    g = Gap("held-out loss", 2.15 - 2.02, 2.15, [2.00, 2.02, 2.04])
    assert g.noise == pytest.approx(0.02 * math.sqrt(4 / 3), rel=1e-12)
    assert g.sigma == pytest.approx(0.13 / 0.0230940, rel=1e-5)  # 5.63
    assert g.half == pytest.approx(4.302653 * 0.0230940, rel=1e-5)
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
        4.302653 * 0.01 * math.sqrt(4 / 3)
    )
    assert j.heldout.value == pytest.approx(0.2) and j.heldout.real
    # the last 20 steps' mean: 10 at +0 and 10 at +0.2
    assert j.last.value == pytest.approx(0.1)
    # a run inside the band throughout never opens
    same = judge(_run("y", {s: 3.001 for s in range(1, 21)}, 3.001), refs, window=1)
    assert same.steps.opens_at is None and same.heldout.real is False


# Student's t at 0.975 as printed in the standard tables (e.g. NIST/SEMATECH e-Handbook,
# section 1.3.6.7.2), by degrees of freedom
PUBLISHED_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 10: 2.228,
                  11: 2.201, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}  # fmt: skip


@pytest.mark.parametrize("df", sorted(PUBLISHED_T975))
def test_the_band_is_the_published_t_quantile_at_any_number_of_seeds(df):
    """n = df + 1 reference seeds: the held-out band and the per-step band are t(0.975, n-1)
    noise units, beyond 11 seeds too (not the normal's 1.96)."""
    seeds = [2.0 + 0.01 * (k % 3) for k in range(df + 1)]  # some spread at every n
    g = Gap("held-out loss", 0.0, 2.0, seeds)
    assert round(g.half / g.noise, 3) == PUBLISHED_T975[df]
    refs = [_run(f"r{k}", {s: v for s in range(1, 5)}) for k, v in enumerate(seeds)]
    steps = judge(_run("x", {s: 2.0 for s in range(1, 5)}), refs, window=1).steps
    assert round(steps.half[-1] / g.noise, 3) == PUBLISHED_T975[df]


def test_gap_png_draws_what_the_judgement_says():
    """A held-out gap far outside the seeds' band while the noisy per-step training loss
    stays inside its own band: the figure draws the judged scores (the run's gap, each seed,
    the band, by the judge's numbers), the per-step curve as a separate, named measure, and
    the judgement's lines verbatim, so the picture cannot say "inside" where the words say
    "a real gap"."""
    import matplotlib.pyplot as plt

    from stabilize.report.gap_cli import figure

    # three seeds whose training loss swings +-0.1 from step to step; held out 2.00-2.02
    refs = [_run(f"r{k}", {s: 3.0 + 0.1 * ((s + k) % 3 - 1) for s in range(1, 21)}, 2.0 + d)
            for k, d in enumerate((0.0, 0.01, 0.02))]  # fmt: skip
    run = _run("x", {s: 3.02 for s in range(1, 21)}, 2.10)
    j = judge(run, refs, window=1)
    # by hand: held out +0.09 over noise 0.01 * sqrt(4/3) = 0.011547: +7.8 sigma, band 0.0497
    assert j.heldout.real and j.heldout.sigma == pytest.approx(0.09 / 0.011547, rel=1e-4)
    assert j.steps.opens_at is None  # per step the words say: never above the band
    fig = figure(j, "x vs 3 reference seeds")
    left, right = fig.axes
    said = [t.get_text() for t in fig.texts if t.get_gid() == "judgement"]
    assert said == j.lines()  # the words, on the picture
    assert [t.get_text() for t in left.get_xticklabels()] == ["held-out loss", "last-steps loss"]
    by = {}
    for line in left.get_lines():
        by.setdefault(line.get_gid(), []).append(list(line.get_ydata()))
    for x, g in enumerate((j.heldout, j.last)):
        mean = statistics.fmean(g.ref)
        assert by["run"][x] == pytest.approx([g.value])
        assert by["seeds"][x] == pytest.approx([r - mean for r in g.ref])
        assert by["band"][x] == pytest.approx([-g.half, g.half])
        assert (abs(by["run"][x][0]) > by["band"][x][1]) == g.real  # drawn as judged
    assert abs(by["run"][0][0]) > by["band"][0][1]  # the held-out gap drawn outside its band
    (curve,) = [x for x in right.get_lines() if x.get_gid() == "gap"]
    assert list(curve.get_ydata()) == pytest.approx(j.steps.gap)
    (band,) = [c for c in right.collections if c.get_gid() == "band"]
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(max(j.steps.half))
    assert "training loss" in right.get_title() and right.get_ylabel().startswith("training")
    plt.close(fig)
