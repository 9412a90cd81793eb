"""eval_forecast.py's scoring: the float64 truth per unit, the monitor replayed on a run's
recorded statistics, and the tables, the trade-off sweep and the targets it prints."""

from __future__ import annotations

import statistics

import numpy as np
import torch

from benchmarks.forecast_score import (
    NEAR,
    RunScore,
    fmt,
    row_metrics,
    table,
    target_misses,
)
from benchmarks.forecast_set import SWEEP
from stabilize.monitors.activations import ActivationConfig, ActivationMonitor
from stabilize.monitors.events import StepStats
from stabilize.monitors.forecast import nest_forecast_keys
from stabilize.numerics import sum_of_squares_rms_limit


def truth_units(r: dict, threshold: float) -> dict[int, dict]:
    """step -> layer -> (float64 value / line, 1): the nearer of the layer's lines (|x| max vs
    ``threshold``; a norm's largest row RMS vs 255.94/sqrt(D)), either of which overflows a
    16-bit reduction of that tensor. Aliased blocks (a pre-norm block's output is the next
    norm's input) are left to their norm."""
    out = {}
    for st in r["steps"]:
        units = {}
        for layer, (amax, rms) in st["truth"].items():
            if layer in r["alias"]:
                continue
            ratio = amax / threshold
            if layer in r["dims"]:
                ratio = max(ratio, rms / sum_of_squares_rms_limit(torch.float16, r["dims"][layer]))
            units[layer] = (ratio, 1.0)
        out[st["stats"]["step"]] = units
    return out


def replay(r: dict, cfg: ActivationConfig) -> dict[tuple[str, int], tuple[float, float]]:
    """The forecast warnings the run's monitor logs: (layer, step) -> its two distances
    ("in ~N steps as natural growth slows, ~M at this rate"). An aliased block's tensor is
    one unit, warned and scored under its norm's name (truth_units)."""
    mon = ActivationMonitor.from_config("activation", cfg)
    alias = r["alias"]
    out = {}
    for st in r["steps"]:
        d = dict(st["stats"])
        d.setdefault("norm_dim", r["dims"])
        d.setdefault("act_alias", alias)  # recorded before StepStats carried it
        for e in mon.update(StepStats(**d)):
            if e.monitor == "forecast" and e.kind == "warn":
                out[(alias.get(e.layer, e.layer), e.step)] = (e.value, e.extra["at_this_rate"])
    return out


def relabel_crossed(runs: list[dict], crossings: dict) -> tuple[list[dict], list[str]]:
    """A run labelled healthy whose float64 truth crossed a line is not healthy: it is scored
    as natural, so that its warnings followed by the crossing count as true, not false.
    Returns the runs and the names moved."""
    moved = sorted(r["name"] for r in runs if r["group"] == "healthy" and crossings[r["name"]])
    return [{**r, "group": "natural"} if r["name"] in moved else r for r in runs], moved


def near_warnings(r: dict, warned, horizon: int, threshold: float) -> set:
    """The warnings whose layer rose past NEAR of its line within the horizon (float64)."""
    truth = truth_units(r, threshold)
    return {(u, s) for u, s in warned
            if max((truth[t][u][0] for t in range(s + 1, s + horizon + 1)
                    if u in truth.get(t, {})), default=0.0) >= NEAR}  # fmt: skip


def activation_config(settings: dict) -> ActivationConfig:
    """``monitor.activation`` from the eval's settings, whose forecast keys keep the flat
    names the recorded commands use (``forecast_within``, ``horizon``, ...; or nested as
    ``forecast.within``): ``nest_forecast_keys`` moves them into ``forecast``."""
    flat = {
        k.removeprefix("forecast."): v for k, v in settings.items() if k.startswith("forecast.")
    }
    rest = {k: v for k, v in settings.items() if not k.startswith("forecast.")}
    section = nest_forecast_keys(rest)
    section["forecast"] = {**section.get("forecast", {}), **flat}
    return ActivationConfig(**section)


def score(runs: list[dict], cfg: ActivationConfig, crossings: dict) -> list[RunScore]:
    out = []
    for r in runs:
        warned = replay(r, cfg)
        near = near_warnings(r, warned, cfg.forecast.horizon, cfg.threshold)
        out.append(RunScore(r["name"], r["group"], len(r["steps"]), crossings[r["name"]],
                            list(warned), cfg.forecast.horizon, first=cfg.forecast.start,
                            estimates={w: n for w, (n, _) in warned.items()},
                            at_rate={w: m for w, (_, m) in warned.items()},
                            near=near))  # fmt: skip
    return out


