"""A run directory's identity: one run per directory.

A launch that would start fresh (``resume=none``) in a directory that already holds a run
is refused before anything is written, naming the ways on; ``resume=restart`` moves the
earlier run's files aside into ``replaced-<time>/`` and starts over; ``resume=auto``
continues the run, and says so (training nothing) when it is already finished, or runs its
ending alone when it stopped at its last step before the ending was whole (``at_the_end``).

Under torchrun every rank shares the run dir and rank 0 writes ``config.json``, so only
rank 0 looks and acts: a rank that looked later could find rank 0's fresh files and take
them for an earlier run. When rank 0 refuses, it exits before the process group forms
and torchrun tears the other ranks down; they have written nothing of the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from stabilize.validate import ConfigError

LOCK = ".lock"  # held (flock) by the launch training in the dir, for its whole life
_held: dict[str, tuple[int, bool]] = {}  # run dir -> (locked descriptor, file created here)

# What a run writes into its dir (train.py, lit/*, rollback snapshots, W&B offline files).
# Hydra's own per-launch files (.hydra*/, *.log) are not a run's: every launch rewrites them.
RUN_FILES = (
    "config.json",
    "result.json",
    "events.jsonl",
    "diagnosis.json",
    "replicas.json",
    "skipped_batches.json",
    "skipped_items.json",  # sequences stabilize-replay --data found (a resume skips them)
    "audit.jsonl",
    "final_eval.json",
    "checkpoints",
    "snapshots",
    "csv",
    "wandb",
    "ranks",  # the watchdog's heartbeats and stack dumps (lit/watchdog.py)
    "bundles",  # repro bundles of faulty steps (stability/bundle.py)
)
RESUME_CHOICES = "'none', 'auto', 'restart' or a path to a .ckpt file"


class RunDirError(ValueError):
    """The run dir does not allow what the launch asks (exit code 2 from the CLI)."""


def check_name(name: Any) -> None:
    """``name`` names one directory: configs/train.yaml puts runs in ``runs/${name}/<id>``
    and sweeps in ``multirun/${name}/<time>``, so a ``/`` or ``..`` in it would put them
    somewhere else (``name=../../x``: outside ``runs/``). ``run_dir=`` or
    ``STABILIZE_RUN_DIR`` choose another place on purpose."""
    s = str(name)
    if name is None or s in ("", ".") or any(c in s for c in ("/", "\\", "..", "\0")):
        raise ConfigError(
            f"name={name!r} is not allowed: a run's name is one directory under runs/ (and "
            "multirun/); allowed: a name without '/', '\\' or '..' (e.g. name=fp16_sweep; "
            "run_dir=PATH or STABILIZE_RUN_DIR=PATH put a run anywhere)"
        )


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


def lock(run_dir: str | os.PathLike) -> bool:
    """Hold ``run_dir/.lock`` (an OS file lock, ``flock``) for this process's life, or
    refuse in one line naming the holder (host, pid, start time): two launches never train
    in one dir. The OS drops the lock when its process dies, however it dies, so a stale
    lock cannot block a resume (the holder's details in the file are then just old text).
    Re-entrant within a process (a resume in the same process takes it again). Returns
    whether this call created the lock file (a refused launch then removes it again)."""
    d = Path(run_dir)
    key = str(d.resolve())
    if key in _held:
        return False
    d.mkdir(parents=True, exist_ok=True)
    created = not (d / LOCK).exists()
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "{}"
        os.close(fd)
        with contextlib.suppress(ValueError):
            h = json.loads(holder)
            holder = f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"
        raise RunDirError(
            f"run dir {d} is in use by another launch ({holder}; lock {d / LOCK}); wait for "
            "it to end, or use another dir (STABILIZE_RUN_DIR=... or run_dir=...)"
        ) from None
    _held[key] = (fd, created)
    return created


def stamp(run_dir: str | os.PathLike) -> None:
    """Write the holder's details into the held lock file, once the launch is accepted and
    about to train (a refused one leaves the file as it found it)."""
    held = _held.get(str(Path(run_dir).resolve()))
    if held is None:  # not rank 0: rank 0 holds the lock
        return
    fd, _ = held
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": datetime.now().isoformat(timespec="seconds")}  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)


def unlock(run_dir: str | os.PathLike, refused: bool = False) -> None:
    """Release this process's lock on ``run_dir`` (the run ended). ``refused``: the launch
    was refused before it trained, so a lock file it created is removed again (the dir as
    it found it)."""
    held = _held.pop(str(Path(run_dir).resolve()), None)
    if held is None:
        return
    fd, created = held
    if refused and created:
        with contextlib.suppress(OSError):
            (Path(run_dir) / LOCK).unlink()
    os.close(fd)  # closing the descriptor releases the flock


def unlock_all() -> None:
    """Release every lock this process holds, removing the lock files it created (a launch
    that ended on a config error leaves nothing behind)."""
    for key in list(_held):
        unlock(key, refused=True)


def sweep_temporaries(run_dir: str | os.PathLike) -> str | None:
    """Remove what writers killed mid-write left in ``checkpoints/`` and ``snapshots/``
    (``.NAME.tmp-PID`` files of ``stabilize.io``, ``NAME.tmp`` / ``NAME.old`` directories
    of a sharded save); a line naming them, or None. Only rank 0 calls this, holding the
    run dir's lock, once the launch is accepted: no other launch can be writing them."""
    if _rank() != 0:
        return None
    gone = []
    for sub in ("checkpoints", "snapshots"):
        d = Path(run_dir) / sub
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            n = p.name
            if (n.startswith(".") and ".tmp-" in n) or n.endswith((".tmp", ".old")):
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(f"{sub}/{n}")
    if not gone:
        return None
    return f"removed {len(gone)} temporaries a killed writer left: {', '.join(gone)}"


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return any((Path(run_dir) / "checkpoints").glob("*.ckpt"))


def elastic_resume(resume: str, run_dir: str | os.PathLike) -> tuple[str, str | None]:
    """What a group restarted by torchrun (``--max-restarts``, TORCHELASTIC_RESTART_COUNT
    > 0) resumes with, whatever the command line said: the newest intact checkpoint
    (``auto``) when the run dir has one, else the first attempt's start again (``restart``,
    which moves its files aside; a ``resume=PATH`` starts from that file again). Returns
    the resume value and a line saying so (None outside a restart). Every rank decides the
    same: nothing is written between the ranks' starts."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts == 0:
        return resume, None
    if has_checkpoint(run_dir):
        chosen, why = "auto", "from the newest intact checkpoint"
    elif resume in ("none", "auto", "restart"):
        chosen, why = "restart", "no checkpoint yet: from step 0, the attempt's files moved aside"
    else:
        chosen, why = resume, "no checkpoint yet: from the file it started from"
    return chosen, f"elastic restart {restarts} (torchrun --max-restarts): resume={chosen}, {why}"


# What shows a run trained (so its checkpoints were written, or should have been)
TRAINED = ("result.json", "events.jsonl", "csv", "checkpoints", "snapshots")


def claim(run_dir: str | os.PathLike, resume: str) -> str | None:
    """Take ``run_dir`` for this launch, before anything is written; rank 0 only acts.

    First the dir's lock (``lock``: a second launch into a running dir is refused). Then
    ``resume=none`` in a dir holding a run: ``RunDirError`` (one line naming the dir and the
    ways on). ``resume=restart``: the earlier run's files are moved into
    ``replaced-<time>/`` inside the dir (nothing is deleted); returns a line saying so.
    """
    if _rank() != 0:
        return None
    lock(run_dir)
    d = Path(run_dir)
    if resume == "auto" and not has_checkpoint(d):
        trained = [n for n in TRAINED if (d / n).exists()]
        if trained:  # its checkpoints were deleted, or it died before its first one
            unlock(run_dir, refused=True)
            raise RunDirError(
                f"resume=auto: run dir {d} holds a run ({', '.join(trained)}) but no "
                f"checkpoint in {d / 'checkpoints'}; nothing to resume from: to start over "
                f"(its files moved aside): resume=restart; or resume=PATH to a checkpoint"
            )
    found = run_files(run_dir) if resume in ("none", "restart") else []
    if not found:
        return None
    if resume == "none":
        unlock(run_dir, refused=True)  # the dir as it was
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


def checkpoint_steps(path: str | os.PathLike, trusted: bool = False) -> tuple[int, int]:
    """(model step, Lightning global step) stored in a checkpoint, without reading its
    tensors (memory-mapped). ``ValueError`` naming the file when it is not one of ours;
    ``UntrustedFile`` when it would need pickle's full power to load."""
    from stabilize.trust import UntrustedFile, check_dcp_index, torch_load  # torch: only here

    try:
        if Path(path).is_dir():  # sharded (DCP): its index, then the non-tensor part
            check_dcp_index(path, trusted)
            path = Path(path) / "meta.pt"
        ckpt = torch_load(path, trusted, map_location="cpu", mmap=True)
        return int(ckpt["stabilize"]["model_step"]), int(ckpt.get("global_step", 0))
    except UntrustedFile as e:
        raise ValueError(f"resume: {e}") from None
    except Exception as e:
        raise ValueError(
            f"resume: {path} is not a stabilize checkpoint ({type(e).__name__}: {e}); "
            f"allowed: a .ckpt written by stabilize-train"
        ) from None


# What a run's ending writes after its last step (lit/runner.py): result.json "done" comes
# last, and its "ending" names the files this ending wrote (no final_eval.json when nothing is
# held out)
ENDING_FILES = ("replicas.json", "final_eval.json")


class AtTheEnd(NamedTuple):
    finished: bool  # True: nothing left to do; False: the ending is left to run
    line: str


def _result(run_dir: str | os.PathLike) -> dict:
    with contextlib.suppress(OSError, ValueError):
        result = json.loads((Path(run_dir) / "result.json").read_text())
        if isinstance(result, dict):
            return result
    return {}


def ending_missing(run_dir: str | os.PathLike, model_step: int) -> list[str]:
    """What the run's ending has left to write at ``model_step``: nothing when result.json
    says "done" at that step and every file it names in ``ending`` is there; else result.json
    "done" and the ending's files that are missing. A "done" at another step is an earlier
    launch's (one that stopped at a lower ``trainer.max_steps``): it proves nothing now."""
    d = Path(run_dir)
    result = _result(d)
    done = result.get("status") == "done" and result.get("model_step") == model_step
    wrote = result.get("ending", ()) if done else ENDING_FILES
    missing = [] if done else ['result.json "done"']
    return missing + [f for f in wrote if not (d / f).is_file()]


def at_the_end(
    run_dir: str | os.PathLike,
    ckpt: str | os.PathLike,
    max_steps: int,
    stop_at: int | None,
    trusted: bool = False,
) -> AtTheEnd | None:
    """None when the checkpoint's model step is short of the step this launch would stop at
    (``trainer.max_steps``, or ``trainer.stop_at_step``): training is left to do. At that
    step, the run is finished only when its ending is whole (``ending_missing``): then one
    line saying so, and nothing to do (training on would take one more step than asked: the
    stop is checked after a step). Its ending missing (a preemption on the last step, a rank
    lost in the final save, a kill in the final eval): one line saying what is missing, and
    the launch runs the ending alone from the checkpoint, without a training step."""
    model_step, _ = checkpoint_steps(ckpt, trusted)
    target, key = max_steps, "trainer.max_steps"
    if stop_at is not None and stop_at < max_steps:
        target, key = stop_at, "trainer.stop_at_step"
    if model_step < target:
        return None
    status = _result(run_dir).get("status", "unknown (no result.json)")
    missing = ending_missing(run_dir, model_step)
    if not missing:
        return AtTheEnd(True, (
            f"run dir {run_dir} is finished (status {status}): {ckpt} is at model step "
            f"{model_step} and {key}={target}; nothing to train (raise {key} to train on)"
        ))  # fmt: skip
    return AtTheEnd(False, (
        f"run dir {run_dir} stopped at model step {model_step} ({key}={target}) before its "
        f"ending was whole (status {status}; missing: {', '.join(missing)}): running the "
        f"ending alone from {ckpt} (replicas check, final eval, result.json), no training step"
    ))  # fmt: skip
