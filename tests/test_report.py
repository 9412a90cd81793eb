"""The report reads at a glance: one step axis (the model's), a legend entry for
every band and marker, the drifting layer in view, no curve in a threshold's colour, the
whole chain of events, arms named by what differs, and sweep.sh's members.

Two scenario arms are trained for real, shortened further than tests/test_scenario.py's
(the drift crosses 256 at step 14, 24 steps): the baseline (rollback off, goes non-finite)
and the remedy arm (one rollback at the drift's overflow, step 14, back to the snapshot at
step 10: the fp32 reduction, the overflow's own rung).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from test_scenario import SHORT as SCENARIO

from stabilize.report import chain, load_run_dir, main, summarize
from stabilize.report.axis import model_steps, pieces, rewinds
from stabilize.report.plots import (
    DROPPED_LABEL,
    LINE_COLOR,
    NONFINITE_LABEL,
    OVERFLOW_LABEL,
    ROLLBACK_LABEL,
    THICK_LABEL,
    THRESHOLD_COLORS,
    figures,
)
from stabilize.sweep import SweepError, members
from stabilize.train import run

from conftest import FAST, ROOT, compose_run, run_cli

CROSS, START, STEPS = 14, 6, 24
# test_scenario's short scenario, shorter still, with the outlier-feature drift on GPT-2's
# init (the scenario before it got a reference arm): one channel's |x| max passes 256 exactly
# at CROSS, past fp16's max, the baseline never trains and goes NaN, the remedy (eps 1e-3,
# see the fixture) rolls back twice; the plots and the chain are tested on those events
CHANGED = {
    "fault": "activation_drift",
    "fault.channels": 1,
    "fault.target": 1e5,
    "fault.target_step": "null",
    "model.init_std": 0.02,
    "trainer.max_steps": STEPS,
    "fault.step": START,
    "fault.cross_step": CROSS,
    "trainer.val_check_interval": STEPS,
    "trainer.limit_val_batches": 1,
    "trainer.checkpoint_every_n_steps": STEPS,
    "audit.every": 6,
}
SHORT = [o for o in SCENARIO if o.split("=")[0] not in CHANGED]
SHORT += [f"{k}={v}" for k, v in CHANGED.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arms")
    for arm, extra in (("baseline", []), ("remedy", ["norm.eps=1e-3"])):
        run(compose_run(root / arm, [*SHORT, f"arm={arm}", *extra]))
    return [load_run_dir(root / a) for a in ("baseline", "remedy")]


@pytest.fixture(scope="module")
def figs(runs):
    made = figures(runs)
    yield made
    for f in made.values():
        plt.close(f)


def _data_lines(ax):
    """The plotted curves: not the axhline/axvline markers (drawn in axes coordinates)."""
    out = []
    for line in ax.get_lines():
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        if xs == [0, 1] or ys == [0, 1]:
            continue
        out.append(line)
    return out


def _legend_texts(fig) -> set[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return {t.get_text() for lg in legends for t in lg.get_texts()}


def test_the_remedy_arm_rewinds_and_every_plot_counts_model_steps(runs, figs):
    base, remedy = runs
    rws = rewinds(remedy)
    # the persistent drift replays the same overflow on the next batch: deterministic, so
    # the ladder's numerics rungs (skip_data fits data-linked faults only; issue 15)
    # an overflowed reduction: the ladder's own rung for that site, fp32_reduction, first
    assert [(rw.at, rw.to, rw.remedy) for rw in rws] == [(CROSS, 10, "fp32_reduction")]
    model = {int(r["train/step"]) for r in remedy.rows if "train/step" in r}
    assert max(r["x"] for r in remedy.rows) > STEPS  # Lightning's step ran on past 24
    for name in ("loss", "grad_norm", "loss_scale", "act_max"):
        for ax in figs[name].axes:
            for line in _data_lines(ax):
                assert set(line.get_xdata()) <= model | {s for s in range(1, STEPS + 1)}, name
                assert max(line.get_xdata()) <= STEPS, name
    # the table's crossing and the plot's are one step: the thick remedy line passes 256 at
    # the model step the table names (Lightning's step there is 6 later)
    s = summarize(remedy)
    assert s.first_over_line == CROSS
    (ax,) = [a for a in figs["act_max"].axes if a.get_title() == "remedy"]
    thick = max(_data_lines(ax), key=lambda ln: ln.get_linewidth())
    first = next(x for x, y in zip(thick.get_xdata(), thick.get_ydata(), strict=True) if y > 256)
    assert first == CROSS
    # each dropped attempt is its own piece, from the restored step to where it was dropped
    dropped = [p for p in pieces(remedy, "train/loss") if p.abandoned]
    assert [p.xs for p in dropped] == [list(range(10, CROSS + 1))]
    kept = pieces(remedy, "train/loss")[0]
    assert kept.xs == list(range(1, STEPS + 1))  # one point per model step, no stale batch
    assert None in model_steps(remedy).values()  # the stale batches' rows were set aside
    # without a rollback the axis is Lightning's step less nothing: the baseline's loss
    assert pieces(base, "train/loss")[0].xs == list(range(1, STEPS + 1))


def test_every_band_marker_and_arm_has_a_legend_entry(figs):
    # eps 1e-3: the dropped attempts trained (finite grad norms), so both plots draw them
    for name, dropped in (("loss", {DROPPED_LABEL}), ("grad_norm", {DROPPED_LABEL})):
        texts = _legend_texts(figs[name])
        assert {ROLLBACK_LABEL, OVERFLOW_LABEL, NONFINITE_LABEL} | dropped <= texts, name
        assert (DROPPED_LABEL in texts) == bool(dropped)
        # the baseline has no finite grad norm (the scaler skips every step): still named
        assert any(t.startswith("baseline") for t in texts) and "remedy" in texts, texts
    act = _legend_texts(figs["act_max"])
    assert "256: one fp16 square overflows" in act and "65504: fp16 max" in act
    assert {ROLLBACK_LABEL, OVERFLOW_LABEL} <= act
    assert "scale floor 1" in _legend_texts(figs["loss_scale"])


def test_the_drifting_layer_is_drawn_thick_and_named(runs, figs):
    act = _legend_texts(figs["act_max"])
    # h.0's output is h.1.ln_1's input: one series, drawn once, named once by the norm that
    # reads it (the monitor judges the tensor as that norm), the block's name in words
    assert "h.1.ln_1's input (h.0's output)" in act and THICK_LABEL in act
    for ax in figs["act_max"].axes:
        lines = [ln for ln in _data_lines(ax) if ln.get_alpha() is None]
        if not lines:
            continue
        widths = sorted(ln.get_linewidth() for ln in lines)
        assert widths[-1] > 2 * widths[-2]  # exactly one thick line per panel
        thick = max(lines, key=lambda ln: ln.get_linewidth())
        run_ = next(r for r in runs if r.arm == ax.get_title())
        drift = max(v for _, v in run_.series("act/h.0") if math.isfinite(v))
        assert max(thick.get_ydata()) == pytest.approx(drift)


def test_no_curve_takes_a_threshold_lines_colour(figs):
    for name, fig in figs.items():
        for ax in fig.axes:
            for line in _data_lines(ax):
                assert to_hex(line.get_color()) not in THRESHOLD_COLORS, (name, line)
    (ax, *_) = figs["act_max"].axes
    hlines = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [0, 1]]
    assert to_hex(next(ln for ln in hlines if ln.get_ydata()[0] == 256).get_color()) == LINE_COLOR


def test_the_chain_keeps_every_rollback_and_says_rollback_off(runs):
    base, remedy = runs
    lines = chain(remedy)
    rolled = [x for x in lines if "**rollback**" in x]
    assert [x.split("`")[1] for x in rolled] == ["fp32_reduction"]  # the overflow's own rung
    assert any("calls for a rollback** (overflow)" in x for x in lines)  # the drift's
    b = chain(base)
    assert any("**would roll back (rollback off)** (nonfinite)" in x for x in b)
    assert not any("**rollback**" in x or "calls for a rollback" in x for x in b)
    skips = [x for x in b if "**skip** (loss_scale)" in x]
    assert len(skips) == 1 and f"times, steps 1-{STEPS})" in skips[0]  # one line, not 24


def test_sweep_members_are_named_by_the_swept_key_and_compared(tmp_path):
    """A real `stabilize-train -m` sweep: members 0 and 1, named by norm.eps."""
    sweep = tmp_path / "sweep"
    small = [o for o in FAST if not o.startswith("trainer.progress")]
    r = run_cli(
        ["stabilize-train", "-m", "norm.eps=1e-6,1e-3", *small, "trainer.max_steps=2"],
        cwd=tmp_path,
        env={"STABILIZE_SWEEP_DIR": str(sweep)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "report"
    assert main([str(sweep / "0"), str(sweep / "1"), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    comparison = text.split("## Comparison")[1].split("## Per run")[0]
    rows = [x for x in comparison.splitlines() if x.startswith("| ")]
    assert rows[0].startswith("| norm.eps | status | model steps |")
    assert [x.split(" | ")[0] for x in rows[1:]] == ["| 1e-06", "| 0.001"]
    assert "| norm.eps=1e-06 |" in text and "| norm.eps=0.001 |" in text
    assert "## Conclusions" not in text and "fixes it" not in text
    assert "### norm.eps=0.001" in text and "### 1\n" not in text


def test_sweep_expands_choice_range_and_lists_with_hydras_parser():
    got = members(["norm=choice(layernorm,rmsnorm)", "seed=range(1,3)", "x=a,b", "y=1"])
    assert got == [
        ["norm=layernorm", "seed=1", "x=a", "y=1"],
        ["norm=layernorm", "seed=1", "x=b", "y=1"],
        ["norm=layernorm", "seed=2", "x=a", "y=1"],
        ["norm=layernorm", "seed=2", "x=b", "y=1"],
        ["norm=rmsnorm", "seed=1", "x=a", "y=1"],
        ["norm=rmsnorm", "seed=1", "x=b", "y=1"],
        ["norm=rmsnorm", "seed=2", "x=a", "y=1"],
        ["norm=rmsnorm", "seed=2", "x=b", "y=1"],
    ]
    assert members(["name='a,b'", "l=[1,2]"]) == [["name='a,b'", "l=[1,2]"]]  # not swept
    with pytest.raises(SweepError, match=r"cannot expand 'lr=interval\(0,1\)'"):
        members(["lr=interval(0,1)"])


def _sweep_sh(args, tmp_path, **env):
    return run_cli(["bash", str(ROOT / "scripts" / "sweep.sh"), *args], cwd=tmp_path, env=env)


def test_sweep_script_lists_members_and_refuses_what_it_cannot_expand(tmp_path):
    # no PYTHON: the script takes the Python beside stabilize-train (the venv's, on PATH
    # first), not /usr/bin's
    venv_bin = str(Path(sys.executable).parent)
    env = {"PYTHON": "", "PATH": f"{venv_bin}:/usr/bin:/bin"}
    r = _sweep_sh(["--dry-run", "--", "norm=choice(layernorm,rmsnorm)", "seed=range(1,3)"],
                  tmp_path, **env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "norm=layernorm seed=1",
        "norm=layernorm seed=2",
        "norm=rmsnorm seed=1",
        "norm=rmsnorm seed=2",
    ]
    assert "4 members" in r.stderr
    r = _sweep_sh(["--dry-run", "--", "optim.lr=interval(1e-4,1e-3)"], tmp_path, **env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot expand 'optim.lr=interval(1e-4,1e-3)'" in r.stderr
    assert not (tmp_path / "runs").exists()
    # neither stabilize-train on PATH nor a .venv beside the script: refused, not /usr/bin's
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "sweep.sh", tmp_path / "scripts" / "sweep.sh")
    r = run_cli(["bash", str(tmp_path / "scripts" / "sweep.sh"), "--", "a=1,2"], cwd=tmp_path,
                env={"PYTHON": "", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 2 and "set PYTHON=" in r.stderr
