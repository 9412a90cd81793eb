"""The delayed-scaling forecast scored on recorded runs (scripts/eval_quant_forecast.py).

``monitor.quant`` forecasts an operand's amax ratio (its amax over the format's max after
its scaling) reaching 1: under delayed scaling, a tensor whose growth outruns its amax
history. It is scored here as the activation forecast is (forecast_score.RunScore):

- a *unit* is a quantized GEMM operand (``<layer>.x``, ``.w``, ``.dy``);
- it *crosses* at the first step from ``COLD`` on where its saturated share (counted before
  the cast, on a measured step; every step is measured here) rises past
  ``monitor.quant.saturated``, the monitor's own verdict line, from at or under it the step
  before (the first steps are the cold start: an empty history saturates everything);
- a *warning* is a forecast event of the monitor, replayed from the recorded StepStats (the
  monitor is a function of them alone), so any setting is scored without training again.

The set: the formats scenario's tiny GPT (configs/experiment/formats.yaml, every step
measured) under ``quant=fp8_delayed``, margin 0, history 16 and 1024, seeds 1 and 2:

- *rising*: ``fault=value_growth`` from step 30 with a step ratio that starts at 1 and rises
  by ``fault.accel`` a step (0.001, 0.002, 0.004): ``c_proj``'s input grows ever faster,
  and the history's scale is outrun once the ratio passes 464/448 (at steps ~66, ~48, ~39);
- *steady*: the scenario's own growth, 1.25 a step from step 30. A steady rate outruns the
  history from its first step or never (under the history's max, the ratio a_t / a_(t-1)
  of a steady or slowing growth never rises): nothing to forecast, shown as the bound;
- *healthy*: no growth: every warning in it is false.

Beside the forecast, two rules that read nothing of the run (the chance rows): *always*
warns every operand every horizon steps from ``COLD``, *clock k* every operand once at step
k. A forecast worth having beats both on precision at a recall they do not buy.
"""

from __future__ import annotations

import dataclasses
import math

from benchmarks.forecast_score import RunScore, fmt, row_metrics
from stabilize.monitors.events import StepStats
from stabilize.monitors.quant import QuantMonitor, QuantMonitorConfig
from stabilize.quant.quantize import scheme_for

COLD = 10  # crossings before this step are the cold start (an empty amax history)
GROWTH_STEP = 30
ACCELS = (0.001, 0.002, 0.004)
HISTORIES = (16, 1024)
SEEDS = (1, 2)
CLOCK = (40, 60)
BASE = [
    "experiment=formats",
    "quant=fp8_delayed",
    "quant.margin=0",
    "logger=none",
    "trainer.progress=none",
    "trainer.val_check_interval=100000",
    "trainer.limit_val_batches=0",
    "trainer.checkpoint_every_n_steps=100000",
    "audit.every=0",
    "trainer.max_steps=120",
]


def quant_set(seeds=SEEDS, accels=ACCELS) -> list[tuple[str, str, list[str]]]:
    """(group, name, overrides) of every run, interleaved so that a set cut short holds
    every group."""
    out = []
    for history in HISTORIES:
        for seed in seeds:
            common = [f"quant.history={history}", f"seed={seed}"]
            for accel in accels:
                grow = ["fault.rate=1.0", f"fault.accel={accel}", f"fault.step={GROWTH_STEP}"]
                out.append(("rising", f"accel{accel:g}-h{history}-s{seed}", [*common, *grow]))
            out.append(("steady", f"rate1.25-h{history}-s{seed}", [*common, "fault.rate=1.25"]))
            out.append(("healthy", f"none-h{history}-s{seed}", [*common, "fault.enabled=false"]))
    return out


def quant_holdout() -> list[tuple[str, str, list[str]]]:
    """Recorded with the set, before any setting was chosen on it, and scored only after:
    seeds 3 and 4, step ratios rising by 0.0015 and 0.003 a step."""
    return quant_set(seeds=(3, 4), accels=(0.0015, 0.003))


def crossings(steps: list[dict], line: float) -> dict[str, int]:
    """{operand: the first step from COLD on where its saturated share rose past ``line``}."""
    out: dict[str, int] = {}
    before: dict[str, float] = {}
    for st in steps:
        for op, share in st["quant_saturated"].items():
            if op not in out and st["step"] >= COLD and share > line >= before.get(op, 0.0):
                out[op] = st["step"]
            before[op] = share
    return out


def _edges() -> dict[str, float]:
    """The fp8_delayed recipe's saturation edge per operand (E4M3 forward, E5M2 gradients)."""
    out = {}
    for op, role in (("x", "input"), ("w", "weight"), ("dy", "grad_output")):
        fmt = scheme_for("fp8_delayed", role).fmt
        out[op] = fmt.overflow_from / fmt.max
    return out


