"""DDP snapshots that fit a node: each rank keeps 1/world of the
flattened state; a restore rebuilds the whole with one all-gather (real torchrun, gloo)."""

from __future__ import annotations

import json

import pytest
import torch

from stabilize.rollback import to_cpu
from stabilize.rollback.sharded import Layout, ShardedState, Sharder, host_bytes

from conftest import FAST, ROOT, launch_sh, run_cli


def _flat(tree) -> dict:
    """The reference flattening: each dtype's tensors laid end to end, in walk order."""
    lay = Layout(tree)
    out = {}
    for t in lay.tensors:
        out.setdefault(t.dtype, []).append(t.reshape(-1).cpu())
    return {d: torch.cat(v) for d, v in out.items()}


def _tree(device="cpu"):
    torch.manual_seed(0)
    w = torch.randn(5, 3, device=device)
    return {
        "a": w,
        "tied": w,  # laid once
        "b": [torch.randn(4, device=device).to(torch.bfloat16), 3, "x"],
        "c": {"step": torch.tensor(7.0, device=device), "n": torch.arange(5, device=device)},
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_slices_of_every_rank_make_the_flattened_state(world):
    tree = _tree()
    shards = [ShardedState.capture(tree, r, world) for r in range(world)]
    for dtype, ref in _flat(tree).items():
        joined = torch.cat([s.slices[dtype] for s in shards])[: ref.numel()]
        assert torch.equal(joined, ref), dtype
        assert all(s.slices[dtype].numel() == -(-ref.numel() // world) for s in shards)
    whole = ShardedState.capture(tree, 0, 1).gather()  # world 1: no collective
    assert torch.equal(whole["a"], tree["a"]) and whole["tied"] is whole["a"]
    assert whole["b"][1:] == [3, "x"] and whole["c"]["step"].item() == 7.0
    assert whole["b"][0].dtype == torch.bfloat16


def test_a_world_of_one_keeps_the_full_copy():
    tree = _tree()
    st = Sharder(0, 1).capture({"model": tree}, {})
    assert set(st) == {"model"} and host_bytes(st) == host_bytes(to_cpu({"model": tree}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slices_are_pinned_and_copied_on_a_side_stream():
    tree = _tree("cuda")
    sharder = [Sharder(r, 2) for r in range(2)]
    shards = [s.capture({"t": tree}, {})["shard"] for s in sharder]
    for s in shards:
        assert s.cuda is not None and all(b.is_pinned() for b in s.slices.values())
        s.ready()
    for dtype, ref in _flat({"t": tree}).items():
        joined = torch.cat([s.slices[dtype] for s in shards])[: ref.numel()]
        assert torch.equal(joined, ref), dtype


def test_two_ranks_restore_sliced_snapshots_bit_identically(tmp_path):
    """Each of 2 gloo ranks snapshots half of a GPT + AdamW state; after 3 more steps the
    all-gathered restore equals a full host copy taken at the snapshot, bit for bit. Rank 0's
    durable copy of the whole is made off the training thread and lands whole."""
    r = run_cli(
        [
            "python",
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "sharded_worker.py"),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for x in res:
        assert x["gathered_equal_ref"] and x["live_differs"] and x["restored_equal_ref"]
        assert x["reused"] and x["recycled_equal_live"] and x["empty_optimizer_state"]
        assert x["fsdp_shard"] and x["fsdp_reused"] and x["fsdp_recycled_equal_live"]
        sliced, full, ref = x["bytes"]
        assert full == ref and sliced <= 0.55 * full  # half, plus padding
    assert res[0]["fingerprint"] == res[1]["fingerprint"]
    # the durable copy: rank 0's, on its own thread, the file equal to the state of its step
    # although the next optimizer steps followed at once
    assert (
        res[0]["durable_threads"] == ["stabilize-durable-copy"] and res[1]["durable_threads"] == []
    )
    assert res[0]["durable_equal_ref"] and res[0]["live_moved_on"]


@pytest.mark.slow  # 40 s; test_stability's torchrun faults on rank 1 cover the rollback by default
def test_nan_on_rank_1_is_rolled_back_from_sharded_snapshots(tmp_path):
    """A transient NaN on rank 1 under DDP: both ranks restore from their halves and the
    replicas end identical (replicas.json); rank 0's durable snapshots stay whole."""
    run_dir = tmp_path / "run"
    args = [a for a in FAST if not a.startswith("trainer.progress")]
    r = launch_sh(
        run_dir,
        *args,
        "logger=none",
        "trainer.accelerator=cpu",
        "trainer.max_steps=8",
        "trainer.val_check_interval=100",
        "rollback.snapshot_every=2",
        "rollback.durable_every=4",
        "rollback.ladder=[retry]",
        "fault=nan_loss",
        "fault.step=5",
        "fault.rank=1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "snapshots sharded: each of 2 ranks keeps 1/2" in r.stdout + r.stderr
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rb = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert [e["extra"]["restored_step"] for e in rb] == [4]
    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["identical"] and [x["model_step"] for x in rep["ranks"]] == [8, 8]
    # rank 0 still writes whole durable snapshots (every 4 steps)
    from stabilize.rollback import load_durable

    snap = load_durable(run_dir / "snapshots" / "snapshot-000004.pt")
    assert "shard" not in snap.state and snap.state["model_step"] == 4
    assert set(snap.state["model"]) >= {"wte.weight", "h.0.attn.c_attn.weight"}


def test_a_host_snapshot_copied_on_a_thread_holds_its_own_step(tmp_path):
    """World 1 on the host: the parameters and AdamW state are copied on a thread while the
    next forward runs; the BatchNorm's running statistics (a forward writes them) at once.
    Read after the next step (the fence before it, as after_backward does), the snapshot is
    the state of its own step, tensor for tensor, and a copy with the thread off is equal."""
    from stabilize.rollback.snapshots import Snapshot, optimizer_written

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(32, 256)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    parts = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ref, ref_mean = _flat(to_cpu(parts)), model[1].running_mean.clone()
    late = optimizer_written(opt)
    assert model[0].weight.data_ptr() in late and model[1].running_mean.data_ptr() not in late
    sharder = Sharder()
    snap = Snapshot(1, sharder.capture(parts, {}, opt), landed=sharder.fence)
    assert sharder._ring_copy is not None  # the parameters' copy went to a thread
    opt.zero_grad()
    model(x).square().mean().backward()  # writes the running statistics
    sharder.fence()  # what the engine's after_backward does
    opt.step()
    got = _flat(snap.state)
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    kept = snap.state["model"]["1.running_mean"]
    assert torch.equal(kept, ref_mean) and not torch.equal(kept, model[1].running_mean)
    sync = Sharder()
    sync.host_async = False
    same = _flat(
        sync.capture({"model": model.state_dict(), "optimizer": opt.state_dict()}, {}, opt)
    )
    assert sync._ring_copy is None
    assert all(torch.equal(same[k], t) for k, t in _flat(to_cpu(parts)).items())
