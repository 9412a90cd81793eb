"""What the harness costs a user, part by part: each adapter and each part of the engine
against the bare loop, step-interleaved in one process.

    python scripts/bench_cost.py [--quick] [--configs tiny,wide] [--block 5] [--rounds 12]
                                 [--runs 1] [--threads 1] [--no-parts] [--no-hf]
                                 [--set KEY=VALUE ...]

One real ``stabilize.train.run`` (the Lightning path, every default on: monitors, rollback
snapshots, checkpoints, the CSV and W&B offline loggers) drives; from a callback at the end
of its blocks the other arms run theirs, each its own model on the same GPTConfig, data,
AdamW, LR schedule, clipping and precision (bench_step.py's ``bare_steps``): the bare loop;
a second bare loop, the method's zero (its ratio to the first is the bias of an arm's
place in the process: allocator, caches); the same loop under ``stabilize.Guard`` with
every default on; and, unless ``--no-parts``,
one Guard per part of the engine with that part off, and one with every part off
(benchmarks/harness_cost.py's PARTS). A round is: a Lightning block, each other arm's block in
order, the same in reverse, a Lightning block; each arm runs two blocks of ``--block``
steps a round (at the defaults one log step and one snapshot), and their positions mirror,
so a drift of the shared machine that is linear over the round hits every arm alike. The
order turns by one arm each round: the arm in the middle runs its two blocks back to back
(its model still in the cache), and each arm is that one in as many rounds.
Per round an arm's ratio is (the bare loop's time per step) / (its own); a part's share is
the full Guard's cost minus the cost of the Guard with that part off, in points of a bare
step. Medians over rounds, quartiles beside them. Lightning's time is the interval between
its own step ends minus the other arms' blocks run in it.

``--runs N`` repeats the whole measurement N times in the process, each time with fresh arms
(new models, new allocations): at tiny the arms moved by up to 4 points between runs, more
than the interval over rounds inside one run says (docs/guide.md); the verdict is then the
median over runs, with every run's ratio beside it.

Targets, per config: the full path (Lightning, and the Guard) >= 0.95 of the bare loop at
tiny, >= 0.985 at wide (width 512: the harness <= 1.5 points of a step). The Lightning
loop's own share is measured by running again with ``--set monitor=off rollback=off``
(every arm then has the harness off: the ratio is Lightning's loop alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L
import torch
from bench_step import AUTOCAST, bare_steps

from benchmarks.harness_cost import (
    ALL_OFF,
    PARTS,
    TIMED_ARM,
    PartClock,
    Times,
    adapter_rows,
    print_cuts,
    print_parts,
    print_timed,
    ratio_of,
)
from benchmarks.hf_arm import hf_steps
from benchmarks.lib import CONFIGS, add_run_args, compose_cfg, prepare, run_overrides, train_with
from benchmarks.stats import md_table

TARGETS = {"tiny": 0.95, "wide": 0.985}  # others: 0.97
ADAPTERS = [("lightning", "Lightning path (StabilityCallback, loggers, checkpoints)", "bare"),
            ("guard", "plain loop under Guard", "bare")]  # fmt: skip
HF = ("hf+callback", "Hugging Face Trainer + HFStabilityCallback (its own bare loop: the "
      "same Trainer without it, a Llama of the run's shape)", "hf")  # fmt: skip
TWIN = ("twin", "a second bare loop (the method's zero: any gap is the method's bias)", "bare")


class Rounds(L.Callback):
    """Times Lightning's blocks and runs every other arm's between them."""

    def __init__(self, arms: dict, block: int, warmup: int, rounds: int, parts: PartClock):
        self.arms, self.block, self.warmup, self.n = arms, block, warmup, rounds
        self.parts = parts  # counts in the full Guard's blocks only
        self.times = Times()
        self.last: float | None = None
        self.l_steps: list[float] = []  # Lightning's step intervals in the current block
        self.l_blocks = 0

    def on_train_start(self, trainer, pl_module):
        for steps in self.arms.values():  # every arm's first slow steps, out of the window
            for _ in range(self.warmup):
                next(steps)

    def _run(self, name: str) -> None:
        self.parts.active = name == TIMED_ARM
        steps, marks = self.arms[name], [time.perf_counter()]
        for _ in range(self.block):
            loss = next(steps)
            marks.append(time.perf_counter())  # on CPU the step is done when next() returns
        loss.item()  # the block's work done (a device sync on CUDA)
        self.times.add(name, [b - a for a, b in zip(marks, marks[1:], strict=False)])
        if self.parts.active:
            self.parts.steps += self.block
        self.parts.active = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        if trainer.global_step <= self.warmup or self.l_blocks >= 2 * self.n:
            self.last = now
            return
        self.l_steps.append(now - self.last)
        if len(self.l_steps) == self.block:
            if self.l_blocks % 2 == 0:
                self.times.rounds.append({})
            self.times.add("lightning", self.l_steps)
            self.l_steps, self.l_blocks = [], self.l_blocks + 1
            if self.l_blocks % 2 == 1:  # the round's first Lightning block: the others now
                order, r = list(self.arms), len(self.times.rounds) - 1
                order = order[r % len(order) :] + order[: r % len(order)]
                for name in order + order[::-1]:
                    self._run(name)
        self.last = time.perf_counter()


def bench(name: str, args, tmp: Path) -> list[dict[str, float]]:
    total = args.warmup + 2 * args.block * args.rounds + 1
    base = [*run_overrides(CONFIGS[name], args.precision, total, "wandb"), *args.set]
    cfg = compose_cfg(str(tmp / name), base)
    clock = PartClock()
    arms = {"bare": bare_steps(cfg), "twin": bare_steps(cfg),
            "guard": bare_steps(cfg, guard_dir=tmp / f"{name}-g"),
            TIMED_ARM: bare_steps(cfg, guard_dir=tmp / f"{name}-t",
                                  patch=clock.attach)}  # fmt: skip
    if args.hf:
        steps = args.warmup + 2 * args.block * args.rounds + 5
        arms["hf"] = hf_steps(cfg, tmp / f"{name}-hf", False, steps)
        arms["hf+callback"] = hf_steps(cfg, tmp / f"{name}-hfc", True, steps)
    for i, p in enumerate([] if args.no_parts else [*PARTS, ALL_OFF]):
        pcfg = compose_cfg(str(tmp / name), [*base, *p.overrides])
        arms[p.arm] = bare_steps(pcfg, guard_dir=tmp / f"{name}-p{i}", patch=p.patch)
    rounds = Rounds(arms, args.block, args.warmup, args.rounds, clock)
    train_with(cfg, rounds)
    return rounds.times.complete(2 * args.block), clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=1, pairs="(unused here)")
    ap.add_argument("--precision", default="fp32", choices=sorted(AUTOCAST))
    ap.add_argument("--block", type=int, default=5, help="steps per block (two a round)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds timed")
    ap.add_argument("--no-parts", action="store_true", help="the adapters only")
    ap.add_argument("--runs", type=int, default=1,
                    help="independent runs, each with fresh arms (the verdict: the median "
                    "over runs, their range beside it; the tables: the last run's)")  # fmt: skip
    ap.add_argument("--no-hf", dest="hf", action="store_false",
                    help="leave the Hugging Face Trainer's arms out")  # fmt: skip
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides, every arm")  # fmt: skip
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.hf and importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: the Hugging Face arms are left out")
        args.hf = False
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.runs < 1:
        ap.error(f"--runs: {args.runs} is not allowed (an integer >= 1)")
    every: list[dict] = []  # per run: {config: (rounds, clock)}
    with tempfile.TemporaryDirectory(prefix="bench_cost-") as tmp:
        for i in range(args.runs):
            every.append({n: bench(n, args, Path(tmp) / f"run{i}") for n in names})
    results = every[-1]
    print(
        f"\n{args.precision}, {args.rounds} rounds of two blocks of {args.block} steps per "
        f"arm, {torch.get_num_threads()} torch threads, load average {args.load:.1f} at "
        f"start on {os.cpu_count()} cores{', --set ' + ' '.join(args.set) if args.set else ''}"
    )
    for n, (rounds, clock) in results.items():
        print(f"\n{n}: each adapter's throughput / the bare loop's, per round\n")
        head = ["adapter", "rounds", "bare ms/step", "its ms/step", "ratio",
                "90% interval", "per round: median (quartiles)"]  # fmt: skip
        adapters = [*ADAPTERS, *([HF] if args.hf else []), TWIN]
        print("\n".join(md_table(head, adapter_rows(rounds, adapters))))
        print(f"\n{n}: where the full Guard's time goes, timed inside its blocks\n")
        print_timed(rounds, clock)
        print(f"\n{n}: this round's cuts, before and after, timed alone\n")
        print_cuts(clock)
        if not args.no_parts:
            print(f"\n{n}: the Guard's cost, one part off at a time (points of a bare step)\n")
            print_parts(rounds, [*PARTS])
        print()
        target = TARGETS.get(n, 0.97)
        judged = [*ADAPTERS, *([HF] if args.hf else [])]
        per_run = {arm: [ratio_of(arm, ref)(run[n][0]) for run in every]
                   for arm, _, ref in [*judged, TWIN]}  # fmt: skip
        if args.runs > 1:
            print(f"{n}: the ratio in each of {args.runs} independent runs\n")
            rows = [[words, *(f"{x:.3f}" for x in per_run[arm]),
                     f"{statistics.median(per_run[arm]):.3f}",
                     f"{min(per_run[arm]):.3f} to {max(per_run[arm]):.3f}"]
                    for arm, words, _ in [*judged, TWIN]]  # fmt: skip
            head = ["adapter", *(f"run {i + 1}" for i in range(args.runs)), "median", "range"]
            print("\n".join(md_table(head, rows)) + "\n")
        for arm, _, ref in judged:
            r = round(statistics.median(per_run[arm]), 3)
            how = f", the median of {args.runs} runs" if args.runs > 1 else ""
            print(f"target {n}: {arm} / {ref} = {r:.3f}{how} (>= {target}) "
                  f"{'PASS' if r >= target else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
