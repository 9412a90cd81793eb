"""Per-operand headroom of a quantized arm: where and when its GEMM operands ran into the
format's max, drawn beside each other and listed in a table.

``quant_hides.py`` gives one number per arm, its worst operand. What that leaves out is
which layer's input, weight or grad-output it was, and whether one operand hit the max or
many did. Each operand (``<layer>.x|w|dy``, stabilize/stability/quant_sites.py) logs its
amax over the format's max after its scaling (``q_ratio/``: 1 is the max, past it values
are clipped) beside the shares ``quant_hides`` reads (``q_sat/``, ``q_clip/``, ``q_sqnr/``,
``q_under/``).

The figure draws every operand's ratio in model steps (``report/axis.py``), one panel per
quantized arm, the most saturated operand thick and on top. Operands whose series are
identical are drawn once under a joint name, as ``layers.py`` does for activations: drawn
one by one, the last would hide the others. The table lists, per arm, the operands that
saturated, clipped a block or flushed more than 5% of their values to 0, the most
saturated first.
"""

from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")  # files only: no display here, none needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from stabilize.report.axis import pieces  # noqa: E402
from stabilize.report.layers import LAYER_PALETTE  # noqa: E402
from stabilize.report.load import Run  # noqa: E402
from stabilize.report.markdown import code as md_code  # noqa: E402
from stabilize.report.markdown import table as md_table  # noqa: E402

OPERANDS = {"x": "input (x)", "w": "weight (w)", "dy": "grad-output (dy)",
            "wx": "wgrad input (wx)", "wdy": "wgrad grad-output (wdy)"}  # fmt: skip
# the colour says the layer, the style the operand (wgrad's own: dash-dot-dot, dots spaced)
STYLES = {"x": "-", "w": "--", "dy": ":", "wx": (0, (4, 1, 1, 1, 1, 1)), "wdy": (0, (1, 3))}
PREFIXES = ("q_ratio/", "q_sat/", "q_clip/", "q_sqnr/", "q_under/")
MAX_COLOR = "#000000"  # the format's max, black as fp16's max is in plots.py
MAX_LABEL = "1: the format's max (clipped from half a step above it)"
DROPPED_LABEL = "attempt dropped by a rollback (x: where), then replayed"  # plots.py's words
XLABEL = "model step (a rollback rewinds it)"  # plots.py's axis
LABEL_WIDTH = 72  # characters a legend line holds in its 4.8 inches: longer ones wrap
UNDER_FLOOR = 0.05  # underflow below it: a format's usual flush of tiny values, not news
TOP = 12  # table rows per arm
HEAD = [
    "arm",
    "operand",
    "max amax ratio",
    "max saturated share",
    "max clipped-block share",
    "min SQNR (dB)",
    "max underflow share",
]
NOTE = (
    "One row per quantized operand that saturated, clipped a block or flushed more than 5% of "
    "its non-zero values to 0, the most saturated first (at most 12 per arm). *max amax "
    "ratio*: its largest amax over the format's max after scaling (1: the max; from half "
    "a step above it, 464/448 for E4M3 and 7/6 for E2M1, values are clipped); *max "
    "saturated share*: the largest share of its values past that edge "
    "(counted before the cast clips them); *max clipped-block share*: of its blocks "
    "(block formats); *min SQNR (dB)*: its lowest SQNR against its high-precision value; "
    "*max underflow share*: the largest share of its non-zero values flushed to 0. In "
    "brackets: the model step where it was first; `-`: not logged."
)
PLOT_NOTE = (
    "In quant_headroom: each quantized operand's amax over the format's max (1: the max; "
    "from half a step above it values are clipped), the colour its layer, the style its "
    "operand; thick: "
    "the operand with the largest saturated share."
)


def operand_name(op: str) -> str:
    """``h.0.attn.c_proj.dy`` -> ``h.0.attn.c_proj grad-output (dy)``."""
    layer, _, kind = op.rpartition(".")
    return f"{layer} {OPERANDS[kind]}" if layer and kind in OPERANDS else op


def _operands(run: Run, prefixes=("q_ratio/",)) -> list[str]:
    return sorted({k.removeprefix(p) for p in prefixes for k in run.keys(p)})


def peak(run: Run, key: str, pick=max) -> tuple[float, int] | None:
    """(value, model step) of a series' extreme over every logged attempt, at its first
    step; None when it has no finite value."""
    found = [
        (v, x)
        for p in pieces(run, key)
        for x, v in zip(p.xs, p.ys, strict=True)
        if v is not None and math.isfinite(v)
    ]
    if not found:
        return None
    best = pick(v for v, _ in found)
    return best, min(x for v, x in found if v == best)


