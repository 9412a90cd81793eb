"""One rank of tests/test_fsdp_precision.py (run by torchrun, gloo): a real training run
(``stabilize.train.run``, the Hydra overrides on the command line) with ``RankTrace``
watching it, which writes ``trace-rank<r>.json`` into the run dir: per optimizer step, this
rank's loss scale before and after the step, whether its own gradient shard held an inf,
the scaler's found-inf verdict and a digest of its parameter shard.

    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_precision_worker.py \
        RUN_DIR override ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stabilize.faults.base import local_part  # noqa: E402
from stabilize.lit.callbacks import params_digest  # noqa: E402

from conftest import compose_run  # noqa: E402


class RankTrace(L.Callback):
    """Per optimizer step, on this rank: what its scaler saw and did, and its shard."""

    def __init__(self, path: Path):
        self.path = path
        self.steps: list[dict] = []
        self._row: dict | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.stale_batch:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        grads = [local_part(p.grad) for p in pl_module.parameters() if p.grad is not None]
        row = {
            "model_step": pl_module.train_state.model_step,  # before this step
            "digest_before": params_digest(pl_module.model),
            "own_shard_inf": any(not bool(torch.isfinite(g).all()) for g in grads),
            "scale_before": None,
            "found_inf": None,
        }
        if scaler is not None and scaler._scale is not None:
            row["scale_before"] = float(scaler._scale)
            per_dev = scaler._found_inf_per_device(optimizer)
            row["found_inf"] = float(sum(v.sum() for v in per_dev.values())) if per_dev else None
        self._row = row

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._row is None:
            return
        row, self._row = self._row, None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        row["scale_after"] = float(scaler._scale) if scaler is not None else None
        row["model_step_after"] = pl_module.train_state.model_step
        row["digest_after"] = params_digest(pl_module.model)
        self.steps.append(row)

    def on_train_end(self, trainer, pl_module):
        self.path.write_text(json.dumps({"rank": trainer.global_rank, "steps": self.steps}))


def main(run_dir: str, overrides: list[str]) -> None:
    from stabilize.train import run

    cfg = compose_run(run_dir, overrides)
    rank = int(os.environ.get("RANK", "0"))
    run(cfg, callbacks=[RankTrace(Path(run_dir) / f"trace-rank{rank}.json")])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
