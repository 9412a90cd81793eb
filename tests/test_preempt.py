"""Preemption with real signals to real processes: SIGTERM (what SLURM and torchrun send
before SIGKILL) makes the run finish its step, write a durable checkpoint there, say
``preempted`` in result.json and exit 4; ``resume=auto`` then goes on exactly, against an
uninterrupted run of the same config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stabilize.exits import EXIT_PREEMPTED
from stabilize.run.rundir import checkpoint_steps
from stabilize.train import run

from conftest import FAST, ROOT, cli, compose_run, csv_losses, launch_sh, train_cli

STEPS = 400  # far more than the test waits for: only the signal ends the run
COMMON = [
    *FAST,
    "logger=none",
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every_n_steps=1000",  # no periodic checkpoint: the signal's only
    "trainer.val_check_interval=1000",
    "rollback.durable_every=0",
    "trainer.final_eval_batches=1",
]


def _start(args, run_dir, cwd):
    env = {**os.environ, "STABILIZE_RUN_DIR": str(run_dir)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHON"] = sys.executable
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a signal to the test's own group would reach it too
    )  # fmt: skip


def _signal_at(p, step: int, sig=signal.SIGTERM, timeout=300) -> list[str]:
    """Read the run's lines until it prints ``step N/`` with N >= step, then signal it;
    returns every line it printed to the end."""
    lines, sent, deadline = [], False, time.time() + timeout
    for line in p.stdout:
        lines.append(line)
        if not sent and line.lstrip().startswith("step ") and "/" in line:
            n = int(line.split()[1].split("/")[0])
            if n >= step:
                p.send_signal(sig)
                sent = True
        if time.time() > deadline:
            p.kill()
            break
    p.wait(timeout=120)
    assert sent, "".join(lines[-20:])
    return lines


def test_sigterm_checkpoints_exits_4_and_resume_goes_on_exactly(tmp_path):
    cut = tmp_path / "cut"
    p = _start(["stabilize-train", *COMMON], cut, tmp_path)
    lines = _signal_at(p, 5)
    text = "".join(lines)
    assert p.returncode == EXIT_PREEMPTED, text[-2000:]
    result = json.loads((cut / "result.json").read_text())
    assert result["status"] == "preempted"
    last = cut / "checkpoints" / "last.ckpt"
    stopped, _ = checkpoint_steps(last)  # the step it finished after the signal
    assert 5 <= stopped < STEPS and result["model_step"] == stopped
    assert f"preempted by SIGTERM at model step {stopped}" in text and "resume=auto" in text
    assert "Traceback" not in text
    # the resume goes on from that step and matches a run that was never interrupted
    end = stopped + 4
    out = run(compose_run(cut, [*COMMON, "resume=auto", f"trainer.stop_at_step={end}"]))
    assert out["resumed_from"] == str(last) and out["model_step"] == end
    full = tmp_path / "full"
    run(compose_run(full, [*COMMON, f"trainer.stop_at_step={end}"]))
    a = csv_losses(max((full / "csv").iterdir()))
    b = csv_losses(max((cut / "csv").iterdir()))  # the resumed launch's own rows
    assert sorted(b) == list(range(stopped, end))
    for step in b:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])


# slow (41 s on 2 cores): one process's SIGTERM, checkpoint, exit 4 and exact resume stay
# in the default suite; this adds the two ranks' agreement on the step to stop at
@pytest.mark.slow
def test_two_ranks_preempted_through_torchrun_checkpoint_together(tmp_path):
    """SIGTERM to torchrun (through scripts/launch.sh): it forwards the signal; both ranks
    agree on the step, write one checkpoint, and the launch exits 4, not a traceback or a
    hang until torchrun's SIGKILL."""
    cut = tmp_path / "ddp"
    script = str(ROOT / "scripts" / "launch.sh")
    t0 = time.time()
    p = _start(["bash", script, "--nproc-per-node", "2", *COMMON], cut, tmp_path)
    # bash runs launch.sh's python with exec: the signal reaches torchrun's agent itself
    lines = _signal_at(p, 4)
    text = "".join(lines)
    assert p.returncode == EXIT_PREEMPTED, text[-3000:]
    assert time.time() - t0 < 240  # no 30-minute collective timeout, no SIGKILL wait
    assert "launch: preempted by SIGTERM (exit 4; checkpointed at the signal)" in text
    result = json.loads((cut / "result.json").read_text())
    stopped, _ = checkpoint_steps(cut / "checkpoints" / "last.ckpt")
    assert result["status"] == "preempted" and result["model_step"] == stopped >= 4
    r = launch_sh(cut, *COMMON, "resume=auto", f"trainer.stop_at_step={stopped + 2}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    replicas = json.loads((cut / "replicas.json").read_text())
    assert replicas["identical"] and replicas["ranks"][0]["model_step"] == stopped + 2


def test_preempt_signals_are_checked(tmp_path, monkeypatch, capsys):
    args = ["trainer.preempt_signals=[SIGFOO]", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    assert code == 2
    assert "trainer.preempt_signals[0]='SIGFOO' is not allowed; allowed: ['SIGTERM'" in err


@pytest.mark.parametrize("codes,want", [([4, 4], 4), ([1, 4], 4), ([3, 4], 3), ([2], 2)])
def test_launch_keeps_the_preempted_code(codes, want):
    from stabilize.launch import exit_code

    assert exit_code(codes) == want


def test_a_second_launch_into_a_running_dir_is_refused_and_a_dead_holder_does_not_block(
    tmp_path, monkeypatch, capsys
):
    """The run-dir lock: while one launch trains in a dir, a resume=auto (or a fresh
    launch) into it is refused in one line naming the holder; once the holder is gone,
    even by SIGKILL (no clean-up ran), the dir is free again."""
    d = tmp_path / "run"
    p = _start(["stabilize-train", *COMMON, "trainer.checkpoint_every_n_steps=2"], d, tmp_path)
    env = {"STABILIZE_RUN_DIR": str(d)}
    for line in p.stdout:
        if line.lstrip().startswith("step ") and int(line.split()[1].split("/")[0]) >= 3:
            break
    for resume in ("auto", "none"):  # launched in this process: the holder is another one
        r = train_cli([*COMMON, f"resume={resume}"], tmp_path, monkeypatch, capsys, env)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"is in use by another launch (pid {p.pid} on " in r.stderr
        assert "Traceback" not in r.stderr
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    stopped, _ = checkpoint_steps(d / "checkpoints" / "last.ckpt")
    args = [*COMMON, "resume=auto", f"trainer.stop_at_step={stopped + 1}"]
    r = train_cli(args, tmp_path, monkeypatch, capsys, env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((d / "result.json").read_text())["model_step"] == stopped + 1
