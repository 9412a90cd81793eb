"""The report's PNG plots: one figure per question, every arm on it.

x is the model's own step, as in the table (``report/axis.py``): the kept trajectory is a
solid line, an attempt a rollback dropped is a faded piece from the restored step to an
``x`` where it was dropped, and the rollback itself a dotted line at the step the model
rewound to. Every band, marker and threshold line has a legend entry; no curve takes a
threshold line's colour.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display here, none needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from stabilize.numerics import FP16_MAX  # noqa: E402
from stabilize.report.axis import pieces, rewinds  # noqa: E402
from stabilize.report.layers import RMS_LINE_COLOR, draw_layers, draw_rms, layer_colors  # noqa: E402
from stabilize.report.load import Run  # noqa: E402
from stabilize.report.quant_layers import headroom_figure  # noqa: E402
from stabilize.report.summary import LINE  # noqa: E402

LINE_COLOR = "#d62728"  # the 256 line (red)
MAX_COLOR = "#000000"  # fp16's max, the loss-scale floor (black)
THRESHOLD_COLORS = (LINE_COLOR, MAX_COLOR, RMS_LINE_COLOR)
# tab10 without its red and grey: a curve never reads as a threshold or a marker
PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
]
MARK = "#555555"  # markers' legend proxies: the style is the meaning, the colour the arm
XLABEL = "model step (a rollback rewinds it)"
ROLLBACK_LABEL = "rollback: the model step rewinds to here"
DROPPED_LABEL = "attempt dropped by a rollback (x: where), then replayed"
OVERFLOW_LABEL = "first overflowed fp16 reduction (dead tokens)"
NONFINITE_LABEL = "steps with non-finite values (shaded in the arm's colour)"
THICK_LABEL = "thick: the panel's first layer over 256 (none: its largest |x| max)"
ENDED_LABEL = "the line ends: what follows cannot be drawn (the arm's entry says what)"


def _colors(runs: list[Run]) -> dict[str, str]:
    return {r.arm: PALETTE[i % len(PALETTE)] for i, r in enumerate(runs)}


def _clean(ys: list[float], log: bool) -> list[float]:
    """Non-finite values (and non-positive ones on a log axis) are gaps, not bridges."""
    return [v if math.isfinite(v) and (v > 0 or not log) else math.nan for v in ys]


def _draw(ax, run: Run, key: str, color: str, log: bool, lw: float = 1.3, **kw) -> dict:
    """One run's metric in model steps; returns what was drawn (for the legend). Where the
    kept trajectory has values past its last drawable point (0 on a log axis, non-finite),
    the line's end is marked and ``got["ended"]`` says at which step and why."""
    got = {"finite": False, "dropped": False, "nonfinite": [], "ended": None}
    last = None  # (step, value) of the kept trajectory's last drawable point
    after: list[float] = []  # the kept values logged after it
    for p in pieces(run, key):
        ys = _clean(p.ys, log)
        got["nonfinite"] += [x for x, v in zip(p.xs, p.ys, strict=True) if not math.isfinite(v)]
        if not p.abandoned:
            for x, v, y in zip(p.xs, p.ys, ys, strict=True):
                if math.isfinite(y):
                    last, after = (x, y), []
                else:
                    after.append(v)
        if not any(math.isfinite(y) for y in ys):
            continue
        got["finite"] = True
        if p.abandoned:
            got["dropped"] = True
            ax.plot(p.xs, ys, color=color, lw=1, alpha=0.5, marker="x", markevery=[len(ys) - 1])
        else:
            ax.plot(p.xs, ys, color=color, lw=lw, **kw)
    if last is not None and after:
        ax.plot([last[0]], [last[1]], color=color, ls="none", marker="D", ms=7, mfc="none",
                mew=1.5, zorder=5, gid="end")  # fmt: skip
        got["ended"] = (last[0], _why_ended(after, log))
    return got


def _why_ended(after: list[float], log: bool) -> str:
    """What follows a line's last drawable point, in words: '0 on 21 steps, non-finite on 7'."""
    zero = sum(1 for v in after if math.isfinite(v) and v <= 0 and log)
    bad = sum(1 for v in after if not math.isfinite(v))
    parts = [f"0 on {zero} steps (no log scale point)"] if zero else []
    parts += [f"non-finite on {bad} steps"] if bad else []
    return ", ".join(parts) or "no value"


def drawable(run: Run, key: str, log: bool) -> dict[int, float]:
    """{model step: value} of the kept trajectory's drawable points."""
    out = {}
    for p in pieces(run, key):
        if not p.abandoned:
            out.update({x: y for x, y in zip(p.xs, _clean(p.ys, log), strict=True)
                        if math.isfinite(y)})  # fmt: skip
    return out


