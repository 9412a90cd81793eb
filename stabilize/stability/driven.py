"""``DrivenHost``: the ``Host`` (host.py) for a model and loop we did not write, learnt from
the calls an adapter makes, through ``Loop`` (loop.py) only.

Our own ``GPTLitModule`` keeps the loop's facts as attributes; a model we did not write
cannot, so this host learns them (docs/design-your-model.md sections 2-3). Its adapters
call ``batch_start`` before each micro-batch's forward, ``saw_loss`` after it,
``after_backward``, ``stepping`` before the optimizer step and ``step_end`` after it:

- the step's loss: the micro-batch's own loss (an adapter gives it as its loop computed
  it; ``loss_factor`` and the loop's scaler undo what the loop did to it), on device;
- the data position: a counter of micro-batches trained on. The loader is not ours, so a
  rollback cannot rewind it: the data goes on after one (as PaLM restarted past the bad
  batches), and a ``skip_*`` remedy's positions are never revisited anyway;
- dropout: the CPU (and CUDA) generator states are saved at each micro-batch of the step,
  so a re-run draws the same masks without the model's help;
- the LR: a lowered LR (``lower_lr``) scales every group's LR inside the optimizer step (a
  step pre-hook) and puts the scheduler's value back after it (a post-hook), so any
  scheduler keeps its own numbers.

Subclasses say how the step is re-run (``loss``) and how the model is rebuilt
(``host_info``): ``LightningHost`` (lit/host.py), ``GuardHost`` (guard.py) and the Hugging
Face adapter's host (hf_trainer.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from stabilize.compat import scaler_scale
from stabilize.rollback import RollbackConfig
from stabilize.rollback.remedies import lr_scale_at
from stabilize.rollback.state import TrainState
from stabilize.stability.loop import Loop
from stabilize.validate import ConfigError


class StabilityConfigError(ConfigError):
    """A module, Trainer or loop the stability harness cannot watch (one line: what, why)."""


def refuse_fault(cfg, gradients: bool) -> None:
    """A harness fault needs hooks a loop we do not own cannot give it: on the loss (the
    user computes it), and in a plain loop on the gradients (the Guard hears of the step
    after its backward)."""
    from stabilize.faults import fault_class
    from stabilize.faults.base import Fault

    cls = fault_class(cfg.kind)
    hooks = [h for h in ("on_loss", *(("arm",) if gradients else ())) if
             getattr(cls, h) is not getattr(Fault, h)]  # fmt: skip
    if hooks:
        where = "the loss" if hooks[0] == "on_loss" else "the gradients"
        raise StabilityConfigError(
            f"fault.kind={cfg.kind!r} acts on {where}, which this loop computes itself; "
            "allowed here: faults in the forward (activation_drift, stream_drift, bitflip)"
        )


def watched_model(module: nn.Module, model: nn.Module | str | None = None) -> nn.Module:
    """The network the probe watches: ``model`` (a module or an attribute path), else the
    one child holding every parameter (``self.model = GPT2LMHeadModel(...)``), else the
    module itself."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, str):
        return module.get_submodule(model)
    total = sum(1 for _ in module.parameters())
    for _, child in module.named_children():
        if total and sum(1 for _ in child.parameters()) == total:
            return child
    return module