def sweep(runs, settings, crossings, part) -> str:
    """One row per setting of SWEEP: recall (warnable), precision, false warnings per 1k
    healthy steps and the estimate's calibration, on each part of the set."""
    names = sorted({part(r) for r in runs})
    rows = ["| setting | " + " | ".join(f"{k} {n}" for n in names for k in
            ("recall", "precision", "false/1k", "est./real", "at rate/real")) + " |",
            "|---|" + "---|" * 5 * len(names)]  # fmt: skip
    for change in SWEEP:
        ss = score(runs, activation_config({**settings, **change}), crossings)
        cells = []
        for n in names:
            m = row_metrics([s for s, r in zip(ss, runs, strict=True) if part(r) == n])
            cells += [fmt(m[k], f) for k, f in (("recall_warnable", ".2f"), ("precision", ".2f"),
                      ("false_per_k", ".1f"), ("calibration", ".2f"),
                      ("calibration_at_rate", ".2f"))]  # fmt: skip
        label = ", ".join(f"{k}={v}" for k, v in change.items()) or "defaults"
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _detrended_ratios(series, seg: int, hs=(4, 8)) -> dict[int, list[float]]:
    """Per ``seg``-step segment of each series: less a quadratic fit, the variance of its
    h-step differences over its 1-step ones."""
    out: dict[int, list[float]] = {h: [] for h in hs}
    t = np.arange(seg)
    for y in series:
        for a in range(0, len(y) - seg + 1, seg):
            res = y[a : a + seg] - np.polyval(np.polyfit(t, y[a : a + seg], 2), t)
            one = np.var(res[1:] - res[:-1])
            for h in hs:
                out[h].append(float(np.var(res[h:] - res[:-h]) / one))
    return out


def noise_growth(runs: list[dict], threshold: float, seg: int = 24, skip: int = 20) -> str:
    """How a layer's fluctuation around its trend grows with the distance. Per layer, in
    ``seg``-step segments past step ``skip`` and before its crossing, the float64 series of
    log(value / line) less a quadratic fit: the variance of its h-step differences over its
    1-step ones. The fit absorbs part of any slow wander, so the references are computed the
    same way on simulated segments (fixed seed): a random walk, and independent noise."""
    series = []
    for r in runs:
        truth = truth_units(r, threshold)
        steps = sorted(truth)
        for u in truth[steps[-1]]:
            v = [truth[s][u][0] for s in steps[skip:] if u in truth[s]]
            end = next((i for i, x in enumerate(v) if not 0 < x < 1), len(v))
            series.append(np.log(v[:end]))
    got = _detrended_ratios(series, seg)
    rng = np.random.default_rng(0)
    walk = _detrended_ratios(np.cumsum(rng.standard_normal((2000, seg)), axis=1), seg)
    iid = _detrended_ratios(rng.standard_normal((2000, seg)), seg)
    med = statistics.median
    parts = [f"h={h}: median {med(v):.2f} (a random walk {med(walk[h]):.2f}, independent noise "
             f"{med(iid[h]):.2f})" for h, v in got.items() if v]  # fmt: skip
    return (f"Noise: variance of an h-step difference around each layer's trend over a 1-step "
            f"one ({len(got[4])} segments of {seg} steps past step {skip}, before any "
            "crossing): " + ("; ".join(parts) or "no segment long enough") + ".")  # fmt: skip


