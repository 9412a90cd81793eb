"""Hung ranks: named within a timeout, their stacks dumped, the launch ended with exit 5.

A rank that stops (a deadlock, a stuck kernel, a frozen or SIGSTOPped process) leaves the
others blocked in their next collective until torch.distributed's timeout (30 min by
default) says only that a collective timed out. Here every rank's progress is visible to
the others, through the run dir every rank shares:

- the main thread marks where it is (step, phase: batch start, backward, batch end,
  validation, checkpoint save): attribute writes, no I/O in the step;
- a daemon thread writes ``ranks/rank-N.json`` every poll (its own ``alive`` counter, the
  latest mark, the pid and host) and reads the others' files;
- ``faulthandler.dump_traceback_later`` is kept armed from the batch ends: when the main
  thread makes no progress for 10 to 15 timeouts, the C-level timer dumps every thread's
  stack into ``ranks/rank-N.stacks.txt``, even if the thread holds the GIL (it is re-armed
  only once less than 10 timeouts of its cover are left: each arming starts a C thread,
  ~0.6 ms, 1 point of a tiny model's step if done every step).

With one process the watchdog only dumps the stacks and logs one line per stall (nothing
else waits on it: it may be a breakpoint). With more, when a rank's own progress has not
moved for the timeout (``trainer.hang_timeout_s``; by default ``max(60 s, 5 x the median
step)``, ten times that while a rank saves, validates or is in the run's ending), it names
the culprits from the others' files: ranks
whose thread is silent too (the process is stopped or frozen), else the ranks behind the
rest, else every rank (all stopped at one point: a collective that not all ranks entered).
A silent rank is named after one timeout in any phase: a rank busy in a long save keeps
its thread beating, a frozen one does not, so the long allowance never waits on it. The
lowest rank that is not a culprit prints one line, writes ``result.json`` (status ``hung``,
the culprits with their last step), SIGKILLs culprits on its host whose thread is silent
(torchrun would wait 30 s more for them) and exits 5 (``stabilize/exits.py``); the others
exit 5 after it.

The ending is watched too (the ranks still meet in collectives there: the straggler shares,
the replicas check, a final save, the final eval, the fault's outcome): phases ``ending``
(the end-of-training callbacks), ``final_save``, ``final_eval`` (lit/runner.py, a tick per
batch), until the runner marks ``done`` after the last collective. torch.distributed's own
timeout (``trainer.pg_timeout_s``) stays the backstop before the first step.

The same files give the straggler figures: each rank's own time per step (waiting for its
batch plus its forward, where no collective runs under DDP) as a share of the median rank's,
in result.json's ``ranks`` and the final summary.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch

from stabilize.exits import EXIT_HUNG
from stabilize.io import atomic_write_text
from stabilize.run.summary import straggler_line

log = logging.getLogger(__name__)
RANKS_DIR = "ranks"
MIN_TIMEOUT_S = 60.0
STEP_FACTOR = 5.0
ENDING = ("ending", "final_save", "final_eval")  # after the last step, in this order
SLOW_PHASES = ("save", "validation", *ENDING)  # a rank here gets SLOW_FACTOR timeouts
SLOW_FACTOR = 10.0
PHASES = ("start", "backward", "end", "validation", "save", *ENDING, "done")


def beat_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank-{rank}.json"


def _write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj))


class Watchdog(L.Callback):
    def __init__(self, run_dir: str | os.PathLike, timeout_s: float | None):
        self.run_dir = Path(run_dir)
        self.configured = timeout_s  # None: auto; 0 is never built (build())
        self.rank, self.world = 0, 1
        # (training batches begun, phase index, phase, global step): every rank goes through
        # the same batches in lockstep, so the first two order any two ranks' progress
        # ..., and a tick per mark: any new mark is progress (a long validation's batches too)
        self.mark = (0, 0, "start", 0, 0)
        self.batches = self.ticks = 0
        self.model_step = 0
        self.steps: deque[float] = deque(maxlen=64)  # recent step times, seconds
        self.own_s, self.own_steps = 0.0, 0
        self._t_start = self._t_end = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the beat file: written by both threads
        self._alive, self._written, self._poll = 0, 0.0, 0.2
        self._thread: threading.Thread | None = None
        self._ending = False  # past the last step: the ending's phases
        self._stacks = None
        self._dump_at = -math.inf  # when the armed C-level dump would fire (monotonic)
        self.shares: list[dict[str, Any]] | None = None  # per rank, at the end of training
        self._straggler_said = False

    # --- the main thread: marks -------------------------------------------------------
    def _set(self, trainer, phase: str) -> None:
        step = self.mark[3] if trainer is None else trainer.global_step
        self.ticks += 1
        self.mark = (self.batches, PHASES.index(phase), phase, step, self.ticks)

    def _rearm(self) -> None:
        """The C-level timer: a dump if the main thread stalls for ``SLOW_FACTOR`` timeouts,
        at most 1.5 times that: armed for 1.5x, and again only when less than 1x is left."""
        if self._stacks is None:
            return
        now, limit = time.monotonic(), self.timeout() * SLOW_FACTOR
        if self._dump_at - now < limit:
            faulthandler.dump_traceback_later(1.5 * limit, file=self._stacks)
            self._dump_at = now + 1.5 * limit

    def _enter(self, trainer, phase: str) -> None:
        """A save or a phase of the ending: its beat now, not at the next poll (a rank
        frozen there is named with the phase it froze in)."""
        self._set(trainer, phase)
        if self._thread is not None:
            self._write_beat()
        self._rearm()

    def on_train_start(self, trainer, pl_module):
        self.rank, self.world = trainer.global_rank, trainer.world_size
        (self.run_dir / RANKS_DIR).mkdir(parents=True, exist_ok=True)
        self._stacks = open(self.run_dir / RANKS_DIR / f"rank-{self.rank}.stacks.txt", "a")  # noqa: SIM115
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="stabilize-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._t_end is not None:
            self.own_s += now - self._t_end  # waiting for this batch
        self._t_start = now
        self.batches += 1
        self._set(trainer, "start")

    def on_before_backward(self, trainer, pl_module, loss):
        if self._t_start is not None:
            self.own_s += time.perf_counter() - self._t_start  # the forward
        self._set(trainer, "backward")

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        now = time.perf_counter()
        if self._t_start is not None:
            self.steps.append(now - self._t_start)
            self.own_steps += 1
        self._t_end = now
        self.model_step = pl_module.train_state.model_step
        self._set(trainer, "end")
        if now - self._written > self._poll:  # the file keeps up with fast steps too
            self._write_beat()
        self._rearm()

    def on_validation_batch_end(self, trainer, *args, **kwargs):
        if self._thread is not None:  # in fit, not the final held-out score
            self._set(trainer, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._enter(trainer, "final_save" if self._ending else "save")

    def on_train_end(self, trainer, pl_module):
        # the end-of-training callbacks after this one still meet the other ranks
        self._ending = True
        self.model_step = pl_module.train_state.model_step
        self._enter(trainer, "ending")
        self.shares = self._gather_shares(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self.close()

    # --- the runner's ending, after fit -----------------------------------------------
    def phase(self, name: str) -> None:
        """Mark one of the ending's phases (``final_eval``)."""
        self._enter(None, name)

    def tick(self) -> None:
        """Progress inside a phase (a final-eval batch): the watch sees the rank moving."""
        self._set(None, self.mark[2])

    def finish(self) -> None:
        """After the run's last collective: no rank waits on another any more."""
        self._set(None, "done")
        self.close()

    def close(self) -> None:
        if self._thread is None and self._stacks is None:
            return  # never started, or closed already
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
        self._dump_at = -math.inf
        self._alive = -1
        self._write_beat()
        if self._stacks is not None:
            self._stacks.close()
            p = Path(self._stacks.name)
            if p.exists() and p.stat().st_size == 0:
                p.unlink()  # no hang, no dump: no file
            self._stacks = None

    def timeout(self) -> float:
        if self.configured is not None:
            return float(self.configured)
        median = statistics.median(self.steps) if self.steps else 0.0
        return max(MIN_TIMEOUT_S, STEP_FACTOR * median)

    # --- straggler shares -------------------------------------------------------------
    def _gather_shares(self, trainer) -> list[dict[str, Any]] | None:
        mine = torch.tensor([self.own_s, float(self.own_steps)], dtype=torch.float64)
        if self.world > 1:
            mine = mine.to(trainer.strategy.root_device)
            rows = trainer.strategy.all_gather(mine).reshape(-1, 2).cpu().tolist()
        else:
            rows = [mine.tolist()]
        if not any(n for _, n in rows):  # a launch that ran only the ending: no figure
            return None
        per_step = [s / max(n, 1.0) for s, n in rows]
        median = statistics.median(per_step) or 1.0
        return [
            {"rank": r, "own_ms_per_step": 1e3 * t, "share": t / median, "steps": int(n)}
            for r, (t, (_, n)) in enumerate(zip(per_step, rows, strict=True))
        ]

    # --- the watchdog thread -------------------------------------------------------------
    def _write_beat(self) -> None:
        beat = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "alive": self._alive, "mark": list(self.mark), "model_step": self.model_step,
                "timeout_s": self.timeout(), "own_s": self.own_s,
                "steps": self.own_steps}  # fmt: skip
        # a full disk must not end the run from here; the next beat retries
        with self._lock, contextlib.suppress(OSError):
            _write_json(beat_path(self.run_dir, self.rank), beat)
            self._written = time.perf_counter()

    def _read_beats(self) -> dict[int, dict]:
        beats = {}
        for r in range(self.world):
            try:
                beats[r] = json.loads(beat_path(self.run_dir, r).read_text())
            except (OSError, ValueError):
                continue
        return beats

    def _watch(self) -> None:
        said = None  # one process: the stall last reported (when its progress last moved)
        seen: dict[int, tuple[Any, float]] = {}  # rank -> (alive counter, when it moved)
        moved: dict[int, tuple[Any, float]] = {}  # rank -> (mark, when it moved)
        while not self._stop.is_set():
            self._alive += 1
            self._write_beat()
            now = time.monotonic()
            beats = self._read_beats()
            beats[self.rank] = {**beats.get(self.rank, {}), "mark": list(self.mark)}
            if self.rank == 0 and not self._straggler_said:
                line = straggler_line(beats)
                if line:  # once a run: the summary has the final shares
                    log.warning(line)
                    self._straggler_said = True
            for r, b in beats.items():
                if seen.get(r, (None,))[0] != b.get("alive"):
                    seen[r] = (b.get("alive"), now)
                if moved.get(r, (None,))[0] != b.get("mark"):
                    moved[r] = (b.get("mark"), now)
            base = limit = self.timeout()
            phases = {b["mark"][2] for b in beats.values() if len(b.get("mark", [])) >= 4}
            slow = bool(phases & set(SLOW_PHASES))
            if slow:
                limit *= SLOW_FACTOR
            if "done" in phases:  # a rank is past the last collective: nothing waits now
                self._stop.wait(1.0)
                continue
            stalled = now - moved[self.rank][1]
            # before the first step (start-up, loading) the pg timeout is the backstop
            watched = self.own_steps or self._ending
            # silent: its thread too (stopped, frozen); a full timeout where a long save or
            # eval may hold the interpreter for a while
            quiet = base if slow else base / 2
            silent = [r for r in beats if r != self.rank and now - seen[r][1] > quiet]
            if watched and stalled > limit and self.world == 1:
                if said != moved[self.rank][1]:  # once per stall: nobody else waits on it
                    said = moved[self.rank][1]
                    self._stall_alone(stalled, limit)
            elif watched and (stalled > limit or (silent and stalled > base)):
                self._declare(beats, silent, stalled, limit if stalled > limit else base)
                return
            # from the step's own timeout, not a save's longer allowance: beats stay frequent
            self._poll = min(5.0, max(0.2, self.timeout() / 20))
            self._stop.wait(self._poll)

    def _stall_alone(self, stalled: float, limit: float) -> None:
        """One process with no progress: its stacks and one line, and the run goes on (no
        other rank waits on it; it may be a debugger's breakpoint or a slow step)."""
        faulthandler.dump_traceback(file=self._stacks or sys.stderr, all_threads=True)
        step, phase = self.mark[3], self.mark[2]
        log.warning(
            f"[watchdog] no progress for {stalled:.0f} s (timeout {limit:.0f} s), last at step "
            f"{step} ({phase}); stacks in {self.run_dir / RANKS_DIR}/; one process: not aborting"
        )

    def _declare(self, beats, silent: list[int], stalled: float, limit: float) -> None:
        marks = {r: tuple(b["mark"][:2]) for r, b in beats.items() if len(b.get("mark", [])) >= 4}
        if silent:
            culprits = silent
        elif len(set(marks.values())) > 1:
            culprits = [r for r, m in marks.items() if m == min(marks.values())]
        else:
            culprits = sorted(beats)
        healthy = [r for r in sorted(beats) if r not in culprits]
        reporter = healthy[0] if healthy else min(culprits)
        faulthandler.dump_traceback(file=self._stacks or sys.stderr, all_threads=True)
        if self.rank != reporter:
            time.sleep(2.0)  # the reporter writes result.json and goes first
            os._exit(EXIT_HUNG)
        named = [_describe(beats[r], r in silent) for r in culprits]
        line = (
            f"watchdog: {'; '.join(named)}: no progress for {stalled:.0f} s (timeout "
            f"{limit:.0f} s); stacks in {self.run_dir / RANKS_DIR}/; aborting (exit {EXIT_HUNG})"
        )
        print(line, file=sys.stderr, flush=True)
        result = {"status": "hung", "model_step": self.model_step, "global_step": self.mark[3],
                  "error": line, "hung": [{**_brief(beats[r]), "silent": r in silent}
                                          for r in culprits]}  # fmt: skip
        with contextlib.suppress(OSError):
            _write_json(self.run_dir / "result.json", result)
        here = socket.gethostname()
        for r in silent:  # stopped or frozen: it cannot act on a signal torchrun would send
            if beats[r].get("host") == here:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    os.kill(int(beats[r]["pid"]), 9)
        sys.stdout.flush()
        os._exit(EXIT_HUNG)


