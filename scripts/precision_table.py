"""The silent-gap table of docs/precision.md, measured: the main job's config in fp32 with
three seeds as the reference; silent runs (a planted biased rounding at a site, the main
job's bf16 arm), each judged against the reference (report/gap.py), bisected where the gap
is real (``stabilize-replay --gap``'s ``gap_bisect``, a window of ``--window`` steps) and
forked at step 0 to the reference's precision (``--tail``'s ``tail``).

Every run is composed with Hydra as the CLI does and trained in this process, one at a
time. The block it writes names the commit, the CPU, the threads and this command.

Usage: python scripts/precision_table.py [--steps 100] [--window 40] [--threads 2]
       [--runs lm_head:1,h.1:1,bf16,pure-bf16] [--set KEY=VALUE ...]
       [--doc docs/precision.md] [--block precision-table] [--out DIR]

``--set``: overrides for every run, the references included (e.g. optim.lr=3e-5); ``--block``:
the marked block of the doc it rewrites.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch

from benchmarks.docblock import commit, cpu, write_block
from benchmarks.lib import compose_cfg
from stabilize.replay.gap_bisect import gap_bisect, tail
from stabilize.report.gap import judge
from stabilize.report.load import load_run_dir
from stabilize.report.markdown import table
from stabilize.train import run

SEEDS = (1234, 1235, 1236)


def arm(spec: str) -> tuple[str, list[str]]:
    """``site:bits`` (a planted biased rounding), ``bf16`` (the main job's bf16 arm) or
    ``pure-bf16`` (bf16 weights with no fp32 master, bf16 AdamW moments, the loss in bf16)."""
    if spec == "pure-bf16":
        return "pure bf16: bf16 weights and moments, no master, bf16 loss", [
            "precision=bf16-true", "model.loss_dtype=logits"]  # fmt: skip
    if spec == "bf16":
        return "bf16-mixed, bf16 norm reductions", ["precision=bf16-mixed",
                                                     "norm.reduction_dtype=bf16"]  # fmt: skip
    site, _, bits = spec.partition(":")
    if not site or not bits.isdigit():
        sys.exit(f"precision_table.py: --runs item {spec!r} is not allowed; allowed: "
                 "SITE:BITS (e.g. lm_head:1), bf16 or pure-bf16")  # fmt: skip
    return f"{site} rounded toward zero, {bits} bit(s)", [
        "precision=fp32",
        "fault=biased_round",
        f"fault.site={site}",
        f"fault.bits={bits}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="lm_head:1,h.1:1,bf16,pure-bf16")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for every run, the references included")  # fmt: skip
    ap.add_argument("--doc", type=Path, default=Path("docs/precision.md"))
    ap.add_argument("--block", default="precision-table")
    ap.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arms = [(spec, *arm(spec)) for spec in args.runs.split(",")]
    base = ["experiment=main", f"trainer.max_steps={args.steps}", "trainer.progress=none",
            "logger=none", f"trainer.val_check_interval={max(1, args.steps // 2)}",
            *args.set]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        refs = []
        for s in SEEDS:
            d = root / f"fp32-{s}"
            print(f"reference seed {s} ...", flush=True)
            run(compose_cfg(str(d), [*base, "precision=fp32", f"seed={s}"]))
            refs.append(d)
        rows = [["run", "held-out gap (nats)", "in seed noise", "judge", "bisection (window "
                 f"{args.window})", "tail from step 0 recovers"]]  # fmt: skip
        for spec, words, overrides in arms:
            d = root / spec.replace(":", "-")
            print(f"{spec} ...", flush=True)
            run(compose_cfg(str(d), [*base, *overrides]))
            j = judge(load_run_dir(d), [load_run_dir(r) for r in refs])
            g = j.heldout
            said = "a real gap" if g.real else "inside the noise"
            bis, rec = "-", "-"
            if g.real:
                b = gap_bisect(d, refs, args.window)
                bis = ("no site closes it" if not b["culprits"] else
                       f"{', '.join(b['culprits'])} closes {100 * b['closed']:.0f}% +- "
                       f"{100 * b['closed_se']:.0f}% ({b['replays']} replays, "
                       f"{len(b['sites'])} sites)")  # fmt: skip
                t = tail(d, refs, 0)
                rec = f"{100 * t['share']:.0f}% +- {100 * t['share_se']:.0f}%"
            rows.append([words, f"{g.value:+.4f}", f"{g.sigma:+.1f} sigma", said, bis, rec])
    md = table(rows)
    cmd = "python scripts/precision_table.py " + shlex.join(sys.argv[1:])
    also = f" with {' '.join(args.set)}" if args.set else ""
    body = (f"Measured at {commit()} on {cpu()}, {args.threads} threads, with `{cmd.strip()}`: "
            f"the main job's config{also}, {args.steps} steps, references in fp32 with seeds "
            f"{', '.join(map(str, SEEDS))}; every silent run with seed 1234.\n\n{md}")  # fmt: skip
    print(body)
    return write_block(args.doc, args.block, body, "precision_table.py")


if __name__ == "__main__":
    sys.exit(main())
