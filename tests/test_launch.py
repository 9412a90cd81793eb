"""Real multi-process launches: torchrun on CPU (gloo), Hydra multirun, scripts/sweep.sh."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from stabilize.io import atomic_torch_save
from stabilize.wandb_offline import find_offline_runs, read_offline_run

from conftest import FAST, ROOT, launch_sh, run_cli, train_cli

SMALL = [o for o in FAST if not o.startswith("trainer.progress")] + ["trainer.accelerator=cpu"]


def test_torchrun_two_ranks_share_one_run_and_stay_identical(tmp_path):
    run_dir = tmp_path / "run"
    r = launch_sh(
        run_dir,
        *SMALL,
        "trainer.max_steps=6",
        "name=ddp",
        "logger=wandb",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # one output dir for both ranks
    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["world_size"] == 2 and rep["identical"]
    assert [x["data_step"] for x in rep["ranks"]] == [6, 6]  # both ranks trained every step
    assert (run_dir / ".hydra").is_dir() and (run_dir / ".hydra-rank1").is_dir()
    runs = find_offline_runs(run_dir / "wandb")
    assert len(runs) == 1  # rank 0 only
    w = read_offline_run(runs[0], wait_s=30)
    assert w.group == "ddp" and w.series("train/step")[-1] == 6
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6 and ckpt["stabilize"]["data_step"] == 6


def test_hydra_multirun_gives_each_member_its_dir_and_one_wandb_group(
    tmp_path, monkeypatch, capsys
):
    sweep = tmp_path / "sweep"
    r = train_cli(  # in this process, as the console script runs it: members one by one
        ["-m", "norm=layernorm,rmsnorm", *SMALL, "logger=wandb", "trainer.max_steps=2",
         "norm.backend=explicit"],
        tmp_path, monkeypatch, capsys, env={"STABILIZE_SWEEP_DIR": str(sweep)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    groups, types = set(), []
    for member in ("0", "1"):
        cfg = json.loads((sweep / member / "config.json").read_text())
        types.append(cfg["norm"]["type"])
        (run,) = find_offline_runs(sweep / member / "wandb")
        groups.add(read_offline_run(run, wait_s=30).group)
    assert types == ["layernorm", "rmsnorm"]
    assert groups == {"sweep"}


@pytest.mark.slow  # ~25 s; the multirun test above keeps the sweep's group in the default suite
def test_sweep_script_launches_each_member_with_torchrun(tmp_path):
    r = run_cli(
        [
            str(ROOT / "scripts" / "sweep.sh"),
            "--group",
            "g1",
            "--",
            "norm.eps=1e-6,1e-3",
            *SMALL,
            "logger=wandb",  # FAST has none: the members' offline runs are read below
            "trainer.max_steps=2",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    eps = []
    for member in ("0", "1"):
        d = tmp_path / "runs" / "g1" / member
        eps.append(json.loads((d / "config.json").read_text())["norm"]["eps"])
        (run,) = find_offline_runs(d / "wandb")
        assert read_offline_run(run, wait_s=30).group == "g1"
    assert eps == [1e-6, 1e-3]


def test_launch_refuses_multinode_without_endpoint(tmp_path):
    r = run_cli([str(ROOT / "scripts" / "launch.sh"), "--nnodes", "2"], cwd=tmp_path)
    assert r.returncode == 2 and "--rdzv-endpoint" in r.stderr


WRITER = """
import sys, torch
from stabilize.io import atomic_torch_save
path = sys.argv[1]
i = 0
print("ready", flush=True)
while True:
    i += 1
    atomic_torch_save({"i": i, "blob": torch.full((2_000_000,), float(i))}, path)
"""


def test_sigkill_during_checkpoint_write_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"i": 0, "blob": torch.zeros(2_000_000)}, path)
    for delay in (0.3, 0.55, 0.8):
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "ready"
        time.sleep(delay)  # 8 MB writes: the kill lands mid-write most of the time
        p.send_signal(signal.SIGKILL)
        p.wait()
        obj = torch.load(path, weights_only=False)
        assert torch.all(obj["blob"] == float(obj["i"]))  # a whole checkpoint, old or new
    atomic_torch_save({"i": -1, "blob": torch.zeros(1)}, path)  # the next save tidies up
    assert [q.name for q in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("resume", ["nope.ckpt"])
def test_resume_from_missing_file_is_a_clear_error(resume, tmp_path):
    from stabilize.lit.checkpoint import resolve_resume

    with pytest.raises(ValueError, match="resume='nope.ckpt' is not allowed: no such"):
        resolve_resume(resume, tmp_path)
    assert resolve_resume("auto", tmp_path) is None


@pytest.mark.slow  # 14 s; exit 3 of one process stays in the default suite (test_stability)
def test_launch_keeps_exit_code_3_of_a_stability_abort_on_two_ranks(tmp_path):
    """A persistent fault exhausts the ladder on every rank: launch.sh exits 3 (torchrun
    alone exits 1 with a ChildFailedError traceback), with the diagnosis and one summary."""
    run_dir = tmp_path / "run"
    r = launch_sh(
        run_dir,
        *SMALL,
        "logger=none",
        "trainer.max_steps=8",
        "trainer.val_check_interval=100",
        "rollback.snapshot_every=2",
        "fault=nan_loss",
        "fault.step=4",
        "fault.persistent=true",
        "rollback.ladder=[retry]",
        cwd=tmp_path,
    )
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr
    assert "stability abort" in r.stderr and "launch: aborted (exit 3" in r.stderr
    assert json.loads((run_dir / "result.json").read_text())["status"] == "aborted"


def test_launch_exits_2_on_a_config_error_and_writes_nothing(tmp_path):
    r = launch_sh(
        tmp_path / "run",
        *SMALL,
        "fault=nan_loss",
        "fault.step=2",
        "fault.rank=2",  # a rank this 2-process launch does not have
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    ours = [line for line in r.stderr.splitlines() if line.startswith("stabilize-train:")]
    assert len(ours) == 1 and "fault.rank=2 is not allowed" in ours[0] and "0 .. 1" in ours[0]
    assert "launch: config error (exit 2" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_config_error_leaves_no_stopped_ranks_hydra_files(tmp_path, monkeypatch):
    """A rank torchrun stopped after rank 0's config error may not have removed what Hydra
    made for it: the launcher removes those from a dir holding no run, and nothing else."""
    from stabilize.launch import _discard_stopped_ranks

    fresh, held = tmp_path / "fresh", tmp_path / "held"
    for d in (fresh, held):
        (d / ".hydra_rank1").mkdir(parents=True)
        (d / ".hydra_rank1" / "config.yaml").write_text("x: 1\n")
        (d / "train_rank1.log").write_text("a line\n")
    (held / "config.json").write_text("{}")  # a run's own dir: left as it is
    for d in (fresh, held):
        monkeypatch.setenv("STABILIZE_RUN_DIR", str(d))
        _discard_stopped_ranks()
    assert not fresh.exists()
    assert sorted(p.name for p in held.iterdir()) == [".hydra_rank1", "config.json",
                                                     "train_rank1.log"]  # fmt: skip
    keep = tmp_path / "mine"
    (keep / ".hydra").mkdir(parents=True)
    (keep / "notes.txt").write_text("the user's own file")
    monkeypatch.setenv("STABILIZE_RUN_DIR", str(keep))
    _discard_stopped_ranks()
    assert [p.name for p in keep.iterdir()] == ["notes.txt"]  # not removed, dir kept
