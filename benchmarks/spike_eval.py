"""The spike forecast's labelled set and its scoring (scripts/eval_spikes.py; issue 38).

**The set.** The main job's recipe (the tiny GPT, fp32, the embedded corpus) with every step
logged and the curvature measured on every step (``monitor.curvature.every=1``), so that any
sparser cadence can be scored by dropping points:

- ``natural``: no injection, clipping off, rollback off, at high LRs (3e-2 .. 2.5e-1: the
  stability map's grid has 6.3e-2 and 2.5e-1, and LayerNorm's largest stable LR is 2.5e-1)
  with beta2 0.95 and 0.999 (Bai et al.'s case: a second moment that has decayed), seed 1,
  and seed 2 at 6e-2;
- ``planted``: ``fault=grad_spike`` (every gradient of step 100 x 1000), clipping off, at LR
  1e-3 and 1e-2: a spike no state can see coming, the forecast's warnings around it scored;
- ``healthy``: LR 3e-3 with the recipe's clipping, 300 steps: the false warnings' base rate.

None of the forecast's settings was chosen on these runs: it is the activation forecast's
trend forecaster with its defaults (monitors/curvature.py), committed before the set was
recorded.

**Ground truth** comes from the training loss alone, never from the series forecast on: the
loss-spike monitor's own detector (monitors/spikes.py: the median of its window, the trend-
robust sigma of successive differences, floored at 1% of the median; a flagged value never
enters the window, ``LabelDetector``: the rule every block was scored with, kept when the
monitor's changed to let it in after its verdict), run on the recorded losses with milder settings
(``LABEL``: 1.1x the median and 6 sigma over the last 20 steps) so that smaller spikes
count, from step ``FIRST`` on; a new spike needs ``GAP`` steps without a labelled one. The
monitor at its own defaults (1.5x, 8 sigma over 100 steps) is counted beside it. A spike at
the planted fault's step or in the ``PLANTED_AFTER`` steps after it is *planted*: shown
apart, never in recall.

**Scoring** (per cadence: a curvature point every k steps): a spike is warned when a warning
of either quotient came 5 to ``horizon`` steps before it (recall over the unplanted spikes);
a warning is true when an unplanted spike follows within the horizon (precision; a warning
whose horizon runs past the run's end with no spike is undetermined, left out);
false warnings per 1,000 steps are counted on runs with no spike at all.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from benchmarks.forecast_score import _div, fmt
from benchmarks.forecast_set import WIDE
from stabilize.monitors.curvature import UNITS, CurvatureConfig, CurvatureMonitor
from stabilize.monitors.events import StepStats
from stabilize.monitors.spikes import GradSpikeConfig, LossSpikeConfig, SpikeConfig, SpikeDetector

BASE = [
    "experiment=main",
    "precision=fp32",
    "logger=none",
    "rollback=off",
    "trainer.log_every_n_steps=1",
    "monitor.curvature.every=1",
    "trainer.val_check_interval=100000",
    "trainer.limit_val_batches=0",
    "trainer.checkpoint_every_n_steps=100000",
    "trainer.progress=none",
    "audit.every=0",
]
GAP, FIRST = 10, 10
# the loss-spike monitor's detector, milder than its defaults (1.5x and 8 sigma over 100
# steps, counted beside): 1.1x and 6 sigma over the last 20 steps, judged after 3
LABEL = LossSpikeConfig(window=20, warmup=3, threshold=6.0, min_ratio=1.1)
LEAD = 5  # a warning counts toward recall from this many steps ahead
CADENCES = (1, 10)
PLANTED_STEP = 100
# a spike this many steps after the planted fault is its own: AdamW's first moment carries
# the x1000 gradient into the next ~10 updates (the set's two came 3 and 5 steps after; the
# first rule, set before the set was recorded, took 2 and called them natural)
PLANTED_AFTER = GAP


def natural(lr: float, beta2: float, seed: int, steps: int = 200, *extra: str, tag: str = ""):
    ov = [f"optim.lr={lr:g}", f"optim.beta2={beta2:g}", f"seed={seed}", "optim.grad_clip=0"]
    name = f"lr{lr:g}-b{beta2:g}-s{seed}" + (f"-{tag}" if tag else "")
    return ("natural", name, [*ov, f"trainer.max_steps={steps}", *extra])


def planted(lr: float, seed: int, steps: int = 200):
    ov = [
        f"optim.lr={lr:g}", f"seed={seed}", "optim.grad_clip=0", "fault=grad_spike",
        f"fault.step={PLANTED_STEP}", "fault.factor=1000", f"trainer.max_steps={steps}",
    ]  # fmt: skip
    return ("planted", f"grad-spike-lr{lr:g}-s{seed}", ov)


def healthy(seed: int, steps: int = 300):
    return ("healthy", f"lr3e-3-s{seed}", ["optim.lr=3e-3", f"seed={seed}",
                                           f"trainer.max_steps={steps}"])  # fmt: skip


def spike_set() -> list[tuple[str, str, list[str]]]:
    """Interleaved, so that a set cut short (``--save`` keeps each finished run) holds every
    group."""
    out = [natural(6e-2, 0.999, 1), planted(1e-3, 1), healthy(1), natural(6e-2, 0.95, 1)]
    out += [natural(lr, b2, 1) for lr in (3e-2, 1.2e-1, 2.5e-1) for b2 in (0.95, 0.999)]
    out += [planted(1e-2, 1), healthy(2)]
    out += [natural(6e-2, b2, 2) for b2 in (0.95, 0.999)]
    # the wider, deeper model at LRs where the tiny one still learns (added after the first
    # 14 runs had no natural spike; the forecast unchanged)
    out += [natural(lr, 0.999, 1, 300, *WIDE, tag="w256d6") for lr in (1e-2, 2e-2)]
    # the memorizing regime (added after the 16 runs above had no natural loss spike; the
    # forecast unchanged): the first natural spikes this set has
    out += [memorized(3e-3, seed) for seed in (1, 2, 3)] + [memorized(1e-3, 1)]
    # the exploratory run's seed (the config's default, 1234), whose spike the curvature pass
    # does not move (it leaves training bit for bit as it was), and the next one (added after
    # seeds 1-3 at 3e-3 had no spike in the memorizing phase)
    return out + [memorized(3e-3, seed) for seed in (1234, 1235)]


# A corpus small enough to memorize (4,000 characters: the tiny model's loss falls to ~0.006
# in ~1,500 steps), a constant LR, no weight decay, beta2 0.999, clipping off: the regime of
# the "slingshot" spikes (Thilak et al. 2206.04817: Adam's late-training loss spikes once the
# gradients have shrunk and the second moment decayed with them). Found by two exploratory
# runs without the curvature pass at 1570752, seed 1234 (the default): at LR 3e-3 the loss
# went 0.006 -> 8.1 at step 2,549 and came back to 0.016 by step 2,975; at LR 1e-3 no spike
# by the monitor's rule.
MEMORIZE = ["data.max_chars=4000", "optim.weight_decay=0", "optim.schedule=constant"]


def memorized(lr: float, seed: int, steps: int = 3000, group: str = "memorized", tag="mem"):
    _, name, ov = natural(lr, 0.999, seed, steps, *MEMORIZE, tag=tag)
    return (group, name, ov)


def holdout() -> list[tuple[str, str, list[str]]]:
    """``--holdout``: the memorizing recipe's first 150 steps at LR 3e-3, seeds 20-31 (its
    warm-up, where seeds 2 and 3 of the set had a loss spike at step 25), recorded after
    ``monitor.curvature.past_line`` was committed (chosen on the set's memorizing runs:
    both warm-up spikes followed a point past Adam's line by 7 steps) and scored only
    after."""
    return [memorized(3e-3, seed, 150, "holdout", "mem150") for seed in range(20, 32)]


class LabelDetector(SpikeDetector):
    """The labels' detector: a flagged value stays out of its window (a lasting level shift
    is one long run of flags, one spike), as the monitors' did when every block of
    docs/forecast.md was scored."""

    enter_flagged = False


def detected(steps: list[dict], series: str, cfg: SpikeConfig) -> list[int]:
    """The steps where a ``LabelDetector`` with ``cfg`` fires on the recorded ``series``
    (``loss``, ``grad_norm``), the first of each run of them (a new one after ``GAP`` quiet
    steps), from step ``FIRST`` on."""
    det = LabelDetector(cfg)
    out: list[int] = []
    last = -math.inf
    for d in steps:
        if det.update(d["step"], d[series]) and d["step"] >= FIRST:
            if d["step"] - last > GAP:
                out.append(d["step"])
            last = d["step"]
    return out


def warnings(
    steps: list[dict], cadence: int, horizon: int, past_line: bool = False
) -> list[tuple[int, str]]:
    """The forecast's warnings (step, unit) over a recorded run, its curvature points kept
    on every ``cadence``-th step only: the monitor as a run builds it, forecast on."""
    mon = CurvatureMonitor(
        CurvatureConfig(every=1, forecast=True, horizon=horizon, past_line=past_line)
    )
    out = []
    for d in steps:
        s = StepStats(**d)
        if s.step % cadence:
            s.opt = {k: v for k, v in s.opt.items() if k not in _CURV}
        out += [(e.step, e.layer) for e in mon.update(s)]
    return out


_CURV = {k for q, line, _, _ in UNITS for k in (q, line)}


@dataclass
class SpikeScore:
    name: str
    group: str
    steps: int
    spikes: list[int]  # unplanted spike starts
    planted: list[int]
    monitor_spikes: int  # by monitor.loss_spike's own thresholds
    warned: list[tuple[int, str]]
    horizon: int
    points: dict[str, list[float]] = field(default_factory=dict)  # unit -> value / line
    last: int = 0  # the run's last step (runs number their steps from 1)

    def lead(self, spike: int) -> int | None:
        """The longest lead of a warning 5..horizon steps before ``spike``."""
        leads = [spike - w for w, _ in self.warned if LEAD <= spike - w <= self.horizon]
        return max(leads) if leads else None

    def verdict(self, w: int) -> bool | None:
        """A warning at step w: True (a spike follows within the horizon), False, or None
        (its horizon runs past the run's last step with none)."""
        if any(w < s <= w + self.horizon for s in self.spikes):
            return True
        return None if w + self.horizon > self.last else False


def score(
    run: dict, cadence: int, horizon: int, truth: str = "loss", past_line: bool = False
) -> SpikeScore:
    """``truth``: ``loss`` (loss spikes, ``LABEL``) or ``grad`` (``monitor.grad_spike``'s
    thresholds at their defaults: 4x the median and 8 robust sigmas over 100 steps, after
    50; a ``LabelDetector``'s)."""
    steps = run["steps"]
    fault = run.get("fault_step")
    if truth == "grad":
        found = detected(steps, "grad_norm", GradSpikeConfig())
        own = len(found)
    else:
        found = detected(steps, "loss", LABEL)
        own = len(detected(steps, "loss", LossSpikeConfig()))
    planted = [t for t in found if fault is not None and fault <= t <= fault + PLANTED_AFTER]
    points: dict[str, list[float]] = {}
    for d in steps:
        if d["step"] % cadence == 0:
            for q, line, unit, _ in UNITS:
                if q in d["opt"] and d["opt"].get(line, 0) > 0:
                    points.setdefault(unit, []).append(d["opt"][q] / d["opt"][line])
    return SpikeScore(
        run["name"], run["group"], len(steps), [t for t in found if t not in planted], planted,
        own, warnings(steps, cadence, horizon, past_line),
        horizon, points, steps[-1]["step"],
    )  # fmt: skip


HEAD = (
    "| set | cadence | runs | steps | spikes | planted | spikes (the monitor's own rule) "
    "| warned >= 5 ahead | recall | median lead | warnings | followed by a spike | "
    "undetermined | precision | false warnings / 1k spike-free steps |"
)


def row(label: str, cadence: int, ss: list[SpikeScore]) -> str:
    spikes = [(s, t) for s in ss for t in s.spikes]
    leads = [s.lead(t) for s, t in spikes]
    hit = [x for x in leads if x is not None]
    verdicts = [s.verdict(w) for s in ss for w, _ in s.warned]
    true, undetermined = verdicts.count(True), verdicts.count(None)
    free = [s for s in ss if not s.spikes and not s.planted]
    free_steps = sum(s.steps for s in free)
    false_free = sum(len(s.warned) for s in free)
    cells = [
        label, f"every {cadence}" if cadence > 1 else "every step", len(ss),
        sum(s.steps for s in ss), len(spikes), sum(len(s.planted) for s in ss),
        sum(s.monitor_spikes for s in ss), len(hit), fmt(_div(len(hit), len(spikes))),
        fmt(statistics.median(hit) if hit else None, ".1f"), len(verdicts), true, undetermined,
        fmt(_div(true, len(verdicts) - undetermined)),
        fmt(_div(1000 * false_free, free_steps), ".1f"),
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


POINTS_HEAD = (
    "| set | quotient | points | <= 0 (not a point) | median of the positive ones, / line "
    "| 90th percentile | above the line |"
)


def points_row(label: str, unit: str, ss: list[SpikeScore]) -> str:
    v = [x for s in ss for x in s.points.get(unit, [])]
    pos = sorted(x for x in v if x > 0)
    cells = [
        label, unit, len(v), fmt(_div(len(v) - len(pos), len(v))),
        fmt(statistics.median(pos) if pos else None, ".3f"),
        fmt(pos[int(0.9 * (len(pos) - 1))] if pos else None, ".3f"),
        fmt(_div(sum(x >= 1 for x in pos), len(v))),
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


GROUPS = ("natural", "memorized", "holdout", "planted", "healthy")


def table(runs: list[dict], horizon: int, truth: str, past_line: bool = False) -> tuple[str, dict]:
    lines = [HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"]
    by_cadence = {}
    for k in CADENCES:
        scores = [score(r, k, horizon, truth, past_line) for r in runs]
        by_cadence[k] = scores
        for g in GROUPS:
            ss = [s for s in scores if s.group == g]
            if ss:
                lines.append(row(g, k, ss))
        lines.append(row("all", k, scores))
    return "\n".join(lines), by_cadence


def report(runs: list[dict], horizon: int, past_line: bool = False) -> str:
    out, by_cadence = table(runs, horizon, "loss", past_line)
    grad, by_grad = table(runs, horizon, "grad", past_line)
    out += (
        "\n\nAgainst gradient-norm spikes instead (`monitor.grad_spike`'s detector at its "
        "defaults, 4x the median and 8 robust sigmas, on the recorded pre-clip norms; the "
        "monitor's own thresholds are the spikes' rule here, a flagged value kept out of the "
        "window as in every label):\n\n" + grad
    )
    pts = [POINTS_HEAD, "|" + "---|" * POINTS_HEAD.count(" | ") + "---|"]
    for g in GROUPS:
        ss = [s for s in by_cadence[1] if s.group == g]
        for _, _, unit, _ in UNITS if ss else ():
            pts.append(points_row(g, unit, ss))
    out += "\n\nThe quotients against their lines (every step; `preconditioned`: curv_pre / "
    out += "(38 / lr), `plain`: curv_u / (2 / lr)):\n\n" + "\n".join(pts)
    found = [f"{s.name}: steps {', '.join(map(str, s.spikes))}" for s in by_cadence[1] if s.spikes]
    out += "\n\nUnplanted loss spikes: " + ("; ".join(found) if found else "none") + "."
    found = [f"{s.name}: steps {', '.join(map(str, s.spikes))}" for s in by_grad[1] if s.spikes]
    out += " Unplanted gradient-norm spikes: " + ("; ".join(found) if found else "none") + "."
    return out + "\n\nEach run:\n\n" + per_run(runs, by_cadence)


RUN_HEAD = (
    "| run | set | final loss (mean of the last 20 steps) | spikes | planted spikes (steps) | "
    "warnings, every step | warnings, every 10 | preconditioned > line | <= 0 |"
)


def per_run(runs: list[dict], by_cadence: dict[int, list[SpikeScore]]) -> str:
    lines = [RUN_HEAD, "|" + "---|" * RUN_HEAD.count(" | ") + "---|"]
    for r, s, s10 in zip(runs, by_cadence[1], by_cadence[CADENCES[-1]], strict=True):
        tail = [d["loss"] for d in r["steps"][-20:]]
        pre = s.points.get("preconditioned", [])
        cells = [
            s.name, s.group, f"{statistics.fmean(tail):.3f}", len(s.spikes),
            ", ".join(map(str, s.planted)) or "-", len(s.warned), len(s10.warned),
            fmt(_div(sum(x >= 1 for x in pre), len(pre))),
            fmt(_div(sum(x <= 0 for x in pre), len(pre))),
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
