"""The snapshot ring under DDP: host bytes per rank and snapshot cost.

    python scripts/bench_snapshots.py [--model 125m] [--steps 20] [--worlds 1,2]

For each world size, one real run under torchrun on CPU (gloo) at the rollback defaults
(``snapshot_every=10``, ``keep=3``, ``durable_every=100``): each rank times every
``RollbackController.snapshot`` call and every training step (batch start to batch end,
the snapshot inside it) with the host clock, and at the end of training measures the host
bytes its ring holds (``sharded.host_bytes``: distinct tensor storages). Printed per world:
the ring per rank, its ratio to world 1, and the snapshots' share of the run's step time
(amortized: all snapshot time over all step time, the first snapshot before step 1
included; the first ``keep`` snapshots allocate and page in their buffers) and the steady
share (snapshots after the ring is full, which reuse the buffers of the one leaving it,
over ``snapshot_every`` mean steps; needs more than 20 steps). A world above 1 keeps
1/world of each snapshot per rank (rollback/sharded.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L

from benchmarks.lib import ROOT, compose_cfg, mute_progress
from stabilize.lit.stability import StabilityCallback
from stabilize.rollback.sharded import host_bytes

CONFIGS = {
    "125m": ["model=gpt-125m", "model.block_size=128", "data.batch_size=2"],
    "tiny": ["model=tiny", "model.block_size=64", "data.batch_size=4"],
}


KEEP, EVERY = 3, 10  # the rollback defaults (configs/rollback/default.yaml)


class SnapClock(L.Callback):
    """Times each snapshot and each step on this rank; the ring's bytes at the end."""

    def __init__(self, out: Path):
        self.out = out
        self.snap_s: list[float] = []
        self.step_s: list[float] = []
        self._t = 0.0

    def setup(self, trainer, pl_module, stage):
        sc = next(c for c in trainer.callbacks if isinstance(c, StabilityCallback))
        self.sc, ctl = sc.engine, sc.engine.controller
        real = ctl.snapshot

        def timed(*args, **kwargs):
            t = time.perf_counter()
            real(*args, **kwargs)
            self.snap_s.append(time.perf_counter() - t)

        ctl.snapshot = timed

    def on_train_start(self, trainer, pl_module):
        mute_progress(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_s.append(time.perf_counter() - self._t)

    def on_train_end(self, trainer, pl_module):
        ring = self.sc.ring.ring
        rec = {
            "world": trainer.world_size,
            "rank": trainer.global_rank,
            "ring_bytes": sum(host_bytes(s.state) for s in ring),
            "ring_steps": [s.step for s in ring],
            "ring_each": [host_bytes(s.state) for s in ring],
            "snap_s": self.snap_s,
            "steps": len(self.step_s),
            "step_s": sum(self.step_s),
        }
        (self.out / f"w{trainer.world_size}-r{trainer.global_rank}.json").write_text(
            json.dumps(rec)
        )


def worker(args) -> None:
    import logging
    import warnings

    from stabilize.train import run

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    out = Path(args.worker)
    cfg = compose_cfg(
        os.environ["STABILIZE_RUN_DIR"],
        [
            *CONFIGS[args.model],
            "logger=none",
            "trainer.progress=plain",
            "trainer.accelerator=cpu",
            f"trainer.max_steps={args.steps}",
            "trainer.val_check_interval=100000",
            "trainer.limit_val_batches=0",
            "trainer.checkpoint_every_n_steps=100000",
        ],
    )
    run(cfg, callbacks=[SnapClock(out)])


def launch(world: int, args, tmp: Path) -> list[dict]:
    out = tmp / f"w{world}"
    out.mkdir()
    env = {
        **os.environ,
        "STABILIZE_RUN_DIR": str(out / "run"),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += [__file__, "--worker", str(out), "--model", args.model, f"--steps={args.steps}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"world {world} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return [json.loads((out / f"w{world}-r{i}.json").read_text()) for i in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="125m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    worlds = [int(w) for w in args.worlds.split(",")]
    print(
        f"snapshot ring under DDP, model {args.model} ({' '.join(CONFIGS[args.model])}), "
        f"{args.steps} steps, CPU, rollback defaults (snapshot_every=10, keep=3, "
        f"durable_every=100); load average {os.getloadavg()[0]:.1f}"
    )
    head = ["world", "rank", "ring steps", "ring MB/rank", "vs world 1", "snapshots"]
    head += ["snap s (each)", "steps", "step s", "snap share", "steady share"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for rec in launch(world, args, Path(tmp)):
                mb = rec["ring_bytes"] / 1e6
                if world == 1:
                    base = mb
                ratio = f"{mb / base:.3f}" if base else "-"
                snaps = rec["snap_s"]
                each = ", ".join(f"{s:.2f}" for s in snaps)
                total = rec["step_s"] + snaps[0]  # the first snapshot runs before step 1
                cells = [world, rec["rank"], rec["ring_steps"], f"{mb:.1f}", ratio, len(snaps)]
                cells += [each, rec["steps"], f"{total:.1f}", f"{sum(snaps) / total:.2%}"]
                # once the ring is full a snapshot reuses the buffers of the one leaving it
                # (no allocation): the long run's cost, per snapshot_every steps
                steady = snaps[KEEP:]
                every = rec["step_s"] / rec["steps"] * EVERY
                cells.append(f"{sum(steady) / len(steady) / every:.2%}" if steady else "-")
                print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
