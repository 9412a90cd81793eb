"""Host memory of the snapshot ring and the disk the run writes (docs/memory.md).

A snapshot (taken by stabilize/stability/controller.py, kept by
stabilize/rollback/snapshots.py) is the model's state dict, the optimizer's and small
host-side state: the weights and AdamW's two moments in the parameters' dtype, plus one fp32
``step`` per parameter tensor; a tied weight is copied once (``rollback.to_cpu``). A
Lightning checkpoint holds the same tensors, so it is the same size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.plan.memory import ADAM_MOMENTS, PARAM_BYTES, param_shapes
from stabilize.run.config import RunConfig

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps a scalar fp32 ``step`` per parameter tensor


def snapshot_bytes(cfg: RunConfig) -> int:
    """Weights + AdamW moments (+ step counters) of the whole model."""
    shapes = param_shapes(cfg.model)
    n = sum(math.prod(s) for s in shapes.values())
    return (1 + ADAM_MOMENTS) * n * PARAM_BYTES[cfg.precision.name] + ADAM_STEP_BYTES * len(shapes)


@dataclass
class Storage:
    """Host memory per node and disk, for ``gpus_per_node`` ranks on ``nodes`` nodes."""

    snapshot: int  # one full snapshot (= one checkpoint), bytes
    ring_per_rank: int  # rollback.keep full copies on every rank (an unsharded ring)
    ring_per_node: int
    sharded_per_rank: int  # rollback.keep slices of 1/world: DDP (rollback/sharded.py), FSDP
    sharded_per_node: int
    write_seconds: float  # one durable snapshot at the given bandwidth
    disk_per_100_steps: int  # durable snapshots + periodic checkpoints written
    disk_bound: int | None  # what retention keeps at most; None: grows without bound
    disk_at_end: int  # after trainer.max_steps, at today's retention


def storage(cfg: RunConfig, gpus_per_node: int, nodes: int, disk_gbps: float) -> Storage:
    world = gpus_per_node * nodes
    snap = snapshot_bytes(cfg)
    rb, tr = cfg.rollback, cfg.trainer
    keep = rb.keep if rb.enabled else 0
    ring = keep * snap
    sharded = keep * math.ceil(snap / world)
    durable_every = rb.durable_every if rb.enabled and rb.durable_every > 0 else 0
    per_100 = 0.0
    if durable_every:
        per_100 += 100 / durable_every * snap
    per_100 += 100 / tr.checkpoint_every_n_steps * snap
    # Retention: durable snapshots kept by rollback.keep_durable, periodic checkpoints by
    # trainer.keep_checkpoints (-1: all), and last.ckpt besides them.
    n_durable = tr.max_steps // durable_every if durable_every else 0
    if rb.keep_durable != -1:
        n_durable = min(n_durable, rb.keep_durable)
    n_ckpt = tr.max_steps // tr.checkpoint_every_n_steps
    if tr.keep_checkpoints != -1:
        n_ckpt = min(n_ckpt, tr.keep_checkpoints)
    bound = None
    durable_bounded = not durable_every or rb.keep_durable != -1
    if durable_bounded and tr.keep_checkpoints != -1:
        bound = ((rb.keep_durable if durable_every else 0) + tr.keep_checkpoints + 1) * snap
    return Storage(
        snapshot=snap,
        ring_per_rank=ring,
        ring_per_node=ring * gpus_per_node,
        sharded_per_rank=sharded,
        sharded_per_node=sharded * gpus_per_node,
        write_seconds=snap / (disk_gbps * 1e9),
        disk_per_100_steps=round(per_100),
        disk_bound=bound,
        disk_at_end=(n_durable + n_ckpt + 1) * snap,
    )
