"""Per-layer |x| max curves for one arm's panel, with the drifting layer in view.

In a drift the residual stream after block i *is* the input of block i+1's first norm
(``h.0`` and ``h.1.ln_1`` are one tensor), and the layers after it follow it closely: drawn
one by one, the last curve hides the first. So identical series are drawn once under a
joint name, and the layer that crossed the line first (from the events; else the one with
the largest max) is drawn thick and on top.
"""

from __future__ import annotations

import math

import torch
from matplotlib.lines import Line2D

from stabilize.numerics import sum_of_squares_rms_limit
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


RMS_LINE_COLOR = "#ff9896"  # the row-RMS line: the 256 line's red, lighter


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
            return e["layer"], "the first over 256"
    best, top = None, -math.inf
    for k in run.keys("act/"):
        m = max((v for _, v in run.series(k) if math.isfinite(v)), default=-math.inf)
        if m > top:
            best, top = k[4:], m
    return best, "the largest |x| max"


def _groups(run: Run) -> dict[str, list[str]]:
    """{series signature: layers} for layers whose logged |x| max series are identical."""
    out: dict[str, list[str]] = {}
    for k in run.keys("act/"):
        sig = repr([(x, f"{v:.6g}") for x, v in run.series(k)])
        out.setdefault(sig, []).append(k[4:])
    return out


def _is_norm(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("ln") or "norm" in last


def plain_label(layers: list[str], lead: str) -> str:
    """One line's legend entry, each tensor named once: the norm that reads it (as the events
    name it) and, in words, what else that tensor is. Thick or thin, one entry (the
    figure's legend says what thick means)."""
    others = [n for n in layers if n != lead]
    if _is_norm(lead):
        label = f"{lead}'s input"
        if others:
            label += f" ({' and '.join(others)}'s output)"
    else:
        label = f"{lead}'s output" + (f" (also {', '.join(others)})" if others else "")
    return label


def draw_layers(ax, run: Run, colors: dict[str, str]) -> list[tuple]:
    """Draw one arm's layers on ``ax``: [(legend label, handle, non-finite steps, dropped)]."""
    top, _ = emphasised(run)
    drawn = []
    for layers in _groups(run).values():
        norms = [n for n in layers if _is_norm(n)]
        lead = top if top in layers else (norms or layers)[0]
        thick = lead == top
        label = plain_label(layers, lead)
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
            h = Line2D([], [], color=color, lw=1.0, label=label)
            drawn.append((label, h, bad, dropped))
    return drawn


def rms_layer(run: Run) -> tuple[str | None, float | None]:
    """(norm, line): the norm whose fp16 sum of squares the run's text names (its first
    overflow; else the thick layer) when its largest row RMS is logged, and the row RMS past
    which that sum overflows, 255.94 / sqrt(D) (a forecast's own ``limit``, else from
    ``model.d_model``)."""
    first = next((e.get("layer") for e in run.events if e.get("monitor") == "overflow"), None)
    layer = first if first and run.series(f"rms/{first}") else emphasised(run)[0]
    if not layer or not run.series(f"rms/{layer}"):
        return None, None
    for e in run.events:
        extra = e.get("extra") or {}
        if e.get("monitor") == "forecast" and extra.get("line") == "rms" and "limit" in extra:
            return layer, float(extra["limit"])
    d = (run.config.get("model") or {}).get("d_model")
    return (layer, sum_of_squares_rms_limit(torch.float16, int(d))) if d else (None, None)


def draw_rms(ax, run: Run, colors: dict[str, str]) -> tuple[str, str, float] | None:
    """The norm's largest row RMS (dotted, its layer's colour) and its overflow line; an
    overflow of that norm is a triangle on the line at its step (the RMS itself is then
    inf, not logged). Returns (norm, legend label, line) or None when the run has no such series."""
    layer, line = rms_layer(run)
    if layer is None:
        return None
    color = colors.get(layer, LAYER_PALETTE[0])
    for p in pieces(run, f"rms/{layer}"):
        ys = [v if math.isfinite(v) and v > 0 else math.nan for v in p.ys]
        ax.plot(p.xs, ys, color=color, lw=1.4, ls=(0, (1, 1)), alpha=0.5 if p.abandoned else 1,
                gid="rms")  # fmt: skip
    over = [int(e["step"]) for e in run.events
            if e.get("monitor") == "overflow" and e.get("layer") == layer]  # fmt: skip
    if over:
        ax.plot([min(over)], [line], color=color, ls="none", lw=0, marker="^", ms=8, zorder=5,
                gid="rms_over")  # fmt: skip
    ax.axhline(line, color=RMS_LINE_COLOR, lw=1, ls="--", gid="rms_line")
    label = f"{layer}'s largest row RMS (^: its fp16 sum of squares overflowed)"
    return layer, label, line
