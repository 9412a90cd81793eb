"""Per-layer |x| max curves for one arm's panel, with the drifting layer in view.

In a drift the residual stream after block i *is* the input of block i+1's first norm
(``h.0`` and ``h.1.ln_1`` are one tensor), and the layers after it follow it closely: drawn
one by one, the last curve hides the first. So identical series are drawn once under a
joint name, and the layer that crossed the line first (from the events; else the one with
the largest max) is drawn thick and on top.
"""

from __future__ import annotations

import math

from matplotlib.lines import Line2D

from stabilize.report.axis import pieces
from stabilize.report.load import Run

# no red (the 256 line), no black (fp16 max), no grey (markers)
LAYER_PALETTE = [
    "#1f77b4",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#17becf",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#aec7e8",
    "#98df8a",
    "#ffbb78",
    "#c5b0d5",
]


def layer_colors(runs: list[Run]) -> dict[str, str]:
    """One colour per layer name, the same in every panel."""
    names = sorted({k[4:] for r in runs for k in r.keys("act/")})
    return {n: LAYER_PALETTE[i % len(LAYER_PALETTE)] for i, n in enumerate(names)}


def emphasised(run: Run) -> tuple[str | None, str]:
    """(layer, why): the layer the activation monitor flagged first, else the largest max."""
    logged = run.keys("act/")
    for e in run.events:
        flagged = e.get("monitor") == "activation" and e.get("kind") == "warn"
        if flagged and f"act/{e.get('layer')}" in logged:
            return e["layer"], "first over 256"
    best, top = None, -math.inf
    for k in run.keys("act/"):
        m = max((v for _, v in run.series(k) if math.isfinite(v)), default=-math.inf)
        if m > top:
            best, top = k[4:], m
    return best, "largest max"


def _groups(run: Run) -> dict[str, list[str]]:
    """{series signature: layers} for layers whose logged |x| max series are identical."""
    out: dict[str, list[str]] = {}
    for k in run.keys("act/"):
        sig = repr([(x, f"{v:.6g}") for x, v in run.series(k)])
        out.setdefault(sig, []).append(k[4:])
    return out


def draw_layers(ax, run: Run, colors: dict[str, str]) -> list[tuple]:
    """Draw one arm's layers on ``ax``: [(legend label, handle, non-finite steps, dropped)]."""
    top, why = emphasised(run)
    drawn = []
    for layers in _groups(run).values():
        lead = top if top in layers else layers[0]
        thick = lead == top
        label = " = ".join([lead] + [n for n in layers if n != lead])
        if thick:
            label += f" ({why})"
        color = colors[lead]
        bad, dropped, any_finite = [], False, False
        for p in pieces(run, f"act/{lead}"):
            bad += [x for x, v in zip(p.xs, p.ys, strict=True) if not math.isfinite(v)]
            ys = [v if math.isfinite(v) and v > 0 else math.nan for v in p.ys]
            if not any(math.isfinite(y) for y in ys):
                continue
            any_finite = True
            if p.abandoned:
                dropped = True
                ax.plot(p.xs, ys, color=color, lw=1, alpha=0.5, marker="x", markevery=[len(ys) - 1])
            else:
                ax.plot(p.xs, ys, color=color, lw=2.6 if thick else 1.0, zorder=4 if thick else 2)
        if any_finite:
            h = Line2D([], [], color=color, lw=2.6 if thick else 1.0, label=label)
            drawn.append((label, h, bad, dropped))
    return drawn
