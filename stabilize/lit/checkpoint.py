"""Checkpoints that a crash cannot corrupt, named by the model's step, and finding the one
to resume from (verified, with a fallback when the newest is damaged or missing)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from stabilize.io import DamagedFile, atomic_torch_save, verify
from stabilize.run.rundir import checkpoint_steps

LAST = "last.ckpt"


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """A file: ``stabilize.io.verify`` (its checksum). A directory: a sharded (FSDP, DCP)
    checkpoint, renamed into place once complete (lit/fsdp.py), so whole iff DCP's
    ``.metadata`` and Lightning's ``meta.pt`` are in it."""
    p = Path(path)
    if p.is_dir():
        missing = [n for n in (".metadata", "meta.pt") if not (p / n).is_file()]
        if missing:
            raise DamagedFile(f"{p} is not a whole sharded checkpoint (no {', '.join(missing)})")
        return True
    return verify(p)


def remove_checkpoint(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        atomic_torch_save(checkpoint, path)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(run_dir: str | os.PathLike, model_step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{model_step:06d}.ckpt"


def warn(message: str) -> None:
    """One line on stderr, from rank 0 only (every rank takes the same decision)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


class PeriodicCheckpoint(Checkpoint):
    """Every ``every`` model steps ``step-NNNNNN.ckpt`` + ``last.ckpt``; at the end of
    training ``last.ckpt`` again if the final step was not saved yet (nothing is lost when a
    run ends or is stopped between two periodic saves); only the newest ``keep`` periodic
    files are kept (-1: all).

    Names use ``model_step`` (it rewinds on rollback), not Lightning's ``global_step`` (it
    never does), so ``step-000040.ckpt`` holds model step 40. A rollback
    replays steps: the replayed step's checkpoint overwrites the earlier one of the same
    name (atomically, ``atomic_torch_save``), because the replay is the trajectory the run
    goes on with.

    This owns its file names instead of subclassing ``ModelCheckpoint``: that one keeps
    ``last_model_path`` in its state and forgets it when the checkpoint directory moves (a
    moved or copied run dir), after which its version counter writes ``last-v1.ckpt`` beside
    the ``last.ckpt`` that resume reads. Here the names are fixed and
    nothing about paths is stored. Being a ``Checkpoint``, Lightning runs it after every
    other callback, so a step that ends in a rollback is saved as restored.
    """

    def __init__(self, run_dir: str | os.PathLike, every: int, keep: int = -1):
        self.run_dir = Path(run_dir)
        self.dirpath = checkpoint_dir(run_dir)
        self.every = every
        self.keep = keep
        self._seen: int | None = None  # model step at the previous batch end
        self._saved: tuple[int, int] | None = None  # (model, global) step of the last save

    def on_train_start(self, trainer, pl_module):
        self._seen = pl_module.train_state.model_step

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        step = pl_module.train_state.model_step
        moved, self._seen = step != self._seen, step  # an optimizer step, or a rollback
        if moved and step % self.every == 0:
            # last.ckpt first: a kill between the two writes leaves last.ckpt the newest
            # file, never older than a step-*.ckpt beside it (resume reads last.ckpt first)
            self._save_last(trainer, pl_module)
            trainer.save_checkpoint(step_path(self.run_dir, step), weights_only=False)
            if self.keep > 0 and trainer.is_global_zero:
                for old in sorted(self.dirpath.glob("step-*.ckpt"))[: -self.keep]:
                    remove_checkpoint(old)

    def on_train_end(self, trainer, pl_module):
        if self._saved != (pl_module.train_state.model_step, trainer.global_step):
            self._save_last(trainer, pl_module)

    def _save_last(self, trainer, pl_module) -> None:
        # weights_only=False: the whole state (optimizer, loops), not the weights alone
        trainer.save_checkpoint(self.dirpath / LAST, weights_only=False)
        self._saved = (pl_module.train_state.model_step, trainer.global_step)


def newest_intact(ckpt_dir: Path, say: Callable[[str], None] = warn) -> Path | None:
    """``last.ckpt`` if it verifies, else the newest ``step-*.ckpt`` that does (saying
    which file was passed over and why); None when there are no checkpoints at all.

    Raises ``ValueError`` (one line, naming the files) when checkpoints exist but none is
    intact: a run never silently starts again from step 0 beside its checkpoints."""
    last = ckpt_dir / LAST
    steps = sorted(ckpt_dir.glob("step-*.ckpt"), reverse=True)  # newest model step first
    candidates = ([last] if last.exists() else []) + steps
    if not candidates:
        return None
    passed = [] if last.exists() else [f"{last} is missing"]
    for path in candidates:
        try:
            checked = verify_checkpoint(path)
        except (DamagedFile, OSError) as e:
            passed.append(str(e))
            continue
        for why in passed:
            say(f"{why}; resuming from {path} instead")
        if not checked:
            say(f"{path} has no checksum (written by an older version): resuming unverified")
        return path
    names = ", ".join(p.name for p in candidates)
    raise ValueError(
        f"no intact checkpoint in {ckpt_dir} ({names}): {'; '.join(passed)}; allowed: "
        f"resume=PATH to a checkpoint you trust, or resume=restart to start over"
    )


def resolve_resume(resume: str, run_dir: str | os.PathLike, trusted: bool = False) -> str | None:
    """``none`` / ``restart`` -> None; ``auto`` -> the newest intact checkpoint of the run
    dir (``newest_intact``), None if it has none; else a path, which must verify. The chosen
    file must load without running code (``checkpoint_steps``) unless ``trusted``: a
    checksum says a file is whole, not who wrote it (stabilize/trust.py)."""
    if resume in ("none", "restart"):
        return None
    if resume == "auto":
        path = newest_intact(checkpoint_dir(run_dir))
        if path is not None:
            checkpoint_steps(path, trusted)
        return None if path is None else str(path)
    if not Path(resume).exists():
        raise ValueError(
            f"resume={resume!r} is not allowed: no such checkpoint file; "
            f"allowed: 'none', 'auto', 'restart' or a path to a .ckpt file"
        )
    try:
        checked = verify_checkpoint(resume)
    except DamagedFile as e:
        raise ValueError(f"resume={resume!r} is not allowed: {e}") from None
    if not checked:
        warn(f"{resume} has no checksum (written by an older version): resuming unverified")
    checkpoint_steps(resume, trusted)
    return resume
