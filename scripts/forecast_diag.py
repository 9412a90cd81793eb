"""The figures docs/forecast.md quotes beside the eval's tables, from the same recorded runs.

    python scripts/forecast_diag.py runs.json [--sqrt-margin]

- the real distance over the projection ("~N at this rate") by the warning's step, for true
  warnings, and ``forecast_slow_steps`` fitted on the core set's natural runs alone;
- every missed warnable crossing of a DeepNorm run, with the warnings that came before it;
- the first overflow of each fp16-reduction run and how far ahead it was warned;
- every healthy run's warnings and how near its layers came to the line;
- the holdout's scores with and without ``forecast_climb``, and where the healthy runs'
  warnings came; ``--sqrt-margin`` scores them with the pessimistic path of before (z sigma
  sqrt(h), commit 8688c11) in its place.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import numpy as np

import stabilize.monitors.forecast as F
from benchmarks.forecast_score import first_crossings, row_metrics
from benchmarks.forecast_set import core, holdout, holdout2, holdout3, tags, wide
from benchmarks.forecast_tables import relabel_crossed, score, truth_units
from stabilize.monitors.activations import ActivationConfig, ActivationMonitor
from stabilize.monitors.events import StepStats

RANGES = (("steps <= 8", 0, 8), ("steps 9-20", 9, 20), ("steps > 20", 21, 10**9))


def sqrt_margin(level, slope, sigma, z, horizon, phi=1.0, tau=0.0):
    """The pessimistic path of commit 8688c11: level + slope S(h) - z sqrt(sigma^2 h + ...)."""
    if level >= 0:
        return 0.0
    if slope <= 0:
        return math.inf
    if phi >= 1.0 and tau <= 0.0:
        zs = z * sigma
        u = (zs + math.sqrt(zs * zs - 4 * slope * level)) / (2 * slope)
        return u * u if u * u <= horizon else math.inf
    h = np.arange(1, int(horizon) + 1, dtype=np.float64)
    rise = slope * h if phi >= 1.0 else slope * phi * (1 - phi**h) / (1 - phi)
    hit = np.flatnonzero(level + rise - z * np.sqrt(sigma**2 * h + tau**2 * h**3 / 3.0) >= 0)
    return float(h[hit[0]]) if hit.size else math.inf


def at_lead(r: dict, layer: str, step: int, cfg: ActivationConfig) -> str:
    """Each of a layer's lines as the forecast saw it at ``step`` (5 ahead of a crossing):
    the fraction of the line, the slope and noise (log, a step), and the slope's lower bound
    z standard errors down over the n points fitted (below 0: no significant rise)."""
    mon = ActivationMonitor.from_config("activation", cfg)
    seen: dict = {}
    update = mon.forecaster.update

    def spy(values):
        out = update(values)
        seen.update(out)
        return out

    mon.forecaster.update = spy
    for st in r["steps"]:
        d = dict(st["stats"])
        if d["step"] > step:
            break
        seen.clear()
        # every name its own unit here: the layer asked about is diagnosed by its own name
        mon.update(StepStats(**{**d, "norm_dim": d.get("norm_dim") or r["dims"], "act_alias": {}}))
    parts = []
    for (lay, kind), p in sorted(seen.items()):
        if lay != layer:
            continue
        n = min(mon.forecaster.seen[(lay, kind)], mon.forecaster.window)
        low = p.slope - cfg.forecast.z * p.sigma * math.sqrt(12.0 / (n**3 - n))
        parts.append(f"{kind} at {math.exp(p.level):.2f} of its line, slope {p.slope:.2f}, "
                     f"noise {p.sigma:.2f}, lower slope {low:.2f} ({n} points)")  # fmt: skip
    return f"at step {step}: " + ("; ".join(parts) or "no forecast yet")


def true_warnings(scores):
    """(run, group, step, projection, real distance) of every warning followed by its crossing."""
    for s in scores:
        for u, step in s.estimates:
            c = s.crossings.get(u)
            if c is not None and step < c <= step + s.horizon:
                yield s.name, s.group, step, s.at_rate[(u, step)], c - step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, help="eval_forecast.py --save's file (with --holdout)")
    p.add_argument("--sqrt-margin", action="store_true", help="the margin of before")
    a = p.parse_args()
    runs = json.loads(a.runs.read_text())
    plan = {n: (g, o) for g, n, o in core() + wide() + holdout() + holdout2() + holdout3()}
    in_core, in_hold = {n for _, n, _ in core()}, {n for _, n, _ in holdout()}
    cross = {r["name"]: first_crossings(truth_units(r, 256.0)) for r in runs}
    runs_by = {r["name"]: r for r in runs}
    cfg = ActivationConfig(line="fp16_square")
    scores = score(runs, cfg, cross)
    tw = list(true_warnings(scores))
    print("real distance / projection, true warnings (median):")
    for label, lo, hi in RANGES:
        got = [real / n for _, _, st, n, real in tw if lo <= st <= hi]
        print(f"  {label}: {statistics.median(got):.2f} ({len(got)} warnings)")
    nat = [(st, n, real) for name, g, st, n, real in tw if name in in_core and g == "natural"]
    lo, hi = 0.0, 50.0  # forecast_slow_steps c: median of N (1 + c / step) / real = 1
    for _ in range(60):
        c = (lo + hi) / 2
        med = statistics.median(n * (1 + c / st) / real for st, n, real in nat)
        lo, hi = (c, hi) if med < 1 else (lo, c)
    print(f"forecast_slow_steps fitted on the core set's natural runs: {(lo + hi) / 2:.1f}")
    for label, k in (("flat 1.8x", None), (f"1 + {cfg.forecast.slow_steps:g} / step", 1)):
        meds = []
        for _, lo_, hi_ in RANGES:
            sel = [(st, n, real) for _, _, st, n, real in tw if lo_ <= st <= hi_]
            f = (lambda st: 1.8) if k is None else (lambda st: 1 + cfg.forecast.slow_steps / st)
            meds.append(statistics.median(n * f(st) / real for st, n, real in sel))
        print(f"  slowed / real, {label}: " + " / ".join(f"{m:.2f}" for m in meds))
    print("DeepNorm: missed warnable crossings (step, layer; the warnings before it):")
    for s in scores:
        if tags(plan[s.name][1])["placement"] != "deepnorm":
            continue
        for u, c in sorted(s.crossings.items(), key=lambda t: t[1]):
            if u in s.warnable and u not in s.timely:
                before = [st for lay, st in s.warnings if lay == u and st < c]
                print(f"  {s.name}: {u} at {c}; warned at {before}; "
                      + at_lead(runs_by[s.name], u, c - 5, cfg))  # fmt: skip
    print("fp16 reductions: each run's first overflow and the first warning before it:")
    for s in scores:
        if tags(plan[s.name][1])["precision"] != "fp16 reduction" or not s.crossings:
            continue
        u, c = min(s.crossings.items(), key=lambda t: t[1])
        before = [st for lay, st in s.warnings if lay == u and st < c]
        print(f"  {s.name}: {u} at step {c}, " + (f"{c - before[0]} steps ahead" if before
                                                   else "not warned"))  # fmt: skip
    if a.sqrt_margin:
        F.first_significant = sqrt_margin
    print(
        "healthy runs (a run that crossed is natural, as eval_forecast scores it): steps, "
        "warnings, near misses, the highest any layer rose (fraction of its line):"
    )
    for s, r in zip(score(relabel_crossed(runs, cross)[0], cfg, cross), runs, strict=True):
        if s.group == "healthy":
            top = max(v for st in truth_units(r, 256.0).values() for v, _ in st.values())
            print(
                f"  {s.name}: {s.steps} steps, {len(s.warnings)} warnings "
                f"{sorted({w for _, w in s.warnings})}, {s.near_misses} near, {top:.2f}"
            )
    print("holdout" + (" (the margin of before)" if a.sqrt_margin else "") + ":")
    for climb in (1.0, 0.0):
        ss = score(runs, ActivationConfig(line="fp16_square", forecast={"climb": climb}), cross)
        m = row_metrics([s for s in ss if s.name in in_hold])
        print(
            f"  forecast_climb={climb:g}: recall (warnable) {m['recall_warnable']:.2f}, "
            f"precision {m['precision']:.2f}, false / 1k healthy {m['false_per_k']:.1f}"
        )
        truth = {r["name"]: truth_units(r, 256.0) for r in runs if r["group"] == "healthy"}
        at = [(st, truth[s.name][st][u][0]) for s in ss if s.name in truth for u, st in s.warnings]
        if at:
            st, ratio = zip(*at, strict=True)
            print(f"    every healthy run's {len(at)} warnings: steps {min(st)}-{max(st)}, at "
                  f"{min(ratio):.2f}-{max(ratio):.2f} of the line")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
