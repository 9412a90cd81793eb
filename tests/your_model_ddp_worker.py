"""One rank of a torchrun (CPU, 2 ranks, gloo) training tests/your_lm.py's GPT2LM, a
LightningModule we did not write, under DDP with ``stabilize.StabilityCallback``:
``your_model_ddp_worker.py RUN_DIR``. Rank 1 plants a NaN in block 1's output once, at its
4th training forward (step 4); rank 0 writes ``RUN_DIR/ranks.json`` with what each rank's
callback ended with."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from your_lm import GPT2LM, loader, nan_once  # tests/: this script's own folder

import stabilize


def main(run_dir: str) -> int:
    torch.manual_seed(0)
    module = GPT2LM()
    rank = int(os.environ["RANK"])
    if rank == 1:  # step 4, on rank 1 only
        module.model.transformer.h[1].register_forward_hook(nan_once(4, (0, 1, 2)))
    cb = stabilize.StabilityCallback(rollback={"snapshot_every": 2}, run_dir=run_dir)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])  # fmt: skip
    trainer.fit(module, loader())
    mine = {"rank": rank, "model_step": cb.host.train_state.model_step,
            "global_step": trainer.global_step,
            "weights": float(sum(p.double().sum() for p in module.parameters()))}  # fmt: skip
    every = [None, None]
    dist.all_gather_object(every, mine)
    if rank == 0:
        (Path(run_dir) / "ranks.json").write_text(json.dumps(every))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
