"""The report's PNG plots: one figure per question, every arm on it.

x is the optimizer step taken (rolled-back steps included, so it never runs backwards);
rollbacks are marked with a vertical dotted line in the arm's colour, the first overflowed
reduction with a dashed one.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display here, none needed
import matplotlib.pyplot as plt  # noqa: E402

from stabilize.numerics import FP16_MAX  # noqa: E402
from stabilize.report.load import Run  # noqa: E402
from stabilize.report.summary import LINE  # noqa: E402


def _colors(runs: list[Run]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {r.arm: cycle[i % len(cycle)] for i, r in enumerate(runs)}


def _markers(ax, run: Run, color: str) -> None:
    for e in run.events:
        x = e.get("global_step")
        if x is None:
            continue
        if e.get("monitor") == "rollback" and e.get("kind") == "rollback":
            ax.axvline(x, color=color, ls=":", lw=1, alpha=0.8)
    first = next((e for e in run.events if e.get("monitor") == "overflow"), None)
    if first is not None and first.get("global_step") is not None:
        ax.axvline(first["global_step"], color=color, ls="--", lw=1, alpha=0.6)


def _plot_metric(runs, key, path, title, ylabel, log=False, lines=()) -> Path | None:
    colors = _colors(runs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    drawn = False
    for r in runs:
        # non-finite values are gaps, not zeros: break the line there
        xs, ys = [], []
        for x, v in r.series(key):
            xs.append(x)
            ys.append(v if math.isfinite(v) and (v > 0 or not log) else math.nan)
        if any(math.isfinite(y) for y in ys):
            ax.plot(xs, ys, color=colors[r.arm], label=r.arm, lw=1.3)
            drawn = True
        nan_x = [x for x, v in r.series(key) if not math.isfinite(v)]
        if nan_x:
            ax.axvspan(min(nan_x), max(nan_x), color=colors[r.arm], alpha=0.08)
        _markers(ax, r, colors[r.arm])
    if not drawn:
        plt.close(fig)
        return None
    for y, label in lines:
        ax.axhline(y, color="black", lw=0.8, ls="-.", alpha=0.6)
        ax.annotate(label, (0.005, y), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    if log:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="optimizer steps taken", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_act(runs: list[Run], path: Path) -> Path | None:
    """Per-layer |x| max, one panel per arm, with the 256 line and fp16's max."""
    with_act = [r for r in runs if r.keys("act/")]
    if not with_act:
        return None
    n = len(with_act)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, sharey=True)
    for ax, r in zip(axes.flat, with_act, strict=False):
        for k in r.keys("act/"):
            pts = r.series(k)
            if any(math.isfinite(v) and v > 0 for _, v in pts):
                # a non-finite reading is a gap in the line, not a bridge across it
                ys = [v if math.isfinite(v) and v > 0 else math.nan for _, v in pts]
                ax.plot([x for x, _ in pts], ys, lw=1, label=k[4:])
        ax.axhline(LINE, color="red", lw=0.9, ls="--")
        ax.axhline(FP16_MAX, color="black", lw=0.9, ls="-.")
        _markers(ax, r, "grey")
        ax.set_yscale("log")
        ax.set_title(r.arm, fontsize=10)
        ax.set_xlabel("optimizer steps taken")
        ax.grid(alpha=0.3)
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel("|x| max (red: 256, black: 65504)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("per-layer activation |x| max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_audit(runs: list[Run], path: Path) -> Path | None:
    with_audit = [r for r in runs if r.audits]
    if not with_audit:
        return None
    colors = _colors(runs)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in with_audit:
        xs = [a["step"] for a in r.audits]
        a1.plot(xs, [a["rel_err_median"] for a in r.audits], color=colors[r.arm], label=r.arm)
        a2.plot(
            xs,
            [100 * (a["dead_share"] + a.get("nonfinite_share", 0)) for a in r.audits],
            color=colors[r.arm],
            label=r.arm,
        )
    a1.set(yscale="log", title="norm output vs float64 (median rel. error)", xlabel="model step")
    a2.set(title="norm rows dead or non-finite (%)", xlabel="model step")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(runs: list[Run], out: Path) -> dict[str, Path]:
    """Write every plot the runs have data for; returns {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    made = {
        "loss": _plot_metric(runs, "train/loss", out / "loss.png", "training loss", "loss"),
        "grad_norm": _plot_metric(
            runs,
            "train/grad_norm",
            out / "grad_norm.png",
            "gradient norm (pre-clip)",
            "norm",
            log=True,
        ),
        "act_max": _plot_act(runs, out / "act_max.png"),
        "loss_scale": _plot_metric(
            runs,
            "train/loss_scale",
            out / "loss_scale.png",
            "fp16 loss scale (GradScaler)",
            "scale",
            log=True,
            lines=[(1.0, "floor 1")],
        ),
        "audit": _plot_audit(runs, out / "audit.png"),
    }
    return {k: v for k, v in made.items() if v is not None}
