"""Each scenario arm's training step against the reference's, timed paired in one process.

    python scripts/arm_cost.py --out DIR/cost.json [--experiment nan_repro]
        [--arms reference,baseline,fp32_reduction,bf16,large_eps] [--rounds 12]
        [--steps 1] [--warmup 2] [--threads N] [-- extra hydra overrides]

The runs of a scenario cannot price its arms: scripts/repro_nan.sh runs them two at a time
at different moments, on a machine other work shares, so the ratio of two runs' step times
is the machine's load as much as the arm (issue 34: 1.35-1.52 for every arm, bf16 included).
Here every arm's training step runs in this one process: bench_step.py's bare loop (the
arm's model and norms as its config composes them, its data, AdamW, LR schedule, clipping,
autocast and, for fp16, a GradScaler; no monitors, no rollback: their cost is the same in
every arm, benchmarks/monitor_toggle.py measures it), ``--steps`` steps per arm per round, the
arms in order on even rounds and reversed on odd ones, so a change of the machine's speed
hits every arm of a round alike. Writes ``cost.json`` (stabilize/report/cost.py reads it:
per round, each arm's step over the reference's; the report shows their median and range).
The remedy arm is not timed: its step is the baseline's until its rung changes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch
from bench_step import bare_steps

from benchmarks.docblock import cpu
from benchmarks.lib import compose_cfg

UNTIMED = ("remedy",)  # its step changes with the rung it takes: no one config to time
WHAT = "the bare step: the arm's model, AdamW, autocast and GradScaler; no monitors"


Clocks = dict[str, dict[str, list[float]]]


def measure(experiment: str, arms: list[str], rounds: int, steps: int, warmup: int,
            overrides: list[str], seed: int = 1234) -> Clocks:  # fmt: skip
    """{"wall" | "cpu": {arm: seconds per step, one value per round}}: the wall clock and
    this process's CPU time (with one thread, the second is not inflated by other work
    taking the core: the scenario's arms run beside it)."""
    need = warmup + rounds * steps
    gens = {}
    with tempfile.TemporaryDirectory(prefix="arm_cost-") as tmp:
        for arm in arms:
            over = [f"experiment={experiment}", f"arm={arm}", f"seed={seed}", *overrides]
            cfg = compose_cfg(f"{tmp}/{arm}", over)
            if cfg.trainer.max_steps < need:  # the loader yields max_steps batches
                cfg = compose_cfg(f"{tmp}/{arm}", [*over, f"trainer.max_steps={need}"])
            gens[arm] = bare_steps(cfg)
        for g in gens.values():  # first steps (allocation, autotuning) out of the timing
            for _ in range(warmup):
                next(g)
        out: Clocks = {"wall": {}, "cpu": {}}
        for r in range(rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    loss = next(gens[arm])
                loss.item()  # the step's work done (a GPU would queue it)
                out["wall"].setdefault(arm, []).append((time.perf_counter() - t0) / steps)
                out["cpu"].setdefault(arm, []).append((time.process_time() - c0) / steps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="arm_cost.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the cost.json to write")
    ap.add_argument("--experiment", default="nan_repro")
    ap.add_argument("--arms", default="reference,baseline,fp32_reduction,bf16,large_eps")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=1, help="steps per arm per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm")
    a = ap.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)} is not allowed; allowed: a positive integer")
    if a.threads:
        torch.set_num_threads(a.threads)
    arms = [x for x in a.arms.split(",") if x and x not in UNTIMED]
    arms = ["reference", *(x for x in arms if x != "reference")]
    t0 = time.perf_counter()
    clocks = measure(a.experiment, arms, a.rounds, a.steps, a.warmup, a.overrides)
    # one thread: its CPU time is the step's own work, whatever else shares the machine;
    # more threads: the wall clock (CPU time would count their spin-waits)
    clock = "cpu" if torch.get_num_threads() == 1 else "wall"
    out = {
        "what": WHAT,
        "clock": clock,
        "experiment": a.experiment,
        "cpu": cpu(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rounds": a.rounds,
        "steps": a.steps,
        "warmup": a.warmup,
        "untimed": [x for x in a.arms.split(",") if x in UNTIMED],
        "step_s": clocks[clock],
        "wall_step_s": clocks["wall"],
        "cpu_step_s": clocks["cpu"],
        "wall_s": time.perf_counter() - t0,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"arm_cost.py: {len(arms)} arms x {a.rounds} rounds in {out['wall_s']:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
