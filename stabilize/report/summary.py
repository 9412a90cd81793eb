"""Per-arm figures and the per-arm table.

Every figure is read from what the run recorded (events.jsonl first: exact steps; metric
rows otherwise); nothing is assumed from the arm's name. The conclusions drawn from them
are rules over these figures (``report/conclusions.py``), so a different outcome gives a
different text.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from stabilize.report.load import Run
from stabilize.report.rollbacks import answered_skips, rollback_lines

LINE = 256.0  # |x| max where one fp16 square overflows (255.94^2 = 65504)
# "final loss" is the mean training loss over the run's last LAST_STEPS model steps: one
# batch's loss is too noisy to rank arms by
LAST_STEPS = 20
# A model that predicts every token with probability 1/V scores ln V nats per token (5.545 at
# V = 256); "flat at ln V" allows this relative tolerance (a healthy tiny model is at ~2.5)
UNIFORM_TOL = 0.01


@dataclass
class ArmSummary:
    arm: str
    name: str
    status: str
    precision: str = "?"
    reduction: str = "?"
    eps: float | None = None
    steps: int = 0  # the model's final step
    steps_taken: int = 0  # optimizer steps taken, rolled-back ones included
    first_nonfinite: int | None = None  # the nonfinite monitor's first event (loss or grads)
    nonfinite_where: str | None = None
    nonfinite_what: str | None = None  # what that first event was about: "loss" | "grads"
    first_loss_nonfinite: int | None = None  # a non-finite loss: the forward
    first_overflow_where: str | None = None  # the norm whose reduction overflowed first
    first_over_line: int | None = None
    first_forecast: int | None = None
    first_overflow: int | None = None
    overflow_rows: float = 0.0
    dead_tokens: float = 0.0
    # rows whose input was not finite in the reduction dtype (e.g. |x| >= 65520 cast to fp16):
    # they output NaN, they are not dead; summed over the same overflow events
    nan_rows: float = 0.0
    scaler_skips: int = 0
    # the backward: the first GradScaler skip at/after the first overflow or in a run of
    # skips a loss-scale verdict answered (else a skip is the scale's calibration), or a
    # non-finite gradient norm without a scaler
    first_grad_nonfinite: int | None = None
    grad_nonfinite_by: str | None = None  # "scaler skip" | "grad norm"
    skips_after_overflow: int = 0  # GradScaler skips at/after the first overflow
    # share of steps the GradScaler skipped before the trouble: before the drift starts, or
    # before the first overflow / 256 crossing / the end when nothing is injected
    early_skip_share: float | None = None
    min_loss_scale: float | None = None
    rollbacks: int = 0
    remedies: list[str] = field(default_factory=list)
    triggers: list[str] = field(default_factory=list)  # "monitor@step" that rolled back
    rollback_story: list[str] = field(default_factory=list)  # report/rollbacks.py, per rollback
    aborted: bool = False
    overflow_after_rollback: bool = False  # an overflow event after the last rollback
    loss_before: float | None = None  # the last logged loss before the line is crossed
    final_loss: float | None = None  # mean over the last LAST_STEPS model steps
    final_val_bpb: float | None = None  # the last periodic validation (a few batches)
    heldout_bpb: float | None = None  # the whole held-out split after training
    heldout_bytes: int | None = None
    heldout_whole: bool | None = None  # every held-out block was scored (final_eval.json)
    heldout_loss: float | None = None  # nats per token on the held-out split
    heldout_tokens: int | None = None
    vocab: int | None = None  # model.vocab_size
    # the first model step from which the training loss stays at ln V (within UNIFORM_TOL)
    # to the end, after it had been lower: the model collapsed to a uniform guess
    flat_from: int | None = None
    rel_err: float | None = None  # median relative error of norm outputs vs float64
    flattened: float | None = None  # share of rows > 5% off sqrt(D) (eps's cost)
    exact: bool = True

    @property
    def never_trained(self) -> bool:
        """The GradScaler skipped most steps before any trouble: nothing was learned."""
        skipped = self.early_skip_share is not None and self.early_skip_share > 0.5
        return skipped and not self.rollbacks  # a remedy may have ended it

    @property
    def uniform_loss(self) -> float | None:
        """ln V: the loss of a uniform guess over the vocabulary."""
        return math.log(self.vocab) if self.vocab else None

    @property
    def uniform_bpb(self) -> float | None:
        """A uniform guess in bits per byte of the held-out split: log2 V bits per token,
        times its tokens per byte (1 for the byte tokenizer: 8 bits at V = 256)."""
        if not self.vocab or not self.heldout_tokens or not self.heldout_bytes:
            return None
        return math.log2(self.vocab) * self.heldout_tokens / self.heldout_bytes

    @property
    def dead(self) -> bool:
        """Collapsed to a uniform guess: the training loss flat at ln V to the end (after it
        had been lower), and the held-out loss at ln V too where it was scored."""
        if self.flat_from is None or self.final_loss is None or self.uniform_loss is None:
            return False
        u = self.uniform_loss
        return all(abs(x - u) <= UNIFORM_TOL * u
                   for x in (self.final_loss, self.heldout_loss) if x is not None)  # fmt: skip

    @property
    def first_nonfinite_any(self) -> int | None:
        """The first non-finite value, forward (loss) or backward (gradients)."""
        steps = [x for x in (self.first_nonfinite, self.first_grad_nonfinite) if x is not None]
        return min(steps, default=None)

    @property
    def warning_lead(self) -> int | None:
        """Steps between the first |x| > 256 warning and the first non-finite value (the
        loss or the gradients)."""
        if self.first_over_line is None or self.first_nonfinite_any is None:
            return None
        return self.first_nonfinite_any - self.first_over_line


DRIFTS = ("activation_drift", "stream_drift")  # faults whose start is where trouble begins


def last_steps_mean(losses: list[tuple[float, float]]) -> float:
    """Mean training loss over the last LAST_STEPS model steps: (model step, loss) pairs in
    logging order; a step replayed after a rollback counts with its last value. A non-finite
    loss among them makes the mean non-finite (the run did end that way)."""
    by_step = dict(losses)
    last = max(by_step)
    window = [v for st, v in by_step.items() if st > last - LAST_STEPS]
    return sum(window) / len(window)


def flat_from(losses: list[tuple[float, float]], level: float | None) -> int | None:
    """The first model step of the run's last stretch at ``level`` (within UNIFORM_TOL),
    when that stretch reaches the last step and an earlier loss was lower; else None."""
    if level is None:
        return None
    by_step = sorted(dict(losses).items())  # a replayed step counts with its last value
    tail = None
    for st, v in reversed(by_step):
        if not (math.isfinite(v) and abs(v - level) <= UNIFORM_TOL * level):
            break
        tail = int(st)
    if tail is None or not any(v < level * (1 - UNIFORM_TOL) for st, v in by_step if st < tail):
        return None
    return tail


def _first(events, monitor, kind=None) -> dict | None:
    for e in events:
        if e.get("monitor") == monitor and (kind is None or e.get("kind") == kind):
            return e
    return None


def _extra_sum(events: list[dict], key: str) -> float:
    return sum(float((e.get("extra") or {}).get(key) or 0) for e in events)


def _healthy_audits(run: Run, before: int | None) -> list[dict]:
    """Audits the fault had not reached yet: before the first overflow or non-finite step."""
    out = []
    for a in run.audits:
        if before is not None and a["step"] >= before:
            continue
        if a.get("dead_share", 0) > 0 or a.get("nonfinite_share", 0) > 0:
            continue
        out.append(a)
    return out


def summarize(run: Run) -> ArmSummary:
    cfg = run.config
    norm = cfg.get("norm") or (cfg.get("model") or {}).get("norm") or {}
    fault = cfg.get("fault") or {}
    s = ArmSummary(
        arm=run.arm,
        name=run.name,
        status=run.status,
        precision=str((cfg.get("precision") or {}).get("name", "?")),
        reduction=str(norm.get("reduction_dtype", "?")),
        eps=norm.get("eps"),
        exact=run.exact_events,
    )
    ev = run.events
    nonfinite = [e for e in ev if e.get("monitor") == "nonfinite"]
    # the monitor's message says which: "loss is nan ..." or "gradient norm is inf ..."
    grad_events = [e for e in nonfinite if str(e.get("message", "")).startswith("gradient")]
    loss_events = [e for e in nonfinite if e not in grad_events]
    if loss_events:
        s.first_loss_nonfinite = int(loss_events[0]["step"])
    if (e := _first(ev, "nonfinite")) is not None:
        s.first_nonfinite = int(e["step"])
        s.nonfinite_what = "grads" if e in grad_events else "loss"
        loc = (e.get("extra") or {}).get("localization") or []
        if loc and loc[0].get("module"):
            first = loc[0]
            state = "finite" if first.get("input_finite") else "non-finite"
            s.nonfinite_where = f"{first['module']} (input {state})"
    # any kind: the crossing is a WARN where an fp16 square is taken, an INFO elsewhere
    # (monitor.activation.line), and the column reports when |x| passed 256 either way
    if (e := _first(ev, "activation")) is not None:
        s.first_over_line = int(e["step"])
    if (e := _first(ev, "forecast")) is not None:
        s.first_forecast = int(e["step"])
    overflows = [e for e in ev if e.get("monitor") == "overflow"]
    if overflows:
        s.first_overflow = int(overflows[0]["step"])
        s.first_overflow_where = overflows[0].get("layer")
        s.overflow_rows = sum(float(e.get("value") or 0) for e in overflows)
        s.dead_tokens = _extra_sum(overflows, "collapsed")
    # every row that went NaN: on overflow events, and on a step where none overflowed
    s.nan_rows = _extra_sum([e for e in ev if e.get("monitor") in ("overflow", "nan_rows")],
                            "nan_rows")  # fmt: skip
    skips = [e for e in ev if e.get("monitor") == "loss_scale" and e.get("kind") == "skip"]
    s.scaler_skips = len(skips)
    # inf/NaN gradients: the skips the overflow caused, and runs of skips a loss-scale
    # verdict answered (a skip the scale recovered from, before any overflow, is calibration)
    over = s.first_overflow
    after = [int(e["step"]) for e in skips if over is not None and int(e["step"]) >= over]
    s.skips_after_overflow = len(after)
    if real := after + answered_skips(ev):
        s.first_grad_nonfinite, s.grad_nonfinite_by = min(real), "scaler skip"
    if grad_events and (s.first_grad_nonfinite is None
                        or int(grad_events[0]["step"]) < s.first_grad_nonfinite):  # fmt: skip
        s.first_grad_nonfinite, s.grad_nonfinite_by = int(grad_events[0]["step"]), "grad norm"
    rb = [e for e in ev if e.get("monitor") == "rollback" and e.get("kind") == "rollback"]
    s.rollbacks = len(rb)
    last_rb = max((int(e.get("global_step") or 0) for e in rb), default=None)
    s.overflow_after_rollback = last_rb is not None and any(
        int(e.get("global_step") or 0) > last_rb for e in overflows
    )
    s.remedies = [str((e.get("extra") or {}).get("remedy")) for e in rb if e.get("extra")]
    if rb:  # the verdicts that called for them (without rollback they are verdicts only)
        verdicts = [e for e in ev if e.get("kind") == "rollback" and e.get("monitor") != "rollback"]
        # in step order (as strings "overflow@13" would sort before "overflow@8")
        s.triggers = [
            f"{m}@{st}" for st, m in sorted({(int(e["step"]), e["monitor"]) for e in verdicts})
        ]
    s.rollback_story = rollback_lines(ev)
    s.aborted = run.status == "aborted" or _first(ev, "rollback", "abort") is not None
    scales = [v for _, v in run.series("train/loss_scale") if math.isfinite(v)]
    s.min_loss_scale = min(scales) if scales else None
    steps = [r["train/step"] for r in run.rows if "train/step" in r]
    s.steps = int(steps[-1]) if steps else 0
    s.steps_taken = int(max((r["x"] for r in run.rows), default=0))
    losses = [(r.get("train/step", r["x"]), r["train/loss"]) for r in run.rows if "train/loss" in r]
    s.vocab = (cfg.get("model") or {}).get("vocab_size")
    if losses:
        s.final_loss = last_steps_mean(losses)
        s.flat_from = flat_from(losses, s.uniform_loss)
        line_at = s.first_over_line or fault.get("cross_step")
        if line_at:
            before = [v for st, v in losses if st < line_at]
            s.loss_before = before[-1] if before else None
    drifts = fault.get("kind") in DRIFTS and fault.get("enabled", True)
    drift_start = fault.get("step") if drifts else None
    trouble = drift_start or min(
        [x for x in (s.first_overflow, s.first_over_line) if x is not None], default=s.steps + 1
    )
    if s.precision == "fp16-mixed" and trouble > 1:
        early = {int(e["step"]) for e in skips if int(e["step"]) < trouble}
        s.early_skip_share = len(early) / (trouble - 1)
    bpb = [v for _, v in run.series("val/bpb")]
    s.final_val_bpb = bpb[-1] if bpb else None
    if run.final_eval and run.final_eval.get("bpb") is not None:
        s.heldout_bpb = float(run.final_eval["bpb"])
        s.heldout_bytes = int(run.final_eval.get("bytes") or 0)
        s.heldout_whole = run.final_eval.get("whole")
        s.heldout_tokens = run.final_eval.get("tokens")
        if run.final_eval.get("loss") is not None:
            s.heldout_loss = float(run.final_eval["loss"])
    cut = min([x for x in (s.first_overflow, s.first_nonfinite) if x is not None], default=None)
    healthy = _healthy_audits(run, cut)
    if healthy:
        s.rel_err = statistics.median(a["rel_err_median"] for a in healthy)
        s.flattened = statistics.median(a["flattened_share"] for a in healthy)
    return s


def _fmt_step(v: int | None) -> str:
    return "never" if v is None else str(v)


def _pct(share: float) -> str:
    """A share as a percentage: two significant digits, whole numbers from 10% up."""
    pct = 100 * share
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"


def _where(a: ArmSummary, what: str) -> str:
    """The localized module, beside the column of the nonfinite event it came from."""
    return f" ({a.nonfinite_where})" if a.nonfinite_where and a.nonfinite_what == what else ""


def table(arms: list[ArmSummary]) -> list[list[Any]]:
    header = [
        "arm",
        "precision / reduction / eps",
        "status",
        "first |x|>256",
        "first overflow",
        "dead rows (sum)",
        "NaN rows (sum)",
        "first non-finite: loss (forward) / grads (backward)",
        "256 warning lead",
        "scaler skips",
        "rollbacks (remedies)",
        "loss before",
        f"final loss (last {LAST_STEPS} steps)",
        "held-out bpb",
        "norm rel. err",
        "flattened rows",
    ]

    def f(v, fmt="{:.3g}"):
        if v is None:
            return "-"
        return fmt.format(v) if isinstance(v, float) else str(v)

    rows = [header]
    for a in arms:
        mark = "" if a.exact else "~"
        rows.append(
            [
                a.arm,
                f"{a.precision} / {a.reduction} / {f(a.eps, '{:g}')}",
                a.status + (" (abort)" if a.aborted and a.status != "aborted" else ""),
                mark + _fmt_step(a.first_over_line),
                mark + _fmt_step(a.first_overflow),
                f(a.dead_tokens, "{:g}"),
                f(a.nan_rows, "{:g}"),
                mark
                + _fmt_step(a.first_loss_nonfinite)
                + _where(a, "loss")
                + " / "
                + _fmt_step(a.first_grad_nonfinite)
                + (f" ({a.grad_nonfinite_by})" if a.grad_nonfinite_by else "")
                + _where(a, "grads"),
                f(a.warning_lead),
                f"{a.scaler_skips}"
                + (f" (min scale {a.min_loss_scale:.2g})" if a.min_loss_scale else ""),
                f"{a.rollbacks}" + (f" ({', '.join(a.remedies)})" if a.remedies else ""),
                f(a.loss_before),
                f(a.final_loss),
                f(a.heldout_bpb, "{:.4g}"),
                f(a.rel_err, "{:.2e}"),
                "-" if a.flattened is None else _pct(a.flattened),
            ]
        )
    return rows


# A sweep's comparison: the outcome columns after the swept keys.
COMPARE = [
    "status",
    "model steps",
    f"final loss (last {LAST_STEPS} steps)",
    "last val bpb",
    "held-out bpb",
    "first |x|>256",
    "first overflow",
    "first non-finite",
    "scaler skips",
    "rollbacks (remedies)",
]


def compare_row(a: ArmSummary) -> list[str]:
    def f(v):
        return "-" if v is None else f"{v:.4g}"

    return [
        a.status + (" (abort)" if a.aborted and a.status != "aborted" else ""),
        str(a.steps),
        f(a.final_loss),
        f(a.final_val_bpb),
        f(a.heldout_bpb),
        _fmt_step(a.first_over_line),
        _fmt_step(a.first_overflow),
        _fmt_step(a.first_nonfinite),
        str(a.scaler_skips),
        f"{a.rollbacks}" + (f" ({', '.join(a.remedies)})" if a.remedies else ""),
    ]
