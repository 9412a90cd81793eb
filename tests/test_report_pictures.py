"""The report's pictures draw what its text says, read from the figures' artists (not their
bytes), on the NaN scenario's baseline and large_eps arms trained for real (test_scenario's
short scenario): both end at a uniform guess (the same loss, the same audit), the baseline's
norm ln_f overflows its fp16 sum of squares (the row-RMS line, 22.6 at D = 128) steps before
any |x| max passes 256, and both arms' gradient norms go to 0 and NaN (their lines stop)."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest
from test_scenario import SHORT

from stabilize.report import load_run_dir, summarize
from stabilize.report.plots import ENDED_LABEL, figures

from conftest import compose_run

D = 128
RMS_LINE = (65504 / D) ** 0.5  # 22.62, by hand


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    for arm in ("baseline", "large_eps"):
        from stabilize.train import run

        run(compose_run(root / arm, [*SHORT, f"arm={arm}", "logger=none"]))
    runs = [load_run_dir(root / a) for a in ("baseline", "large_eps")]
    figs = figures(runs)
    yield runs, figs
    for f in figs.values():
        plt.close(f)


def _legend(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for lg in legends for t in lg.get_texts()]


def _curve(ax, xs_ys: dict[int, float]):
    """The lines of ``ax`` that draw exactly these points."""
    want = sorted(xs_ys.items())
    out = []
    for ln in ax.get_lines():
        got = [(int(x), y) for x, y in zip(ln.get_xdata(), ln.get_ydata(), strict=True)
               if math.isfinite(y)]  # fmt: skip
        if got and got == [(x, pytest.approx(y)) for x, y in want]:
            out.append(ln)
    return out


def _tail(run, key, since):
    return {int(x): v for x, v in run.series(key) if x >= since}


def test_arms_that_end_identical_are_both_visible_and_said_to_be(made):
    (base, eps), figs = made
    # measured: from step 14 both arms' loss is ln(256), the uniform guess, to 4 digits
    same = [x for x, v in _tail(eps, "train/loss", 1).items()
            if v == pytest.approx(dict(base.series("train/loss"))[x], rel=1e-3)]  # fmt: skip
    first = min(x for x in same if all(y in same for y in range(x, 41)))
    assert first < 40 and math.isclose(
        dict(eps.series("train/loss"))[40], math.log(256), rel_tol=1e-3
    )
    (ax,) = figs["loss"].axes
    lines = {ln.get_color(): ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2}
    b, e = (lines[c] for c in ("#1f77b4", "#ff7f0e"))  # the palette's first two: the arms
    assert b.get_linewidth() > e.get_linewidth() + 1.5  # the one underneath shows around it
    assert b.get_zorder() <= e.get_zorder()
    (note,) = [t for t in _legend(figs["loss"]) if t.startswith("large_eps")]
    assert note.startswith("large_eps (= baseline at steps") and note.endswith(f" {first}-40)")
    # the audit: the same from the first audit after the overflow, in both panels
    for ax in figs["audit"].axes:
        ab, ae = ax.get_lines()[:2]
        assert ab.get_linewidth() > ae.get_linewidth() and ab.get_markersize() > ae.get_markersize()
        assert any(t.startswith("large_eps (= baseline at steps") for t in _legend(figs["audit"]))


def test_act_max_draws_the_row_rms_line_where_the_damage_starts(made):
    (base, _), figs = made
    fig = figs["act_max"]
    (ax,) = [a for a in fig.axes if a.get_title() == "baseline"]
    over = next(e for e in base.events if e["monitor"] == "overflow")
    s = summarize(base)
    assert over["step"] < s.first_over_line  # the damage comes first: the text says so
    # the line the damage crosses, the norm's row RMS that reaches it, the step it overflowed
    hl = [ln for ln in ax.get_lines() if ln.get_gid() == "rms_line"]
    assert len(hl) == 1 and hl[0].get_ydata()[0] == pytest.approx(RMS_LINE, rel=1e-4)
    rms = {int(x): v for x, v in base.series(f"rms/{over['layer']}")}
    assert _curve(ax, rms), "the overflowing norm's row RMS is not drawn"
    (tri,) = [ln for ln in ax.get_lines() if ln.get_gid() == "rms_over"]
    assert list(tri.get_xdata()) == [over["step"]]
    assert tri.get_ydata()[0] == pytest.approx(RMS_LINE, rel=1e-4)
    texts = _legend(fig)
    assert f"{RMS_LINE:.1f}: row RMS past which an fp16 sum of {D} squares overflows" in texts
    assert f"{over['layer']}'s largest row RMS (^: its fp16 sum of squares overflowed)" in texts
    # each line named once, in words: no "a = b" names, no entry twice
    assert len(texts) == len(set(texts)) and not any(" = " in t for t in texts), texts
    assert "h.1.ln_1's input (h.0's output)" in texts


def test_a_dead_arms_grad_norm_line_ends_with_a_mark_and_a_reason(made):
    (base, eps), figs = made
    fig = figs["grad_norm"]
    (ax,) = fig.axes
    texts = _legend(fig)
    assert ENDED_LABEL in texts
    for run in (base, eps):
        xs = [(int(x), v) for x, v in run.series("train/grad_norm")]
        last = max(x for x, v in xs if math.isfinite(v) and v > 0)
        after = [v for x, v in xs if x > last]
        zero = sum(1 for v in after if v == 0)
        bad = sum(1 for v in after if not math.isfinite(v))
        assert zero and bad  # measured: 0 (no gradient through the dead norm), then NaN
        label = (f"{run.arm} (ends at step {last}: then 0 on {zero} steps (no log scale point), "
                 f"non-finite on {bad} steps)")  # fmt: skip
        assert label in texts, texts
        value = dict(xs)[last]
        ends = [ln for ln in ax.get_lines() if ln.get_gid() == "end"
                and list(ln.get_xdata()) == [last]]  # fmt: skip
        assert pytest.approx(value) in [ln.get_ydata()[0] for ln in ends]
    assert len([ln for ln in ax.get_lines() if ln.get_gid() == "end"]) == 2  # one per arm
