"""A run directory's identity: one run per directory (issue 12).

A launch that would start fresh (``resume=none``) in a directory that already holds a run
is refused before anything is written, naming the ways on; ``resume=restart`` moves the
earlier run's files aside into ``replaced-<time>/`` and starts over; ``resume=auto``
continues the run, and says so (training nothing) when it is already finished.

Under torchrun every rank shares the run dir and rank 0 writes ``config.json``, so only
rank 0 looks and acts: a rank that looked later could find rank 0's fresh files and take
them for an earlier run. When rank 0 refuses, it exits before the process group forms
and torchrun tears the other ranks down; they have written nothing of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import datetime
from pathlib import Path

# What a run writes into its dir (train.py, lit/*, rollback snapshots, W&B offline files).
# Hydra's own per-launch files (.hydra*/, *.log) are not a run's: every launch rewrites them.
RUN_FILES = (
    "config.json",
    "result.json",
    "events.jsonl",
    "diagnosis.json",
    "replicas.json",
    "skipped_batches.json",
    "audit.jsonl",
    "final_eval.json",
    "checkpoints",
    "snapshots",
    "csv",
    "wandb",
)
RESUME_CHOICES = "'none', 'auto', 'restart' or a path to a .ckpt file"


class RunDirError(ValueError):
    """The run dir does not allow what the launch asks (exit code 2 from the CLI)."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_files(run_dir: str | os.PathLike) -> list[str]:
    """The names of the run outputs present in ``run_dir`` (empty directories don't count)."""
    d = Path(run_dir)
    found = []
    for name in RUN_FILES:
        p = d / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def claim(run_dir: str | os.PathLike, resume: str) -> str | None:
    """Take ``run_dir`` for this launch, before anything is written; rank 0 only acts.

    ``resume=none`` in a dir holding a run: ``RunDirError`` (one line naming the dir and the
    ways on). ``resume=restart``: the earlier run's files are moved into
    ``replaced-<time>/`` inside the dir (nothing is deleted); returns a line saying so.
    """
    if _rank() != 0 or resume not in ("none", "restart"):
        return None
    found = run_files(run_dir)
    if not found:
        return None
    d = Path(run_dir)
    if resume == "none":
        raise RunDirError(
            f"run dir {d} already holds a run ({', '.join(found)}); to continue it: "
            f"resume=auto; to start a new run: another dir (STABILIZE_RUN_DIR=... or "
            f"run_dir=...); to replace it: resume=restart"
        )
    # Moving (not deleting): starting over must not cost the earlier run's evidence.
    attic = d / f"replaced-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"
    attic.mkdir()
    for name in found:
        (d / name.rstrip("/")).rename(attic / name.rstrip("/"))
    return f"resume=restart: moved the earlier run's {', '.join(found)} to {attic}"


def already_finished(
    run_dir: str | os.PathLike, ckpt: str | os.PathLike, max_steps: int, stop_at: int | None
) -> str | None:
    """A line saying the run is finished when the checkpoint's model step has reached the
    step this launch would stop at (``trainer.max_steps``, or ``trainer.stop_at_step``);
    None when there is training left to do. Training on would take one more step than
    asked (the stop is checked after a step) and overwrite ``last.ckpt``."""
    from stabilize.lit.checkpoint import checkpoint_steps  # torch + Lightning: only here

    model_step, _ = checkpoint_steps(ckpt)
    target, key = max_steps, "trainer.max_steps"
    if stop_at is not None and stop_at < max_steps:
        target, key = stop_at, "trainer.stop_at_step"
    if model_step < target:
        return None
    status = "unknown (no result.json)"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        status = json.loads((Path(run_dir) / "result.json").read_text()).get("status", status)
    return (
        f"run dir {run_dir} is finished (status {status}): {ckpt} is at model step "
        f"{model_step} and {key}={target}; nothing to train (raise {key} to train on)"
    )
