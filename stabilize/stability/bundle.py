"""A repro bundle: everything needed to replay a failing step in another process.

Written on a fault (``rollback.bundle``: ``fault``, the default, on every verdict that rolls
back or would; ``always``, on warnings and scaler skips too; ``off``) under
``run_dir/bundles/step-NNNNNN-<monitor>/``, before anything is restored:

- ``state.pt``: the live state the step started from (the step is judged before the
  optimizer applies it): model, optimizer, LR scheduler, loss scaler, the train state
  (model/data step, LR scale, remedies, skipped positions) and the fault injector's course;
  left out when it would pass ``rollback.bundle_max_mb`` (the bundle says so);
- ``batch.pt``: every rank's micro-batches of the step (token ids), their data positions
  and the corpus items each one was drawn from (``StepSampler.batch_for_step``): under DDP
  one all-gather of the ids, rank 0 writes the one copy (the replicas' states are equal);
- ``meta.json``: the resolved config, the versions (torch, CUDA, Python, this package, the
  git commit when known), the step's recorded loss and gradient norm, its events;
- ``manifest.json`` last: each file's size and SHA-256. The directory is written as
  ``.tmp`` and renamed when whole.

Under FSDP (each rank holds a shard) the model and optimizer go into ``state/`` instead of
``state.pt``: a torch.distributed.checkpoint directory, one shard file per rank
(``__R_0.distcp``, written by rank R: a collective) and the small parts in ``rest.pt``
(rollback/dcp.py); the console line names the shards. ``stabilize-replay BUNDLE``
(stabilize/replay/) rebuilds the step from either, unsharded.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from stabilize.rollback import to_cpu

FORMAT = 2
READS = (1, 2)  # format 1: our GPT only (no ``host``); 2 adds ``host`` and any batch layout
FILES = ("state.pt", "batch.pt", "meta.json")


def versions() -> dict[str, Any]:
    import stabilize

    commit = None
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                           cwd=Path(stabilize.__file__).parent, timeout=5)  # fmt: skip
        commit = (r.stdout.strip() or None) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "stabilize": getattr(stabilize, "__version__", None),
        "git_commit": commit,
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _pair(b: Any) -> bool:
    return (
        isinstance(b, (tuple, list))
        and len(b) == 2
        and all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in b)
    )


def write_bundle(
    loop,
    host,
    stats,
    events,
    batches,
    positions,
    rcfg,
    run_dir,
    sharded: bool = False,
    attempt: int = 1,
) -> Path | None:
    """Every rank calls this at a faulty step (a collective under DDP and FSDP); rank 0
    writes all but the FSDP shards. Returns the bundle's directory on rank 0. ``attempt``:
    the step's how-manieth bundle (a step rolled back twice: ``step-NNNNNN-<monitor>-2``)."""
    rank, world = loop.rank, loop.world
    sampler = host.train_sampler()
    mine: dict[str, Any] = {"rank": rank, "positions": list(positions)}
    if all(_pair(b) for b in batches):  # (x, y) token ids: the data bisection reads rows
        mine["x"] = [b[0].detach().cpu() for b in batches]
        mine["y"] = [b[1].detach().cpu() for b in batches]
    else:  # any other batch: its tensors, as they came (dicts, lists, tuples)
        mine["batches"] = [to_cpu(b) for b in batches]
    mine["items"] = (
        [sampler.batch_for_step(p, rank) for p in positions] if sampler is not None else None
    )
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, mine)
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    first = events[0] if events else None
    name = f"step-{stats.step:06d}-{first.monitor if first else 'on-demand'}"
    name += f"-{attempt}" if attempt > 1 else ""
    final = run_dir / "bundles" / name
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    opt = loop.optimizer()
    scaler = loop.scaler()
    injector = host.injector
    state = {
        "schedulers": [s.state_dict() for s in loop.schedulers()],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "train_state": host.train_state.state_dict(),
        "fault": injector.snapshot_state() if injector is not None else None,
    }
    # under FSDP these are DTensors, whose numel() is the global one: the size is the
    # whole state's on every rank, so every rank takes the same decision
    big = [host.model.state_dict(), opt.state_dict()]
    size_mb = _nbytes([state, big]) / 2**20
    omitted = rcfg.bundle_max_mb >= 0 and size_mb > rcfg.bundle_max_mb
    if sharded and not omitted:  # every rank writes its shard (DCP's save: a collective)
        from stabilize.rollback.dcp import save_sharded
        from stabilize.rollback.snapshots import Snapshot

        save_sharded(Snapshot(stats.step, state, 0.0), host.model, opt, tmp)
        if rank == 0:
            (tmp / f"snapshot-{stats.step:06d}").rename(tmp / "state")
    if rank != 0:
        return None
    if not sharded and not omitted:
        torch.save({"model": big[0], "optimizer": big[1], **state}, tmp / "state.pt")
    torch.save({"ranks": ranks}, tmp / "batch.pt")
    meta = {
        "format": FORMAT,
        "step": stats.step,
        "world_size": world,
        "device": host.device.type,
        "precision": host.precision_name,
        "recorded": {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "loss_scale": stats.loss_scale,
        },  # fmt: skip
        "state_omitted": f"{size_mb:.0f} MB > rollback.bundle_max_mb" if omitted else None,
        "state_sharded": sharded and not omitted,
        "events": [e.to_dict() for e in events],
        "versions": versions(),
        "config": host.run_config(),
        "host": host.host_info(),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    names = [f for f in FILES if (tmp / f).exists()]
    shards = sorted(str(p.relative_to(tmp)) for p in (tmp / "state").glob("*")) if sharded else []
    files = {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
             for f in names + shards}  # fmt: skip
    (tmp / "manifest.json").write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(final.parent, rcfg.bundle_keep)
    total = sum(v["bytes"] for v in files.values()) / 2**20
    note = " (state left out: over rollback.bundle_max_mb)" if omitted else ""
    parts = [f for f in shards if f.endswith(".distcp")]
    if parts:
        note = f" (FSDP: model and optimizer as {len(parts)} shards, {', '.join(parts)})"
    # a model we did not build: its replay imports the user's code, by the user's choice
    flag = "--trust-code " if meta["host"].get("kind") in ("lightning", "guard") else ""
    print(f"[bundle] repro bundle: {final} ({total:.1f} MB, {time.perf_counter() - t0:.2f} s)"
          f"{note}; replay it with: stabilize-replay {flag}{final}", flush=True)  # fmt: skip
    return final


def _prune(root: Path, keep: int) -> None:
    """The newest ``keep`` bundles by step stay (-1: all)."""
    if keep < 0:
        return
    done = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
    for p in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(p, ignore_errors=True)
