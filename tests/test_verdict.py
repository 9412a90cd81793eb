"""Verdicts against the healthy reference (stabilize/report/verdict.py), by hand-computed
gaps and bands: "fixes it" needs the NaN stopped AND the training inside the reference's
seed band; every word of a verdict follows from the numbers in its row."""

from __future__ import annotations

import pytest

from stabilize.report.summary import ArmSummary
from stabilize.report.verdict import Facts, judge, verdict_rows


def arm(name, bpb, loss, status="done", first_overflow=None, **kw):
    a = ArmSummary(name, name, status, precision="fp16-mixed", reduction="fp16", **kw)
    a.heldout_bpb, a.final_loss, a.first_overflow = bpb, loss, first_overflow
    return a


def refs(*pairs):
    arms = [arm(f"reference seed {i}", b, lo) for i, (b, lo) in enumerate(pairs)]
    return arms, [Facts("reference", seed=i) for i in range(len(pairs))]


def test_fixes_it_only_inside_the_band_and_without_nan():
    ra, rf = refs((3.20, 2.50), (3.24, 2.56), (3.22, 2.53))
    arms = [
        arm("fp32_reduction", 3.23, 2.55),  # inside both bands (below)
        arm("bf16", 3.40, 2.54),  # no NaN, 0.18 bpb worse than the mean 3.22: outside
        arm("baseline", 8.0, 5.55, first_overflow=41),
    ]
    fs = [
        Facts("fp32_reduction", 1234),
        Facts("bf16", 1234),
        Facts("baseline", 1234, nan_steps=[57, 61]),
    ]
    ref, vs = judge(ra + arms, rf + fs)
    # by hand: mean 3.22, sample sd 0.02, t(0.975, 2) = 4.302653, sqrt(1 + 1/3): +-0.0994
    half = 4.302653 * 0.02 * (4 / 3) ** 0.5
    assert ref.seeds == 3 and ref.band("bpb") == pytest.approx((3.22 - half, 3.22 + half))
    assert ref.band("loss")[1] == pytest.approx(2.53 + 4.302653 * 0.03 * (4 / 3) ** 0.5)
    assert ref.mean("bpb") == pytest.approx(3.22) and ref.mean("loss") == pytest.approx(2.53)
    by = {v.arm: v for v in vs}
    fp32, bf16, base = by["fp32_reduction"], by["bf16"], by["baseline"]
    assert fp32.nan_stopped and fp32.inside and fp32.label == "fixes it"
    assert fp32.gap_bpb == pytest.approx(0.01) and fp32.gap_loss == pytest.approx(0.02)
    assert "+0.010 bpb held out" in fp32.words and "3-seed band 3.121-3.319" in fp32.words
    assert bf16.nan_stopped and bf16.inside is False and "fixes it" not in bf16.words
    assert bf16.words.startswith("bf16 stops the NaN but trains worse") and "+0.180" in bf16.words
    assert not base.nan_stopped and base.label == "does not stop the NaN"
    assert "overflowed at step 41" in base.words and "from step 57" in base.words
    rows = verdict_rows(ref, vs)
    assert rows[1][0] == "reference (3 seeds)" and "band 3.121-3.319" in rows[1][3]
    cells = {r[0]: r for r in rows[2:]}
    assert cells["fp32_reduction"][1] == "yes"
    # in seed noise, by hand: 0.01 / (0.02 * sqrt(4/3)) = 0.43, 0.02 / (0.03 * sqrt(4/3)) = 0.58
    assert cells["fp32_reduction"][3:6] == ["+0.010 (+0.4)", "+0.020 (+0.6)", "yes"]
    assert fp32.sigma_bpb == pytest.approx(0.01 / (0.02 * (4 / 3) ** 0.5))
    assert "+0.010 bpb held out (+0.4 sigma of seed noise)" in fp32.words
    assert bf16.sigma_bpb == pytest.approx(0.18 / (0.02 * (4 / 3) ** 0.5))  # 7.79
    assert "+0.180 bpb held out (+7.8 sigma of seed noise)" in bf16.words
    assert cells["baseline"][1] == "no" and cells["baseline"][-1] == "does not stop the NaN"


def test_a_bf16_arm_hides_its_measured_gap_in_seed_noise():
    ra, rf = refs((3.20, 2.50), (3.24, 2.56), (3.22, 2.53))
    near, far = arm("bf16", 3.25, 2.54), arm("bf16", 3.40, 2.54)
    for a in (near, far):
        a.precision, a.reduction = "bf16-mixed", "bf16"
    (_, (v_near,)), (_, (v_far,)) = (judge([*ra, a], [*rf, Facts("bf16", 1)]) for a in (near, far))
    # 0.03 / 0.023094 = 1.3 sigma < 4.303: inside; 0.18 / 0.023094 = 7.8: a real gap
    assert v_near.hides.endswith(
        "a held-out gap of +0.030 bpb to the reference, +1.3 sigma of seed noise (inside the noise)"
    )
    assert v_far.hides.endswith("+7.8 sigma of seed noise (a real gap)")


def test_one_reference_seed_says_there_is_no_spread():
    ra, rf = refs((3.20, 2.50))
    ref, (v,) = judge([*ra, arm("fp32_reduction", 3.2, 2.5)], [*rf, Facts("fp32_reduction", 1)])
    assert ref.seeds == 1 and v.inside is None and "fixes it" not in v.words
    assert "no spread" in v.words and v.gap_bpb == pytest.approx(0.0)
    assert verdict_rows(ref, [v])[1][3].endswith("no spread (1 seed)")


def test_a_remedy_that_overflowed_again_or_did_not_finish_did_not_stop_it():
    ra, rf = refs((3.20, 2.50), (3.30, 2.60))
    again = arm("remedy", 3.25, 2.55, first_overflow=41)
    crashed = arm("large_eps", None, None, status="crashed")
    fs = [Facts("remedy", 1, overflow_after_last_rollback=True), Facts("large_eps", 1)]
    _, (r, c) = judge([*ra, again, crashed], [*rf, *fs])
    assert not r.nan_stopped and "overflowed again after its last rollback" in r.words
    assert not c.nan_stopped and "ended crashed" in c.words


def test_no_reference_no_training_verdict():
    ref, (v,) = judge([arm("bf16", 3.3, 2.5)], [Facts("bf16", 1)])
    assert ref is None and v.gap_bpb is None and "no reference arm" in v.words
