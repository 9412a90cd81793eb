"""torchrun whose exit code says what happened: ``python -m stabilize.launch [torchrun args]``.

torchrun exits 1 with a ChildFailedError traceback whatever its ranks exited with, so a
stability abort (3) and a config error (2) looked like any crash. This
runs torchrun's own ``main`` and, when a rank fails, exits with the code that says why
(``stabilize/exits.py``), printing one line instead of the traceback:

- the first failure (torchrun's root cause) if it is 2 or 3, else any rank's 3 or 2 (the
  other ranks are stopped by torchrun, with a signal);
- otherwise the first failure's own exit code (1 for a rank killed by a signal).

scripts/launch.sh runs this; everything else about torchrun is unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from stabilize.exits import (
    EXIT_ABORT,
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_HUNG,
    EXIT_PREEMPTED,
    meaning,
)

KEPT = (EXIT_CONFIG, EXIT_ABORT, EXIT_PREEMPTED, EXIT_HUNG)  # passed on as they are


def exit_code(codes: list[int]) -> int:
    """The launch's exit code from its failed ranks' codes, the root cause first."""
    if codes and codes[0] in KEPT:
        return codes[0]
    for known in (EXIT_HUNG, EXIT_ABORT, EXIT_CONFIG, EXIT_PREEMPTED):
        if known in codes:
            return known
    return codes[0] if codes and codes[0] > 0 else EXIT_CRASH


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:  # torchrun itself was signalled (a preemption): it has
        # forwarded the signal to the workers and waited for them (~30 s, then SIGKILL)
        code = EXIT_PREEMPTED if _preempted() else 128 + int(e.sigval)
        why = "checkpointed at the signal" if code == EXIT_PREEMPTED else "no checkpoint"
        print(f"launch: {meaning(code)} by {e.sigval.name} (exit {code}; {why})",
              file=sys.stderr, flush=True)  # fmt: skip
        return code
    except ChildFailedError as e:
        root_rank, root = e.get_first_failure()
        others = sorted((r, f.exitcode) for r, f in e.failures.items() if r != root_rank)
        codes = [root.exitcode] + [c for _, c in others]
        code = exit_code(codes)
        ranks = ", ".join(f"rank {r}: {c}" for r, c in [(root_rank, root.exitcode), *others])
        print(f"launch: {meaning(code)} (exit {code}; {ranks})", file=sys.stderr, flush=True)
        if code == EXIT_CONFIG:
            _discard_stopped_ranks()
        return code
    return 0


def _discard_stopped_ranks() -> None:
    """A config error writes nothing: each rank removes what Hydra made for it before the
    app ran, but a rank torchrun stopped (with a signal, after rank 0 failed) may not have
    got there. In a run dir that holds no run (no ``config.json``), its Hydra records
    (``.hydra*``), log files and lock file go, then the dir if it is empty."""
    run_dir = os.environ.get("STABILIZE_RUN_DIR")
    d = Path(run_dir) if run_dir else None
    if d is None or not d.is_dir() or (d / "config.json").exists():
        return
    for p in d.iterdir():
        if p.name.startswith(".hydra") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and (p.suffix == ".log" or p.name == ".lock"):
            p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        d.rmdir()  # only an empty dir


def _preempted() -> bool:
    """Did the workers stop on the signal after a checkpoint? Their ``result.json`` says
    (``$STABILIZE_RUN_DIR``, the run dir every rank shares under launch.sh)."""
    run_dir = os.environ.get("STABILIZE_RUN_DIR")
    try:
        result = json.loads((Path(run_dir) / "result.json").read_text()) if run_dir else {}
    except (OSError, ValueError):
        return False
    return result.get("status") == "preempted"


if __name__ == "__main__":
    sys.exit(main())
