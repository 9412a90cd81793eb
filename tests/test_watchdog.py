"""A hung rank, for real: SIGSTOP one of 2 torchrun ranks (gloo, CPU). The other names it
(pid, host, last step) within the timeout, dumps its own stacks, writes result.json
``hung``, and the launch exits 5, instead of waiting out the 30-minute collective timeout
in silence."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import lightning as L
from test_preempt import COMMON, _start

from stabilize.exits import EXIT_HUNG
from stabilize.lit.watchdog import beat_path
from stabilize.train import run

from conftest import FAST, ROOT, compose_run

TIMEOUT = 4  # trainer.hang_timeout_s: seconds without progress


def _beat_at(run_dir, rank: int, step: int, deadline: float) -> dict:
    """The rank's heartbeat once it reports global step >= ``step``."""
    while time.time() < deadline:
        try:
            beat = json.loads(beat_path(run_dir, rank).read_text())
            if beat["mark"][3] >= step:
                return beat
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} reported no step {step}")


def test_a_stopped_rank_is_named_within_the_timeout_and_the_launch_exits_5(tmp_path):
    d = tmp_path / "hang"
    args = [*COMMON, f"trainer.hang_timeout_s={TIMEOUT}"]
    p = _start(["bash", str(ROOT / "scripts" / "launch.sh"), "--nproc-per-node", "2", *args],
               d, tmp_path)  # fmt: skip
    lines, stopped_at, victim, last = [], None, None, None
    deadline = time.time() + 300
    for line in p.stdout:
        lines.append(line)
        if stopped_at is None and line.lstrip().startswith("step "):
            beat = _beat_at(d, 1, 3, deadline)
            victim, last = beat["pid"], beat["mark"][3]
            os.kill(victim, signal.SIGSTOP)  # frozen: it can neither step nor answer
            stopped_at = time.time()
        if time.time() > deadline:
            p.kill()
            break
    p.wait(timeout=120)
    took = time.time() - stopped_at
    text = "".join(lines)
    assert p.returncode == EXIT_HUNG, text[-3000:]
    assert f"watchdog: rank 1 (pid {victim} on " in text, text[-3000:]
    assert "its process not running (stopped or frozen)" in text
    assert "launch: hung (exit 5" in text and "Traceback" not in text
    # named well before torchrun's own 30 s SIGTERM-to-SIGKILL wait, let alone pg timeout
    assert took < TIMEOUT + 20, took
    result = json.loads((d / "result.json").read_text())
    assert result["status"] == "hung" and [h["rank"] for h in result["hung"]] == [1]
    assert result["hung"][0]["pid"] == victim and result["hung"][0]["last_step"] >= last
    stacks = (d / "ranks" / "rank-0.stacks.txt").read_text()
    assert "Thread" in stacks and "File " in stacks  # rank 0's own threads, where they wait
    try:  # the frozen rank is gone (SIGKILLed by rank 0: it could not act on a signal)
        os.kill(victim, 0)
        gone = False
    except ProcessLookupError:
        gone = True
    assert gone


def test_a_straggler_is_named_once_every_rank_has_its_figure():
    """By hand: own time 0.10 and 0.15 s a step over 20 steps, median 0.125 s: rank 1 is
    1.2x the median rank, rank 0 0.8x; nothing is said before 20 steps or when even."""
    from stabilize.lit.watchdog import straggler_line

    beats = {0: {"own_s": 2.0, "steps": 20}, 1: {"own_s": 3.0, "steps": 20}}
    line = straggler_line(beats)
    assert line.startswith("[watchdog] straggler: rank 1 150.0 ms (1.20x)") and "rank 0" not in line
    assert "median rank's 125.0 ms" in line
    assert straggler_line({0: {"own_s": 2.0, "steps": 20}, 1: {"own_s": 3.0, "steps": 19}}) is None
    assert straggler_line({0: {"own_s": 2.0, "steps": 20}, 1: {"own_s": 2.2, "steps": 20}}) is None


class _SleepAt(L.Callback):
    """A step that stalls: the main thread sleeps past the timeout at one batch end."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        if pl_module.train_state.model_step == self.step:
            time.sleep(self.seconds)


def test_one_process_that_stalls_gets_its_stacks_dumped_and_goes_on(tmp_path, caplog):
    """Nothing else waits on a lone process (it may sit at a breakpoint): a stall past the
    timeout dumps its stacks and logs one line, and the run finishes."""
    d = tmp_path / "alone"
    cfg = compose_run(d, [*FAST, "logger=none", "trainer.max_steps=6", "trainer.hang_timeout_s=1"])
    with caplog.at_level(logging.WARNING, logger="stabilize.lit.watchdog"):
        out = run(cfg, callbacks=[_SleepAt(3, 3.0)])
    assert (
        out["model_step"] == 6 and json.loads((d / "result.json").read_text())["status"] == "done"
    )
    said = [r.message for r in caplog.records if "[watchdog] no progress" in r.message]
    assert len(said) == 1 and "one process: not aborting" in said[0], said
    stacks = (d / "ranks" / "rank-0.stacks.txt").read_text()
    assert "test_watchdog.py" in stacks and "on_train_batch_end" in stacks  # where it slept


def test_the_c_level_dump_is_armed_once_for_many_fast_steps_and_still_fires(tmp_path):
    """Arming faulthandler's timer starts a C thread (~0.6 ms): a step end re-arms it only
    once less than one limit (10 timeouts) of its cover is left. A stall still gets its
    stacks dumped, no sooner than the limit and no later than 1.5x it."""
    import faulthandler

    from stabilize.lit.watchdog import SLOW_FACTOR, Watchdog

    w = Watchdog(tmp_path, timeout_s=0.05)  # limit: 0.5 s
    limit = 0.05 * SLOW_FACTOR
    path = tmp_path / "stacks.txt"
    w._stacks = open(path, "w")  # noqa: SIM115  (as on_train_start opens it)
    try:
        t0 = time.monotonic()
        w._rearm()
        armed = w._dump_at
        assert t0 + 1.5 * limit <= armed <= time.monotonic() + 1.5 * limit
        for _ in range(200):  # fast steps: the timer keeps its cover, nobody re-arms it
            w._rearm()
        assert w._dump_at == armed
        time.sleep(max(0.0, t0 + 0.9 * limit - time.monotonic()))
        assert path.stat().st_size == 0  # not before the limit
        time.sleep(max(0.0, armed + 0.7 - time.monotonic()))
        assert "File " in path.read_text()  # the stall's stacks, by the C-level timer
    finally:
        faulthandler.cancel_dump_traceback_later()
        w._stacks.close()
