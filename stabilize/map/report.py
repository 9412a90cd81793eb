"""A map's report: ``map.json`` (every cell, every recipe's summary), ``map.md`` (the per-
recipe table, the per-cell table, the claims and their verdicts) and two figures, loss vs
LR for every recipe with the seeds' spread (``loss_vs_lr.png``) and a recipe x LR heatmap
coloured by outcome, each diverged square named by its mechanism (``outcomes.png``).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from stabilize.map.analysis import RecipeSummary, best_lr_ratio, summarize
from stabilize.map.cells import CellResult, cell_dir, finished, read_cell
from stabilize.map.claims import claims
from stabilize.map.spec import MapSpec


def collect(spec: MapSpec, root: Path) -> list[CellResult]:
    """Every finished cell; the recipe's L0 is the mean of its cells' first-step losses."""

    raw = [(c, read_cell(cell_dir(root, c), c, spec)) for c in spec.cells()
           if finished(cell_dir(root, c))]  # fmt: skip
    out = []
    for recipe in spec.recipes:
        l0s = [r.loss0 for c, r in raw if c.recipe == recipe and r.loss0 is not None]
        l0 = statistics.fmean(l0s) if l0s else None
        out += [read_cell(cell_dir(root, c), c, spec, l0) for c, _ in raw if c.recipe == recipe]
    return out


def _g(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_report(spec: MapSpec, root: Path) -> Path:
    cells = collect(spec, root)
    recipes = [summarize(r, cells) for r in spec.recipes if any(c.recipe == r for c in cells)]
    found = claims(recipes, cells)
    (root / "map.json").write_text(json.dumps({
        "spec": spec.__dict__, "cells": [c.to_dict() for c in cells],
        "recipes": [r.to_dict() for r in recipes], "claims": found,
    }, indent=1, default=str))  # fmt: skip
    _figures(recipes, cells, root)
    lines = [f"# Stability map `{spec.name}`", "",
             f"{len(cells)} of {len(spec.cells())} cells finished: {len(spec.recipes)} "
             f"recipes x LRs {', '.join(f'{x:g}' for x in spec.lrs)} x seeds "
             f"{', '.join(map(str, spec.seeds))}; {spec.steps} steps each, rollback off. "
             f"Final loss: the mean training loss of the last {spec.tail_steps} steps.", "",
             "![loss vs LR](loss_vs_lr.png)", "", "![outcomes](outcomes.png)", "",
             "| recipe | L0 | L* | LR sensitivity [seeds] | best LR [seeds] | largest stable "
             "LR | diverged cells |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in recipes:
        seeds = r.best_lr_seeds.values()
        edge = " (grid edge)" if r.best_at_edge else ""
        lines.append(
            f"| {r.recipe} | {r.l0:.3f} | {_g(r.l_star, '.3f')} | {r.sensitivity:.3f} "
            f"[{min(r.sensitivity_seeds):.3f}, {max(r.sensitivity_seeds):.3f}] | "
            f"{r.best_lr:.3g}{edge} [{min(seeds):.3g}, {max(seeds):.3g}] | "
            f"{_g(r.largest_stable_lr)} | {sum(r.diverged.values())} of {r.seeds * len(r.lrs)} |"
        )
    lines += ["", f"LR sensitivity: the mean over the {len(spec.lrs)} LRs of min(L(lr), L0) - "
              "L* (Wortsman et al. 2023), on the seeds' mean curve; [seeds]: the seeds' own "
              "curves. Best LR: a parabola in log LR through the best grid point and its "
              "neighbours.", ""]  # fmt: skip
    pairs = [(r, recipes[0]) for r in recipes[1:]]  # each against the first recipe
    if pairs:
        lines += ["| best-LR ratio | median | seeds' min | max |", "|---|---|---|---|"]
        for a, b in pairs:
            q = best_lr_ratio(a, b)
            if q:
                lines.append(f"| {a.recipe} / {b.recipe} | {q['median']:.2f} | "
                             f"{q['min']:.2f} | {q['max']:.2f} |")  # fmt: skip
        lines.append("")
    if found:
        lines += ["## Claims", ""] + [f"- **{c['claim']}** {c['verdict']}: {c['evidence']}"
                                      for c in found] + [""]  # fmt: skip
    lines += ["## Cells", "", "| recipe | LR | seed | final loss | bpb | diverged | first "
              "monitor (step): mechanism | early grad norm min / median / max | attn logit "
              "max | log Z | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in cells:
        g = c.grad_early or {}
        first = f"{c.first_monitor} ({c.first_step}): {c.mechanism}" if c.first_monitor else "-"
        lines.append(
            f"| {c.recipe} | {c.lr:g} | {c.seed} | {_g(c.final_loss, '.3f')} | {_g(c.bpb, '.3f')}"
            f" | {'step ' + str(c.diverged_step) if c.diverged else 'no'} | {first} | "
            f"{_g(g.get('min'))} / {_g(g.get('median'))} / {_g(g.get('max'))} | "
            f"{_g(c.attn_logit_max)} | {_g(c.log_z_final)} | {_g(c.seconds, '.0f')} |"
        )
    out = root / "map.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _figures(recipes: list[RecipeSummary], cells: list[CellResult], root: Path) -> None:
    from stabilize.report.plots import plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, r in enumerate(recipes):  # markers apart: curves that coincide stay visible
        (line,) = ax.plot(r.lrs, [min(v, r.l0) if math.isfinite(v) else r.l0 for v in r.mean],
                          marker="osD^vP*X"[k % 8], label=r.recipe, alpha=0.85)  # fmt: skip
        ax.fill_between(r.lrs, r.lo, r.hi, alpha=0.2, color=line.get_color())
    if recipes:
        ax.axhline(recipes[0].l0, color="grey", ls=":", lw=1, label="L0 (init)")
    ax.set(xscale="log", xlabel="learning rate", ylabel="final loss (min with L0)",
           title="loss vs LR: seeds' mean, band = seeds' min..max")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "loss_vs_lr.png", dpi=110)
    plt.close(fig)

    lrs = sorted({c.lr for c in cells})
    fig, ax = plt.subplots(figsize=(1.4 * len(lrs) + 2.5, 0.8 * len(recipes) + 1.6))
    grid = [[math.nan] * len(lrs) for _ in recipes]
    texts = []
    for i, r in enumerate(recipes):
        for j, lr in enumerate(lrs):
            mine = [c for c in cells if c.recipe == r.recipe and c.lr == lr]
            if not mine:
                continue
            div = [c for c in mine if c.diverged]
            ok = [c.final_loss for c in mine if not c.diverged]
            grid[i][j] = -1.0 if div else statistics.fmean(ok)
            text = f"{grid[i][j]:.2f}"
            if div:
                text = f"{len(div)}/{len(mine)} diverged\n{_short(div[0])}"
            texts.append((j, i, text, bool(div)))
    import numpy as np

    arr = np.ma.masked_invalid(np.array(grid, dtype=float))
    ok = np.ma.masked_where(arr < 0, arr)
    ax.imshow(np.ma.masked_where(arr >= 0, arr), cmap="Reds_r", vmin=-1.5, vmax=0, aspect="auto")
    ax.imshow(ok, cmap="YlGn_r", aspect="auto")
    lo, hi = (float(ok.min()), float(ok.max())) if ok.count() else (0.0, 1.0)
    for j, i, text, div in texts:  # white on the dark squares (the low losses, the red)
        dark = div or (hi > lo and (grid[i][j] - lo) / (hi - lo) < 0.4)
        ax.text(j, i, text, ha="center", va="center", fontsize=7,
                color="white" if dark else "black")  # fmt: skip
    ax.set_xticks(range(len(lrs)), [f"{x:g}" for x in lrs])
    ax.set_yticks(range(len(recipes)), [r.recipe for r in recipes])
    ax.set(xlabel="learning rate", title="final loss (green) or diverged (red, mechanism)")
    fig.tight_layout()
    fig.savefig(root / "outcomes.png", dpi=110)
    plt.close(fig)


def _short(c: CellResult) -> str:
    return (c.mechanism or "no monitor fired").split(" at ")[0]


COLUMNS = ["recipe", "lr", "seed", "final_loss", "bpb", "diverged", "diverged_step",
           "first_monitor", "mechanism", "attn_logit_max", "log_z_final"]  # fmt: skip


def to_wandb(spec: MapSpec, root: Path) -> str:
    """One W&B run in the cells' group (``map-NAME``, job type ``map``): the cells as a
    table, the two figures, each recipe's sensitivity and best LR in the summary. Offline
    unless ``WANDB_MODE`` says otherwise, as the cells. Returns the run's directory."""
    import os

    import wandb

    cells = collect(spec, root)
    run = wandb.init(project="stabilize", group=f"map-{spec.name}", job_type="map",
                     name=f"map-{spec.name}", dir=str(root), config=spec.__dict__,
                     mode=os.environ.get("WANDB_MODE", "offline"))  # fmt: skip
    rows = [[getattr(c, k) for k in COLUMNS] for c in cells]
    run.log({
        "map/cells": wandb.Table(columns=COLUMNS, data=rows),
        "map/loss_vs_lr": wandb.Image(str(root / "loss_vs_lr.png")),
        "map/outcomes": wandb.Image(str(root / "outcomes.png")),
    })  # fmt: skip
    for r in (summarize(x, cells) for x in spec.recipes if any(c.recipe == x for c in cells)):
        run.summary[f"{r.recipe}/lr_sensitivity"] = r.sensitivity
        run.summary[f"{r.recipe}/best_lr"] = r.best_lr
    where = run.dir
    run.finish()
    return str(Path(where).parent)
