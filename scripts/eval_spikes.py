"""Score the spike forecast (``monitor.curvature.forecast``) on a labelled set of real runs.

    python scripts/eval_spikes.py [--save runs.json | --load runs.json ...] [--shard I/N]
                                  [--quick] [--holdout] [--past-line] [--reach] [--horizon 40]
                                  [--doc docs/forecast.md [--doc-block NAME]]

The set, the labels and the scoring: benchmarks/spike_eval.py. Each run is trained in
this process with every step logged and the curvature measured on every step; its per-step
``StepStats`` (the monitors' input) are recorded, and the monitor, forecast on, is fed them
again at each cadence scored: the monitor is a function of them alone, so the replay gives
the warnings the live run would have logged. ``--save`` keeps every finished run (an
interrupted set resumes from it); ``--shard I/N`` records every N-th run from the I-th (two
processes, one per core); ``--load`` (repeatable) scores recorded runs without training.
``--doc`` writes the tables into the doc between its ``<!-- eval_spikes:begin/end -->``
markers (``--doc-block NAME``: another block). ``--past-line`` scores the forecast with
``monitor.curvature.past_line`` on; ``--holdout`` records the held-out set instead;
``--reach`` scores, instead of the forecast, what threshold rules chosen on the set itself
reach (spike_reach.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.docblock import write_measured
from benchmarks.lib import record_plan, record_stats
from benchmarks.spike_eval import BASE, holdout, report, spike_set
from benchmarks.spike_reach import reach


def record(group: str, name: str, overrides: list[str], root: Path) -> dict:
    rc, steps = record_stats(name, [*BASE, *overrides], root)
    fault = rc.fault.step if rc.fault.kind != "none" else None
    return {"group": group, "name": name, "overrides": overrides, "fault_step": fault,
            "steps": steps}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", type=Path, help="write the recorded runs here (JSON; runs already "
                   "in it are kept, not rerun)")  # fmt: skip
    p.add_argument("--load", type=Path, action="append", default=[],
                   help="score runs recorded by --save (repeatable: a run in two "
                   "files is scored once); no training")  # fmt: skip
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="record every N-th run of the set from the I-th")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="the set's first natural and "
                   "healthy runs, 12 steps each (a smoke run)")  # fmt: skip
    p.add_argument("--horizon", type=int, default=40, help="the forecast's horizon (steps)")
    p.add_argument(
        "--holdout",
        action="store_true",
        help="record the held-out set instead "
        "(spike_eval.holdout: recorded after the past-line rule, scored after)",
    )
    p.add_argument(
        "--past-line",
        action="store_true",
        help="score with monitor.curvature.past_line=true (a point past its line is warned too)",
    )
    p.add_argument(
        "--doc-block",
        default="eval_spikes",
        metavar="NAME",
        help="the doc's block to write (<!-- NAME:begin/end -->)",
    )
    p.add_argument(
        "--reach",
        action="store_true",
        help="instead of the forecast's tables: what threshold rules on the optimizer-state "
        "series reach, chosen on the set itself (benchmarks/spike_reach.py)",
    )
    p.add_argument("--doc", type=Path, help="also write the tables into this doc")
    args = p.parse_args(argv)
    i, _, n = args.shard.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        print(f"--shard {args.shard!r}: not I/N with 0 <= I < N", file=sys.stderr)
        return 2
    if args.load:
        by_name = {}  # a run in two files (copies merged) is scored once
        for f in args.load:
            for r in json.loads(f.read_text()):
                by_name.setdefault(r["name"], r)
        runs = list(by_name.values())
    else:
        runs = json.loads(args.save.read_text()) if args.save and args.save.exists() else []
        plan = (holdout() if args.holdout else spike_set())[int(i) :: int(n)]
        if args.quick:
            plan = [(g, f"{name}-quick", [*(o for o in ov if not o.startswith(
                "trainer.max_steps=")), "trainer.max_steps=12"])
                    for g, name, ov in plan if g != "planted"][:2]  # fmt: skip
        record_plan(plan, runs, args.save, "eval_spikes-", record)
    rule = ", past_line=true" if args.past_line else ""
    if args.reach:
        text = reach(runs, args.horizon)
    else:
        head = f"spike forecast: monitor.curvature.forecast{rule}, horizon {args.horizon} steps"
        text = f"{head}; {len(runs)} runs\n\n" + report(runs, args.horizon, args.past_line)
    print(text)
    if args.doc:
        return write_measured(args.doc, args.doc_block, "eval_spikes.py", argv, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
