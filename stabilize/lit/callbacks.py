"""Small callbacks: throughput (tokens/s, MFU), the replica check, the stop at a model step
(progress lines and the bar: ``progress.py``)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from stabilize.lit.fsdp import is_sharded


def flops_per_token(model) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L T d for attention
    (Chowdhery et al. 2022, PaLM, appendix B); N excludes the position table."""
    c = model.cfg
    return 6 * model.num_params(non_embedding=True) + 12 * c.n_layer * c.block_size * c.d_model


class ThroughputLogger(L.Callback):
    """Logs ``perf/tokens_per_s`` (all ranks together) and, where the device's peak FLOPs
    are known, ``perf/mfu``. Host-side clocks only: no device sync added."""

    def __init__(self, compute_dtype: torch.dtype):
        self.compute_dtype = compute_dtype
        self._t0: float | None = None
        self._tokens = 0
        self._peak: float | None = None
        self._fpt = 0.0
        self._val_t0 = 0.0

    def on_train_start(self, trainer, pl_module):
        dev = pl_module.device
        self._peak = get_available_flops(dev, self.compute_dtype) if dev.type == "cuda" else None
        self._fpt = flops_per_token(pl_module.model)

    def on_validation_start(self, trainer, pl_module):
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if self._t0 is not None:  # training throughput: the pause does not count
            self._t0 += time.perf_counter() - self._val_t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if getattr(pl_module, "stale_batch", False):  # fetched before a rollback: dropped
            return
        self._tokens += batch[0].numel() * trainer.world_size
        step = trainer.global_step
        if step % trainer.log_every_n_steps:
            return
        now = time.perf_counter()
        if self._t0 is not None and now > self._t0:
            tps = self._tokens / (now - self._t0)
            stats = {"perf/tokens_per_s": tps}
            if self._peak:
                stats["perf/mfu"] = tps * self._fpt / (self._peak * trainer.world_size)
            pl_module.log_dict(stats, on_step=True, on_epoch=False)
        self._t0, self._tokens = now, 0


def params_digest(module: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in name order: equal iff bit-identical.

    Under FSDP2 the root is resharded first: after a no-grad forward (validation, the audit)
    its parameters are still the gathered whole ones, not this rank's shard. The bytes are
    read from a copy: ``Tensor.numpy()`` marks the storage it views unresizable for good,
    and FSDP2 frees a gathered parameter by resizing its storage to 0 (a digest of the live
    root made the next checkpoint fail, "Trying to resize storage that is not resizable")."""
    if is_sharded(module):
        module.reshard()
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        p = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
        # reshape(-1): a 0-dim parameter (ScaleNorm's scalar gain) cannot be viewed as bytes
        p = p.detach().to("cpu", copy=True).contiguous().reshape(-1)
        h.update(p.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReplicaCheck(L.Callback):
    """At the end of training every rank hashes its parameters; rank 0 writes
    ``replicas.json`` saying whether all replicas are bit-identical (DDP keeps them so;
    a mismatch means a rank silently diverged). Under FSDP each rank hashes its own shard:
    the shards differ, ``identical`` is null and ``sharded`` true."""

    def __init__(self, run_dir: str):
        self.path = Path(run_dir) / "replicas.json"

    def on_train_end(self, trainer, pl_module):
        mine = {
            "digest": params_digest(pl_module.model),
            "data_step": pl_module.train_state.data_step,
            "model_step": pl_module.train_state.model_step,
        }
        ranks = [mine]
        if trainer.world_size > 1:
            ranks = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, mine)
        if trainer.is_global_zero:
            sharded = is_sharded(pl_module.model)
            report = {
                "global_step": trainer.global_step,
                "world_size": trainer.world_size,
                "ranks": ranks,
                "identical": None if sharded else len({r["digest"] for r in ranks}) == 1,
                "sharded": sharded,
            }
            self.path.write_text(json.dumps(report, indent=2))


class StopAtModelStep(L.Callback):
    """Ends training when the *model* has taken ``steps`` optimizer steps.

    Lightning's ``max_steps`` counts its own ``global_step``, which never rewinds: after a
    rollback it would end the run short of the model's budget.
    """

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.train_state.model_step >= self.steps:
            trainer.should_stop = True
