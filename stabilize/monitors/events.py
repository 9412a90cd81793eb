"""What monitors say: events with a severity, and the stats they read."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Severity order: a step's verdict is its most severe event.
INFO, WARN, SKIP, ROLLBACK, ABORT = "info", "warn", "skip", "rollback", "abort"
SEVERITY = {INFO: 0, WARN: 1, SKIP: 2, ROLLBACK: 3, ABORT: 4}


@dataclass
class Event:
    kind: str  # info | warn | skip | rollback | abort
    monitor: str  # which monitor (or "rollback" / "fault" for the harness's own events)
    step: int  # the model's step
    message: str
    layer: str | None = None
    value: float | None = None
    threshold: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # JSON has no inf/nan: write them as strings so events.jsonl stays valid JSON
        for k in ("value", "threshold"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


def verdict(events: list[Event]) -> str:
    """The most severe kind among ``events`` (``info`` when there are none)."""
    return max((e.kind for e in events), key=SEVERITY.__getitem__, default=INFO)


@dataclass
class StepStats:
    """One step's numbers, already on the host and identical on every rank."""

    step: int
    loss: float
    grad_norm: float | None = None
    loss_scale: float | None = None
    scaler_skipped: bool = False
    act_max: dict[str, float] = field(default_factory=dict)  # layer -> |x| max
    norm_overflow: dict[str, float] = field(default_factory=dict)  # norm -> rows overflowed
    norm_collapsed: dict[str, float] = field(default_factory=dict)  # norm -> dead rows
    # norm -> rows whose input is not finite in the reduction dtype (they output NaN)
    norm_nan_rows: dict[str, float] = field(default_factory=dict)
    norm_rms_max: dict[str, float] = field(default_factory=dict)  # norm -> largest row RMS
    attn_logit: dict[str, float] = field(default_factory=dict)  # block -> logit upper bound
    # (empty where not measured this step): block -> lowest head entropy (nats, log
    # steps); the output logits' log Z {"mean", "max"}; per block h.{i} / "other", on log
    # steps: the pre-clip gradient norm and the coming update's ||dW|| / ||W||
    attn_entropy: dict[str, float] = field(default_factory=dict)
    log_z: dict[str, float] = field(default_factory=dict)
    layer_grad_norm: dict[str, float] = field(default_factory=dict)
    update_ratio: dict[str, float] = field(default_factory=dict)
    # per block, on log steps: the mean of g^2 / v_hat (AdamW's surprise); the whole
    # model's optimizer series {update_ratio, g2_v, and on curvature steps curv_u, curv_pre,
    # edge_gd, edge_adam} (stability/curvature.py; docs/design-spikes.md)
    g2_v: dict[str, float] = field(default_factory=dict)
    opt: dict[str, float] = field(default_factory=dict)
    # a quantized GEMM operand (``<layer>.x`` / ``.w`` / ``.dy``) on logged steps: its amax,
    # amax over the format's max after scaling, saturated and underflow shares, clipped
    # scale groups, SQNR in dB (stability/quant_sites.py)
    quant_amax: dict[str, float] = field(default_factory=dict)
    quant_amax_ratio: dict[str, float] = field(default_factory=dict)
    quant_saturated: dict[str, float] = field(default_factory=dict)
    quant_underflow: dict[str, float] = field(default_factory=dict)
    quant_clipped: dict[str, float] = field(default_factory=dict)
    quant_sqnr_db: dict[str, float] = field(default_factory=dict)
    # per delayed-scaling operand, the amax ratio past which its cast saturates (the format's
    # overflow edge over its max; constant): the forecast's line. Current and block scaling
    # follow the tensor itself: nothing to forecast, none given.
    quant_edge: dict[str, float] = field(default_factory=dict)
    # each rank's parameter fingerprint, on replica-check steps only (empty otherwise)
    replicas: tuple[int, ...] = ()
    norm_dim: dict[str, int] = field(default_factory=dict)  # norm -> width D (constant)
    # block -> the norm whose input *is* that block's output (pre-norm): one tensor, logged
    # under both names, judged once, as the block (monitors/activations.py)
    act_alias: dict[str, str] = field(default_factory=dict)


# What a monitor may declare in ``needs``: every StepStats field but the step.
STEP_FIELDS = tuple(f.name for f in fields(StepStats) if f.name != "step")

# The per-layer series of StepStats and the metric prefix each is logged under on log steps
# (``<prefix>/<layer>``, stabilize/stability/sink.py), in logging order. A new per-layer
# statistic is a StepStats field, a probe slot that fills it, and a line here.
SERIES_METRICS = {
    "act_max": "act",
    "attn_logit": "attn_logit",
    "norm_overflow": "overflow",
    "norm_collapsed": "dead",
    "norm_nan_rows": "nan_rows",
    "norm_rms_max": "rms",
    "attn_entropy": "attn_entropy",
    "log_z": "log_z",
    "layer_grad_norm": "grad_norm",
    "update_ratio": "update_ratio",
    "g2_v": "g2_v",
    "opt": "opt",
    # the quantized GEMMs' operands (<layer>.x / .w / .dy), stability/quant_sites.py
    "quant_amax": "q_amax",
    "quant_amax_ratio": "q_ratio",
    "quant_saturated": "q_sat",
    "quant_underflow": "q_under",
    "quant_clipped": "q_clip",
    "quant_sqnr_db": "q_sqnr",
}
