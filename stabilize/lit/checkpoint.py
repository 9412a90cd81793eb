"""Checkpoints that a crash cannot corrupt, and finding the one to resume from."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from stabilize.io import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        atomic_torch_save(checkpoint, path)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> str | None:
    """``none`` -> None; ``auto`` -> the run dir's last.ckpt if there is one; else a path."""
    if resume == "none":
        return None
    if resume == "auto":
        last = checkpoint_dir(run_dir) / "last.ckpt"
        return str(last) if last.exists() else None
    if not Path(resume).is_file():
        raise ValueError(
            f"resume={resume!r} is not allowed: no such checkpoint file; "
            f"allowed: 'none', 'auto' or a path to a .ckpt file"
        )
    return resume


class PeriodicCheckpoint(ModelCheckpoint):
    """Every ``every`` optimizer steps ``step-NNNNNN.ckpt`` + ``last.ckpt``; at the end of
    training ``last.ckpt`` again if the final step was not a multiple (nothing is lost when a
    run ends or is stopped between two periodic saves); only the newest ``keep`` periodic
    files are kept (-1: all).

    No ``monitor``: with one, Lightning defers the save of an epoch's last batch to a
    validation that may never come, and the final checkpoint silently goes missing.
    """

    def __init__(self, run_dir: str | os.PathLike, every: int, keep: int = -1):
        super().__init__(
            dirpath=checkpoint_dir(run_dir),
            filename="step-{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every,
            save_top_k=-1,
            save_last=True,
        )
        self.keep = keep

    def on_train_batch_end(self, trainer, *args, **kwargs):
        super().on_train_batch_end(trainer, *args, **kwargs)
        if self.keep > 0 and trainer.is_global_zero:
            for old in sorted(Path(self.dirpath).glob("step-*.ckpt"))[: -self.keep]:
                old.unlink()

    def on_train_end(self, trainer, pl_module):
        if self._last_global_step_saved != trainer.global_step:
            trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt")
