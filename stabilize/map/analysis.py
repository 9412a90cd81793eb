"""Per recipe, over its cells: the loss-vs-LR curve with the seeds' spread, the LR
sensitivity, the best LR and the largest stable LR; the best-LR ratio of two recipes.

LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities", section 3): the mean over the LR grid of min(L(lr), L0) - L*,
with L(lr) the final loss at lr (a diverged cell's is L0 or above: it counts as L0), L0
the loss at initialization and L* the best final loss over the grid. Computed on the
seeds' mean curve, and per seed for the spread.

The best LR is read off the grid, then refined by a parabola through the best point and
its two neighbours in log LR (the grid is coarse: 4x steps over 3 decades cannot tell 0.7x
apart); at the grid's edge it is the edge, and said so. The best-LR ratio of two recipes is
per seed (the same seed in both: paired), its median with the seeds' min and max.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from stabilize.map.cells import CellResult


def sensitivity(losses: list[float], l0: float) -> tuple[float, float]:
    """(LR sensitivity, L*) of one curve: a non-finite loss counts as L0."""
    clipped = [min(v, l0) if math.isfinite(v) else l0 for v in losses]
    best = min(clipped)
    return sum(c - best for c in clipped) / len(clipped), best


def refine_best(lrs: list[float], losses: list[float]) -> tuple[float, bool]:
    """(best LR, at the grid's edge): the vertex of the parabola through the best grid
    point and its neighbours in log10 LR, kept within those neighbours."""
    vals = [v if math.isfinite(v) else math.inf for v in losses]
    i = min(range(len(vals)), key=vals.__getitem__)
    if i == 0 or i == len(vals) - 1 or not all(map(math.isfinite, vals[i - 1 : i + 2])):
        return lrs[i], i in (0, len(vals) - 1)
    x = [math.log10(v) for v in lrs[i - 1 : i + 2]]
    y = vals[i - 1 : i + 2]
    den = (x[0] - x[1]) * (x[0] - x[2]) * (x[1] - x[2])
    a = (x[2] * (y[1] - y[0]) + x[1] * (y[0] - y[2]) + x[0] * (y[2] - y[1])) / den
    b = (x[2] ** 2 * (y[0] - y[1]) + x[1] ** 2 * (y[2] - y[0]) + x[0] ** 2 * (y[1] - y[2])) / den
    if a <= 0:
        return lrs[i], False
    vertex = min(max(-b / (2 * a), x[0]), x[2])
    return 10**vertex, False


@dataclass
class RecipeSummary:
    recipe: str
    lrs: list[float]
    mean: list[float]  # the seeds' mean final loss per LR (NaN where any seed diverged)
    lo: list[float]  # the seeds' min and max per LR (finite seeds only)
    hi: list[float]
    l0: float
    l_star: float
    sensitivity: float
    sensitivity_seeds: list[float]
    best_lr: float
    best_at_edge: bool
    best_lr_seeds: dict[int, float]
    largest_stable_lr: float | None
    diverged: dict[float, int]  # LR -> diverged seeds
    seeds: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, diverged={str(k): v for k, v in self.diverged.items()})


def summarize(recipe: str, cells: list[CellResult]) -> RecipeSummary:
    mine = [c for c in cells if c.recipe == recipe]
    lrs = sorted({c.lr for c in mine})
    seeds = sorted({c.seed for c in mine})
    at = {(c.lr, c.seed): c for c in mine}
    l0s = [c.loss0 for c in mine if c.loss0 is not None and math.isfinite(c.loss0)]
    l0 = statistics.fmean(l0s)  # every cell's first step: the same init up to the seed

    def value(c: CellResult) -> float:
        return c.final_loss if not c.diverged else math.nan

    mean, lo, hi, div = [], [], [], {}
    for lr in lrs:
        vals = [value(at[lr, s]) for s in seeds if (lr, s) in at]
        ok = [v for v in vals if math.isfinite(v)]
        mean.append(statistics.fmean(vals) if len(ok) == len(vals) else math.nan)
        lo.append(min(ok) if ok else math.nan)
        hi.append(max(ok) if ok else math.nan)
        div[lr] = len(vals) - len(ok)
    sens, l_star = sensitivity(mean, l0)
    per_seed, best_seed = [], {}
    for s in seeds:
        curve = [value(at[lr, s]) if (lr, s) in at else math.nan for lr in lrs]
        per_seed.append(sensitivity(curve, l0)[0])
        best_seed[s] = refine_best(lrs, curve)[0]
    best, edge = refine_best(lrs, mean)
    stable = [lr for lr in lrs if div[lr] == 0]
    return RecipeSummary(
        recipe=recipe, lrs=lrs, mean=mean, lo=lo, hi=hi, l0=l0, l_star=l_star,
        sensitivity=sens, sensitivity_seeds=per_seed, best_lr=best, best_at_edge=edge,
        best_lr_seeds=best_seed, largest_stable_lr=max(stable) if stable else None,
        diverged=div, seeds=len(seeds),
    )  # fmt: skip


def best_lr_ratio(a: RecipeSummary, b: RecipeSummary) -> dict[str, float] | None:
    """a's best LR over b's, per seed both ran (paired): the median, min and max."""
    common = sorted(set(a.best_lr_seeds) & set(b.best_lr_seeds))
    if not common:
        return None
    r = [a.best_lr_seeds[s] / b.best_lr_seeds[s] for s in common]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "seeds": len(r)}