def replay(steps: list[dict], cfg: QuantMonitorConfig) -> dict[tuple[str, int], float]:
    """The forecast warnings the run's monitor logs at ``cfg`` with its forecast on:
    (operand, step) -> the measured steps it said were left. A step recorded before
    StepStats carried ``quant_edge`` gets the fp8_delayed recipe's (the set's only one)."""
    mon = QuantMonitor(dataclasses.replace(cfg, forecast=True))
    edges = _edges()
    out = {}
    for st in steps:
        if not st.get("quant_edge"):
            st = {**st, "quant_edge": {op: edges[op.rpartition(".")[2]]
                                       for op in st["quant_amax_ratio"]
                                       if op.rpartition(".")[2] in edges}}  # fmt: skip
        for e in mon.update(StepStats(**st)):
            if e.monitor == "quant" and "where its cast saturates" in e.message:
                out[(e.layer, e.step)] = e.value
    return out


def operands(steps: list[dict]) -> list[str]:
    return sorted({op for st in steps for op in st["quant_amax_ratio"]})


def chance(steps: list[dict], rule: str, horizon: int) -> list[tuple[str, int]]:
    """A rule's warnings that read nothing of the run but its step."""
    n = len(steps)
    if rule == "always":
        at = range(COLD, n + 1, horizon)
    else:
        at = [int(rule.split()[1])] if int(rule.split()[1]) <= n else []
    return sorted(((op, s) for op in operands(steps) for s in at), key=lambda w: w[1])


def score(runs: list[dict], rule: str, cfg: QuantMonitorConfig) -> list[RunScore]:
    out = []
    for r in runs:
        steps = r["steps"]
        cross = crossings(steps, cfg.saturated)
        if rule == "forecast":
            warned = replay(steps, cfg)
            warnings = sorted(warned, key=lambda w: w[1])
        else:
            warned, warnings = {}, chance(steps, rule, cfg.horizon)
        out.append(RunScore(r["name"], r["group"], len(steps), cross, warnings, cfg.horizon,
                            first=cfg.window, estimates=warned))  # fmt: skip
    return out


def _ahead(ss: list[RunScore], lead: int) -> float | None:
    able = [(s, u) for s in ss for u in s.warnable]
    if not able:
        return None
    return sum(1 for s, u in able if s.timely.get(u, 0) >= lead) / len(able)


def report(runs: list[dict], cfg: QuantMonitorConfig) -> str:
    """One row per rule and group, then every rising run's planted crossing."""
    rules = ["forecast", "always", *(f"clock {k}" for k in CLOCK)]
    groups = sorted({r["group"] for r in runs}, key=lambda g: ("rising", "steady").index(g)
                    if g in ("rising", "steady") else 2)  # fmt: skip
    rows = [
        "| rule | runs | crossings | warnable | warned >= 5 ahead (recall) | warned >= 10 "
        "ahead | warnings | followed by a crossing | undetermined | precision | median lead "
        "| median estimate / real distance | false warnings / 1k healthy steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    planted = []
    for rule in rules:
        scores = score(runs, rule, cfg)
        for g in [*groups, "all"]:
            ss = [s for s in scores if g in ("all", s.group)]
            m = row_metrics(ss)
            rows.append(
                f"| {rule}: {g} | {len(ss)} | {m['crossings']} | {m['warnable']} "
                f"| {fmt(m['recall_warnable'])} | {fmt(_ahead(ss, 10))} | {m['warnings']} "
                f"| {m['true']} | {m['undetermined']} | {fmt(m['precision'])} "
                f"| {fmt(m['lead'], '.1f')} | {fmt(m['calibration'])} "
                f"| {fmt(m['false_per_k'], '.1f')} |"
            )
        if rule == "forecast":
            planted = [_planted_row(r, s) for r, s in zip(runs, scores, strict=True)
                       if r["group"] == "rising"]  # fmt: skip
    head = (f"monitor.quant: saturated {cfg.saturated:g}, horizon {cfg.horizon}, window "
            f"{cfg.window}; crossings from step {COLD}; {len(runs)} runs")  # fmt: skip
    grown = [
        "| run | c_proj input crosses at | warned (longest lead) | first warning's estimate |",
        "|---|---|---|---|",
        *planted,
    ]
    return "\n\n".join([head, "\n".join(rows), "The planted crossings (the grown GEMM "
                        "input, `h.0.attn.c_proj.x`):", "\n".join(grown)])  # fmt: skip


def _planted_row(r: dict, s: RunScore) -> str:
    op = "h.0.attn.c_proj.x"
    c = s.crossings.get(op)
    mine = [(step, s.estimates.get((op, step), math.nan)) for u, step in s.warnings if u == op]
    lead = s.timely.get(op)
    first = f"{mine[0][1]:.0f} steps, at step {mine[0][0]}" if mine else "-"
    if c is None:
        said = "warned; no crossing followed" if mine else "none"
    else:
        said = f"{lead} steps ahead" if lead else ("too late" if mine else "none")
    return f"| {r['name']} | {c if c is not None else 'never'} | {said} | {first} |"
