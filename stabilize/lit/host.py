"""``LightningHost``: the stability core's ``Host`` (stability/host.py) for a LightningModule
we did not write (docs/design-your-model.md sections 2-3).

It asks the user for nothing: what ``GPTLitModule`` keeps as attributes is learnt from
Lightning's own hooks (``DrivenHost``, stability/driven.py, from the stability callback's
``on_train_batch_start``, ``on_before_backward`` and ``on_train_batch_end``). What is
Lightning's here: ``on_before_backward``'s tensor is the ``training_step`` loss divided by
``accumulate_grad_batches`` and, under ``16-mixed``, times the GradScaler's scale
(Lightning's ``MixedPrecision.pre_backward`` scales before it calls the hook): both are
undone, on device; the clip and the precision are the Trainer's; the re-run is the
module's own ``training_step`` (``self.log`` muted), its loss taken as a tensor or a dict's
``"loss"``; the sampler and the dataset are the Trainer's train loader's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from stabilize.rollback import RollbackConfig
from stabilize.stability.driven import DrivenHost, plain
from stabilize.stability.loop import Loop

# Lightning's precision flags -> the names a bundle records (its replay's autocast)
PRECISION = {"16-mixed": "fp16-mixed", "bf16-mixed": "bf16-mixed", "32-true": "fp32",
             "32": "fp32", "64-true": "fp64"}  # fmt: skip


def module_path(module: nn.Module) -> str:
    """``pkg.mod:Class`` of a LightningModule (what a bundle's replay imports)."""
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"


class LightningHost(DrivenHost):
    """The ``Host`` protocol answered for any LightningModule (see the module doc)."""

    def __init__(self, module, trainer, loop: Loop, model: nn.Module,
                 rollback: RollbackConfig, factory: str | None = None):  # fmt: skip
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        super().__init__(model, loop, rollback, factory, loss_factor=accumulate)
        self.module, self.trainer = module, trainer

    @property
    def device(self):
        return self.module.device

    @property
    def clip_norm(self) -> float:
        t = self.trainer
        algo = str(getattr(t, "gradient_clip_algorithm", None) or "norm")
        return float(t.gradient_clip_val or 0.0) if algo.endswith("norm") else 0.0

    @property
    def precision_name(self) -> str:
        return PRECISION.get(str(self.trainer.precision), str(self.trainer.precision))

    def parameters(self):
        return self.module.parameters()

    def loss(self, batch):
        """The module's own ``training_step`` on ``batch``, its logging muted."""
        m = self.module
        with _muted(m):
            out = m.training_step(batch, 0)
        if isinstance(out, dict):
            out = out["loss"]
        if not isinstance(out, torch.Tensor):
            got = type(out).__name__
            raise TypeError(f"{type(m).__name__}.training_step returned {got}; the re-run "
                            "needs the loss (a tensor or a dict with 'loss')")  # fmt: skip
        return out

    def train_sampler(self):
        sampler = getattr(self.trainer.train_dataloader, "batch_sampler", None)
        return sampler if hasattr(sampler, "batch_for_step") else None

    def train_dataset(self):
        return getattr(self.trainer.train_dataloader, "dataset", None)

    def run_config(self) -> dict[str, Any]:
        return {"hparams": plain(dict(getattr(self.module, "hparams", {}) or {}))}

    def host_info(self) -> dict[str, Any]:
        path = self._model_path()
        return {
            "kind": "lightning",
            "module": module_path(self.module),
            "hparams": plain(dict(getattr(self.module, "hparams", {}) or {})),
            "factory": self.factory,
            "model_path": path,
            "loss": "training_step",
            **self.fault_info(),
        }

    def _model_path(self) -> str:
        if self.model is self.module:
            return ""
        return next((n for n, m in self.module.named_modules() if m is self.model), "")


@contextlib.contextmanager
def _muted(module):
    """``self.log`` / ``self.log_dict`` do nothing inside (a re-run logs no second value)."""
    saved = module.__dict__.get("log"), module.__dict__.get("log_dict")
    module.log = module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        for name, v in zip(("log", "log_dict"), saved, strict=True):
            if v is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = v
