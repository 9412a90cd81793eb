"""What the stability engine asks of the training loop it runs in: the ``Loop`` protocol.

The engine (engine.py) and its parts (gather, classify, localize, bundle, controller, sink)
read a loop only through these names, never through a Trainer. Three adapters answer
them: ``LightningLoop`` (lit/loop.py) from a Lightning Trainer, ``Guard``'s loop
(guard_loop.py) from the objects a plain loop hands the Guard, and the Hugging Face
adapter's (hf_trainer.py) from the arguments ``transformers.Trainer`` gives its callbacks.

``Host`` (host.py) is the other half: what the engine asks of the model and its data.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch

from stabilize.stability.metrics_csv import MetricsCsv


class Loop(Protocol):
    @property
    def rank(self) -> int:
        """This process's rank in ``torch.distributed`` (0 without it)."""

    @property
    def world(self) -> int:
        """The number of ranks whose gradients are averaged (1 without distribution)."""

    @property
    def is_zero(self) -> bool:
        """Rank 0: the one that writes the run dir's shared files and logs."""

    @property
    def step(self) -> int:
        """The loop's own count of optimizer steps taken (it never rewinds: a rollback
        moves the model's step back, not this one); events carry it as ``global_step``."""

    @property
    def log_every(self) -> int:
        """The per-layer series are logged on every ``log_every``-th step."""

    @property
    def log_row(self) -> int:
        """The step value the loop's own metrics rows carry now (per-layer rows line up)."""

    @property
    def sharded(self) -> bool:
        """Parameters and gradients are shards (FSDP, or a module clipping its own shards):
        no replay, no replica fingerprint, no whole bundle."""

    @property
    def fsdp(self) -> bool:
        """FSDP2: every rank writes its own shard of a snapshot or a bundle."""

    @property
    def replicas(self) -> int:
        """Ranks holding the same whole state (DDP's world; 1 otherwise): each snapshots
        1/replicas of it."""

    def optimizer(self) -> torch.optim.Optimizer:
        """The one optimizer the loop steps."""

    def schedulers(self) -> list[Any]:
        """Every LR scheduler the loop steps (none, one or more)."""

    def scaler(self) -> Any | None:
        """The GradScaler whose scale divides the loss (None: no loss scaling)."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        """What a re-run's forward runs under (the loop's autocast)."""

    def log(self, metrics: dict[str, float], step: int, dashboards: bool = True) -> None:
        """Host floats to every logger the loop has (rank 0 calls it). ``dashboards``
        False: the loop's local files only (its CSV), not W&B: the engine sends the
        dashboards the log steps and the steps with news, as Lightning's own ``self.log``
        keeps to ``log_every_n_steps``: a W&B call is paid on the training thread."""

    def wandb_runs(self) -> list[Any]:
        """The W&B runs the loop logs to (alerts and per-layer charts go there)."""

    @property
    def wandb_step_metric(self) -> str | None:
        """The step metric the loop's W&B logger binds every key to (None: W&B's own)."""


def dist_rank_world() -> tuple[int, int]:
    """``torch.distributed``'s rank and world size, or (0, 1) without it."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def every_rank(value) -> list | None:
    """``value`` of every rank, in rank order (None on one process). A collective: a
    loop's checkpoint saves the engine's state on every rank."""
    rank, world = dist_rank_world()
    if world < 2:
        return None
    out = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def my_rank(values: list | None):
    """This rank's entry of ``every_rank``'s list (None: not saved, or another world)."""
    rank, world = dist_rank_world()
    if not values or world < 2:
        return None
    return values[rank] if len(values) == world else None


class HandedLoop:
    """A ``Loop`` answered from the objects a loop hands its adapter (a plain loop's, a
    Hugging Face Trainer's): whole copies on every rank, metrics to ``csv/version_0``."""

    sharded = fsdp = False
    replicas = 1  # every rank keeps a whole snapshot
    log_every = 10
    wandb_step_metric = None

    def __init__(self, optimizer, scaler, schedulers: list, run_dir: str | Path):
        self.rank, self.world = dist_rank_world()
        self.opt, self.scaler_, self.scheds = optimizer, scaler, schedulers
        self.autocast: tuple[str, torch.dtype] | None = None  # the first forward's
        self.csv = MetricsCsv(run_dir)

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def optimizer(self):
        return self.opt

    def schedulers(self) -> list:
        return self.scheds

    def scaler(self):
        s = self.scaler_
        return s if s is not None and s.is_enabled() else None

    def forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1])

    def log(self, metrics: dict[str, float], step: int, dashboards: bool = True) -> None:
        self.csv.log(metrics, step)

    def wandb_runs(self) -> list:
        return []
