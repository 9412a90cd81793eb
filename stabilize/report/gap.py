"""The gap judge: how far a run is from its reference, in units of seed noise
(docs/design-precision.md section 1).

For a score x of one run and the same score of n reference seeds (the reference config,
e.g. the same run in fp32), the gap is ``x - mean(ref)``; its noise is the standard
deviation of one more seed's difference from the reference mean, ``s * sqrt(1 + 1/n)``
(s: the seeds' sample standard deviation), and the gap is "a real gap" only outside the
95% prediction band, ``t(0.975, n-1)`` noise units (the band of ``report/verdict.py``).

Scores: the held-out loss (nats per token, ``final_eval.json``) and the mean training loss
of the last steps (``summary.last_steps_mean``). Per step: the training loss at each model
step every run has (the value that stuck after a rollback), the gap to the reference mean
and the band, each smoothed over ``window`` steps; the gap *opens* at the first step from
which the smoothed gap stays above the smoothed band to the end.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field

from stabilize.report.load import Run
from stabilize.report.summary import last_steps_mean

MIN_SEEDS = 3


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz), which
    converges fast for x < (a + 1) / (a + b + 2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):  # at 0.975: 10-60 terms for any df measured, 1 to 10^6
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence at a={a}, b={b}, x={x}")


def _ibeta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))  # fmt: skip
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at ``p`` (0.5 < p < 1) for ``df`` degrees of freedom, for any df
    (no scipy here): P(T > t) = I_x(df/2, 1/2) / 2 with x = df / (df + t^2), solved for x
    by bisection (I_x rises with x), to machine precision."""
    if not (0.5 < p < 1 and df >= 1):
        raise ValueError(f"t_quantile: p={p} must be in (0.5, 1) and df={df} >= 1")
    lo, hi, want = 0.0, 1.0, 2 * (1 - p)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _ibeta(df / 2, 0.5, mid) < want else (lo, mid)
    x = (lo + hi) / 2
    return math.sqrt(df * (1 - x) / x)


@functools.cache  # a report asks at every step, with one df
def t975(df: int) -> float:
    """t(0.975, df): the 95% prediction band's half width in noise units, n - 1 seeds' df
    (a table that stopped at df 10 and fell back to the normal's 1.96 made the band 4-11%
    too narrow at 12-31 seeds)."""
    return t_quantile(0.975, df)


@dataclass
class Gap:
    """One score's gap to the reference mean, in units of seed noise."""

    score: str  # "held-out loss" | "last-steps loss" (nats; the report's bpb too)
    value: float  # the run's score minus the reference mean
    run: float
    ref: list[float]

    @property
    def n(self) -> int:
        return len(self.ref)

    @property
    def noise(self) -> float | None:
        """s * sqrt(1 + 1/n): one more seed's spread about the reference mean (None: fewer
        than 2 seeds)."""
        if self.n < 2:
            return None
        return statistics.stdev(self.ref) * math.sqrt(1 + 1 / self.n)

    @property
    def sigma(self) -> float | None:
        noise = self.noise
        return self.value / noise if noise and self.n >= MIN_SEEDS else None

    @property
    def half(self) -> float | None:
        """The 95% prediction band's half width (nats)."""
        noise = self.noise
        return None if noise is None else t975(self.n - 1) * noise

    @property
    def real(self) -> bool | None:
        """Outside the band (None: it cannot be told: < 3 seeds, or no spread)."""
        if self.n < MIN_SEEDS or not self.noise:
            return None
        return abs(self.value) > self.half

    def words(self) -> str:
        head = f"{self.score} {self.value:+.4f} nats"
        if self.n < MIN_SEEDS:
            return (f"{head}: {self.n} reference seed{'s' if self.n != 1 else ''}, at least "
                    f"{MIN_SEEDS} are needed to measure seed noise")  # fmt: skip
        if not self.noise:
            return f"{head}: the {self.n} reference seeds score the same, no seed noise to measure"
        band = f"the {self.n}-seed band is +-{self.half:.4f}"
        if self.real:
            return f"{head}, {self.sigma:+.1f} sigma of seed noise: a real gap ({band})"
        return f"{head}, {self.sigma:+.1f} sigma of seed noise: inside the noise ({band})"


@dataclass
class StepGaps:
    """The per-step gap curve (smoothed) and where it opens."""

    steps: list[int] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)  # smoothed run - reference mean
    half: list[float] = field(default_factory=list)  # smoothed band half width
    window: int = 1
    opens_at: int | None = None


@dataclass
class Judgement:
    heldout: Gap | None
    last: Gap | None
    steps: StepGaps

    @property
    def primary(self) -> Gap | None:
        """The held-out gap where the runs were scored, else the last-steps one."""
        return self.heldout or self.last

    def lines(self) -> list[str]:
        out = [g.words() for g in (self.heldout, self.last) if g is not None]
        s = self.steps
        if s.steps:
            where = (f"opens at step {s.opens_at} (the smoothed gap above the band from there "
                     "to the end)" if s.opens_at is not None
                     else "never stays above the band to the end")  # fmt: skip
            out.append(f"per step ({len(s.steps)} matched steps, smoothed over {s.window}): "
                       f"the gap {where}")  # fmt: skip
        return out


