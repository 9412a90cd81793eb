"""Start-up cost: ``stabilize-train --help`` and a config error vs a 1-step run, side by side.

    python scripts/bench_startup.py [--repeats 5]

Each repeat runs, one after the other in fresh processes, ``stabilize-train --help``,
``stabilize-train norm.type=groupnorm`` (a config error: exit 2) and a 1-step run of the
tiny GPT (``trainer.max_steps=1``, W&B off, no validation), and times each from the
process's start to its exit. Prints the median (min to max) of each and the ratios of the
medians to the 1-step run's (the target: ``--help`` under 1/5 of it). The executable
is the ``stabilize-train`` beside this Python (a venv's), else ``python -m stabilize.train``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.stats import load_average, print_table, span

ONE_STEP = [
    "trainer.max_steps=1",
    "trainer.val_check_interval=1000",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.progress=none",
    "logger=none",
    "audit.every=0",
]
CASES = {
    "--help": ["--help"],
    "config error": ["norm.type=groupnorm"],
    "1-step run": ONE_STEP,
}


def command() -> list[str]:
    exe = Path(sys.executable).parent / "stabilize-train"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "stabilize.train"]


def timed(args: list[str], cwd: str) -> float:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    r = subprocess.run([*command(), *args], cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 2):
        sys.exit(f"bench_startup: {' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in CASES}
    print(f"load average before: {load_average():.2f}; command: {' '.join(command())}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, case in CASES.items():  # interleaved: a load change hits all three
                run_dir = f"hydra.run.dir={tmp}/r{i}-{name.replace(' ', '_')}"
                times[name].append(timed([*case, run_dir], tmp))
    base = statistics.median(times["1-step run"])
    rows = [
        [name, span(ts, "{:.2f}"), f"{statistics.median(ts) / base:.3f}"]
        for name, ts in times.items()
    ]
    print_table(["command", f"wall s, median (min to max) of {args.repeats}", "/ 1-step"], rows)
    print(f"load average after: {load_average():.2f}")


if __name__ == "__main__":
    main()
