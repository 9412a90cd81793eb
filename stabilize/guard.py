"""``stabilize.Guard``: the stability engine around a plain PyTorch loop
(docs/your-model.md section 2). No Lightning here.

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

Gradient accumulation takes the natural shape: every batch drawn from ``guard.batches``
since the last ``before_step`` is a micro-batch of the step (draw N, backward N, then
``before_step``), and ``before_step`` is given the list of their losses. The probe, the
re-run and the bundle see every micro-batch of the step.

``before_step(loss)`` is the one host sync of the step. It unscales the gradients (a
GradScaler's ``unscale_``, unless the loop did it already to clip: then the norm judged is
the clipped one), judges the step and returns a ``Verdict``. When ``apply`` is false the
model, optimizer, schedulers and scaler are already restored to a good snapshot and
remedied: the user skips the step. Step k's snapshot and logs are taken when the next
batch is drawn (the optimizer has applied step k by then) or at ``close()``. The per-step
metrics go to ``csv/version_0/metrics.csv``, what ``stabilize-report`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabilize.compat import scaler_unscaled
from stabilize.monitors import Event
from stabilize.stability.arguments import check_callback, check_guard, settings, shown
from stabilize.stability.controller import StabilityAbort
from stabilize.stability.driven import DrivenHost, StabilityConfigError, fn_path, refuse_fault
from stabilize.stability.engine import StabilityEngine
from stabilize.stability.loop import HandedLoop


@dataclass
class Verdict:
    """What ``before_step`` decided for the step."""

    apply: bool
    """Take the optimizer step. False: the step was judged bad and everything is restored."""
    step: int
    """The model step judged (1-based)."""
    loss: float | None = None
    """The step's loss as the monitors saw it (a host float; the mean over micro-batches)."""
    events: list[Event] = field(default_factory=list)
    """The monitors' verdicts on it (warnings included)."""


class GuardHost(DrivenHost):
    """The ``Host`` for a plain loop: the model is the module; the re-run is ``loss_fn``.
    A micro-batch is counted when it is drawn (its data position and dropout state are
    taken then); its loss arrives with ``before_step``."""

    def __init__(self, model, loop, rollback, factory, loss_fn):
        super().__init__(model, loop, rollback, factory)
        self.loss_fn = loss_fn
        self.drawn = 0  # micro-batches drawn for the step in flight

    @property
    def window_start(self) -> bool:
        return self.drawn == 0

    def drew(self) -> None:
        """A micro-batch was drawn (after the engine took its position)."""
        self.drawn += 1
        self._consumed += 1
        self.train_state.data_step = self._consumed

    def saw_loss(self, loss: torch.Tensor, scaled: bool = False) -> None:
        """A micro-batch's own loss (not scaled: the Guard is given it before any scaler)."""
        loss = loss.detach().float()
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss
        self._micro += 1

    def step_end(self, batches: list, positions: list[int]) -> bool:
        self.drawn = 0
        return super().step_end(batches, positions)

    def loss(self, batch) -> torch.Tensor:
        if self.loss_fn is None:
            raise StabilityConfigError("no re-run without Guard(loss_fn=...)")
        return self.loss_fn(self.model, batch)

    def host_info(self) -> dict[str, Any]:
        return {"kind": "guard", "factory": self.factory, "loss": fn_path(self.loss_fn),
                "model_path": "", **self.fault_info()}  # fmt: skip


class GuardLoop(HandedLoop):
    """The engine's ``Loop`` for a plain loop: the objects the user handed the Guard."""

    def __init__(self, optimizer, scaler, schedulers: list, run_dir: Path, log_every: int):
        super().__init__(optimizer, scaler, schedulers, run_dir)
        self.log_every = log_every
        self.step = 0  # optimizer steps the loop has been through (taken or skipped)

    @property
    def log_row(self) -> int:
        return self.step