def plain(value: Any) -> Any:
    """``hparams`` as JSON: a config object with ``to_dict`` (Hugging Face's) as its dict and
    its class path (``replay.rebuild.rebuild_value`` makes it again, through its registry of
    config classes: the path is a key, never imported)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        cls = type(value)
        return {"__class__": f"{cls.__module__}:{cls.__qualname__}", **value.to_dict()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def fn_path(fn: Any) -> str | None:
    """``pkg.mod:name`` of a function or class (None for a lambda or a local one)."""
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{mod}:{name}" if mod and name and "<" not in name else None


class DrivenHost:
    """The ``Host`` protocol answered from an adapter's calls (see the module doc)."""

    precision_name = "fp32"
    """``fp32`` | ``fp16-mixed`` | ``bf16-mixed``: what the loop trains under (set by the
    adapter once it knows)."""
    clip_norm = 0.0
    """The loop's gradient clipping norm (0: none), for the update/weight ratios."""

    def __init__(self, model: nn.Module, loop: Loop, rollback: RollbackConfig,
                 factory: str | None = None, loss_factor: float = 1.0):  # fmt: skip
        self.loop, self.model = loop, model
        self.train_state = TrainState(model)
        self.step_loss: torch.Tensor | None = None
        self.injector = None
        self.factory = factory
        self.loss_factor = loss_factor  # what undoes the loop's division by accumulation
        self._lower_lr = rollback.remedy.get("lower_lr")
        self._micro = 0  # micro-batches of the step in flight
        self._consumed = 0  # micro-batches trained on (the loader's position; never rewinds)
        self._rng: dict[int, tuple] = {}  # data position -> generator states (this step's)
        self._stepped = False  # an optimizer step was taken in this batch
        self._last: tuple[list, list[int]] = ([], [])  # the last healthy step's batches
        self._norm: torch.Tensor | None = None
        self._norm_at = -1
        self._lrs: list[float] = []

    def start(self) -> None:
        """At train start (the optimizer exists then): the LR hooks."""
        opt = self.loop.optimizer()
        opt.register_step_pre_hook(self._scale_lr)
        opt.register_step_post_hook(self._restore_lr)

    # ---- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def global_rank(self) -> int:
        return self.loop.rank

    @property
    def window_start(self) -> bool:
        return self._micro == 0

    @property
    def stale_batch(self) -> bool:
        return False  # the loader is never moved behind the loop's back

    @property
    def micro(self) -> int:
        """Micro-batches seen of the step in flight."""
        return self._micro

    def parameters(self):
        return self.model.parameters()

    # ---- driven by an adapter -----------------------------------------------------------------
    def batch_start(self) -> None:
        if self.window_start:
            self.step_loss, self._rng = None, {}
        if self.injector is not None:  # the harness's own fault: the step it belongs to
            self.injector.begin(self.train_state.model_step + 1, self.train_state.data_step)
        cuda = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        self._rng[self.train_state.data_step] = (torch.get_rng_state(), cuda)

    def saw_loss(self, loss: torch.Tensor, scaled: bool = True) -> None:
        """A micro-batch's loss as the loop computed it: taken back to the micro-batch's
        own loss (``loss_factor``; the scaler's scale when ``scaled``); a harness fault on
        the gradients is armed for this backward."""
        if self.injector is not None:
            self.injector.arm(self.train_state.model_step + 1, self.model)
        loss = loss.detach().float() * self.loss_factor
        scaler = self.loop.scaler() if scaled else None
        scale = scaler_scale(scaler) if scaler is not None else None
        if scale is not None:
            loss = loss / scale.reshape(())
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss
        self._micro += 1
        self._consumed += 1
        self.train_state.data_step = self._consumed

    def after_backward(self) -> None:
        if self.injector is not None:
            self.injector.disarm(self.model)  # then the fault's after_backward

    def stepping(self) -> None:
        self._stepped = True

    def step_end(self, batches: list, positions: list[int]) -> bool:
        """After a batch: True when it ended an optimizer step (the model's step counted
        unless the step was judged bad and not applied)."""
        if not self._stepped:
            return False
        self._stepped, self._micro = False, 0
        if self.train_state.skip_step:
            self.train_state.skip_step = False
        else:
            self.train_state.model_step += 1
            self._last = (list(batches), list(positions))
        return True

    # ---- checkpoints ----------------------------------------------------------------------------
    def saved(self) -> dict[str, Any]:
        return {"train_state": self.train_state.state_dict(), "consumed": self._consumed}

    def load(self, state: dict[str, Any]) -> None:
        """A resumed run goes on from the saved model step and data position."""
        self.train_state.load_state_dict(state["train_state"], 0.0)
        self._consumed = int(state["consumed"])

    # ---- the engine's requests ------------------------------------------------------------------
    def grad_total_norm(self) -> torch.Tensor:
        step = self.train_state.data_step
        if self._norm is None or self._norm_at != step:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self._norm = (torch.nn.utils.get_total_norm(grads, foreach=True) if grads
                          else torch.zeros((), device=self.device))  # fmt: skip
            self._norm_at = step
        return self._norm

    def seed_dropout(self, data_step: int) -> None:
        saved = self._rng.get(data_step)
        if saved is None:
            return
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state_all(saved[1])

    def loss(self, batch) -> torch.Tensor:
        raise NotImplementedError  # each adapter's host re-runs its loop's own step

    def other_batches(self, positions: list[int]) -> tuple[list, list[int]]:
        """The last healthy step's micro-batches (this loader cannot be read at will)."""
        return self._last

    def train_sampler(self):
        return None

    def train_dataset(self):
        return None

    def lr_scale(self) -> float:
        ts = self.train_state
        return lr_scale_at(ts.lr_scale, ts.lr_since, ts.model_step, self._lower_lr)

    def apply_lr(self) -> None:
        """Nothing to set now: ``_scale_lr`` scales each optimizer step by ``lr_scale``."""

    def _scale_lr(self, opt, args, kwargs) -> None:
        scale = self.lr_scale()
        self._lrs = [g["lr"] for g in opt.param_groups] if scale != 1.0 else []
        for g in opt.param_groups if self._lrs else ():
            g["lr"] = g["lr"] * scale

    def _restore_lr(self, opt, args, kwargs) -> None:
        for g, lr in zip(opt.param_groups, self._lrs, strict=False):
            g["lr"] = lr
        self._lrs = []

    def seek_data(self, data_step: int) -> None:
        """The loader cannot be rewound: the data goes on, the position stays the number of
        micro-batches trained on."""
        self.train_state.data_step = self._consumed

    def run_config(self) -> dict[str, Any]:
        return {}

    def host_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def fault_info(self) -> dict[str, Any]:
        """The harness's own fault, if one is planted: the replay plants it again."""
        cfg = getattr(self.injector, "cfg", None)
        if cfg is None or cfg.kind == "none":
            return {}
        return {"fault": dataclasses.asdict(cfg)}
