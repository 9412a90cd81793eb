"""Verdicts against a healthy reference: "no NaN" is not "fixed".

A scenario's ``reference`` arm is the same run without the drift (same model, data, seed
and precision; ``configs/arm/reference.yaml``), possibly run with several seeds. Every other
arm is judged by two questions, each answered from recorded numbers only:

1. **Did it stop the NaN?** No non-finite loss or gradient caused by the fault: no
   ``nonfinite`` event, and no more GradScaler skips (inf/NaN gradients) from the arm's
   first overflowed reduction on than the reference had over the same steps (the most any
   of its seeds had there). A skip is also the loss scale's ordinary calibration: the
   healthy reference skips a few times too (3-4 in 120 steps of nan_repro), so a skip counts
   as NaN gradients only beyond the reference's own rate. For an arm that rolled back, only
   what came after its last rollback counts.
2. **Does it train like the reference?** Its gap to the reference's mean, on the held-out
   bits per byte and on the mean training loss of the last steps, against the reference's
   seed band: the 95% prediction interval for one more seed, mean +- t(0.975, n-1) * s *
   sqrt(1 + 1/n) over the n reference seeds (s: their sample standard deviation). A run of
   another arm is one draw, so [min, max] of 3 seeds would call a third of healthy draws
   "worse". Only the upper side counts (lower is not a failure to train). With one
   reference seed there is no spread, and the verdict says it cannot tell a gap from noise.

"fixes it" needs both; "stops the NaN but trains X worse" is the first alone. An arm whose
model collapsed to a uniform guess (``ArmSummary.dead``: the loss flat at ln V, ln 256 =
5.545 for bytes, and held out too) "dies", whatever else it did: the sentence tells its chain
in step order with the numbers beside it. What each arm hides is measured beside it
(``hides``); what it costs, only where it was measured paired (``report/cost.py``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from stabilize.report.gap import Gap, t975
from stabilize.report.load import Run
from stabilize.report.summary import DRIFTS, ArmSummary

REFERENCE = "reference"


@dataclass
class Facts:
    """What the verdict reads from one run besides its ``ArmSummary``."""

    arm: str  # the configured arm (several seeds share it)
    seed: int | None
    nan_steps: list[int] = field(default_factory=list)  # non-finite loss/grad-norm events
    overflow_after_last_rollback: bool = False
    # GradScaler skips (model steps) after the last rollback, and the first overflow there:
    # the window in which a skip may be NaN gradients rather than calibration
    skips: list[int] = field(default_factory=list)
    window: int | None = None
    end: int = 0  # the model's final step
    rel_err_drift: float | None = None  # norm-output error vs float64 while drifted
    norm_dev: float | None = None  # worst norm's median |output norm / sqrt(D) - 1|


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _median(xs):
    xs = [x for x in xs if _finite(x)]
    return statistics.median(xs) if xs else None


def facts(run: Run, s: ArmSummary) -> Facts:
    cfg = run.config
    f = Facts(arm=str(cfg.get("arm") or s.arm), seed=cfg.get("seed"))
    ev = run.events
    rb = [int(e["global_step"]) for e in ev if e.get("monitor") == "rollback"
          and e.get("kind") == "rollback" and e.get("global_step") is not None]  # fmt: skip
    after = max(rb, default=-1)

    def later(e):
        return e.get("global_step") is None or int(e["global_step"]) > after

    overflows = [e for e in ev if e.get("monitor") == "overflow" and later(e)]
    f.overflow_after_last_rollback = bool(rb) and bool(overflows)
    f.window = min((int(e["step"]) for e in overflows), default=None)
    f.nan_steps = sorted({int(e["step"]) for e in ev if e.get("monitor") == "nonfinite"
                          and later(e)})  # fmt: skip
    f.skips = sorted({int(e["step"]) for e in ev if e.get("monitor") == "loss_scale"
                      and e.get("kind") == "skip" and later(e)})  # fmt: skip
    f.end = s.steps
    fault = cfg.get("fault") or {}
    drifts = fault.get("kind") in DRIFTS and fault.get("enabled", True)
    start = fault.get("step") if drifts else None
    if start is not None:  # the drift's own magnitude: audits from the planned target on
        at = fault.get("target_step") or fault.get("cross_step") or start
        f.rel_err_drift = _median(a.get("rel_err_median") for a in run.audits if a["step"] >= at)
    f.norm_dev = _median(a.get("norm_dev_worst") for a in run.audits)
    return f


@dataclass
class Reference:
    names: list[str]
    bpb: list[float]
    loss: list[float]
    skips: list[list[int]] = field(default_factory=list)  # each seed's GradScaler skip steps

    def skip_allowance(self, lo: int, hi: int) -> int:
        """The most GradScaler skips any reference seed had in steps [lo, hi]: its own rate
        of calibration skips over those steps."""
        return max((sum(lo <= x <= hi for x in seed) for seed in self.skips), default=0)

    @property
    def seeds(self) -> int:
        return len(self.names)

    def band(self, key: str) -> tuple[float, float] | None:
        """The 95% prediction interval for one more seed (None: fewer than 2 seeds)."""
        vals = getattr(self, key)
        if len(vals) < 2:
            return None
        n, m, sd = len(vals), statistics.fmean(vals), statistics.stdev(vals)
        half = t975(n - 1) * sd * math.sqrt(1 + 1 / n)
        return (m - half, m + half)

    def mean(self, key: str) -> float | None:
        vals = getattr(self, key)
        return statistics.fmean(vals) if vals else None


@dataclass
class Verdict:
    arm: str
    nan_stopped: bool
    gap_bpb: float | None
    gap_loss: float | None
    inside: bool | None  # both gaps inside the band; None: no spread (1 seed) or no score
    hides: str
    label: str = ""  # the verdict in a few words (the table's cell) ...
    words: str = ""  # ... and as the conclusion's sentence
    # GradScaler skips counted as NaN gradients: the arm's skips in [window, end] when they
    # are more than the reference's allowance there (else none), and that allowance
    grad_nan: list[int] = field(default_factory=list)
    in_window: list[int] = field(default_factory=list)  # every skip of the arm in the window
    allowance: int | None = None
    window: tuple[int, int] | None = None
    dies: bool = False  # the model collapsed to a uniform guess (ArmSummary.dead)
    # each gap in units of seed noise (report/gap.py; None: fewer than 3 seeds, no spread)
    sigma_bpb: float | None = None
    sigma_loss: float | None = None


def reference(arms: list[ArmSummary], fs: list[Facts]) -> Reference | None:
    refs = [(a, f) for a, f in zip(arms, fs, strict=True) if f.arm == REFERENCE]
    if not refs:
        return None
    ok = [(a, f) for a, f in refs if a.status == "done"]
    return Reference(
        names=[a.arm for a, _ in ok],
        bpb=[a.heldout_bpb for a, _ in ok if a.heldout_bpb is not None],
        loss=[a.final_loss for a, _ in ok if _finite(a.final_loss)],
        skips=[f.skips for _, f in ok],
    )


def _inside(value: float | None, band: tuple[float, float] | None) -> bool | None:
    if value is None or band is None or not math.isfinite(value):
        return False if value is not None else None
    return value <= band[1]  # better than every seed is not a failure to train


def hides(a: ArmSummary, f: Facts) -> str:
    """What the arm's way out hides, as measured (empty: nothing measured)."""
    parts = []
    # a 16-bit reduction that did not overflow: its rounding at the drift's magnitude (an
    # overflowed one's error is its dead rows, counted elsewhere)
    if f.rel_err_drift is not None and a.reduction in ("bf16", "fp16") and a.first_overflow is None:
        parts.append(f"norm outputs off by {f.rel_err_drift:.2g} vs float64 at the drift's |x|")
    if a.flattened:
        parts.append(f"{100 * a.flattened:.2g}% of rows flattened by eps")
    if f.norm_dev is not None and f.norm_dev > 0.01:
        parts.append(f"output norms {100 * f.norm_dev:.2g}% off sqrt(D) (worst norm's median)")
    return "; ".join(parts)