def highlighted(run: Run) -> str | None:
    """The operand with the largest saturated share; on a tie, or none saturated, the one
    with the largest amax ratio among them."""
    best, top = None, (-math.inf, -math.inf)
    for op in _operands(run):
        sat, ratio = peak(run, f"q_sat/{op}"), peak(run, f"q_ratio/{op}")
        key = (sat[0] if sat else 0.0, ratio[0] if ratio else -math.inf)
        if key > top:
            best, top = op, key
    return best


def _groups(run: Run) -> list[list[str]]:
    """Operands whose logged amax ratio series are identical, together."""
    out: dict[str, list[str]] = {}
    for op in _operands(run):
        sig = repr([(x, f"{v:.6g}") for x, v in run.series(f"q_ratio/{op}")])
        out.setdefault(sig, []).append(op)
    return list(out.values())


def _label(run: Run, ops: list[str], lead: str, thick: bool) -> str:
    """One line's legend entry: each operand named once, the thick one with its peak."""
    label = operand_name(lead)
    others = [operand_name(o) for o in ops if o != lead]
    if others:
        label += f" (the same series: {', '.join(others)})"
    if not thick:
        return label
    sat = peak(run, f"q_sat/{lead}")
    if sat and sat[0] > 0:
        return f"{label}; thick: peak saturated share {sat[0]:.2%} (step {sat[1]}), the largest"
    ratio = peak(run, f"q_ratio/{lead}")
    top = f", its amax ratio the largest, {ratio[0]:.3g} (step {ratio[1]})" if ratio else ""
    return f"{label}; thick: peak saturated share 0 (nothing saturated){top}"


def _panel(ax, run: Run, colors: dict[str, str]) -> list:
    """One arm's operands on ``ax``, the thick one last; returns the legend's handles."""
    top = highlighted(run)
    groups = sorted(_groups(run), key=lambda g: top in g)  # the thick one drawn last
    handles, dropped = [], False
    for ops in groups:
        lead = top if top in ops else ops[0]
        thick = lead == top
        color = colors[lead.rpartition(".")[0]]
        ls = STYLES.get(lead.rpartition(".")[2], "-")
        lw, z = (2.6, 4) if thick else (1.0, 2)
        for p in pieces(run, f"q_ratio/{lead}"):
            ys = [v if v is not None and math.isfinite(v) and v > 0 else math.nan for v in p.ys]
            if not any(math.isfinite(y) for y in ys):
                continue
            if p.abandoned:
                dropped = True
                ax.plot(p.xs, ys, color=color, ls=ls, lw=1, alpha=0.5, marker="x",
                        markevery=[len(ys) - 1], zorder=z)  # fmt: skip
            else:
                ax.plot(p.xs, ys, color=color, ls=ls, lw=lw, zorder=z)
        label = "\n    ".join(textwrap.wrap(_label(run, ops, lead, thick), LABEL_WIDTH))
        handles.append(Line2D([], [], color=color, ls=ls, lw=lw, label=label))
    ax.axhline(1.0, color=MAX_COLOR, lw=1, ls="-.")
    handles.append(Line2D([], [], color=MAX_COLOR, lw=1, ls="-.", label=MAX_LABEL))
    if dropped:
        handles.append(Line2D([], [], color="#555555", lw=1, alpha=0.5, marker="x",
                              label=DROPPED_LABEL))  # fmt: skip
    return handles


def headroom_figure(runs: list[Run]) -> Figure | None:
    """Each quantized operand's amax over the format's max, one panel per quantized arm
    (None: no run logged ``q_ratio/``)."""
    quant = [r for r in runs if r.keys("q_ratio/")]
    if not quant:
        return None
    layers = sorted({op.rpartition(".")[0] for r in quant for op in _operands(r)})
    colors = {n: LAYER_PALETTE[i % len(LAYER_PALETTE)] for i, n in enumerate(layers)}
    most = max(len(_groups(r)) for r in quant) + 2
    ncol = math.ceil(most / 28)
    height = max(3.6, 0.16 * math.ceil(most / ncol) + 1.2)
    fig, axes = plt.subplots(len(quant), 1, figsize=(12 + 5 * ncol, height * len(quant) + 0.6),
                             squeeze=False)  # fmt: skip
    for ax, r in zip(axes[:, 0], quant, strict=True):
        handles = _panel(ax, r, colors)
        below = _y_axis(ax, r)
        ax.set_title(r.arm + below, fontsize=10)
        ax.set_xlabel(XLABEL, fontsize=8)
        ax.set_ylabel("amax / the format's max", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  ncol=ncol)  # fmt: skip
    fig.suptitle("quantized GEMM operands: amax over the format's max after scaling")
    width = 12 + 5 * ncol  # ~4.8 inches of legend a column, right of the axes
    fig.subplots_adjust(left=0.9 / width, right=1 - 4.8 * ncol / width, top=0.93, hspace=0.45)
    return fig


