"""What the command-line tools' exit codes mean, and errors printed on one line.

Every entry point (``stabilize-train``, ``stabilize-plan``, ``stabilize-report``,
scripts/launch.sh, sweep.sh, repro_nan.sh) uses the same codes, so automation can tell a
run that stopped on purpose from one that crashed:

- 0 ``done``
- 2 ``config error``: a setting, a data file or a resume path was refused before anything
  was written; the one-line message names the key, the value and what is allowed (or the
  file). Settings this machine cannot honour count: ``trainer.accelerator=gpu`` without
  CUDA, online W&B without an API key, a hub dataset not cached while offline
- 3 ``aborted``: a stability abort; the rollback ladder was exhausted (diagnosis.json)
- 4 ``preempted``: a preemption signal (``trainer.preempt_signals``, SIGTERM by default)
  stopped the run after a durable checkpoint at that step; requeue it with ``resume=auto``
- 5 ``hung``: a rank made no progress for ``trainer.hang_timeout_s``; the watchdog named
  it (result.json ``hung``, stacks in ``ranks/``) and ended the launch (lit/watchdog.py)
- anything else: ``crashed`` (a traceback says where; an OS error, such as a full disk at a
  checkpoint write, is one line naming the file instead)
"""

from __future__ import annotations

import io
import os
from types import TracebackType

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_ABORT = 3
EXIT_PREEMPTED = 4
EXIT_HUNG = 5

MEANINGS = {
    EXIT_OK: "done",
    EXIT_CONFIG: "config error",
    EXIT_ABORT: "aborted",
    EXIT_PREEMPTED: "preempted",
    EXIT_HUNG: "hung",
}


def meaning(code: int) -> str:
    """``done`` / ``config error`` / ``aborted`` / ``crashed``, for an exit code."""
    return MEANINGS.get(code, "crashed")


def one_line(text: str) -> str:
    """A multi-line message (Hydra's, OmegaConf's) on one line: its lines joined by "; ",
    and an indented list under a line (Hydra's "Available options in 'norm':") by ", "."""
    pieces: list[str] = []
    items: list[str] = []

    def flush() -> None:
        if items:
            head = pieces.pop() if pieces else ""
            sep = " " if head.endswith(":") else ": " if head else ""
            pieces.append(head + sep + ", ".join(items))
            items.clear()

    for raw in str(text).splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[:1] in (" ", "\t") and pieces:
            items.append(line)
        else:
            flush()
            pieces.append(line)
    flush()
    return "; ".join(p.rstrip(";.") for p in pieces)


def _file_in_traceback(tb: TracebackType | None) -> str | None:
    """The file an OSError was writing or reading when it has no ``filename``: a failed
    ``write()`` or ``flush()`` (a full disk: ENOSPC) does not say which file, but the frame
    that made the call holds it open; the innermost open file object with a name wins."""
    found = None
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                found = value.name
        tb = tb.tb_next
    return found


def file_error(e: OSError) -> str:
    """An OSError as one line that names its file: ``<strerror>: <file>``."""
    name = e.filename or _file_in_traceback(e.__traceback__)
    what = e.strerror or str(e) or type(e).__name__
    if name is None:
        return f"{type(e).__name__}: {what}"
    target = f" -> {os.fsdecode(e.filename2)}" if e.filename2 else ""
    return f"{what}: {os.fsdecode(name)}{target}"