def judge(arms: list[ArmSummary], fs: list[Facts]) -> tuple[Reference | None, list[Verdict]]:
    ref = reference(arms, fs)
    out = []
    for a, f in zip(arms, fs, strict=True):
        if f.arm == REFERENCE:
            continue
        there, allowance, window = scaler_nan(f, ref)
        grad_nan = there if allowance is not None and len(there) > allowance else []
        stopped = (
            not f.nan_steps
            and not grad_nan
            and a.status == "done"
            and not f.overflow_after_last_rollback
        )
        gap_bpb = gap_loss = inside = None
        if ref is not None:
            if a.heldout_bpb is not None and ref.bpb:
                gap_bpb = a.heldout_bpb - ref.mean("bpb")
            if a.final_loss is not None and ref.loss:
                gap_loss = a.final_loss - ref.mean("loss")
            if ref.seeds > 1 and gap_bpb is not None:
                inside = bool(_inside(a.heldout_bpb, ref.band("bpb"))) and bool(
                    _inside(a.final_loss, ref.band("loss"))
                )
        v = Verdict(a.arm, stopped, gap_bpb, gap_loss, inside, hides(a, f), grad_nan=grad_nan,
                    in_window=there, allowance=allowance, window=window,
                    dies=a.dead)  # fmt: skip
        held = Gap("held-out", gap_bpb, a.heldout_bpb, ref.bpb) if gap_bpb is not None else None
        if held is not None:
            v.sigma_bpb = held.sigma
        if ref is not None and gap_loss is not None and math.isfinite(gap_loss):
            v.sigma_loss = Gap("last-steps", gap_loss, a.final_loss, ref.loss).sigma
        if a.precision.startswith("bf16") and v.sigma_bpb is not None and not a.dead:
            said = "a real gap" if held.real else "inside the noise"
            gap = (f"a held-out gap of {gap_bpb:+.3f} bpb to the reference, "
                   f"{held.sigma:+.1f} sigma of seed noise ({said})")  # fmt: skip
            v.hides = "; ".join(x for x in (v.hides, gap) if x)
        v.label, v.words = words(a, f, v, ref)
        out.append(v)
    return ref, out


