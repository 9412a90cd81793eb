"""``stabilize-report``: compare runs (a scenario's arms) in a table, plots and conclusions.

    stabilize-report RUN_DIR [RUN_DIR ...] [--out DIR] [--title T] [--cost cost.json]
    stabilize-report --wandb ENTITY/PROJECT --group G [--out DIR]

Writes DIR/report.md (default: the common parent of the run dirs) with one table row per
run, the chain of events, each forecast warning beside its real lead, PNG plots beside it
(x: the model's step), and for a scenario's arms the verdicts and conclusions its numbers
support (with ``--cost``, the step cost scripts/arm_cost.py measured paired), for a sweep a
table keyed by the swept values, for one run its conclusion: what went wrong, which remedy
fixed it, its repro bundles.
"""

from stabilize.report.chain import chain
from stabilize.report.cli import main, write_report
from stabilize.report.load import Run, load_run_dir, load_wandb
from stabilize.report.naming import arm_names
from stabilize.report.summary import summarize

__all__ = [
    "Run",
    "arm_names",
    "chain",
    "load_run_dir",
    "load_wandb",
    "summarize",
    "write_report",
    "main",
]
