"""Disk use of a run's durable snapshots and periodic checkpoints vs the retention settings.

    python scripts/bench_disk.py [--steps 300] [--model tiny]

Runs ``--steps`` optimizer steps (CPU, the tiny GPT unless told) with a durable snapshot
and a checkpoint every 10 steps, once per retention setting, and prints the files and
bytes under ``snapshots/`` and ``checkpoints/`` at the end, with the bound the settings
promise: at most keep_durable snapshot files and keep_checkpoints + 1 (last.ckpt)
checkpoint files. With -1 (keep all) disk use grows with the run's length.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.lib import CONFIGS, compose_cfg
from stabilize.train import run

EVERY = 10
SETTINGS = [  # (rollback.keep_durable, trainer.keep_checkpoints)
    (-1, -1),  # keep everything: the old default
    (3, 5),  # the defaults
    (1, 1),
]


def usage(directory: Path, pattern: str) -> tuple[int, int]:
    files = list(directory.glob(pattern)) if directory.is_dir() else []
    return len(files), sum(f.stat().st_size for f in files)


def one(run_dir: Path, model: str, steps: int, keep_durable: int, keep_ckpt: int) -> dict:
    cfg = compose_cfg(
        str(run_dir),
        [
            *CONFIGS[model],
            "logger=none",
            "trainer.progress=none",
            "trainer.accelerator=cpu",
            f"trainer.max_steps={steps}",
            "trainer.log_every_n_steps=50",
            "trainer.val_check_interval=100000",
            f"trainer.checkpoint_every_n_steps={EVERY}",
            f"trainer.keep_checkpoints={keep_ckpt}",
            f"rollback.snapshot_every={EVERY}",
            f"rollback.durable_every={EVERY}",
            f"rollback.keep_durable={keep_durable}",
            "data.batch_size=4",
            "model.block_size=64",
        ],
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # Lightning's model summary
        run(cfg)
    n_s, b_s = usage(run_dir / "snapshots", "snapshot-*.pt")
    n_c, b_c = usage(run_dir / "checkpoints", "*.ckpt")
    # what the settings allow: a durable snapshot at step 0 and every EVERY steps; a
    # periodic checkpoint every EVERY steps, and last.ckpt
    kd = steps // EVERY + 1 if keep_durable == -1 else min(keep_durable, steps // EVERY + 1)
    kc = (steps // EVERY if keep_ckpt == -1 else min(keep_ckpt, steps // EVERY)) + 1
    bound = kd * b_s / max(1, n_s) + kc * b_c / max(1, n_c)
    return {
        "setting": f"{keep_durable} / {keep_ckpt}",
        "snapshots": f"{n_s} (<= {kd})",
        "checkpoints": f"{n_c} (<= {kc})",
        "MB": (b_s + b_c) / 1e6,
        "bound_MB": bound / 1e6,
        "grows": "with steps" if -1 in (keep_durable, keep_ckpt) else "no",
        "s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    args = ap.parse_args()
    print(
        f"disk after {args.steps} steps, model {args.model}: a durable snapshot and a "
        f"checkpoint every {EVERY} steps (last.ckpt besides)"
    )
    head = f"{'keep_durable / keep_checkpoints':>32} {'snapshots':>10} {'checkpoints':>12}"
    print(f"{head} {'MB on disk':>11} {'bound MB':>9} {'grows':>11} {'run s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kd, kc) in enumerate(SETTINGS):
            r = one(Path(tmp) / f"r{i}", args.model, args.steps, kd, kc)
            print(
                f"{r['setting']:>32} {r['snapshots']:>10} {r['checkpoints']:>12} "
                f"{r['MB']:>11.2f} {r['bound_MB']:>9.2f} {r['grows']:>11} {r['s']:>7.1f}"
            )


if __name__ == "__main__":
    main()
