"""``stabilize.Guard``: the stability harness around a plain PyTorch loop (issue 36;
docs/your-model.md section 2).

A few calls around the user's own forward, backward and step::

    guard = stabilize.Guard(model, opt, scaler=scaler, scheduler=sched, run_dir="runs/mine",
                            loss_fn=my_loss, factory="mypkg.train:build_model")
    for batch in guard.batches(loader):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = my_loss(model, batch)
        scaler.scale(loss).backward()
        if guard.before_step(loss).apply:
            scaler.step(opt)
            scaler.update()
            sched.step()
        opt.zero_grad(set_to_none=True)
    guard.close()

The Guard drives the same ``StabilityCallback`` a Lightning run uses, hook by hook, with a
``GuardHost`` (lit/host.py's ``LightningHost`` with the user's ``loss_fn`` as the re-run)
and ``_Loop``, the few facts of a Trainer the stability core reads, answered for the
user's loop: the optimizer, schedulers and scaler it was given, rank and world from
``torch.distributed`` (1 without it), autocast for the re-run from the first forward's
autocast state. So the events, the rollback ladder, the bundles, the per-step metrics
(``csv/version_0/metrics.csv``, what ``stabilize-report`` reads) are the Lightning run's.

``before_step(loss)`` is the one host sync of the step. It unscales the gradients (a
GradScaler's ``unscale_``: the step's ``scaler.step`` then does not unscale twice), judges
the step and returns a ``Verdict``. When ``apply`` is false the model, optimizer,
schedulers and scaler are already restored to a good snapshot and remedied: the user skips
the step. Step k's snapshot and logs are taken when the next batch is drawn (the optimizer
has applied step k by then) or at ``close()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from stabilize.lit.arguments import check_guard, shown
from stabilize.lit.host import LightningHost, StabilityConfigError, refuse_fault
from stabilize.lit.stability import StabilityCallback
from stabilize.monitors import Event


@dataclass
class Verdict:
    """What ``before_step`` decided for the step."""

    apply: bool
    """Take the optimizer step. False: the step was judged bad and everything is restored."""
    step: int
    """The model step judged (1-based)."""
    loss: float | None = None
    """The step's loss as the monitors saw it (a host float)."""
    events: list[Event] = field(default_factory=list)
    """The monitors' verdicts on it (warnings included)."""


def _fn_path(fn: Any) -> str | None:
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{mod}:{name}" if mod and name and "<" not in name else None


class GuardHost(LightningHost):
    """The ``Host`` for a plain loop: the model is the module; the re-run is ``loss_fn``."""

    def __init__(self, model, loop, rollback, factory, loss_fn):
        super().__init__(model, loop, model, rollback, factory)
        self.loss_fn = loss_fn

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def saw_loss(self, loss: torch.Tensor) -> None:
        """The user's own loss (not scaled: the Guard is given it before any scaler), after
        the backward (no gradient fault can be armed: ``Guard`` refuses those)."""
        loss = loss.detach().float()
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss
        self._micro += 1
        self._consumed += 1
        self.train_state.data_step = self._consumed

    def loss(self, batch) -> torch.Tensor:
        if self.loss_fn is None:
            raise StabilityConfigError("no re-run without Guard(loss_fn=...)")
        return self.loss_fn(self.model, batch)

    def run_config(self) -> dict[str, Any]:
        return {}

    def host_info(self) -> dict[str, Any]:
        return {
            "kind": "guard",
            "factory": self.factory,
            "loss": _fn_path(self.loss_fn),
            "model_path": "",
            **self.fault_info(),
        }


class _Precision:
    """The re-run's autocast (the first forward's) and the scaler."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.autocast: tuple[str, torch.dtype] | None = None

    def forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1])


class _EpochLoop:
    """Lightning's epoch loop counter the sink's rows are keyed by (compat.py reads it)."""

    def __init__(self):
        self._batches_that_stepped = 0
        self.max_steps = -1

    def stepped(self) -> None:
        self._batches_that_stepped += 1


class _Loop:
    """What the stability core reads of a Lightning Trainer, for the user's loop."""

    def __init__(self, model: nn.Module, optimizer, scaler, schedulers, run_dir: Path,
                 log_every: int, clip: float):  # fmt: skip
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.global_rank = torch.distributed.get_rank() if dist else 0
        self.world_size = torch.distributed.get_world_size() if dist else 1
        self.is_global_zero = self.global_rank == 0
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = [SimpleNamespace(scheduler=s) for s in schedulers]
        self.precision_plugin = _Precision(scaler)
        self.strategy = SimpleNamespace(model=model)  # not DDP, not FSDP: whole copies
        self.loggers = [CSVLogger(save_dir=str(run_dir), name="csv", version=0)]
        self.global_step = 0
        self.log_every_n_steps = log_every
        self.fit_loop = SimpleNamespace(epoch_loop=_EpochLoop())
        self.max_steps = -1  # the user's loop decides when to stop
        self.accumulate_grad_batches = 1
        self.gradient_clip_val, self.gradient_clip_algorithm = clip, "norm"
        self.precision = "32-true"
        self.log_dir = self.default_root_dir = str(run_dir)
        self.train_dataloader = None
        self.should_stop = False


