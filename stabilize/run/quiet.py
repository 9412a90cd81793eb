"""Known third-party noise off the console (``verbose=true`` shows it), and the run's
description first.

A default run prints our lines only: the step lines, the ``[stability]`` lines, the final
summary. Each pattern below is a message another package prints in every run although it
says nothing about this one; anything not listed here still reaches the console. Lightning's
model summary (``Total FLOPs: 0``) is turned off in the Trainer instead (``lit/build.py``;
the run's one-line model description replaces it), and W&B's banner and ~25-line summary by
its own silent mode (the final summary says where the offline run is and how to sync it).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# logger name -> messages (regex, matched at the start) that are noise in every run
NOISE_LOGS: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.utilities.rank_zero": (
        r"(GPU|TPU|HPU) available",  # the accelerator lines
        r"💡 Tip",  # advertises other Lightning products
    ),
    "lightning.fabric.utilities.rank_zero": (r"-+\ndistributed_backend=",),  # DDP banner
    "lightning.fabric.utilities.distributed": (r"Initializing distributed: ",),
    "lightning.pytorch.accelerators.cuda": (r"LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES",),
}

# warnings (regex on the message, matched at the start) that are false or not actionable here
NOISE_WARNINGS: tuple[str, ...] = (
    # fp16: the GradScaler skipped an optimizer step and Lightning still stepped the scheduler.
    # Harmless here: the LR is a function of the model's step (lit/module.py), not of how
    # often the scheduler was stepped.
    r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`",
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's use of a deprecated torch API
    r"Precision .* is not supported by the model summary",  # the summary is off by default
)


class _DropNoise(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p.match(msg) for p in self.patterns)


@contextmanager
def quiet(verbose: bool = False) -> Iterator[None]:
    """Inside: the known noise is dropped (nothing, with ``verbose``). Everything is put
    back on the way out (a sweep's next member, or a test, starts clean)."""
    if verbose:
        yield
        return
    filters = [(logging.getLogger(name), _DropNoise(p)) for name, p in NOISE_LOGS.items()]
    for logger, f in filters:
        logger.addFilter(f)
    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"  # read by wandb.init and by run.finish()
    try:
        with warnings.catch_warnings():
            for pattern in NOISE_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
        if silent is None:
            os.environ.pop("WANDB_SILENT", None)
        else:
            os.environ["WANDB_SILENT"] = silent


# Loggers whose lines before the run's one-line description wait until it is printed (the
# README promises the description first): the token cache's build and mapping (in the
# start-up checks), matplotlib's font cache (built on a fresh machine when Lightning imports
# it: noise, dropped below ERROR unless verbose)
HELD = ("stabilize.data", "matplotlib")


class _Hold(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.loggers: list[tuple[logging.Logger, bool]] = []  # (logger, its own propagate)
        self.verbose = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_HOLD = _Hold()


@contextmanager
def held_until_described(verbose: bool = False) -> Iterator[None]:
    """Inside, until ``described()``: the HELD loggers' lines wait, then follow in order (on
    the way out at the latest: a run refused before its description still shows them)."""
    if not _HOLD.loggers:  # not nested (a run inside a run holds once)
        _HOLD.verbose = verbose
        for name in HELD:
            logger = logging.getLogger(name)
            _HOLD.loggers.append((logger, logger.propagate))
            logger.propagate = False
            logger.addHandler(_HOLD)
    try:
        yield
    finally:
        described()


def described() -> None:
    """The description is out: the held lines are logged now (a no-op when none is held)."""
    while _HOLD.loggers:
        logger, propagate = _HOLD.loggers.pop()
        logger.removeHandler(_HOLD)
        logger.propagate = propagate
    records, _HOLD.records = _HOLD.records, []
    for r in records:
        if r.name.startswith("matplotlib") and r.levelno < logging.ERROR and not _HOLD.verbose:
            continue
        logging.getLogger(r.name).handle(r)