class Guard:
    """The stability harness for a plain loop (see the module doc).

    Writes, in ``run_dir``: ``events.jsonl`` (every verdict), ``bundles/`` (a repro bundle
    per fault), ``snapshots/`` (the durable snapshots), ``diagnosis.json`` (on an abort),
    ``config.json``, ``result.json``, and the per-step metrics to
    ``csv/version_0/metrics.csv``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        *,
        scheduler: Any = None,
        run_dir: str | Path,
        loss_fn: Any = None,
        factory: str | None = None,
        clip: float = 0.0,
        monitor: Any = None,
        rollback: Any = None,
        fault: Any = None,
        log_every: int = 10,
        blocks: str | None = None,
    ):
        """``scaler``: the loop's GradScaler, if any. ``scheduler``: one LR scheduler or a
        list. ``run_dir``: where events, bundles, snapshots and metrics go. ``loss_fn``:
        ``fn(model, batch) -> loss``, the re-run of one micro-batch (the classification and
        the replay need it). ``factory``: ``pkg.mod:fn`` rebuilding the model for
        ``stabilize-replay``. ``clip``: the gradient clipping norm the Guard applies after
        judging (0: none). ``monitor`` / ``rollback`` / ``fault``: the settings groups (a
        dataclass, a dict or None). ``log_every``: the per-layer series' interval.
        ``blocks``: a glob naming the residual blocks."""
        # every argument checked before anything is written: a refused one leaves no run dir
        self.run_dir = check_guard(model, optimizer, scaler, run_dir, loss_fn, clip, log_every)
        monitor, rollback, fault = settings(monitor, rollback, fault)
        check_callback(self.run_dir, 1, None, blocks, factory, ())
        refuse_fault(fault, gradients=True)
        scheds = [] if scheduler is None else list(scheduler) if isinstance(
            scheduler, (list, tuple)) else [scheduler]  # fmt: skip
        self.loop = GuardLoop(optimizer, scaler, scheds, self.run_dir, log_every)
        self.engine = StabilityEngine(monitor, rollback, fault, self.run_dir)
        self.host = GuardHost(model, self.loop, rollback, factory, loss_fn)
        self.host.clip_norm = float(clip)
        self.model, self.optimizer, self.scaler, self.clip = model, optimizer, scaler, clip
        self._autocast_hook = model.register_forward_pre_hook(self._read_autocast)
        self.engine.setup(self.loop, self.host, blocks, describe=True)
        self.host.start()
        self.engine.start()
        self._owed = False  # a judged step whose end (snapshot, logs) is still to be done
        self._closed = False
        self._described = False

    def _read_autocast(self, module, args) -> None:
        """At the first forward: the autocast it runs under (the re-run's)."""
        dev = next(module.parameters()).device.type
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            self.loop.autocast = (dev, dtype)
            names = {torch.float16: "fp16-mixed", torch.bfloat16: "bf16-mixed"}
            self.host.precision_name = names.get(dtype, "fp32")
        self._autocast_hook.remove()

    # ---- the loop's calls -------------------------------------------------------------------
    def batches(self, loader):
        """The loader's batches, each announced to the engine before its forward."""
        for batch in loader:
            self._open("batches")
            self._finish()
            self.host.batch_start()
            self.engine.micro_batch(batch)
            self.host.drew()
            yield batch

    def before_step(self, loss: torch.Tensor | list[torch.Tensor]) -> Verdict:
        """After the backward of every micro-batch, before the optimizer step: judge it
        (see the module doc). ``loss``: the micro-batch's loss, or with accumulation the
        list of every micro-batch's, each as its forward returned it (before any
        division by the accumulation and before any scaler)."""
        losses = self._check_step(loss)
        host, engine = self.host, self.engine
        if not self._described:  # the precision is known once the first forward ran
            engine.write_run_info()
            self._described = True
        for one in losses:
            host.saw_loss(one)
        engine.gather.accumulate = len(losses)
        scaler = self.loop.scaler()
        if scaler is not None and not scaler_unscaled(scaler, self.optimizer):
            scaler.unscale_(self.optimizer)
        engine.after_backward()  # the snapshot's copy has landed before a fault writes
        host.after_backward()
        host.stepping()
        pending = engine.judge()
        bad = host.train_state.skip_step
        if self.clip > 0 and not bad:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, host.grad_total_norm())
        stats, events = (pending[0], pending[1]) if pending is not None else (None, [])
        verdict = Verdict(apply=not bad, step=host.train_state.model_step + 1,
                          loss=stats.loss if stats is not None else None,
                          events=list(events))  # fmt: skip
        self._owed = True
        if bad:  # restored now: the user skips the step
            if scaler is not None:
                # the scaler's per-step record (its unscale_ above) is closed as its own
                # update() does; the rollback then loads the snapshot's scale over it
                scaler.update()
            self._finish()
        return verdict

    @property
    def model_step(self) -> int:
        """The model's steps: taken and kept (a rollback moves it back), the step just
        judged and applied included."""
        return self.host.train_state.model_step + int(self._owed)

    @property
    def last(self):
        """The last step's ``StepStats`` (what the monitors judged)."""
        return self.engine.last

    def _open(self, call: str) -> None:
        if self._closed:  # torn down: nothing would be judged or written
            msg = f"Guard.{call}() after Guard.close(); allowed: a new Guard for a new loop"
            raise StabilityConfigError(msg)

    def _check_step(self, loss) -> list[torch.Tensor]:
        """``before_step``'s order and argument, checked before anything is counted: a
        second call for one batch would count its loss twice and judge a step not taken."""
        self._open("before_step")
        drawn = self.host.drawn
        if self._owed:
            raise StabilityConfigError(
                "Guard.before_step() called twice for one batch; allowed: once per batch "
                "drawn from guard.batches(loader) (with accumulation: once per step), after "
                "its backward"
            )
        if drawn == 0:
            raise StabilityConfigError(
                "Guard.before_step() before any batch was drawn for this step; allowed: "
                "after the backward of the batches drawn from guard.batches(loader)"
            )
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        if not all(isinstance(x, torch.Tensor) and x.numel() == 1 for x in losses):
            raise StabilityConfigError(
                f"Guard.before_step(loss={shown(loss)}) is not allowed; allowed: the step's "
                "loss, a one-element torch.Tensor (the one its backward ran on, before any "
                "scaler), or a list of one per micro-batch"
            )
        if len(losses) != drawn:
            raise StabilityConfigError(
                f"Guard.before_step(loss={shown(loss)}) after {drawn} batches drawn for this "
                f"step is not allowed; allowed: a list of the {drawn} micro-batches' losses "
                "(with accumulation every batch drawn since the last before_step is one)"
            )
        return losses

    def _finish(self) -> None:
        """The end of the judged step: counted, logged, snapshotted or rolled back."""
        if not self._owed:
            return
        self._owed = False
        self.loop.step += 1
        self.host.step_end(self.engine.batches, self.engine.positions)
        self.engine.step_end()

    def close(self) -> None:
        """The last step's end; open episodes summed up; the durable snapshot in flight
        written; the metrics file flushed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish()
            self.engine.close()
            self.engine.write_result("done")
        finally:
            self.engine.writer.close()
            self.loop.csv.save()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
            return
        self._closed = True
        self.engine.fail()
        aborted = isinstance(exc[1], StabilityAbort)
        self.engine.write_result("aborted" if aborted else "failed", repr(exc[1]))
        self.loop.csv.save()
