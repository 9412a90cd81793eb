"""Comparing runs: a scenario's arms, a sweep's members or one run, read from run dirs or W&B
(``load.py``), into a table, the chain of events, verdicts, conclusions and plots. The
command, ``stabilize-report``, and ``write_report`` are in ``cli.py``."""

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
