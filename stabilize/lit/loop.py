"""``LightningLoop``: the stability engine's ``Loop`` (stability/loop.py) answered from a
Lightning Trainer. The one place that reads a Trainer for the engine."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy

from stabilize.compat import batches_that_stepped
from stabilize.lit.fsdp import is_fsdp


class LightningLoop:
    def __init__(self, trainer):
        self.trainer = trainer

    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    @property
    def world(self) -> int:
        return self.trainer.world_size

    @property
    def is_zero(self) -> bool:
        return self.trainer.is_global_zero

    @property
    def step(self) -> int:
        return self.trainer.global_step

    @property
    def log_every(self) -> int:
        return self.trainer.log_every_n_steps

    @property
    def log_row(self) -> int:
        # the step Lightning's own self.log rows carry in a batch end (one less than
        # global_step there)
        return batches_that_stepped(self.trainer)

    @property
    def fsdp(self) -> bool:
        return is_fsdp(self.trainer.strategy)

    @property
    def sharded(self) -> bool:
        # FSDP2, or a module that clips sharded gradients itself
        return self.fsdp or hasattr(self.trainer.strategy.model, "clip_grad_norm_")

    @property
    def replicas(self) -> int:
        return self.trainer.world_size if isinstance(self.trainer.strategy, DDPStrategy) else 1

    def optimizer(self):
        return self.trainer.optimizers[0]

    def schedulers(self) -> list[Any]:
        return [c.scheduler for c in self.trainer.lr_scheduler_configs]

    def scaler(self):
        return getattr(self.trainer.precision_plugin, "scaler", None)

    def forward_context(self):
        return self.trainer.precision_plugin.forward_context()

    def log(self, metrics: dict[str, float], step: int, dashboards: bool = True) -> None:
        for lg in self.trainer.loggers:
            if dashboards or not isinstance(lg, WandbLogger):
                lg.log_metrics(metrics, step=step)

    wandb_step_metric = "trainer/global_step"  # what WandbLogger binds every key to

    def wandb_runs(self) -> list[Any]:
        return [lg.experiment for lg in self.trainer.loggers if isinstance(lg, WandbLogger)]