class Guard:
    """The stability harness for a plain loop (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler=None,
        *,
        scheduler=None,
        run_dir: str | Path,
        loss_fn=None,
        factory: str | None = None,
        clip: float = 0.0,
        monitor=None,
        rollback=None,
        fault=None,
        log_every: int = 10,
        blocks: str | None = None,
    ):
        # every argument checked before anything is written: a refused one leaves no run dir
        # (the callback checks the settings; its setup makes the dir once the model is seen)
        self.run_dir = check_guard(model, optimizer, scaler, run_dir, loss_fn, clip, log_every)
        self.cb = StabilityCallback(monitor, rollback, fault, self.run_dir, 1, blocks=blocks,
                                    factory=factory)  # fmt: skip
        refuse_fault(self.cb.fcfg, gradients=True)
        if scheduler is None:
            scheds = []
        else:
            scheds = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
        self.loop = _Loop(model, optimizer, scaler, scheds, self.run_dir, log_every, clip)
        self.host = GuardHost(model, self.loop, self.cb.rcfg, factory, loss_fn)
        self.cb.host, self.cb._driven = self.host, True
        self.model, self.optimizer, self.scaler, self.clip = model, optimizer, scaler, clip
        self._autocast_hook = model.register_forward_pre_hook(self._read_autocast)
        self.cb.setup(self.loop, self.host, "fit")
        self.cb.on_train_start(self.loop, self.host)
        self._owed: Any = None  # the batch whose end (snapshot, logs) is still to be done
        self._batch_idx = 0
        self._closed = False
        self._judged: bool | None = None  # None: no batch drawn yet; True: before_step ran

    def _read_autocast(self, module, args) -> None:
        """At the first forward: the autocast it runs under (the re-run's)."""
        dev = next(module.parameters()).device.type
        if torch.is_autocast_enabled(dev):
            self.loop.precision_plugin.autocast = (dev, torch.get_autocast_dtype(dev))
            names = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}
            self.loop.precision = names.get(torch.get_autocast_dtype(dev), "32-true")
        self._autocast_hook.remove()

    # ---- the loop's calls -------------------------------------------------------------------
    def batches(self, loader):
        """The loader's batches, each announced to the probe before its forward."""
        for batch in loader:
            self._open("batches")
            self._finish()
            self.cb.on_train_batch_start(self.loop, self.host, batch, self._batch_idx)
            self._batch, self._judged = batch, False
            yield batch

    def before_step(self, loss: torch.Tensor) -> Verdict:
        """After the backward, before the optimizer step: judge it (see the module doc)."""
        self._check_step(loss)
        host, loop, cb = self.host, self.loop, self.cb
        if self._batch_idx == 0:  # the precision is known once the first forward ran
            cb.write_run_info(loop)
        host.saw_loss(loss)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        cb.on_after_backward(loop, host)
        cb.on_before_optimizer_step(loop, host, self.optimizer)
        pending = cb._pending
        bad = host.train_state.skip_step
        if self.clip > 0 and not bad:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, host.grad_total_norm())
        stats, events = (pending[0], pending[1]) if pending is not None else (None, [])
        verdict = Verdict(
            apply=not bad,
            step=host.train_state.model_step + 1,
            loss=stats.loss if stats is not None else None,
            events=list(events),
        )
        self._owed = self._batch
        if bad:  # restored now: the user skips the step
            if self.scaler is not None and self.scaler.is_enabled():
                # the scaler's per-step record (its unscale_ above) is closed as its own
                # update() does; the rollback then loads the snapshot's scale over it
                self.scaler.update()
            self._finish()
        return verdict

    def _open(self, call: str) -> None:
        if self._closed:  # its callback is torn down: nothing would be judged or written
            msg = f"Guard.{call}() after Guard.close(); allowed: a new Guard for a new loop"
            raise StabilityConfigError(msg)

    def _check_step(self, loss) -> None:
        """``before_step``'s order and argument, checked before anything is counted: a
        second call for one batch would count its loss twice and judge a step not taken."""
        self._open("before_step")
        if self._judged is None:
            raise StabilityConfigError(
                "Guard.before_step() before any batch was drawn; allowed: after the backward "
                "of a batch from guard.batches(loader)"
            )
        if self._judged:
            raise StabilityConfigError(
                "Guard.before_step() called twice for one batch; allowed: once per batch "
                "drawn from guard.batches(loader), after its backward"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise StabilityConfigError(
                f"Guard.before_step(loss={shown(loss)}) is not allowed; allowed: the step's "
                "loss, a one-element torch.Tensor (the one its backward ran on, before any scaler)"
            )
        self._judged = True

    def _finish(self) -> None:
        """The end of the last batch: its step counted, logged, snapshotted or rolled back."""
        if self._owed is None:
            return
        batch, self._owed = self._owed, None
        loop = self.loop
        loop.global_step += 1
        loop.fit_loop.epoch_loop.stepped()
        self.cb.on_train_batch_end(loop, self.host, None, batch, self._batch_idx)
        self._batch_idx += 1

    def close(self) -> None:
        """The last step's end; open episodes summed up; the durable snapshot in flight
        written; the metrics file flushed."""
        if self._closed:
            return
        self._closed = True
        self._finish()
        self.cb.on_train_end(self.loop, self.host)  # and result.json
        self.cb.teardown(self.loop, self.host, "fit")
        for lg in self.loop.loggers:
            lg.save()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.cb.on_exception(self.loop, self.host, exc[1])

    @property
    def last(self):
        """The last step's ``StepStats`` (what the monitors judged)."""
        return self.cb.last
