"""The quantized operands' figure and table (stabilize/report/quant_layers.py) against
hand-made series: what the figure draws, read from its artists (not its bytes), and each
table cell against the series' own extremes."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from stabilize.report.cli import write_report
from stabilize.report.load import Run
from stabilize.report.plots import figures
from stabilize.report.quant_layers import (
    DROPPED_LABEL,
    HEAD,
    MAX_LABEL,
    TOP,
    headroom_figure,
    layer_lines,
    layer_rows,
)

X, W, DY = "h.0.attn.c_proj.x", "h.0.attn.c_proj.w", "h.0.attn.c_proj.dy"
W1 = "h.1.mlp.c_fc.w"  # its amax ratio series is W's: drawn once, named both ways
A = "h.0.attn.c_attn.x"  # X's series too, sorts before X: the joint line is still X's

# fp8_delayed: X saturates most (3% at step 3); DY's amax ratio is the largest (2.0) but it
# saturates less (1%); W flushes 8% to 0 from step 2 and never saturates; A never saturates
FP8 = {
    X: {"q_ratio": [0.5, 0.9, 1.7, 1.2], "q_sat": [0, 0, 0.03, 0.01], "q_clip": [0, 0, 0, 0],
        "q_sqnr": [30, 28, 12.5, 20], "q_under": [0.01, 0.02, 0.01, 0.01]},
    W: {"q_ratio": [0.3] * 4, "q_sat": [0] * 4, "q_sqnr": [35] * 4,
        "q_under": [0.06, 0.08, 0.07, 0.08]},
    DY: {"q_ratio": [0.1, 2.0, 0.2, 0.1], "q_sat": [0, 0.01, 0, 0], "q_sqnr": [25, 9, 25, 25],
         "q_under": [0] * 4},
    W1: {"q_ratio": [0.3] * 4, "q_sat": [0] * 4, "q_sqnr": [33] * 4, "q_under": [0.01] * 4},
    A: {"q_ratio": [0.5, 0.9, 1.7, 1.2], "q_sat": [0] * 4, "q_sqnr": [31] * 4,
        "q_under": [0] * 4},
}  # fmt: skip
# mxfp8: nothing saturates, X's ratio is the largest; X clips 2% of its blocks at step 2
MX = {
    X: {"q_ratio": [0.2, 0.6, 0.3], "q_sat": [0] * 3, "q_clip": [0, 0.02, 0],
        "q_sqnr": [31, 30, 29], "q_under": [0] * 3},
    DY: {"q_ratio": [0.2, 0.5, 0.3], "q_sat": [0] * 3, "q_sqnr": [27] * 3, "q_under": [0] * 3},
    W: {"q_ratio": [0.1, 0.1, 0.15], "q_sat": [0] * 3, "q_sqnr": [40] * 3, "q_under": [0] * 3},
}  # fmt: skip


def _run(arm: str, ops: dict, steps: list[int] | None = None) -> Run:
    n = len(next(iter(ops.values()))["q_ratio"])
    steps = steps or list(range(1, n + 1))
    rows = []
    for i, s in enumerate(steps):
        row = {"x": float(i + 1), "train/step": float(s), "train/loss": 5.0 - 0.1 * i}
        for op, series in ops.items():
            row.update({f"{k}/{op}": float(v[i]) for k, v in series.items()})
        rows.append(row)
    return Run(name=arm, arm=arm, config={}, rows=rows)


def _plain() -> Run:
    return Run("fp16", "fp16", {}, [{"x": float(s), "train/step": float(s), "train/loss": 4.0,
                                     "act/h.0": 3.0} for s in range(1, 5)])  # fmt: skip


@pytest.fixture
def fig():
    f = headroom_figure([_plain(), _run("fp8_delayed", FP8), _run("mxfp8", MX)])
    yield f
    plt.close(f)


def _data(ax) -> list:
    """The drawn series, not the line at 1 (an axhline: x in axes coordinates)."""
    return [ln for ln in ax.get_lines() if list(ln.get_xdata()) != [0, 1]]


def _xy(ln) -> tuple[list, list]:
    return [int(x) for x in ln.get_xdata()], [float(y) for y in ln.get_ydata()]


def _panel(fig, arm):
    (ax,) = [a for a in fig.axes if a.get_title() == arm]
    return ax


def test_every_operand_is_drawn_once_against_the_formats_max(fig):
    assert [a.get_title() for a in fig.axes] == ["fp8_delayed", "mxfp8"]  # fp16: no panel
    ax = _panel(fig, "fp8_delayed")
    got = sorted(_xy(ln) for ln in _data(ax))
    # W and W1 are one series, and A and X: one line each, not two on top of each other
    assert got == sorted(([1, 2, 3, 4], FP8[op]["q_ratio"]) for op in (X, W, DY))
    (one,) = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [0, 1]]
    assert list(one.get_ydata()) == [1, 1] and ax.get_yscale() == "log"
    labels = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]
    assert labels == [
        "h.0.attn.c_proj grad-output (dy)",
        "h.0.attn.c_proj weight (w) (the same series: h.1.mlp.c_fc weight (w))",
        "h.0.attn.c_proj input (x) (the same series: h.0.attn.c_attn input (x)); thick: peak "
        "saturated share 3.00% (step 3), the largest",
        MAX_LABEL,
    ]


def test_the_most_saturated_operand_is_thick_on_top_not_the_largest_ratio(fig):
    lines = _data(_panel(fig, "fp8_delayed"))
    thick = max(lines, key=lambda ln: ln.get_linewidth())
    assert _xy(thick) == ([1, 2, 3, 4], FP8[X]["q_ratio"])  # not DY's 2.0
    others = [ln for ln in lines if ln is not thick]
    assert all(ln.get_linewidth() < thick.get_linewidth() for ln in others)
    assert all(ln.get_zorder() < thick.get_zorder() for ln in others)
    assert lines[-1] is thick  # drawn last too


def test_nothing_saturated_the_largest_ratio_is_thick(fig):
    ax = _panel(fig, "mxfp8")
    lines = _data(ax)
    assert sorted(_xy(ln) for ln in lines) == sorted(([1, 2, 3], MX[op]["q_ratio"])
                                                     for op in (X, W, DY))  # fmt: skip
    thick = max(lines, key=lambda ln: ln.get_linewidth())
    assert _xy(thick)[1] == MX[X]["q_ratio"] and thick.get_linestyle() == "-"  # x: solid
    labels = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]
    assert labels == [
        "h.0.attn.c_proj grad-output (dy)",
        "h.0.attn.c_proj weight (w)",
        "h.0.attn.c_proj input (x); thick: peak saturated share 0 (nothing saturated), its amax "
        "ratio the largest, 0.6 (step 2)",
        MAX_LABEL,
    ]


def test_the_x_axis_is_the_model_step_and_a_dropped_attempt_is_drawn_faded():
    # the model rewinds from step 3 to 2 (train/step drops): row 4 is the stale batch
    ops = {X: {"q_ratio": [0.5, 0.9, 1.7, 0.8, 0.7], "q_sat": [0, 0, 0.02, 0, 0]}}
    run = _run("fp8_tensor", ops, steps=[1, 2, 3, 2, 3])
    f = headroom_figure([run])
    (ax,) = f.axes
    kept = [ln for ln in _data(ax) if ln.get_alpha() is None]
    dropped = [ln for ln in _data(ax) if ln.get_alpha() == 0.5]
    assert [_xy(ln) for ln in kept] == [([1, 2, 3], [0.5, 0.9, 0.7])]
    assert [_xy(ln) for ln in dropped] == [([2, 3], [0.9, 1.7])]
    assert DROPPED_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]
    rows, _ = layer_rows([run])
    assert rows[1][2:4] == ["1.7 (step 3)", "2.00% (step 3)"]  # the model step, not row 3's x
    plt.close(f)


def test_the_table_cells_are_the_series_extremes():
    rows, left = layer_rows([_plain(), _run("fp8_delayed", FP8), _run("mxfp8", MX)])
    assert rows[0] == HEAD and left == {}
    body = {(r[0], r[1]): r[2:] for r in rows[1:]}
    # the most saturated first; W1 and A did nothing worth a row, nor MX's W and DY
    assert [r[:2] for r in rows[1:]] == [
        ["fp8_delayed", "h.0.attn.c_proj input (x)"],
        ["fp8_delayed", "h.0.attn.c_proj grad-output (dy)"],
        ["fp8_delayed", "h.0.attn.c_proj weight (w)"],
        ["mxfp8", "h.0.attn.c_proj input (x)"],
    ]
    assert body["fp8_delayed", "h.0.attn.c_proj input (x)"] == [
        "1.7 (step 3)", "3.00% (step 3)", "0", "12.5 (step 3)", "2.00% (step 2)"]  # fmt: skip
    assert body["fp8_delayed", "h.0.attn.c_proj grad-output (dy)"] == [
        "2 (step 2)", "1.00% (step 2)", "-", "9.0 (step 2)", "0"]  # fmt: skip
    # an 8% underflow is a row of its own, first reached at step 2 (8% again at step 4)
    assert body["fp8_delayed", "h.0.attn.c_proj weight (w)"] == [
        "0.3 (step 1)", "0", "-", "35.0 (step 1)", "8.00% (step 2)"]  # fmt: skip
    assert body["mxfp8", "h.0.attn.c_proj input (x)"] == [
        "0.6 (step 2)", "0", "2.00% (step 2)", "29.0 (step 3)", "0"]  # fmt: skip


def test_an_arm_with_more_than_twelve_rows_shows_the_worst_and_counts_the_rest():
    ops = {f"h.{i}.mlp.c_fc.x": {"q_ratio": [1.0, 1.5], "q_sat": [0, (i + 1) / 100]}
           for i in range(TOP + 3)}  # fmt: skip
    run = _run("nvfp4", ops)
    rows, left = layer_rows([run])
    assert left == {"nvfp4": 3}
    shares = [float(r[3].split("%")[0]) for r in rows[1:]]
    assert shares == [float(i + 1) for i in range(TOP + 2, 2, -1)]  # 15% .. 4%, 3 left out
    text = "\n".join(layer_lines([run]))
    assert "`nvfp4`: 3 more operands saturated, clipped or flushed, left out" in text


def test_a_run_without_quantized_series_has_no_figure_and_no_table(tmp_path):
    plain = _plain()
    assert headroom_figure([plain]) is None
    made = figures([plain])
    assert "quant_headroom" not in made and "act_max" in made
    for f in made.values():
        plt.close(f)
    assert layer_rows([plain]) == ([HEAD], {}) and layer_lines([plain]) == []
    text = write_report([plain], tmp_path / "plain").read_text()
    assert "Quantized operands" not in text and "quant_headroom" not in text


def test_the_report_shows_the_figure_and_the_table(tmp_path):
    text = write_report([_run("fp8_delayed", FP8)], tmp_path).read_text()
    assert "![quant_headroom](quant_headroom.png)" in text
    assert (tmp_path / "quant_headroom.png").stat().st_size > 10_000
    section = text.split("## Quantized operands")[1].split("\n## ")[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ")]
    assert rows[0] == "| " + " | ".join(HEAD) + " |" and len(rows) == 4
    assert "*max amax ratio*" in section


def test_the_axis_is_log_across_decades_with_the_cold_start_below_it_linear_near_one():
    """A delayed arm whose first two steps sit at 1e-8 and 1e-3 (an empty amax history)
    and later between 0.2 and 1.2: a log axis from half the lowest later ratio (0.1) to
    twice the largest, and the title says what fell below. A block format's ratios within
    a few percent of 1: a linear axis with the line at 1 in view, nothing said."""
    cold = _run("fp8_delayed", {X: {"q_ratio": [1e-8, 1e-3, 0.2, 1.2, 0.9]}})
    near = _run("mxfp8", {X: {"q_ratio": [1.12, 1.14, 1.13]}})
    f = headroom_figure([cold, near])
    try:
        (ax_cold,) = [a for a in f.axes if a.get_title().startswith("fp8_delayed")]
        assert ax_cold.get_yscale() == "log"
        assert ax_cold.get_ylim() == pytest.approx((0.1, 2.4))
        assert "below the axis: the first two steps" in ax_cold.get_title()
        ax_near = _panel(f, "mxfp8")
        assert ax_near.get_yscale() == "linear"
        low, high = ax_near.get_ylim()
        assert low <= 1.0 and high >= 1.14
    finally:
        plt.close(f)
