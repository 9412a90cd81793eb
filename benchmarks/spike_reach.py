"""What a spike warning can reach on a recorded set: the best that simple threshold rules
on the optimizer-state series do, chosen on the set itself (``eval_spikes.py --reach``).

The forecast's own table (spike_eval.py) scores rules fixed before the set was recorded. This
one answers the issue's fallback question, "if the target is not reachable, say what is":
every rule here warns when one series is at or above a threshold, once per ``horizon`` steps
like the monitor's warnings, and the thresholds are percentiles of that series over the
set's own steps, so each row is an upper bound on what that rule could score out of sample,
not a figure for it. Beside them:

- ``always``: a warning every ``horizon`` steps whatever the series say, the chance level:
  with a horizon of H steps it is 5 to H steps ahead of a spike at (H - 4) / H of the
  positions a spike can take, so recall alone says little; its false warnings are the
  price of that recall without information;
- ``clock``: one warning at step k of every run (k in ``CLOCK``): a rule that reads nothing
  but the step, which a threshold crossed at the same step of every run (a series that
  follows the LR warm-up) only repeats;
- the trend forecast as the monitor runs it (``monitor.curvature.forecast``, and with
  ``past_line``), every step.

Scored the same way for every row: a spike is warned at lead L when a warning came L to
``horizon`` steps before it; a warning is true when an unplanted spike follows within
``horizon`` steps, undetermined when its horizon runs past the run's end with none, else
false; false warnings are counted per 1,000 steps of every run (the forecast's table counts
them on spike-free runs only: a set of short warm-up runs has few).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from benchmarks.forecast_score import _div, fmt
from benchmarks.spike_eval import LEAD, score

LEADS = (1, 3, LEAD)
PERCENTILES = (50, 75, 90, 95, 99)
CLOCK = (10, 20)


def _quotient(q: str, line: str) -> Callable[[dict], float | None]:
    def f(opt: dict) -> float | None:
        v, ln = opt.get(q), opt.get(line)
        return v / ln if v is not None and ln and math.isfinite(ln) and ln > 0 else None

    return f


# (the row's name, the value read from a step's ``opt`` dict)
SERIES: tuple[tuple[str, Callable[[dict], float | None]], ...] = (
    ("curv_pre / Adam's line", _quotient("curv_pre", "edge_adam")),
    ("curv_u / GD's line", _quotient("curv_u", "edge_gd")),
    ("g^2 / v_hat (largest block)", lambda o: o.get("g2_v")),
    ("update / weight (largest block)", lambda o: o.get("update_ratio")),
)


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile by the nearest rank (the value at or below which p% lie)."""
    v = sorted(values)
    return v[max(0, math.ceil(p / 100 * len(v)) - 1)]


def threshold_warnings(
    steps: list[dict], value: Callable[[dict], float | None], theta: float, horizon: int
) -> list[int]:
    """The steps a rule "``value`` >= ``theta``" warns at, once per ``horizon`` steps."""
    out: list[int] = []
    for d in steps:
        v = value(d["opt"])
        met = v is not None and math.isfinite(v) and v >= theta
        if met and (not out or d["step"] - out[-1] >= horizon):
            out.append(d["step"])
    return out


def every(steps: list[dict], horizon: int) -> list[int]:
    """``always``: a warning at the first step and every ``horizon`` steps after."""
    return [d["step"] for d in steps if (d["step"] - steps[0]["step"]) % horizon == 0]


def metrics(runs: list[tuple[dict, list[int], list[int]]], horizon: int) -> list:
    """``runs``: (run, its unplanted spikes, a rule's warning steps) -> the row's cells after
    its name: warnings, the runs warned and the range of their first warnings' steps,
    recall at each lead of ``LEADS``, precision, false per 1k steps."""
    spikes = [(sp, ws) for _, sps, ws in runs for sp in sps]
    recall = [
        fmt(_div(sum(any(lead <= s - w <= horizon for w in ws) for s, ws in spikes), len(spikes)))
        for lead in LEADS
    ]
    true = false = 0
    for r, sps, ws in runs:
        last = r["steps"][-1]["step"]
        for w in ws:
            if any(w < s <= w + horizon for s in sps):
                true += 1
            elif w + horizon <= last:
                false += 1
    steps = sum(len(r["steps"]) for r, _, _ in runs)
    n = sum(len(ws) for _, _, ws in runs)
    first = [ws[0] for _, _, ws in runs if ws]
    when = f"{len(first)}: {min(first)}-{max(first)}" if first else "0"
    return [n, when, *recall, fmt(_div(true, true + false)), fmt(_div(1000 * false, steps), ".1f")]


HEAD = (
    "| rule | threshold | warnings | runs warned: their first warning's steps | "
    + " | ".join(f"recall, warned >= {k} ahead" for k in LEADS)
    + " | precision | false warnings / 1k steps |"
)


def before(scored: list, warned: list[list[int]], horizon: int) -> str:
    """Each spike as ``run: step <- warnings`` (those 0 to ``horizon`` steps before it)."""
    out = []
    for s, ws in zip(scored, warned, strict=True):
        for sp in s.spikes:
            near = [w for w in ws if 0 <= sp - w <= horizon]
            out.append(f"{s.name}: {sp} <- {', '.join(map(str, near)) or 'none'}")
    return "; ".join(out) or "no spike"


def reach(runs: list[dict], horizon: int) -> str:
    """The table (module docstring) over ``runs`` recorded by eval_spikes.py."""
    scored = [score(r, 1, horizon) for r in runs]
    fore = [score(r, 1, horizon, past_line=True) for r in runs]
    lines = [HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"]

    def add(name: str, theta: str, warned: list[list[int]]) -> None:
        rows = [(r, s.spikes, ws) for r, s, ws in zip(runs, scored, warned, strict=True)]
        cells = [name, theta, *metrics(rows, horizon)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")

    add("always (once per horizon)", "-", [every(r["steps"], horizon) for r in runs])
    for k in CLOCK:
        add(
            f"clock: step {k} only", "-", [[k] if k <= r["steps"][-1]["step"] else [] for r in runs]
        )
    add("trend forecast (the monitor's)", "-", [sorted({w for w, _ in s.warned}) for s in scored])
    add("trend forecast + past_line", "-", [sorted({w for w, _ in s.warned}) for s in fore])
    near = []  # per threshold row: each spike and the row's warnings in the horizon before it
    for name, value in SERIES:
        vals = [v for r in runs for d in r["steps"] if (v := value(d["opt"])) is not None]
        vals = [v for v in vals if math.isfinite(v)]
        for p in PERCENTILES if vals else ():
            theta = percentile(vals, p)
            warned = [threshold_warnings(r["steps"], value, theta, horizon) for r in runs]
            add(name, f"{theta:.3g} (p{p})", warned)
            near.append(f"- {name} (p{p}): " + before(scored, warned, horizon))
    n = sum(len(s.spikes) for s in scored)
    return (
        f"What a warning can reach on these {len(runs)} runs ({n} unplanted loss spikes, "
        f"horizon {horizon} steps; thresholds chosen on the set itself, so each threshold "
        "row is an upper bound for its rule, not an out-of-sample figure):\n\n"
        + "\n".join(lines)
        + f"\n\nEach spike (run: step) and the threshold rows' warnings in the {horizon} steps "
        "before it or at its step (a lead of 0):\n\n" + "\n".join(near)
    )
