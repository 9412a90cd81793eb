"""Progress a person reads: one counter everywhere, the model's step.

- ``PlainProgress`` (logs, CI, ``trainer.progress=plain``; ``auto`` off a terminal): one line
  per log step: ``step 44/50  loss 3.30  grad_norm 0.81  lr 1.0e-03  scale 65536
  tok/s 17,680  eta 0:04``, and ``validation @ step 44  loss ..  bpb ..``.
- ``StepBar`` (a terminal, ``rich``): Lightning's Rich bar counting model steps to the
  run's stop step (so it has a total and an ETA), with loss, grad norm, lr and loss scale in
  place of ``v_num``. Lightning's own bar counts its batches against an unknown total
  (``Epoch 0/-2 ... 15/--``): the run is bounded by model steps, not by Lightning's.

Lightning's ``global_step`` never rewinds; the model's step does after a rollback, so a
line may show a step lower than the one before it (the final summary counts both).
"""

from __future__ import annotations

import sys
import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


def stop_step(pl_module) -> int:
    """The model step the run stops at: ``trainer.max_steps``, or ``stop_at_step``."""
    t = pl_module.cfg.trainer
    return t.max_steps if t.stop_at_step is None else min(t.max_steps, t.stop_at_step)


def step_values(trainer, pl_module) -> dict[str, float]:
    """The step's loss, pre-clip grad norm, LR and loss scale, read off the module (one host
    transfer each, on log steps only: the bar and the lines are not per-step syncs)."""
    out: dict[str, float] = {}
    if pl_module.step_loss is not None:
        out["loss"] = float(pl_module.step_loss) / pl_module.cfg.optim.accumulate_grad_batches
    if pl_module.grad_norm is not None:
        out["grad_norm"] = float(pl_module.grad_norm)
    if trainer.optimizers:
        out["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        out["scale"] = float(scaler.get_scale())
    return out


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


FORMATS = {"loss": "{:.4g}", "grad_norm": "{:.3g}", "lr": "{:.2e}", "scale": "{:g}"}


class PlainProgress(L.Callback):
    """One line every ``every`` Lightning steps (the log steps), for logs and CI."""

    def __init__(self, every: int, stream=None):
        self.every = every
        self.stream = stream
        self._last = -1  # the global step last printed (a window's micro-batches share it)
        self._rollbacks = 0  # rollbacks seen: a rolled-back step gets no line (its loss and
        # step are the dropped attempt's; the console's ROLLBACK line says what happened)

    def on_train_start(self, trainer, pl_module):
        self._t0 = self._tok_t0 = time.perf_counter()
        self._g0 = trainer.global_step
        self._tokens = 0
        self._val_t0 = 0.0

    def on_validation_start(self, trainer, pl_module):
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        if hasattr(self, "_tok_t0"):  # tokens/s: training time only
            self._tok_t0 += time.perf_counter() - self._val_t0
        if trainer.is_global_zero:
            m = trainer.callback_metrics
            line = "  ".join(
                f"{k.split('/')[-1]} {float(m[k]):.4g}" for k in ("val/loss", "val/bpb") if k in m
            )
            self._print(f"validation @ step {pl_module.train_state.model_step}  {line}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if getattr(pl_module, "stale_batch", False):
            return
        self._tokens += batch[0].numel() * trainer.world_size
        step = trainer.global_step
        rollbacks = len(pl_module.train_state.remedies)
        if rollbacks != self._rollbacks:
            self._rollbacks = rollbacks
            return
        last = pl_module.train_state.model_step >= stop_step(pl_module)
        if step == self._last or (step % self.every and not last) or step == 0:
            return
        self._last = step
        now = time.perf_counter()
        tps = self._tokens / max(now - self._tok_t0, 1e-9)
        self._tok_t0, self._tokens = now, 0
        if not trainer.is_global_zero:
            return
        vals = step_values(trainer, pl_module)
        parts = [f"{k} {FORMATS[k].format(v)}" for k, v in vals.items()]
        parts.append(f"tok/s {tps:,.0f}")
        # ETA: Lightning steps per second so far (rollbacks' replays included) over the
        # model steps still to go
        done = step - self._g0
        left = max(stop_step(pl_module) - pl_module.train_state.model_step, 0)
        if done > 0:
            parts.append(f"eta {fmt_duration(left * (now - self._t0) / done)}")
        self._print(
            f"step {pl_module.train_state.model_step}/{stop_step(pl_module)}  " + "  ".join(parts)
        )

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stdout, flush=True)


class StepBar(RichProgressBar):
    """Lightning's Rich bar, counting model steps up to the stop step, with our metrics."""

    @property
    def total_train_batches(self) -> int:
        return stop_step(self.trainer.lightning_module)

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, pl_module.train_state.model_step)
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict[str, str]:
        return {k: FORMATS[k].format(v) for k, v in step_values(trainer, pl_module).items()}