def scaler_nan(f: Facts, ref: Reference | None) -> tuple[list[int], int | None, tuple | None]:
    """The arm's GradScaler skips in the window [first overflow, end], the reference's
    allowance there (the most any of its seeds had over the same steps) and the window; the
    skips count as NaN gradients when there are more of them than the allowance. Without a
    reference the allowance is 0 (every skip from the overflow on counts)."""
    if f.window is None:
        return [], None, None
    lo, hi = f.window, max(f.end, f.window)
    there = [x for x in f.skips if lo <= x <= hi]
    allowance = ref.skip_allowance(lo, hi) if ref is not None and ref.skips else 0
    return there, allowance, (lo, hi)


def steps_text(steps: list[int]) -> str:
    """[54, 56, 59] -> "54, 56 and 59"; runs of consecutive steps as "a-b"."""
    runs: list[list[int]] = []
    for x in sorted(steps):
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def gap_words(v: Verdict) -> str:
    bits = []
    if v.gap_bpb is not None and math.isfinite(v.gap_bpb):
        bits.append(f"{v.gap_bpb:+.3f} bpb held out{_sigma(v.sigma_bpb)}")
    if v.gap_loss is not None and math.isfinite(v.gap_loss):
        bits.append(f"{v.gap_loss:+.3f} loss over the last steps{_sigma(v.sigma_loss)}")
    return ", ".join(bits) or "no score"


def _sigma(x: float | None) -> str:
    return "" if x is None else f" ({x:+.1f} sigma of seed noise)"


def _skipped(v: Verdict) -> str:
    """The scaler skips counted as NaN gradients, with the reference's allowance beside."""
    lo, hi = v.window
    ref = f", the reference at most {v.allowance} over steps {lo}-{hi}" if v.allowance else ""
    return (
        f"NaN gradients at steps {steps_text(v.grad_nan)} were skipped by the loss scaler "
        f"({len(v.grad_nan)} skips from step {lo} on{ref})"
    )


def _uniform(a: ArmSummary) -> str:
    """The numbers of a uniform guess beside the arm's own."""
    out = f"loss {a.final_loss:.3f} over its last steps = ln {a.vocab}"
    if a.heldout_bpb is not None:
        u = a.uniform_bpb
        same = (
            f" = log2 {a.vocab}"
            if a.heldout_tokens == a.heldout_bytes
            else (f", a uniform guess's {u:.2f}" if u else "")
        )
        out += f", {a.heldout_bpb:.2f} bpb held out{same}"
    return out


def dies_words(a: ArmSummary, f: Facts, v: Verdict) -> str:
    """A collapse to a uniform guess, told in step order with its numbers."""
    links: list[tuple[int, str]] = []
    if a.first_overflow is not None:
        where = f" ({a.first_overflow_where})" if a.first_overflow_where else ""
        links.append((a.first_overflow, (
            f"its fp16 reduction overflowed at step {a.first_overflow}{where} and the rows came "
            f"out of the norm as zeros ({a.dead_tokens:g} dead rows over all norms and steps)"
        )))  # fmt: skip
    if a.flat_from is not None:
        links.append((a.flat_from, (
            f"from step {a.flat_from} the training loss is flat at {a.uniform_loss:.3f} = ln "
            f"{a.vocab}"
        )))  # fmt: skip
    if v.grad_nan:
        links.append((v.grad_nan[0], _skipped(v)))
    if f.nan_steps:
        links.append((f.nan_steps[0], f"the loss or gradient norm went non-finite at step "
                      f"{f.nan_steps[0]}"))  # fmt: skip
    said = "; ".join(t for _, t in sorted(links, key=lambda st: st[0]))
    return f"{a.arm} dies: {said}; the model predicts uniformly ({_uniform(a)})."