def _y_axis(ax, r: Run) -> str:
    """A log axis where the ratios span decades, linear where they do not (a block format's
    sit within a few percent of 1); on a log axis, from the lowest ratio after the first two
    steps (a delayed scale's cold start: an empty history, ratios down to 1e-8 that would
    flatten the rest), and what falls below is said in the title (returned)."""
    later = [v for op in _operands(r) for x, v in r.series(f"q_ratio/{op}")
             if x > 2 and math.isfinite(v) and v > 0]  # fmt: skip
    every = [v for op in _operands(r) for _, v in r.series(f"q_ratio/{op}")
             if math.isfinite(v) and v > 0]  # fmt: skip
    if not every or max(every) / min(every) < 20:
        return ""  # linear: the default axis, the line at 1 in view
    ax.set_yscale("log")
    if not later or min(every) >= min(later) / 2:
        return ""
    ax.set_ylim(min(later) / 2, max(every) * 2)
    return " (below the axis: the first two steps, the amax history's cold start)"


def _share(v: float) -> str:
    """A share in percent: two decimals, or two significant digits below 0.1% (a share of
    a few elements in 100,000 is not "0.00%")."""
    return f"{v:.2%}" if v >= 1e-3 else f"{100 * v:.2g}%"


def _cell(p: tuple[float, int] | None, fmt) -> str:
    """``fmt``: a format string, or ``_share`` for a share (0 is "0")."""
    if p is None:
        return "-"
    if p[0] == 0 and fmt is _share:
        return "0"
    return f"{fmt(p[0]) if callable(fmt) else fmt.format(p[0])} (step {p[1]})"


def layer_rows(runs: list[Run]) -> tuple[list[list[str]], dict[str, int]]:
    """The table (header first): per arm, its operands that saturated, clipped a block or
    flushed more than 5% to 0, the most saturated first, at most ``TOP``; and by arm, how
    many more there were."""
    rows, left = [list(HEAD)], {}
    for r in runs:
        found = []
        for op in _operands(r, PREFIXES):
            ratio, sat, clip = (peak(r, f"{p}{op}") for p in ("q_ratio/", "q_sat/", "q_clip/"))
            sqnr, under = peak(r, f"q_sqnr/{op}", min), peak(r, f"q_under/{op}")
            shares = tuple(p[0] if p else 0.0 for p in (sat, clip, under))
            if not (shares[0] > 0 or shares[1] > 0 or shares[2] > UNDER_FLOOR):
                continue
            cells = [r.arm, operand_name(op), _cell(ratio, "{:.3g}")]
            cells += [_cell(sat, _share), _cell(clip, _share), _cell(sqnr, "{:.1f}")]
            cells += [_cell(under, _share)]
            found.append(((-shares[0], -shares[1], -shares[2], op), cells))
        found.sort(key=lambda f: f[0])
        rows += [cells for _, cells in found[:TOP]]
        if len(found) > TOP:
            left[r.arm] = len(found) - TOP
    return rows, left


def layer_lines(runs: list[Run]) -> list[str]:
    """report.md's section on the quantized operands ([] without a quantized arm)."""
    if not any(r.keys(p) for r in runs for p in PREFIXES):
        return []
    rows, left = layer_rows(runs)
    lines = ["## Quantized operands", ""]
    if len(rows) == 1:
        return lines + [
            "No quantized operand saturated, clipped a block or flushed more than 5% of its "
            "non-zero values to 0.",
            "",
        ]
    lines += [md_table(rows), ""]
    lines += [
        f"{md_code(arm)}: {n} more operands saturated, clipped or flushed, left out (the "
        f"{TOP} most saturated are above)."
        for arm, n in left.items()
    ]
    return lines + ([""] if left else []) + [NOTE, ""]
