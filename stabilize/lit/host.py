"""``LightningHost``: the stability core's ``Host`` (stability/host.py) for a LightningModule
we did not write (docs/design-your-model.md sections 2-3).

It asks the user for nothing: what ``GPTLitModule`` keeps as attributes is learnt here from
Lightning's own hooks (the stability callback calls ``batch_start``, ``saw_loss`` and
``step_end`` from its ``on_train_batch_start``, ``on_before_backward`` and
``on_train_batch_end``) and from the optimizer, schedulers and scaler the Trainer holds:

- the step's loss: ``on_before_backward``'s tensor is the ``training_step`` loss divided by
  ``accumulate_grad_batches`` and, under ``16-mixed``, times the GradScaler's scale (Lightning's
  ``MixedPrecision.pre_backward`` scales before it calls the hook): both are undone, on device;
- the data position: a counter of micro-batches trained on. The loader is not ours, so a
  rollback cannot rewind it: the data goes on after one (as PaLM restarted past the bad
  batches), and a ``skip_*`` remedy's positions are never revisited anyway;
- dropout: the CPU (and CUDA) generator states are saved at each micro-batch of the step, so
  a re-run draws the same masks without the module's help;
- the LR: a lowered LR (``lower_lr``) scales every group's LR inside the optimizer step (a
  step pre-hook) and puts the scheduler's value back after it (a post-hook), so any
  scheduler keeps its own numbers;
- the re-run: the module's own ``training_step`` (``self.log`` muted), its loss taken as a
  tensor or a dict's ``"loss"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from stabilize.compat import scaler_scale
from stabilize.rollback import RollbackConfig
from stabilize.rollback.remedies import lr_scale_at
from stabilize.rollback.state import TrainState
from stabilize.validate import ConfigError

# Lightning's precision flags -> the names a bundle records (its replay's autocast)
PRECISION = {"16-mixed": "fp16-mixed", "bf16-mixed": "bf16-mixed", "32-true": "fp32",
             "32": "fp32", "64-true": "fp64"}  # fmt: skip


def watched_model(module: nn.Module, model: nn.Module | str | None = None) -> nn.Module:
    """The network the probe watches: ``model`` (a module or an attribute path), else the
    one child holding every parameter (``self.model = GPT2LMHeadModel(...)``), else the
    LightningModule itself."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, str):
        return module.get_submodule(model)
    total = sum(1 for _ in module.parameters())
    for _, child in module.named_children():
        if total and sum(1 for _ in child.parameters()) == total:
            return child
    return module


def module_path(module: nn.Module) -> str:
    """``pkg.mod:Class`` of a LightningModule (what a bundle's replay imports)."""
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"


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


class LightningHost:
    """The ``Host`` protocol answered for any LightningModule (see the module doc)."""

    def __init__(self, module, trainer, model: nn.Module, rollback: RollbackConfig,
                 factory: str | None = None):  # fmt: skip
        self.module, self.trainer, self.model = module, trainer, model
        self.train_state = TrainState(model)
        self.step_loss: torch.Tensor | None = None
        self.injector = None
        self.factory = factory
        self._lower_lr = rollback.remedy.get("lower_lr")
        self._accumulate = max(1, int(trainer.accumulate_grad_batches))
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
        opt = self.trainer.optimizers[0]
        opt.register_step_pre_hook(self._scale_lr)
        opt.register_step_post_hook(self._restore_lr)

    # ---- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def global_rank(self) -> int:
        return self.trainer.global_rank

    @property
    def window_start(self) -> bool:
        return self._micro == 0

    @property
    def stale_batch(self) -> bool:
        return False  # the loader is never moved behind Lightning's back

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

    # ---- driven by the stability callback -----------------------------------------------------
    def batch_start(self) -> None:
        if self._micro == 0:
            self.step_loss, self._rng = None, {}
        if self.injector is not None:  # the harness's own fault: the step it belongs to
            self.injector.begin(self.train_state.model_step + 1, self.train_state.data_step)
        cuda = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        self._rng[self.train_state.data_step] = (torch.get_rng_state(), cuda)

    def saw_loss(self, loss: torch.Tensor) -> None:
        """``on_before_backward``'s loss: scaled back to the micro-batch's own loss; a
        harness fault on the gradients is armed for this backward."""
        if self.injector is not None:
            self.injector.arm(self.train_state.model_step + 1, self.model)
        loss = loss.detach().float() * self._accumulate
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
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

    # ---- checkpoints (the callback's state) ---------------------------------------------------
    def saved(self) -> dict[str, Any]:
        return {"train_state": self.train_state.state_dict(), "consumed": self._consumed}

    def load(self, state: dict[str, Any]) -> None:
        """A resumed run goes on from the saved model step and data position."""
        self.train_state.load_state_dict(state["train_state"], 0.0)
        self._consumed = int(state["consumed"])

    # ---- the core's requests ------------------------------------------------------------------
    def grad_total_norm(self) -> torch.Tensor:
        step = self.train_state.data_step
        if self._norm is None or self._norm_at != step:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
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

    def other_batches(self, positions: list[int]) -> tuple[list, list[int]]:
        """The last healthy step's micro-batches (this loader cannot be read at will)."""
        return self._last

    def train_sampler(self):
        sampler = getattr(self.trainer.train_dataloader, "batch_sampler", None)
        return sampler if hasattr(sampler, "batch_for_step") else None

    def train_dataset(self):
        return getattr(self.trainer.train_dataloader, "dataset", None)

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

    def fault_info(self) -> dict[str, Any]:
        """The harness's own fault, if one is planted: the replay plants it again."""
        cfg = getattr(self.injector, "cfg", None)
        if cfg is None or cfg.kind == "none":
            return {}
        return {"fault": dataclasses.asdict(cfg)}

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
