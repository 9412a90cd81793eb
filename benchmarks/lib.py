"""The harness the training benchmarks share: an offline environment, the common command
line, Hydra composition of the real configs, the bench model sizes, a clock callback that
stamps every optimizer step, and one real training run with it.

The environment (``offline_environment``: W&B offline and silent, datasets offline) is set
when a benchmark composes its first run (``compose_cfg``), never on import: wandb reads it
at ``wandb.init`` and datasets, imported lazily by the data pipeline, when it loads. The
statistics and tables the scripts print are in stats.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import wandb
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import stabilize.train  # (the config's resolvers and the dataclasses' defaults)
from benchmarks.stats import load_average
from stabilize.lit.progress import PlainProgress
from stabilize.paths import config_dir
from stabilize.run.config import RunConfig

# the checkout the benchmarks run from (benchmarks/ is not installed: it sits beside scripts/)
ROOT = Path(__file__).resolve().parents[1]


def offline_environment() -> None:
    """A benchmark never reaches the network: W&B offline (whatever WANDB_MODE said), W&B
    silent and datasets offline unless the caller chose otherwise."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


CONFIGS = {
    "tiny": ["model=tiny"],
    "small": ["model=tiny", "model.n_layer=4"],  # twice tiny's depth: ~2x its step time
    # tiny's depth at 4x its width: the matmuls grow 16x, the per-layer monitoring work less
    "wide": ["model=tiny", "model.d_model=512", "model.n_head=8"],
    # GPT-3 Small at 4 x 2048 tokens: for a GPU (scripts/gpu_check.sh's stage 4)
    "gpt-125m": ["model=gpt-125m", "data.batch_size=4"],
}


def compose_cfg(run_dir: str, overrides: list[str]) -> RunConfig:
    """configs/train.yaml composed with Hydra as the CLI does, as a typed RunConfig (the
    benchmark's environment set first: ``offline_environment``)."""
    offline_environment()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"run_dir={run_dir}", *overrides])
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def mute_progress(trainer) -> None:
    """Silence the plain progress lines of a benchmarked run."""
    for cb in trainer.callbacks:
        if isinstance(cb, PlainProgress):
            cb.stream = io.StringIO()


def add_run_args(ap, configs: dict, repeats: int, pairs: str) -> None:
    """The options every training benchmark takes: its window, its pairs of runs, which
    configs, how many torch threads (``prepare`` checks and applies them)."""
    ap.add_argument("--quick", action="store_true", help="tiny only, 2 pairs (< 90 s)")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=repeats, help=f"{pairs} pairs")
    ap.add_argument("--configs", default="tiny,small", help=f"of {sorted(configs)}")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")


def prepare(ap, args, configs: dict) -> list[str]:
    """After parsing: --quick, --threads, --configs checked, Lightning's chatter muted, and
    the load average recorded (over cores - threads, other jobs stall OpenMP threads)."""
    import logging
    import warnings

    if args.quick:
        args.configs, args.repeats = "tiny", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    for n in names:
        if n not in configs:
            ap.error(f"--configs: {n!r} is not one of {sorted(configs)}")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning\..*")
    args.load = load_average()
    return names


def run_overrides(config: list[str], precision: str, total: int, logger: str) -> list[str]:
    """The benchmarks' common run: a config, a precision, ``total`` steps, no validation, plain
    progress (muted by the benchmarks' callbacks), the given logger."""
    return [
        *config,
        f"precision={precision}",
        f"trainer.max_steps={total}",
        "trainer.limit_val_batches=0",
        "trainer.progress=plain",
        f"logger={logger}",
    ]


class StepClock(L.Callback):
    """``perf_counter`` and ``process_time`` after every optimizer step, keyed by
    global_step; the device is synced at the window's two edges only, so a GPU run is not
    slowed by it. Its ``on_train_batch_end`` runs after the LR scheduler step and before the
    checkpoint callback, which Lightning orders last."""

    def __init__(self, edges: tuple[int, ...] = ()):
        self.edges = edges
        self.t: dict[int, float] = {}
        self.cpu: dict[int, float] = {}

    def stamp(self, step: int) -> None:
        """Record both clocks as the time after ``step``."""
        self.t[step], self.cpu[step] = time.perf_counter(), time.process_time()

    def on_train_start(self, trainer, pl_module):
        mute_progress(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.edges and pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.stamp(step)


def train_with(cfg: RunConfig, clock: L.Callback) -> dict:
    """One real run (``stabilize.train.run``) with ``clock`` among its callbacks; its
    result. W&B's chatter is muted and its service process stopped after the run: it must
    not run during the next one."""
    offline_environment()
    with contextlib.redirect_stdout(io.StringIO()):
        out = stabilize.train.run(cfg, callbacks=[clock])
    wandb.teardown()
    return out


class StatsRecorder(L.Callback):
    """Each training step's ``StepStats`` (the monitors' input), as the stability callback
    gathered them: a monitor is a function of them alone, so feeding them again replays
    the warnings the live run logged, at any setting."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        self.stab = next(c for c in trainer.callbacks if type(c).__name__ == "StabilityCallback")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = self.stab.last
        if s is not None and not (self.steps and self.steps[-1]["step"] == s.step):
            self.steps.append(dataclasses.asdict(s))


def record_stats(name: str, overrides: list[str], root: Path) -> tuple[RunConfig, list[dict]]:
    """One real run of ``configs/train.yaml`` with ``overrides`` in ``root / name`` (removed
    after): its config and every step's StepStats. A run Lightning ended early (SIGTERM) is
    not a result: SystemExit."""
    run_dir = root / name
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"run_dir={run_dir}", *overrides])
    rc = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    rec = StatsRecorder()
    stabilize.train.run(rc, callbacks=(rec,))
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(rec.steps) < rc.trainer.max_steps:
        raise SystemExit(f"{name}: stopped at step {len(rec.steps)}; not recorded")
    return rc, rec.steps


def record_plan(plan, runs: list[dict], save: Path | None, prefix: str, record) -> list[dict]:
    """Each ``(group, name, overrides)`` of ``plan`` not yet in ``runs``, recorded by
    ``record(group, name, overrides, tmp_dir)`` with a progress line on stderr; ``save``:
    the runs written after every one (an interrupted set keeps what it made)."""
    done, t0 = {r["name"] for r in runs}, time.time()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for k, (group, name, ov) in enumerate(plan):
            if name in done:
                continue
            print(f"[{k + 1}/{len(plan)}] {group} {name} ({time.time() - t0:.0f} s)",
                  file=sys.stderr)  # fmt: skip
            runs.append(record(group, name, ov, Path(tmp)))
            if save:
                save.write_text(json.dumps(runs))
    return runs