def _gone(pid: int) -> bool:
    """No such process, or a zombie its parent (torchrun) has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it runs
        return False
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def gone_ranks(run_dir: str | os.PathLike, world: int, me: int) -> list[int]:
    """The other ranks on this host whose process has died, from their beats (pid, host):
    whom a collective that broke mid-way lost. Ranks on other hosts are not known here."""
    here, gone = socket.gethostname(), []
    for r in range(world):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            beat = json.loads(beat_path(run_dir, r).read_text())
            if r != me and beat.get("host") == here and _gone(int(beat["pid"])):
                gone.append(r)
    return gone


def _brief(beat: dict) -> dict:
    _, _, phase, step = (beat.get("mark") or [None] * 4)[:4]
    return {"rank": beat.get("rank"), "pid": beat.get("pid"), "host": beat.get("host"),
            "last_step": step, "phase": phase}  # fmt: skip


def _describe(beat: dict, silent: bool) -> str:
    b = _brief(beat)
    how = ", its process not running (stopped or frozen)" if silent else ""
    return (
        f"rank {b['rank']} (pid {b['pid']} on {b['host']}) last at step {b['last_step']} "
        f"({b['phase']}){how}"
    )


def build(run_dir: str | os.PathLike, timeout_s: float | None) -> Watchdog | None:
    """The callback, or None when ``trainer.hang_timeout_s=0`` (off)."""
    return None if timeout_s == 0 else Watchdog(run_dir, timeout_s)
