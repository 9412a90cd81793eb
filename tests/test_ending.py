"""A run's ending (after its last step: the replicas check, the final save, the final eval,
result.json "done") survives an interruption, with real signals to real processes: a resume
whose checkpoint is at the stop step runs the ending alone, without a training step, instead
of calling the run finished; a rank frozen in the ending is named by the watchdog within its
timeout (exit 5); a rank killed there is one line from the surviving rank, and torchrun's
restart finishes the ending."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import sys
import time

import lightning as L
import pytest
from test_preempt import _start

from stabilize.exits import EXIT_HUNG
from stabilize.lit.preempt import Preempted
from stabilize.run.rundir import checkpoint_steps
from stabilize.train import run

from conftest import FAST, ROOT, compose_run, launch_sh, train_cli

STEPS = 5
ARGS = [
    *[a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.checkpoint_every"))],
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every_n_steps=4",  # the last step's save is the end of training's
    "rollback.durable_every=0",
    "trainer.final_eval_batches=1",
]
TIMEOUT = 4  # trainer.hang_timeout_s


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(d, name) -> dict:
    return json.loads((d / name).read_text())


def _assert_ended(d, world: int) -> dict:
    """The ending is whole: result.json done at the last step, naming the files it wrote,
    and those files, every rank holding the same weights."""
    result = _read(d, "result.json")
    assert result["status"] == "done" and result["model_step"] == STEPS, result
    assert result["ending"] == ["replicas.json", "final_eval.json"]
    replicas = _read(d, "replicas.json")
    assert replicas["world_size"] == world and replicas["identical"] is True
    assert [r["model_step"] for r in replicas["ranks"]] == [STEPS] * world
    assert _read(d, "final_eval.json")["model_step"] == STEPS
    return replicas


class SignalAt(L.Callback):
    """A real signal to this process as the batch of model step ``step`` begins: the signal
    lands inside that step, so the run stops after it (lit/preempt.py)."""

    def __init__(self, step: int, sig: signal.Signals):
        self.step, self.sig = step, sig

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.train_state.model_step == self.step - 1:
            os.kill(os.getpid(), self.sig)


def test_a_sigterm_on_the_last_step_then_a_resume_runs_the_ending_alone(
    tmp_path, monkeypatch, capsys
):
    d, twin = tmp_path / "cut", tmp_path / "twin"
    with pytest.raises(Preempted):
        run(compose_run(d, ARGS), callbacks=[SignalAt(STEPS, signal.SIGTERM)])
    assert _read(d, "result.json")["status"] == "preempted"
    last = d / "checkpoints" / "last.ckpt"
    assert checkpoint_steps(last) == (STEPS, STEPS)
    assert not (d / "final_eval.json").exists() and not (d / "replicas.json").exists()
    before = _sha(last)
    env = {"STABILIZE_RUN_DIR": str(d)}
    r = train_cli([*ARGS, "resume=auto"], tmp_path, monkeypatch, capsys, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"stopped at model step {STEPS} (trainer.max_steps={STEPS}) before its ending was "
        'whole (status preempted; missing: result.json "done", replicas.json, '
        "final_eval.json): running the ending alone from"
    ) in r.stdout, r.stdout
    assert f"its ending alone, from {last}" in r.stdout
    assert f"done: {STEPS} steps ({STEPS} asked), final/val_bpb " in r.stdout
    assert "nothing to train" not in r.stdout and "Traceback" not in r.stderr
    replicas = _assert_ended(d, world=1)
    assert _read(d, "result.json")["global_step"] == STEPS  # no training step...
    assert _sha(last) == before  # ... and no save of the state it resumed from
    # the ending is the one an uninterrupted run has: the same weights, the same score
    run(compose_run(twin, ARGS))
    assert _read(twin, "replicas.json")["ranks"] == replicas["ranks"]
    assert _read(twin, "final_eval.json")["loss"] == _read(d, "final_eval.json")["loss"]
    # now the run is finished: nothing to do
    r = train_cli([*ARGS, "resume=auto"], tmp_path, monkeypatch, capsys, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"is finished (status done): {last} is at model step {STEPS}" in r.stdout
    assert "nothing to train" in r.stdout


def _launch_worker(d, cwd, monkeypatch, stop_signal: str, *args: str, restarts: int = 0):
    """tests/ending_worker.py under torchrun through stabilize.launch (as scripts/launch.sh
    runs stabilize-train, one thread a rank): rank 1 stops itself with ``stop_signal`` in
    the final save."""
    worker = str(ROOT / "tests" / "ending_worker.py")
    cmd = [sys.executable, "-m", "stabilize.launch", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), worker, *args]  # fmt: skip
    env = {"STOP_RANK": "1", "STOP_SIGNAL": stop_signal, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # _start passes this process's environment on
    return _start(cmd, d, cwd)


def _frozen(tmp_path, monkeypatch):
    """Rank 1 SIGSTOPs itself in the final save: the watchdog has the ending in its watch,
    so the frozen rank is named within about one timeout (not ten, a save's allowance for a
    rank that works), exit 5; rank 0 wrote the last step's checkpoint before it waited."""
    d = tmp_path / "frozen"
    args = [*ARGS, f"trainer.hang_timeout_s={TIMEOUT}"]
    p = _launch_worker(d, tmp_path, monkeypatch, "SIGSTOP", *args)
    out, _ = p.communicate(timeout=300)
    ended = time.time()
    assert p.returncode == EXIT_HUNG, out[-3000:]
    stop = ast.literal_eval((d / "stopped.txt").read_text())
    assert f"watchdog: rank 1 (pid {stop['pid']} on " in out, out[-3000:]
    assert f"last at step {STEPS} (final_save), its process not running" in out, out[-3000:]
    assert f"(timeout {TIMEOUT} s)" in out and "launch: hung (exit 5" in out
    assert ended - stop["t"] < TIMEOUT + 10, ended - stop["t"]  # a save's 10x would be 40 s
    result = _read(d, "result.json")
    assert result["status"] == "hung" and result["hung"][0]["phase"] == "final_save"
    with pytest.raises(ProcessLookupError):  # SIGKILLed by rank 0: it could not act itself
        os.kill(stop["pid"], 0)
    assert checkpoint_steps(d / "checkpoints" / "last.ckpt")[0] == STEPS
    return d


