"""Preemption: a signal makes every rank finish its step, checkpoint, and exit 4.

Clusters announce a preemption with a signal some seconds before SIGKILL: SLURM sends
SIGTERM (or the signal of ``--signal=USR1@60``), Kubernetes SIGTERM, torchrun forwards what
it receives to its workers and SIGKILLs them ~30 s later. Lightning turns SIGTERM into
``SIGTERMException``, a ``SystemExit`` with no code: uncaught, a preempted run exits 0 with
no checkpoint at the signal; and its handler broadcasts from inside the signal handler,
which can hang two ranks that are not in the same collective.

Here the handler only records the signal (nothing else is safe inside a handler). At the
end of each training batch the ranks agree (one 1-element all-reduce, max, under DDP; a
plain read with one process), so they stop after the same optimizer step. Then every rank
writes ``last.ckpt`` (durable: temp file, fsync, rename, SHA-256 footer), rank 0 writes
``result.json`` with status ``preempted``, and the run raises ``Preempted``, which
``stabilize-train`` turns into exit code 4 (``stabilize/exits.py``); ``resume=auto`` then
goes on from that exact step. ``trainer.preempt_signals`` names the signals (default
``[SIGTERM]``; add ``SIGUSR1`` for SLURM's ``--signal``).
"""

from __future__ import annotations

import signal
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint


class Preempted(Exception):
    """The run stopped on a preemption signal after a durable checkpoint."""

    def __init__(self, signame: str, model_step: int, checkpoint: str):
        super().__init__(
            f"preempted by {signame} at model step {model_step}; checkpoint {checkpoint}; "
            "resume with resume=auto"
        )
        self.signame, self.model_step, self.checkpoint = signame, model_step, checkpoint


class PreemptOnSignal(Checkpoint):
    """A ``Checkpoint`` callback so Lightning runs it after every other callback (after the
    stability callback's rollback and the periodic checkpoint), as the step's last word."""

    def __init__(self, signals: list[str], periodic: Any):
        self.signals = list(signals)
        self.periodic = periodic  # lit/checkpoint.PeriodicCheckpoint: writes last.ckpt
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def on_train_start(self, trainer, pl_module):
        # after Lightning's own signal connector (registered before on_train_start): ours
        # replaces its SIGTERM handler, whose broadcast inside the handler could hang
        for name in self.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handler)

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def on_exception(self, trainer, pl_module, exception):
        self._restore()

    def _restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._previous.clear()

    def _agreed(self, trainer) -> bool:
        """Did any rank receive a signal? Every rank gets the same answer."""
        mine = self.received is not None
        if trainer.world_size == 1:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=trainer.strategy.root_device)
        flag = trainer.strategy.reduce(flag, reduce_op="max")
        return bool(flag.item())

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        if not self._agreed(trainer):
            return
        step = pl_module.train_state.model_step
        if self.periodic._saved != (step, trainer.global_step):
            self.periodic._save_last(trainer, pl_module)
        path = str(self.periodic.dirpath / "last.ckpt")
        raise Preempted(self.received or "a signal on another rank", step, path)


def build(cfg_signals: list[str], periodic: Any) -> L.Callback | None:
    """The callback, or None when no signal is configured (``trainer.preempt_signals=[]``)."""
    return PreemptOnSignal(cfg_signals, periodic) if cfg_signals else None