def same_as(series: dict[str, dict[int, float]], rel: float = 1e-3) -> dict[str, tuple]:
    """{arm: (earlier arm, [(first, last step)], all)} for an arm whose curve lies on an
    earlier arm's for 2 or more steps in a row (equal within ``rel``, far below a pixel):
    drawn one over the other, the later would hide it. ``all``: at every step it has."""
    out: dict[str, tuple] = {}
    arms = list(series)
    for i, arm in enumerate(arms):
        mine = series[arm]
        for other in arms[:i]:
            theirs = series[other]
            shared = sorted(set(mine) & set(theirs))
            close = [
                x
                for x in shared
                if abs(mine[x] - theirs[x]) <= rel * max(abs(mine[x]), abs(theirs[x]))
            ]
            runs = _runs(close, sorted(mine))
            if runs:
                out[arm] = (other, runs, len(close) == len(mine))
                break
    return out


def _runs(equal: list[int], steps: list[int]) -> list[tuple[int, int]]:
    """Stretches of 2 or more of ``steps`` in a row that are all in ``equal``."""
    at = {x: i for i, x in enumerate(steps)}
    out: list[list[int]] = []
    for x in equal:
        if out and at[x] == at[out[-1][1]] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return [(a, b) for a, b in out if b > a]


def widths(arms: list[str], same: dict[str, tuple], lw: float = 1.3) -> dict[str, float]:
    """Line widths so that no arm hides another: an arm that a later one lies on is drawn
    wider by 2 points per arm on top of it (one on another: 3.3 under 1.3), the later on top."""
    under = dict.fromkeys(arms, 0)
    for arm in arms:
        o = same.get(arm)
        while o is not None:
            under[o[0]] += 1
            o = same.get(o[0])
    return {a: lw + 2.0 * under[a] for a in arms}


def same_note(arm: str, same: dict[str, tuple]) -> str:
    """'identical to baseline', or '= baseline at steps 1-12, 14-40'."""
    if arm not in same:
        return ""
    other, runs, whole = same[arm]
    if whole:
        return f"identical to {other}"
    return f"= {other} at steps " + ", ".join(f"{a}-{b}" for a, b in runs)


def _markers(ax, run: Run, color: str, nonfinite: list[int]) -> set[str]:
    """Rollbacks (dotted, at the restored step), the first overflow (dashed), the non-finite
    band; returns the legend labels they need."""
    used = set()
    for rw in rewinds(run):
        ax.axvline(rw.to, color=color, ls=":", lw=1.2, alpha=0.9)
        used.add(ROLLBACK_LABEL)
    first = next((e for e in run.events if e.get("monitor") == "overflow"), None)
    if first is not None and first.get("step") is not None:
        ax.axvline(int(first["step"]), color=color, ls="--", lw=1, alpha=0.7)
        used.add(OVERFLOW_LABEL)
    for lo, hi in spans(nonfinite):
        ax.axvspan(lo - 0.5, hi + 0.5, color=color, alpha=0.12, lw=0)
        used.add(NONFINITE_LABEL)
    return used


