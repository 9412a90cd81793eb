"""FSDP2 on CPU: ``trainer.strategy=fsdp`` shards every block with
``fully_shard`` over gloo; each rank snapshots its shard, durable snapshots and checkpoints
are torch.distributed.checkpoint directories that load at another world size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stabilize.lit.module import param_groups
from stabilize.model import GPT
from stabilize.replay import main as replay_main
from stabilize.replay.core import sharded_state
from stabilize.rollback.dcp import load_sharded
from stabilize.train import run

from conftest import FAST, compose_run, launch_sh, read_csv_metrics

BASE = [
    *[a for a in FAST if not a.startswith("trainer.progress")],
    "logger=none",
    "trainer.accelerator=cpu",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.final_eval_batches=null",  # the whole held-out split, sharded and not
    "rollback.snapshot_every=2",
    "rollback.durable_every=4",
    "precision=fp32",
]


def losses(run_dir) -> dict[int, float]:
    """{model step: the step's loss (mean over ranks)}; a replayed step's later value."""
    out = {}
    for r in read_csv_metrics(run_dir):
        if "train/loss_step" in r and "train/step" in r:
            out[int(r["train/step"])] = r["train/loss_step"]
    return out


def launch(run_dir: Path, nproc: int, args: list[str], cwd: Path):
    r = launch_sh(run_dir, *args, cwd=cwd, nproc=nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def reference(tmp_path, steps: int) -> dict[int, float]:
    """One process, no sharding, the global batch of 2 ranks (data.batch_size 2 x 4): the
    same items per step (stabilize.data.StepSampler), no fault."""
    ref_dir = tmp_path / "ref"
    run(compose_run(ref_dir, [*BASE, f"trainer.max_steps={steps}", "data.batch_size=8"]))
    return losses(ref_dir)


def test_fsdp_on_two_cpu_ranks_rolls_back_a_nan_on_rank_1_and_trains_like_one_process(
    tmp_path, capsys
):
    run_dir = tmp_path / "fsdp"
    args = [*BASE, "trainer.max_steps=8", "trainer.strategy=fsdp", "rollback.ladder=[retry]"]
    args += ["fault=nan_loss", "fault.step=5", "fault.rank=1"]
    args += ["rollback.keep_durable=2", "trainer.keep_checkpoints=1"]  # retention, sharded
    out = launch(run_dir, 2, args, tmp_path).stdout
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rb = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert [e["extra"]["restored_step"] for e in rb] == [4]  # every rank: one decision
    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["sharded"] and [x["model_step"] for x in rep["ranks"]] == [8, 8]
    assert rep["ranks"][0]["digest"] != rep["ranks"][1]["digest"]  # two halves
    # the losses of the unsharded one-process run, the fault rolled back and replayed
    ref = reference(tmp_path, 8)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 9)) == sorted(ref)
    for s in ref:
        assert abs(got[s] - ref[s]) <= 1e-5, (s, got[s], ref[s])
    # the whole held-out split scored by the sharded model, as by the unsharded one
    mine, theirs = (
        json.loads((d / "final_eval.json").read_text()) for d in (run_dir, tmp_path / "ref")
    )
    assert mine["tokens"] == theirs["tokens"] and abs(mine["loss"] - theirs["loss"]) <= 1e-5
    # durable snapshots and checkpoints: DCP directories, one shard file per rank
    snaps = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert snaps == ["snapshot-000004", "snapshot-000008"]  # step 0's pruned: keep_durable=2
    for name in snaps:
        d = run_dir / "snapshots" / name
        assert sorted(p.name for p in d.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step-000008.ckpt"]  # step 4's removed: keep_checkpoints=1
    assert (run_dir / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    # saved by 2 ranks, loaded by 1 (an unsharded model): the reference's final weights
    cfg = compose_run(tmp_path / "x", [*BASE, "data.batch_size=8"])
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    snap = load_sharded(run_dir / "snapshots" / "snapshot-000008", model, opt)
    assert snap.step == 8 and snap.state["model_step"] == 8
    want = torch.load(tmp_path / "ref" / "checkpoints" / "last.ckpt", weights_only=False)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want["state_dict"][f"model.{k}"], rtol=0, atol=1e-5)
    assert all(len(s) == 3 for s in opt.state.values())  # step, exp_avg, exp_avg_sq
    # the fault's repro bundle: each rank's shard, replayed unsharded by a process of one rank
    (bundle,) = (run_dir / "bundles").iterdir()
    shards = sorted(p.name for p in (bundle / "state").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"] and not (bundle / "state.pt").exists()
    assert f"(FSDP: model and optimizer as 2 shards, state/{shards[0]}, state/{shards[1]})" in out
    at4 = torch.load(tmp_path / "ref" / "checkpoints" / "step-000004.ckpt", weights_only=False)
    for k, v in sharded_state(bundle / "state", cfg)["model"].items():  # the step-5 start
        torch.testing.assert_close(v, at4["state_dict"][f"model.{k}"], rtol=0, atol=1e-5)
    capsys.readouterr()
    assert replay_main([str(bundle)]) == 0  # stabilize-replay here: no process group
    said = capsys.readouterr().out
    assert said.strip().endswith("reproduces: yes"), said
    assert "2 rank(s)" in said and "loss nan (recorded nan)" in said


@pytest.mark.slow  # two torchrun launches of 20 steps
def test_fsdp_losses_equal_ddp_losses_for_20_fp32_steps(tmp_path):
    args = [*BASE, "trainer.max_steps=20"]
    launch(tmp_path / "ddp", 2, [*args, "trainer.strategy=ddp"], tmp_path)
    launch(tmp_path / "fsdp", 2, [*args, "trainer.strategy=fsdp"], tmp_path)
    ddp, fsdp = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert sorted(ddp) == sorted(fsdp) == list(range(1, 21))
    for s in ddp:
        assert abs(ddp[s] - fsdp[s]) <= 1e-5, (s, ddp[s], fsdp[s])


@pytest.mark.slow  # three torchrun launches
def test_fsdp_resumes_exactly_on_two_ranks_and_on_one(tmp_path):
    """Saved by 2 ranks at step 4 (a DCP checkpoint), resumed by 2 ranks and by 1: the
    losses of steps 5..8 are those of the uninterrupted run (2 ranks: bit for bit)."""
    args = [*BASE, "trainer.max_steps=8", "trainer.strategy=fsdp"]
    launch(tmp_path / "whole", 2, args, tmp_path)
    launch(tmp_path / "cut", 2, [*args, "trainer.stop_at_step=4"], tmp_path)
    shutil.copytree(tmp_path / "cut", tmp_path / "one")
    launch(tmp_path / "cut", 2, [*args, "resume=auto"], tmp_path)
    # one process: its batch is the 2 ranks' global batch
    launch(tmp_path / "one", 1, [*args, "resume=auto", "data.batch_size=8"], tmp_path)
    whole, cut, one = (losses(tmp_path / n) for n in ("whole", "cut", "one"))
    assert sorted(cut) == sorted(one) == sorted(whole) == list(range(1, 9))
    assert all(cut[s] == whole[s] for s in whole), (cut, whole)
    for s in range(5, 9):
        assert abs(one[s] - whole[s]) <= 1e-5, (s, one[s], whole[s])