def words(a: ArmSummary, f: Facts, v: Verdict, ref: Reference | None) -> tuple[str, str]:
    """The verdict's label and sentence; every word follows from the numbers in ``v``
    (tests/test_verdict.py and tests/test_report_truth.py hold them against each other)."""
    if v.dies:
        return "dies (predicts uniformly)", dies_words(a, f, v)
    if not v.nan_stopped:
        why = []
        if a.first_overflow is not None:
            why.append(f"its reduction overflowed at step {a.first_overflow}")
        if f.nan_steps:
            why.append(f"non-finite loss or gradient norm from step {f.nan_steps[0]}")
        if v.grad_nan:
            why.append(_skipped(v))
        if f.overflow_after_last_rollback:
            why.append("it overflowed again after its last rollback")
        if a.status != "done":
            why.append(f"it ended {a.status}")
        label = "does not stop the NaN"
        return label, f"{a.arm} {label}: " + "; ".join(why or ["it did not finish"]) + "."
    if ref is None:
        label = "stops the NaN (no reference)"
        return label, f"{a.arm} stops the NaN; there is no reference arm to judge its training by."
    if v.inside is None:
        return "stops the NaN (no spread to judge)", (
            f"{a.arm} stops the NaN; gap to the reference {gap_words(v)}, with 1 reference seed: "
            "no spread to tell it from seed noise."
        )
    lo, hi = ref.band("bpb")
    band = f"the reference's {ref.seeds}-seed band {lo:.3f}-{hi:.3f} bpb"
    if v.inside:
        return "fixes it", (
            f"{a.arm} fixes it: no NaN, and it trains like the reference ({gap_words(v)}; {band})."
        )
    return "stops the NaN, trains worse", (
        f"{a.arm} stops the NaN but trains worse than the reference ({gap_words(v)}; {band}, "
        f"its held-out bpb {a.heldout_bpb:.3f})."
    )


HEADER = ["arm", "NaN stopped", "NaN-gradient skips (all of them, if more than the reference's)",
          "gap: held-out bpb (sigma)", "gap: last-steps loss (sigma)", "inside band"]  # fmt: skip
TAIL = ["what it hides", "verdict"]
COST = "step time / reference (paired: median, range)"


def _cell_sigma(gap: float | None, sigma: float | None) -> str:
    """A table cell's sigma beside its gap (nothing where the gap or the noise is unknown)."""
    if gap is None or not math.isfinite(gap) or sigma is None:
        return ""
    return f" ({sigma:+.1f})"


def verdict_rows(
    ref: Reference | None, vs: list[Verdict], cost: dict[str, str] | None = None
) -> list[list[str]]:
    """The verdict table; ``cost``: each arm's paired cost cell (report/cost.py), the column
    left out without it (a cost that was not measured paired is not shown)."""

    def g(x, fmt):
        return "-" if x is None or not math.isfinite(x) else fmt.format(x)

    rows = [HEADER + ([COST] if cost is not None else []) + TAIL]
    if ref is not None:
        band = ref.band("bpb")
        spread = f"{band[0]:.3f}-{band[1]:.3f}" if band else "no spread (1 seed)"
        skips = ", ".join(str(len(x)) for x in ref.skips) or "-"
        rows.append([f"reference ({ref.seeds} seed{'s' if ref.seeds > 1 else ''})", "-",
                     f"skips per seed: {skips}",
                     f"mean {g(ref.mean('bpb'), '{:.3f}')}, band {spread}",
                     f"mean {g(ref.mean('loss'), '{:.3f}')}", "-"]
                    + ([cost.get(REFERENCE, "1")] if cost is not None else [])
                    + ["-", "-"])  # fmt: skip
    for v in vs:
        inside = "-" if v.inside is None else ("yes" if v.inside else "no")
        if v.window is not None:
            lo, hi = v.window
            beyond = (
                f"{len(v.grad_nan)} ({len(v.in_window)} skips in steps {lo}-{hi}"
                + (f": {steps_text(v.in_window)}" if v.in_window else "")
                + f"; the reference at most {v.allowance} there)"
            )
        else:
            beyond = "0 (no overflow)"
        rows.append([v.arm, "yes" if v.nan_stopped else "no", beyond,
                     g(v.gap_bpb, "{:+.3f}") + _cell_sigma(v.gap_bpb, v.sigma_bpb),
                     g(v.gap_loss, "{:+.3f}") + _cell_sigma(v.gap_loss, v.sigma_loss), inside]
                    + ([cost.get(v.arm, "-")] if cost is not None else [])
                    + [v.hides or "-", v.label])  # fmt: skip
    return rows
