"""Score the delayed-scaling forecast (``monitor.quant``) on a labelled set of real runs.

    python scripts/eval_quant_forecast.py [--save runs.json | --load runs.json] [--quick]
                                          [--holdout] [--set KEY=VALUE ...]
                                          [--doc docs/formats.md [--doc-block NAME]]

The set, the labels and the scoring: benchmarks/quant_forecast.py. Each run trains in this
process with every step measured; its per-step ``StepStats`` are recorded and the monitor is
fed them again at the settings scored (``--set``: a ``monitor.quant`` key, e.g.
``--set window=12``). ``--save`` keeps every finished run (an interrupted set resumes from
it); ``--load`` scores recorded runs without training; ``--quick`` records the first rising
and healthy runs, 60 steps each (a smoke run). ``--doc`` writes the tables into the doc
between its ``<!-- eval_quant_forecast:begin/end -->`` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.docblock import write_measured
from benchmarks.lib import record_plan, record_stats
from benchmarks.quant_forecast import BASE, quant_holdout, quant_set, report
from stabilize.monitors.quant import QuantMonitorConfig


def _settings(pairs: list[str]) -> QuantMonitorConfig | str:
    """``monitor.quant`` at its defaults, the forecast on, with ``KEY=VALUE`` pairs set; the
    error line else."""
    fields = {f.name: f for f in dataclasses.fields(QuantMonitorConfig)}
    kw: dict = {"forecast": True}
    for kv in pairs:
        key, _, value = kv.partition("=")
        key = key.removeprefix("monitor.quant.")
        if key not in fields or key == "enabled" or not value:
            return f"--set {kv!r}: not a monitor.quant KEY=VALUE; keys: " + ", ".join(
                k for k in fields if k != "enabled"
            )
        default = getattr(QuantMonitorConfig(), key)
        if isinstance(default, bool):
            if value.lower() not in ("true", "false"):
                return f"--set {kv!r}: {key} takes true or false"
            kw[key] = value.lower() == "true"
            continue
        try:
            kw[key] = type(default)(value)
        except ValueError:
            return f"--set {kv!r}: {key} takes a {type(default).__name__}"
    try:
        return QuantMonitorConfig(**kw)
    except ValueError as e:
        return f"--set: {e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", type=Path, help="write the recorded runs here (JSON; runs already "
                   "in it are kept, not rerun)")  # fmt: skip
    p.add_argument("--load", type=Path, help="score runs recorded by --save; no training")
    p.add_argument("--quick", action="store_true", help="the first rising and healthy runs, "
                   "60 steps each (a smoke run)")  # fmt: skip
    p.add_argument("--holdout", action="store_true", help="record (or score) the held-out set "
                   "instead (quant_forecast.quant_holdout: recorded before, scored after, the "
                   "settings chosen on the set)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a monitor.quant setting to score at (repeatable)")  # fmt: skip
    p.add_argument("--doc", type=Path, help="also write the tables into this doc")
    p.add_argument("--doc-block", default="eval_quant_forecast", metavar="NAME",
                   help="the doc's block to write (<!-- NAME:begin/end -->)")  # fmt: skip
    args = p.parse_args(argv)
    cfg = _settings(args.set)
    if isinstance(cfg, str):
        print(f"eval_quant_forecast.py: {cfg}", file=sys.stderr)
        return 2
    if args.load:
        runs = json.loads(args.load.read_text())
    else:
        runs = json.loads(args.save.read_text()) if args.save and args.save.exists() else []
        plan = quant_holdout() if args.holdout else quant_set()
        if args.quick:
            plan = [next(x for x in plan if x[0] == g) for g in ("rising", "healthy")]
            plan = [(g, f"{n}-quick", [*ov, "trainer.max_steps=60"]) for g, n, ov in plan]

        def record(group, name, ov, tmp):
            _, steps = record_stats(name, [*BASE, *ov], tmp)
            return {"group": group, "name": name, "overrides": ov, "steps": steps}

        record_plan(plan, runs, args.save, "eval_quant_forecast-", record)
    text = report(runs, cfg)
    print(text)
    if args.doc:
        return write_measured(args.doc, args.doc_block, "eval_quant_forecast.py", argv, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
