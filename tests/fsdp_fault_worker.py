"""One rank of tests/test_fsdp_precision.py's fault check (torchrun, 2 ranks, gloo): the
fault kinds that touch parameters or gradients, on a ``fully_shard``-ed GPT, against an
unsharded copy of it that gets no fault (the reference gradient, computed here in the
same process from the same weights and batch; both ranks train on that batch, so the
reduced gradient equals the reference one).

Writes ``rank<r>.json``: per case, what this rank saw in its own shard.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sharded_worker import finish  # tests/: this script's own folder

from stabilize.faults import FaultConfig, FaultInjector, fault_config
from stabilize.faults.base import local_part
from stabilize.model import GPT, GPTConfig

BLOCK = "h.0.attn.c_attn.weight"  # resharded after the forward: not in the autograd graph
ROOT = "wte.weight"  # the root's: still gathered when the fault is armed


def loss_of(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def step(model, x, fault: FaultConfig | None, rank: int) -> None:
    """One forward and backward with the fault armed as the training module arms it."""
    inj = FaultInjector(fault, rank) if fault is not None else None
    if inj is not None:
        inj.begin(1)
    loss = loss_of(model, x)
    if inj is not None:
        loss = inj.on_loss(1, loss)
        inj.arm(1, model)
    loss.backward()
    if inj is not None:
        inj.disarm(model)


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=256))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    step(plain, x, None, rank)
    ref = {n: p.grad.clone() for n, p in plain.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    res = {}

    def sharded():
        m = copy.deepcopy(plain)
        m.zero_grad(set_to_none=True)
        for block in m.h:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    cases = {
        "inf_block": dict(kind="inf_grad", param=BLOCK),
        "inf_root": dict(kind="inf_grad", param=ROOT),
        "spike": dict(kind="grad_spike", factor=7.0),
        "flip_param": dict(kind="bitflip", param=BLOCK, flip="param", bit=30),
        "flip_grad": dict(kind="bitflip", param=BLOCK, flip="grad", bit=30),
    }
    for name, kw in cases.items():
        m = sharded()
        before = {n: local_part(p).detach().clone() for n, p in m.named_parameters()}
        step(m, x, fault_config(step=1, rank=1, **kw), rank)
        params = dict(m.named_parameters())
        grads = {n: p.grad.full_tensor() for n, p in params.items()}
        own = local_part(params[kw.get("param", BLOCK)].grad)
        row = {
            # element 0 of the whole gradient lives on rank 0's shard
            "own_first_inf": bool(own.numel()) and bool(torch.isinf(own.reshape(-1)[0])),
            "own_nonfinite": int((~torch.isfinite(own)).sum()),
            "nonfinite": sum(int((~torch.isfinite(g)).sum()) for g in grads.values()),
        }
        if kw["kind"] == "grad_spike":  # every gradient: rank 1's x 7 and rank 0's, averaged
            row["spiked"] = all(close(grads[n], ref[n] * (1 + 7.0) / 2) for n in ref)
        elif kw["kind"] == "inf_grad":  # every other element: the reference gradient
            p = kw["param"]
            row["others_equal_ref"] = all(close(grads[n], ref[n]) for n in ref if n != p)
            row["others_equal_ref"] &= close(grads[p].reshape(-1)[1:], ref[p].reshape(-1)[1:])
        else:  # bitflip: element 0 of this rank's own shard, by the bits that changed
            mine = local_part(params[BLOCK]).detach()
            if kw["flip"] == "param":
                was, now = before[BLOCK], mine
            else:  # the reference's shard of the gradient (low mantissa bits: rounding)
                was, now = ref[BLOCK].chunk(world)[rank], local_part(params[BLOCK].grad)
            bits = now.reshape(-1)[:1].view(torch.int32) ^ was.reshape(-1)[:1].view(torch.int32)
            row["flipped_bits"] = int(bits.item()) >> 12 << 12
            row["param_rest_unchanged"] = torch.equal(
                mine.reshape(-1)[1:], before[BLOCK].reshape(-1)[1:]
            )
        res[name] = row
    finish(out, rank, res)


if __name__ == "__main__":
    main(sys.argv[1])
