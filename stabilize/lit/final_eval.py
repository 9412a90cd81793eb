"""The end-of-run score on the whole held-out split.

Periodic validation reads ``trainer.limit_val_batches`` batches: cheap, but on the scenario's
corpus 4 batches are 2,048 bytes, most of them one ASCII table, and two arms' order can flip
on the whole split. After training, every rank scores its share of *all* the held-out blocks
(``trainer.final_eval_batches``: null = all, N = the first N batches, 0 = off; at most
``trainer.final_eval_tokens`` tokens either way, so a 10B-token corpus's 5% split is not
scored for half an hour after the last step), in the run's
own precision (the numbers the run would give a user), summing nats, tokens and the UTF-8
bytes behind the targets; the sums are reduced over ranks and written to
``final_eval.json``: loss per token and bits per byte, with the counts they came from (and,
on one rank, each batch's loss: ``batch_loss``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stabilize.data import bits_per_byte, build_dataloaders
from stabilize.lit.fsdp import is_sharded

FILE = "final_eval.json"
PROGRESS_EVERY_S = 10.0


def held_out_score(
    module,
    trainer,
    max_batches: int | None,
    max_tokens: int | None = None,
    tick: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Score ``module.model`` on the held-out blocks; every rank must call this. None when
    nothing is held out (``data.val_fraction=0`` and no validation split). ``tick()`` after
    each batch: the watchdog's progress (a long eval moves, a frozen one does not)."""
    cfg = module.cfg
    rank, world = trainer.global_rank, trainer.world_size
    _, val = build_dataloaders(
        cfg.data, cfg.model.block_size, rank=0, world_size=1, num_steps=0, val_batches=None
    )
    blocks = val.dataset
    b = cfg.data.batch_size
    n_all = math.ceil(len(blocks) / b)
    n = n_all if max_batches is None else min(n_all, max_batches)
    if max_tokens is not None:  # the bound at scale: whole batches up to max_tokens
        n = min(n, max(1, max_tokens // (b * cfg.model.block_size)))
    if n == 0:
        return None
    # the same number of forwards on every rank (a sharded model gathers in each); a rank's
    # padding batch is block 0 again, not counted
    per_rank = math.ceil(n / world)
    device = trainer.strategy.root_device
    model = module.model
    if not is_sharded(model):  # Lightning's teardown may have moved it to the CPU
        model = model.to(device)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bytes
    per_batch: list[torch.Tensor] = []  # one rank: each batch's loss (a paired comparison)
    token_bytes = blocks.token_bytes
    t0 = last = time.perf_counter()  # a line every PROGRESS_EVERY_S: a short one says nothing
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            for k in range(per_rank):
                if k and rank == 0 and (now := time.perf_counter()) - last >= PROGRESS_EVERY_S:
                    last, rate = now, k / (now - t0)
                    print(f"final eval: {k}/{per_rank} batches a rank, "
                          f"eta {(per_rank - k) / rate:.0f} s", flush=True)  # fmt: skip
                i = rank + k * world
                idx = range(i * b, min(i * b + b, len(blocks))) if i < n else range(1)
                x, y = (
                    torch.stack(t).to(device) for t in zip(*(blocks[j] for j in idx), strict=True)
                )
                logits = model(x)
                nats = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
                nb = y.numel() if token_bytes is None else token_bytes.to(device)[y].sum()
                if i < n and world == 1:
                    per_batch.append(nats.detach().double() / y.numel())
                if i < n:  # a padding batch's forward is for the shards' gathers only
                    sums += torch.stack(
                        [nats.double(), torch.tensor(float(y.numel()), device=device).double(),
                         torch.as_tensor(nb, device=device).double()]
                    )  # fmt: skip
                if tick is not None:
                    tick()
    finally:
        model.train(was_training)
    nats, tokens, nbytes = trainer.strategy.reduce(sums, reduce_op="sum").tolist()
    return {
        "loss": nats / tokens if tokens else math.nan,
        "bpb": bits_per_byte(nats, nbytes) if nbytes else math.nan,
        "tokens": int(tokens),
        "bytes": int(nbytes),
        "batches": n,
        "held_out_blocks": len(blocks),
        "whole": n == n_all,  # every held-out block scored (not the first final_eval_batches)
        "model_step": module.train_state.model_step,
        # each batch's loss per token, one rank only (the gap bisection pairs them by batch)
        "batch_loss": torch.stack(per_batch).tolist() if per_batch else None,
    }


def write(run_dir: Path, score: dict[str, Any]) -> None:
    (Path(run_dir) / FILE).write_text(json.dumps(score, indent=2))


def read(run_dir: Path) -> dict[str, Any] | None:
    p = Path(run_dir) / FILE
    return json.loads(p.read_text()) if p.is_file() else None
