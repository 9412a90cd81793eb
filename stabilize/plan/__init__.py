"""``stabilize-plan``: per-GPU memory, per-node host memory and disk of a run, before it runs.

- ``memory.py``: parameters, gradients, AdamW moments, autocast copies, activations (from
  the model's ops), per GPU.
- ``storage.py``: the snapshot ring's host memory per node, durable snapshots, disk.
- ``hardware.py``: the GPUs known and the ``plan.*`` settings.
- ``cli.py``: Hydra composition of the training config and the printed table.
"""

from stabilize.plan.cli import compose_run, main, render
from stabilize.plan.hardware import GPUS, PlanConfig, parse_plan_overrides
from stabilize.plan.memory import (
    Activations,
    ModelState,
    activations,
    matmul_weight_count,
    model_state,
    param_count,
    param_shapes,
    shard_count,
)
from stabilize.plan.storage import Storage, snapshot_bytes, storage

__all__ = [
    "GPUS",
    "Activations",
    "ModelState",
    "PlanConfig",
    "Storage",
    "activations",
    "compose_run",
    "main",
    "matmul_weight_count",
    "model_state",
    "param_count",
    "param_shapes",
    "parse_plan_overrides",
    "render",
    "shard_count",
    "snapshot_bytes",
    "storage",
]