def test_a_rank_frozen_in_the_final_save_is_named_within_the_timeout(tmp_path, monkeypatch):
    _frozen(tmp_path, monkeypatch)


# slow (~45 s on 2 cores): two torchrun launches; the frozen rank's naming stays in the
# default suite (above), the ending run alone on a resume too (one process, first test)
@pytest.mark.slow
def test_after_a_rank_frozen_in_the_final_save_a_resume_finishes_the_ending(tmp_path, monkeypatch):
    d = _frozen(tmp_path, monkeypatch)
    r = launch_sh(d, *ARGS, "resume=auto", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "before its ending was whole (status hung;" in r.stdout, r.stdout[-3000:]
    _assert_ended(d, world=2)


# slow (~45 s on 2 cores): torchrun's restart after a kill; the frozen rank and the resume
# that finishes the ending stay in the default suite (above)
@pytest.mark.slow
def test_a_rank_killed_in_the_final_save_is_one_line_and_the_restart_finishes(
    tmp_path, monkeypatch
):
    """SIGKILL in the final save: the surviving rank's broken collective is one line (not
    gloo's traceback), torchrun restarts the group, and the restart, at the last step's
    checkpoint, runs the ending alone."""
    d = tmp_path / "killed"
    p = _launch_worker(d, tmp_path, monkeypatch, "SIGKILL", *ARGS, restarts=1)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    # gloo's words depend on where rank 0 was when the socket closed: "closed" or "reset"
    said = [ln for ln in out.splitlines() if "stabilize-train: rank 0: rank 1 died (gloo: " in ln]
    assert len(said) == 1, out[-3000:]
    assert said[0].endswith("by peer); torchrun restarts the group (restart 1 of 1)"), said
    assert "Traceback" not in out and "pair.cc" not in out, out[-3000:]
    assert "elastic restart 1 (torchrun --max-restarts): resume=auto" in out
    assert "before its ending was whole (status failed;" in out, out[-3000:]
    _assert_ended(d, world=2)
