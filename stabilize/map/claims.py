"""The four claims a map answers when it holds the recipes they are about, each verdict a
function of the numbers printed beside it (tests/test_map.py checks the words):

- **the seed's, on RMSNorm** (recipes ``rmsnorm`` and ``layernorm``): "RMSNorm's gradient
  norm fluctuates 0.05-0.5 early in training while LayerNorm's stays within 0.1-0.3", read
  over steps 1..early_steps at each recipe's best grid LR; and "RMSNorm wants ~0.7x
  LayerNorm's learning rate", read from the per-seed best-LR ratio;
- **Wortsman et al.'s, on qk-norm** (``layernorm-qknorm`` against ``layernorm``): without
  it the attention logit grows with the LR, and it lowers the LR sensitivity;
- **on z-loss** (``layernorm-zloss`` against ``layernorm``): it lowers the output log Z.

Verdicts: *supported*, *not supported*, or *not resolved* (the seeds' spread holds both
answers); a claim whose recipes are not in the map is left out.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from stabilize.map.analysis import RecipeSummary, best_lr_ratio
from stabilize.map.cells import CellResult


def ratio_verdict(q: dict[str, float] | None, target: float) -> str:
    """``target`` inside the seeds' [min, max] of the ratio and 1 outside: supported; both
    inside: not resolved; ``target`` outside: not supported."""
    if q is None:
        return "not measured"
    inside = q["min"] <= target <= q["max"]
    if inside:
        return "not resolved" if q["min"] <= 1.0 <= q["max"] else "supported"
    return "not supported"


def spearman(xs: list[float], ys: list[float]) -> float:
    """The rank correlation (no ties expected: LRs are distinct, bounds are floats)."""
    rx = {x: i for i, x in enumerate(sorted(xs))}
    ry = {y: i for i, y in enumerate(sorted(ys))}
    n = len(xs)
    if n < 3:
        return math.nan
    d2 = sum((rx[x] - ry[y]) ** 2 for x, y in zip(xs, ys, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _median_by_lr(cells: list[CellResult], recipe: str, field: str) -> dict[float, float]:
    out: dict[float, list[float]] = {}
    for c in cells:
        v = getattr(c, field)
        if c.recipe == recipe and v is not None and math.isfinite(v):
            out.setdefault(c.lr, []).append(v)
    return {lr: statistics.median(v) for lr, v in sorted(out.items())}


def early_grad(cells: list[CellResult], r: RecipeSummary) -> dict[str, float] | None:
    """Early grad-norm statistics at the recipe's best grid LR, over its seeds: the lowest
    min, the median of medians, the highest max."""
    finite = [(v, lr) for v, lr in zip(r.mean, r.lrs, strict=True) if math.isfinite(v)]
    if not finite:
        return None
    lr = min(finite)[1]
    g = [c.grad_early for c in cells if c.recipe == r.recipe and c.lr == lr and c.grad_early]
    if not g:
        return None
    return {"lr": lr, "min": min(x["min"] for x in g), "max": max(x["max"] for x in g),
            "median": statistics.median(x["median"] for x in g)}  # fmt: skip


def claims(recipes: list[RecipeSummary], cells: list[CellResult]) -> list[dict[str, Any]]:
    by = {r.recipe: r for r in recipes}
    out = []
    if "rmsnorm" in by and "layernorm" in by:
        rms, ln = early_grad(cells, by["rmsnorm"]), early_grad(cells, by["layernorm"])
        if rms and ln:
            in_rms = rms["min"] >= 0.05 and rms["max"] <= 0.5
            in_ln = ln["min"] >= 0.1 and ln["max"] <= 0.3
            wider = rms["max"] / rms["min"] > ln["max"] / ln["min"]
            verdict = "supported" if in_rms and in_ln and wider else "not supported"
            out.append({"claim": "RMSNorm's early grad norm 0.05-0.5, LayerNorm's 0.1-0.3:",
                        "verdict": verdict, "evidence":
                        f"steps 1..early at each best grid LR: RMSNorm {rms['min']:.3g}-"
                        f"{rms['max']:.3g} (median {rms['median']:.3g}, LR {rms['lr']:g}), "
                        f"LayerNorm {ln['min']:.3g}-{ln['max']:.3g} (median "
                        f"{ln['median']:.3g}, LR {ln['lr']:g}); in the claimed ranges: "
                        f"{'yes' if in_rms else 'no'} / {'yes' if in_ln else 'no'}; RMSNorm "
                        f"{'wider' if wider else 'not wider'} (max/min)"})  # fmt: skip
        q = best_lr_ratio(by["rmsnorm"], by["layernorm"])
        verdict = ratio_verdict(q, 0.7)
        edge = [r for r in ("rmsnorm", "layernorm") if by[r].best_at_edge]
        if edge:  # the minimum is not inside the grid: no ratio to read
            verdict = f"not resolved ({' and '.join(edge)}: best LR at the grid's edge)"
        out.append({"claim": "RMSNorm wants ~0.7x LayerNorm's LR:",
                    "verdict": verdict, "evidence": "best-LR ratio "
                    + (f"{q['median']:.2f}, seeds {q['min']:.2f}-{q['max']:.2f} ({q['seeds']} "
                       "paired seeds)" if q else "not measured")})  # fmt: skip
    if "layernorm-qknorm" in by and "layernorm" in by:
        ln_b = _median_by_lr(cells, "layernorm", "attn_logit_max")
        qk_b = _median_by_lr(cells, "layernorm-qknorm", "attn_logit_max")
        rho = spearman(list(ln_b), list(ln_b.values())) if ln_b else math.nan
        top = max(set(ln_b) & set(qk_b), default=None)
        grows = rho >= 0.8
        lower = top is not None and qk_b[top] < ln_b[top]
        if top is None:
            evidence = "no LR where both have a finite bound"
        else:
            evidence = (
                f"LayerNorm's largest bound per LR (seeds' median) "
                f"{', '.join(f'{v:.3g}' for v in ln_b.values())}: rank correlation with the "
                f"LR {rho:.2f}; at LR {top:g}: {ln_b[top]:.3g} without, {qk_b[top]:.3g} with"
            )
        out.append({"claim": "without qk-norm the attention logit grows with the LR; qk-norm "
                    "lowers it:", "verdict": "supported" if grows and lower else
                    "not supported", "evidence": evidence})  # fmt: skip
        a, b = by["layernorm-qknorm"], by["layernorm"]
        if max(a.sensitivity_seeds) < min(b.sensitivity_seeds):
            v = "supported"
        elif min(a.sensitivity_seeds) > max(b.sensitivity_seeds):
            v = "not supported"
        else:
            v = "not resolved"
        out.append({"claim": "qk-norm lowers the LR sensitivity:", "verdict": v, "evidence":
                    f"{a.sensitivity:.3f} [{min(a.sensitivity_seeds):.3f}, "
                    f"{max(a.sensitivity_seeds):.3f}] with, {b.sensitivity:.3f} "
                    f"[{min(b.sensitivity_seeds):.3f}, {max(b.sensitivity_seeds):.3f}] "
                    "without"})  # fmt: skip
    if "layernorm-zloss" in by and "layernorm" in by:
        z = _median_by_lr(cells, "layernorm-zloss", "log_z_final")
        n = _median_by_lr(cells, "layernorm", "log_z_final")
        common = sorted(set(z) & set(n))
        lower = [lr for lr in common if z[lr] < n[lr]]
        v = "supported" if common and len(lower) == len(common) else (
            "not supported" if not lower else "not resolved")  # fmt: skip
        out.append({"claim": "z-loss lowers log Z:", "verdict": v, "evidence":
                    f"final log Z max (seeds' median) lower at {len(lower)} of {len(common)} "
                    "LRs: " + ", ".join(f"{lr:g}: {z[lr]:.2f} vs {n[lr]:.2f}"
                                        for lr in common)})  # fmt: skip
    return out