def recall_by_step(scores: list[RunScore], key, early: int) -> str:
    """Warnable recall split by when the crossing came: at steps up to ``early`` (warned 5
    ahead means warned from the first few points a forecast has) and after it."""
    rows = [
        f"| set | warnable crossings | at steps <= {early} | warned >= 5 ahead | recall "
        "| after | warned >= 5 ahead | recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in sorted({key(s) for s in scores}):
        ss = [s for s in scores if key(s) == k]
        parts = []
        for late in (False, True):
            us = [(s, u) for s in ss for u in s.warnable if (s.crossings[u] > early) == late]
            ok = sum(u in s.timely for s, u in us)
            parts += [str(len(us)), str(ok), fmt(ok / len(us) if us else None)]
        rows.append(f"| {k} | {sum(len(s.warnable) for s in ss)} | " + " | ".join(parts) + " |")
    return "\n".join(rows)


def missed(
    runs: list[dict], scores: list[RunScore], threshold: float, early: int, lead: int = 5
) -> str:
    """The warnable crossings after step ``early`` that no warning led by ``lead`` steps: per
    miss, its value (float64, a fraction of its line) ``2 lead`` and ``lead`` steps before
    the crossing and at it, and the longest lead of its warnings within the horizon. A unit that had
    not risen by the last step a timely warning could come (the value at c - lead no higher
    than at c - 2 lead) gave no series a ``lead``-step lead could be read from."""
    truth = {r["name"]: truth_units(r, threshold) for r in runs}
    rows = ["| run | unit | crossed at (c) | value at c - 10 | at c - 5 | rise | at c | rise "
            "| warned (longest lead) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    flat = n = 0
    for s in scores:
        tu = truth[s.name]
        for u in sorted(u for u in s.warnable if s.crossings[u] > early and u not in s.timely):
            c = s.crossings[u]
            a, b, v = (tu.get(c - k, {}).get(u, (float("nan"),))[0] for k in (2 * lead, lead, 0))
            leads = [c - w for x, w in s.warnings if x == u and 0 < c - w <= s.horizon]
            n += 1
            flat += b <= a
            first = f"{max(leads)} steps ahead" if leads else "none in the horizon"
            rows.append(f"| {s.name} | {u} | {c} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {v:.2f} | "
                        f"{v / b:.2f}x | {first} |")  # fmt: skip
    if not n:
        return f"Missed crossings after step {early}: none."
    return (f"Missed crossings after step {early} ({n}; {flat} of them no higher {lead} steps "
            f"before crossing than {2 * lead} before; values: float64, over the line):\n\n"
            + "\n".join(rows))  # fmt: skip


def report(runs, settings, tag, crossings, with_sweep: bool, seconds: float):
    """The printed text, and the targets missed (one line each)."""
    cfg = activation_config(settings)
    scores = score(runs, cfg, crossings)
    head = (f"forecast: {', '.join(f'{k}={v}' for k, v in settings.items())}, horizon "
            f"{cfg.forecast.horizon}; {len(runs)} runs, {seconds:.0f} s")  # fmt: skip
    out = [head, "By kind of run:", table(scores)]
    for axis in ("placement", "precision", "set", "model", "norm", "corpus"):
        if len({t[axis] for t in tag.values()}) > 1:
            out += [f"By {axis} (each row: all of its runs, the healthy ones included):",
                    table(scores, key=lambda s, a=axis: tag[s.name][a])]  # fmt: skip
    for part, when in (
        ("holdout", "the constant margin and forecast_climb were chosen"),
        ("holdout2", "the leading slowed distance and the past-the-line rule were chosen"),
        ("holdout3", "the expiring warning was chosen"),
        ("holdout4", "the rule for the sandwich placement's sublayer-output norms was chosen"),
    ):
        held = [s for s in scores if tag[s.name]["set"] == part]
        if held:
            out += [
                f"By placement, the {part} set alone (not scored while {when}):",
                table(held, key=lambda s: tag[s.name]["placement"]),
            ]
    early = cfg.forecast.start + 8
    first = cfg.forecast.start
    for axis in ("placement", "precision"):
        out += [
            f"Warnable recall by {axis}, crossings at steps {first + 5}-{early} (a 5-step lead "
            f"there means a warning from the forecast's first {first}-{first + 3} points) apart "
            "from later ones (all runs):",
            recall_by_step(scores, lambda s, a=axis: tag[s.name][a], early),
        ]
    out.append(missed(runs, scores, cfg.threshold, early))
    if with_sweep:
        out += ["The trade-off (one setting changed from the defaults at a time; core: the "
                "runs the first settings were chosen on, wide: the runs the constant margin "
                "and forecast_climb were chosen on; holdout, holdout2, holdout3: each scored "
                "only after one change, chosen on the sets before it, was committed; a "
                "setting's row is not out of sample on any set):",
                sweep(runs, settings, crossings, lambda r: tag[r["name"]]["set"])]  # fmt: skip
    out.append(noise_growth(runs, cfg.threshold))
    out.append(f"Warnable: crossings at step >= {cfg.forecast.start + 5} (the first forecast is "
               f"at step {cfg.forecast.start}, 5 steps ahead of it).")  # fmt: skip
    misses = []
    for axis in ("placement", "precision"):
        for k in sorted({t[axis] for t in tag.values()}):
            misses += target_misses(k, [s for s in scores if tag[s.name][axis] == k])
    out.append("Targets (per placement and per precision: recall (warnable) >= 0.9, precision "
               ">= 0.8, <= 5 false warnings / 1k healthy steps, median estimate / real distance "
               "in [0.67, 1.5]): " + ("all met." if not misses else "missed:"))  # fmt: skip
    out[-1] += "".join(f"\n- {m}" for m in misses)
    return "\n\n".join(out), misses
