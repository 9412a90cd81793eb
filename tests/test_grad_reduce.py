"""Issue 37's all-reduce site (stabilize/lit/grad_reduce.py, ``trainer.grad_reduce_dtype``):
two real processes on gloo, a real DDP with the hook, against the sum computed by hand."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stabilize.lit.grad_reduce import ddp_hook, fsdp_policy


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + rank))


def _worker(rank: int, store: str, out: str) -> None:
    # a file store, not a TCP port: no other test's process group can answer on it, and a
    # rank that never comes fails the test in a minute instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        got = {}
        for name in ("grad", "bf16"):
            torch.manual_seed(0)
            net = torch.nn.Linear(8, 4)
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            hook = ddp_hook(name)
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            ddp(_inputs(rank)).square().sum().backward()
            got[name] = net.weight.grad
        if rank == 0:
            torch.save(got, out)
        dist.barrier()  # every rank past every collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # no destroy_process_group after success: in a fresh-clone suite at dc54bb7 a rank slept
    # in gloo's teardown for minutes after both results were in (rank 0's file written, the
    # other rank gone); the process's exit frees the group
    os._exit(0)


def _reduced(tmp_path) -> dict[str, torch.Tensor]:
    """Rank 0's gradient after DDP's own all-reduce and after the bf16 one; the two ranks
    given two minutes (they take seconds), then stopped: a hang fails the test, not the
    suite."""
    out = str(tmp_path / "grads.pt")
    store = str(tmp_path / "store")
    ctx = mp.start_processes(_worker, args=(store, out), nprocs=2, start_method="spawn",
                             join=False)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish in 120 s")
    return torch.load(out)


def test_a_bf16_all_reduce_rounds_each_share_and_the_sum_as_computed_by_hand(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    grads = []
    for rank in (0, 1):  # each rank's own gradient, in this process
        net.zero_grad()
        net(_inputs(rank)).square().sum().backward()
        grads.append(net.weight.grad.clone())
    fp32 = (grads[0] + grads[1]) / 2
    shares = [(g / 2).bfloat16() for g in grads]  # each rank's share, rounded to bf16
    by_hand = (shares[0].float() + shares[1].float()).bfloat16().float()  # summed in bf16
    got = _reduced(tmp_path)
    got_fp32, got_bf16 = got["grad"], got["bf16"]
    assert torch.allclose(got_fp32, fp32, rtol=1e-6, atol=1e-7)  # DDP's own: the mean
    assert got_bf16.dtype == torch.float32 and torch.equal(got_bf16, by_hand)
    assert not torch.equal(got_bf16, got_fp32)  # the site changes the gradient


def test_the_choices_map_to_ddp_hooks_and_fsdp_policies():
    assert ddp_hook("grad") is None and fsdp_policy("grad") is None  # the backends' own
    assert callable(ddp_hook("fp32")) and fsdp_policy("fp32").reduce_dtype == torch.float32
    assert fsdp_policy("bf16").reduce_dtype == torch.bfloat16


@pytest.mark.slow  # two torchrun launches; test_a_bf16_all_reduce... covers the hook itself
def test_lightning_ddp_on_cpu_takes_the_bf16_reduce(tmp_path):
    """trainer.grad_reduce_dtype=bf16 reaches Lightning's DDP on CPU (whose own strategy
    registers a comm hook on CUDA only): two 2-rank gloo runs, the same first loss (no
    update yet), then different losses from the first bf16-reduced update on."""
    from conftest import FAST, launch_sh, read_csv_metrics

    args = [*[a for a in FAST if not a.startswith("trainer.progress")], "trainer.max_steps=4",
            "trainer.accelerator=cpu", "precision=fp32", "trainer.strategy=ddp"]  # fmt: skip
    loss = {}
    for name in ("grad", "bf16"):
        run_dir = tmp_path / name
        r = launch_sh(run_dir, *args, f"trainer.grad_reduce_dtype={name}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        loss[name] = [row["train/loss"] for row in read_csv_metrics(run_dir) if "train/loss" in row]
    assert len(loss["grad"]) == len(loss["bf16"]) == 4
    assert loss["grad"][0] == loss["bf16"][0] and loss["grad"][1:] != loss["bf16"][1:]