def step_losses(run: Run) -> dict[int, float]:
    """The training loss by model step, every step where the run logged it (``load.py``
    reads ``train/loss_step`` as ``train/loss``; a step's last value, i.e. the one that
    stuck after a rollback)."""
    out: dict[int, float] = {}
    for r in run.rows:
        if "train/loss" in r and "train/step" in r and math.isfinite(r["train/loss"]):
            out[int(r["train/step"])] = r["train/loss"]
    return out


def _smooth(xs: list[float], w: int) -> list[float]:
    """A trailing mean over ``w`` points (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def step_gaps(run: Run, refs: list[Run], window: int | None = None) -> StepGaps:
    mine = step_losses(run)
    theirs = [step_losses(r) for r in refs]
    steps = sorted(set(mine).intersection(*theirs)) if theirs else []
    if not steps or len(refs) < 2:
        return StepGaps()
    w = window or max(1, len(steps) // 10)
    n, t = len(refs), t975(len(refs) - 1)
    # each curve smoothed first, then compared: a step's loss differs between seeds mostly
    # by noise that does not persist (measured on 3 fp32 seeds of the main job, 100 steps:
    # a step's band ~0.4 nats wide each side, a 20-step mean's 0.043), so the band of the
    # smoothed gap is the smoothed curves' spread, not the steps' spread smoothed
    mine_s = _smooth([mine[s] for s in steps], w)
    refs_s = [_smooth([d[s] for s in steps], w) for d in theirs]
    sg = [m - statistics.fmean(r[i] for r in refs_s) for i, m in enumerate(mine_s)]
    sh = [t * statistics.stdev(r[i] for r in refs_s) * math.sqrt(1 + 1 / n)
          for i in range(len(steps))]  # fmt: skip
    opens = None
    for i in range(len(steps) - 1, -1, -1):  # the last run of steps above the band
        if abs(sg[i]) <= sh[i]:
            break
        opens = steps[i]
    return StepGaps(steps, sg, sh, w, opens)


def judge(run: Run, refs: list[Run], window: int | None = None) -> Judgement:
    """``run`` against the reference seeds ``refs``."""
    heldout = last = None
    scored = [r.final_eval.get("loss") if r.final_eval else None for r in [run, *refs]]
    if all(x is not None for x in scored):
        heldout = Gap("held-out loss", scored[0] - statistics.fmean(scored[1:]), scored[0],
                      scored[1:])  # fmt: skip
    by_step = [sorted(step_losses(r).items()) for r in [run, *refs]]
    lasts = [last_steps_mean(x) if x else None for x in by_step]
    if all(x is not None and math.isfinite(x) for x in lasts) and refs:
        last = Gap("last-steps loss", lasts[0] - statistics.fmean(lasts[1:]), lasts[0], lasts[1:])
    return Judgement(heldout, last, step_gaps(run, refs, window))


# ---- the words of the gap bisection and the tail (replay/gap_bisect.py writes their dicts to
# RUN/gap/bisection.json and RUN/gap/tail.json; stabilize-gap shows them beside the judge) ----
def bisection_words(b: dict) -> str:
    """One line: what the bisection of a real gap found (``b``: gap_bisect's dict)."""
    n, w = len(b["sites"]), b["window"]
    bound = math.ceil(math.log2(n)) + 3 if n > 1 else 3
    head = (f"gap bisection over {n} sites, {b['replays']} window replays (bound "
            f"ceil(log2 {n}) + 3 = {bound}), steps {b['start']}-{b['start'] + w}")  # fmt: skip
    gap = f"{b['gap']:+.4f} +- {b['gap_se']:.4f} nats held out"
    if b["noise"]:
        gap += f", {b['gap'] / b['noise']:+.1f} sigma of seed noise"
    if not b["culprits"]:
        return (f"{head}: every site in fp32 changes the window's score by {gap}: not a "
                "precision gap at these sites (nothing to close)")  # fmt: skip
    return (f"{head}: the window's gap is {gap}; fp32 at {', '.join(b['culprits'])} closes "
            f"{100 * b['closed']:.0f}% +- {100 * b['closed_se']:.0f}% of it "
            f"(target {100 * b['share']:.0f}%)")  # fmt: skip


def tail_words(t: dict) -> str:
    """One line: what the tail counterfactual recovered (``t``: tail's dict), or, for a gap
    the judge does not call real, that there was nothing to recover a share of."""
    if t["share"] is None:  # declined before a replay: a share of seed noise means nothing
        judged = t.get("judged") or "the run scores as the reference's mean"  # older files
        return ("tail counterfactual: nothing significant to recover (the run's gap is not a "
                f"real gap against the reference's seed noise): {judged}")  # fmt: skip
    head = (f"tail counterfactual: steps {t['start']}-{t['end']} retrained at the reference's "
            f"precision ({t['precision']}, every site in fp32)")  # fmt: skip
    return (f"{head}: held-out loss {t['tail']:.4f} against the run's {t['run']:.4f} and the "
            f"reference's mean {t['reference']:.4f}: it recovers {100 * t['share']:.0f}% +- "
            f"{100 * t['share_se']:.0f}% of the gap (+- one reference seed's noise)")  # fmt: skip