def spans(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps: [1, 2, 3, 7] -> [(1, 3), (7, 7)]. One band per run of
    non-finite steps, so a few scattered skips do not shade the whole plot."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and s <= out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _proxies(used: set[str]) -> list:
    """Legend entries for the markers actually drawn, in a fixed order."""
    styles = {
        DROPPED_LABEL: Line2D([], [], color=MARK, lw=1, alpha=0.5, marker="x"),
        ROLLBACK_LABEL: Line2D([], [], color=MARK, ls=":", lw=1.2),
        OVERFLOW_LABEL: Line2D([], [], color=MARK, ls="--", lw=1),
        NONFINITE_LABEL: Patch(color=MARK, alpha=0.2, lw=0),
        ENDED_LABEL: Line2D([], [], color=MARK, ls="none", marker="D", ms=7, mfc="none"),
    }
    out = []
    for label, h in styles.items():
        if label in used:
            h.set_label(label)
            out.append(h)
    return out


def _metric_figure(runs, key, title, ylabel, log=False, lines=()) -> Figure | None:
    colors = _colors(runs)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    handles, used, any_finite = [], set(), False
    drawn = [r for r in runs if r.series(key)]
    same = same_as({r.arm: drawable(r, key, log) for r in drawn})
    lw = widths([r.arm for r in drawn], same)
    for r in drawn:
        got = _draw(ax, r, key, colors[r.arm], log, lw=lw[r.arm])
        any_finite |= got["finite"]
        used |= _markers(ax, r, colors[r.arm], got["nonfinite"])
        if got["dropped"]:
            used.add(DROPPED_LABEL)
        # every arm in the legend, also one with no finite value to draw (its band says why)
        notes = [same_note(r.arm, same)] if r.arm in same else []
        if got["ended"] is not None:
            used.add(ENDED_LABEL)
            notes.append(f"ends at step {got['ended'][0]}: then {got['ended'][1]}")
        if not got["finite"]:
            notes = ["no finite value"]
        label = f"{r.arm} ({'; '.join(notes)})" if notes else r.arm
        handles.append(Line2D([], [], color=colors[r.arm], lw=lw[r.arm], label=label))
    if not handles or not any_finite:
        plt.close(fig)
        return None
    for y, label in lines:
        ax.axhline(y, color=MAX_COLOR, lw=0.9, ls="-.", alpha=0.7)
        handles.append(Line2D([], [], color=MAX_COLOR, lw=0.9, ls="-.", label=label))
    if log:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=XLABEL, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles + _proxies(used), fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    fig.tight_layout()
    return fig


def _act_figure(runs: list[Run]) -> Figure | None:
    """Per-layer |x| max, one panel per arm, with the 256 line and fp16's max."""

    with_act = [r for r in runs if r.keys("act/")]
    if not with_act:
        return None
    n = len(with_act)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols + 4.4, 3.6 * rows), squeeze=False, sharey=True
    )
    colors = layer_colors(with_act)
    handles: dict[str, object] = {}
    used: set[str] = set()
    rms_lines: set[float] = set()
    for ax, r in zip(axes.flat, with_act, strict=False):
        nonfinite = []
        for label, h, bad, dropped in draw_layers(ax, r, colors):
            handles.setdefault(label, h)
            nonfinite += bad
            if dropped:
                used.add(DROPPED_LABEL)
        rms = draw_rms(ax, r, colors)
        if rms is not None:
            layer, label, line = rms
            style = {"lw": 1.4, "ls": (0, (1, 1)), "marker": "^"}
            handles.setdefault(
                label, Line2D([], [], color=colors.get(layer, MARK), label=label, **style)
            )
            rms_lines.add(line)
        ax.axhline(LINE, color=LINE_COLOR, lw=1, ls="--")
        ax.axhline(FP16_MAX, color=MAX_COLOR, lw=1, ls="-.")
        used |= _markers(ax, r, MARK, nonfinite)
        ax.set_yscale("log")
        ax.set_title(r.arm, fontsize=10)
        ax.set_xlabel(XLABEL, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel("|x| max (dotted: largest row RMS)")
    legend = list(handles.values())
    legend.append(Line2D([], [], color=MARK, lw=2.6, label=THICK_LABEL))
    legend += [
        Line2D([], [], color=LINE_COLOR, lw=1, ls="--", label="256: one fp16 square overflows"),
        Line2D([], [], color=MAX_COLOR, lw=1, ls="-.", label="65504: fp16 max"),
    ]
    legend += [
        Line2D(
            [],
            [],
            color=RMS_LINE_COLOR,
            lw=1,
            ls="--",
            label=f"{v:.1f}: row RMS past which an fp16 sum of "
            f"{round(FP16_MAX / v**2)} squares overflows",
        )  # fmt: skip
        for v in sorted(rms_lines)
    ]
    fig.legend(handles=legend + _proxies(used), fontsize=7, loc="center right")
    fig.suptitle("per-layer activation |x| max and the overflowing norm's row RMS")
    fig.tight_layout(rect=(0, 0, 1 - 4.3 / (4.6 * cols + 4.4), 1))
    return fig


def _audit_figure(runs: list[Run]) -> Figure | None:
    with_audit = [r for r in runs if r.audits]
    if not with_audit:
        return None
    colors = _colors(runs)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        (a1, lambda a: a["rel_err_median"]),
        (a2, lambda a: 100 * (a["dead_share"] + a.get("nonfinite_share", 0))),
    )
    for ax, value in panels:
        series = {r.arm: {a["step"]: value(a) for a in r.audits} for r in with_audit}
        same = same_as(series)
        lw = widths(list(series), same)
        for r in with_audit:  # audits record the model step themselves
            xs, ys = list(series[r.arm]), list(series[r.arm].values())
            note = same_note(r.arm, same)
            # a marker on every audit: a run audited once (audit.every past its length: only
            # the train-end audit) is one point, which a line alone does not draw; an arm
            # under another one is drawn wider, its markers larger
            label = f"{r.arm} ({note})" if note else r.arm
            ms = 4 + 2 * (lw[r.arm] - 1.3)
            ax.plot(xs, ys, color=colors[r.arm], lw=lw[r.arm], marker="o", ms=ms, label=label)
    a1.set(yscale="log", title="norm output vs float64 (median rel. error)", xlabel=XLABEL)
    a2.set(title="norm rows dead or non-finite (%)", xlabel=XLABEL)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figures(runs: list[Run]) -> dict[str, Figure]:
    """Every figure the runs have data for, unsaved ({name: Figure}; close them)."""
    made = {
        "loss": _metric_figure(runs, "train/loss", "training loss", "loss"),
        "grad_norm": _metric_figure(
            runs, "train/grad_norm", "gradient norm (pre-clip)", "norm", log=True
        ),
        "act_max": _act_figure(runs),
        "loss_scale": _metric_figure(
            runs,
            "train/loss_scale",
            "fp16 loss scale (GradScaler)",
            "scale",
            log=True,
            lines=[(1.0, "scale floor 1")],
        ),
        "audit": _audit_figure(runs),
        "quant_headroom": headroom_figure(runs),
    }
    return {k: v for k, v in made.items() if v is not None}


def make_plots(runs: list[Run], out: Path) -> dict[str, Path]:
    """Write every plot the runs have data for; returns {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in figures(runs).items():
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    return paths
