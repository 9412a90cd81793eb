"""RunConfig -> Lightning Trainer: precision, launch environment, loggers, callbacks."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from stabilize.compat import wandb_init_kwargs
from stabilize.lit.audit import NormAudit
from stabilize.lit.callbacks import ReplicaCheck, StopAtModelStep, ThroughputLogger
from stabilize.lit.checkpoint import AtomicCheckpointIO, PeriodicCheckpoint
from stabilize.lit.fsdp import fsdp_strategy
from stabilize.lit.grad_reduce import ddp_strategy
from stabilize.lit.preempt import build as preempt_callback
from stabilize.lit.progress import PlainProgress, StepBar
from stabilize.lit.stability import StabilityCallback
from stabilize.lit.watchdog import build as watchdog_callback
from stabilize.run.config import LoggerConfig, PrecisionConfig, RunConfig, TrainerConfig
from stabilize.run.env import LaunchEnv

COMPUTE_DTYPE = {
    "fp32": torch.float32,
    "fp16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


def resolve_accelerator(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name == "gpu" else name


def precision_args(cfg: PrecisionConfig, accelerator: str) -> tuple[str | None, list]:
    """(Trainer's ``precision``, extra plugins).

    fp16 goes through an explicit MixedPrecision plugin with our own GradScaler on every
    device: Lightning turns ``precision="16-mixed"`` on CPU into bf16 with only a warning,
    and the plugin also lets us set the scaler's initial scale and growth interval.
    """
    if cfg.name == "fp16-mixed":
        device = "cuda" if accelerator == "cuda" else "cpu"
        scaler = torch.amp.GradScaler(
            device, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval
        )
        return None, [MixedPrecision("16-mixed", device, scaler=scaler)]
    return {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}[cfg.name], []


def device_args(cfg: TrainerConfig, env: LaunchEnv) -> dict:
    """devices / num_nodes / strategy, taken from torchrun's environment when present."""
    if env.torchrun:
        devices = env.local_world_size
        num_nodes = max(1, env.world_size // env.local_world_size)
    else:
        devices = 1 if cfg.devices == "auto" else cfg.devices
        num_nodes = cfg.num_nodes
    strategy = cfg.strategy
    timeout = timedelta(seconds=cfg.pg_timeout_s)  # the collectives' backstop
    if strategy == "auto":
        strategy = "ddp" if devices * num_nodes > 1 else "auto"
    if strategy == "ddp":
        strategy = ddp_strategy(cfg.grad_reduce_dtype, timeout=timeout)
    elif strategy == "fsdp":  # FSDP2, on CPU too (lit/fsdp.py)
        strategy = fsdp_strategy(devices * num_nodes, timeout)
    return {"devices": devices, "num_nodes": num_nodes, "strategy": strategy}


def wandb_run_name(run: RunConfig) -> str:
    """``<name>-<arm>-<run dir's name>``, each thing said once: a part is left out where a
    later part already says it (repro_nan.sh's run dir is the arm, ``large_eps``, or the
    arm and seed, ``large_eps-seed1235``: the name was ``nan_repro-large_eps-large_eps``)."""
    parts = [run.name, run.arm or "", os.path.basename(os.path.normpath(run.run_dir))]
    parts = [p for p in parts if p]
    kept = []
    for i, p in enumerate(parts):
        later = parts[i + 1 :]
        if p in kept or any(q == p or q.startswith(p + "-") for q in later):
            continue
        kept.append(p)
    return "-".join(kept)


def build_loggers(cfg: LoggerConfig, run: RunConfig) -> list[Logger]:
    loggers: list[Logger] = []
    if cfg.csv:
        # csv/version_N/metrics.csv: a resumed launch gets the next version, so nothing
        # logged before the interruption is overwritten (CSVLogger deletes an existing file).
        loggers.append(CSVLogger(save_dir=run.run_dir, name="csv"))
    mode = cfg.wandb_mode()
    if cfg.wandb and mode != "disabled":
        wandb_logger = WandbLogger(
            save_dir=run.run_dir,
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group or run.name,
            job_type=cfg.job_type,
            tags=[*cfg.tags, *([f"arm:{run.arm}"] if run.arm else [])],
            name=cfg.name or wandb_run_name(run),
            mode=mode,
        )
        # Lightning passes anonymous=None, which wandb (0.2x on) warns about in every run
        # ("has no effect"): the setting is gone, so is the warning
        wandb_init_kwargs(wandb_logger).pop("anonymous", None)
        loggers.append(wandb_logger)
    return loggers


def progress_callbacks(cfg: TrainerConfig) -> tuple[list[L.Callback], bool]:
    kind = cfg.progress
    if kind == "auto":
        kind = "rich" if sys.stdout.isatty() else "plain"
    if kind == "rich":
        return [StepBar()], True
    if kind == "plain":
        return [PlainProgress(cfg.log_every_n_steps)], False
    return [], False


def build_trainer(run: RunConfig, extra_callbacks: list[L.Callback] = ()) -> L.Trainer:
    t = run.trainer
    accelerator = resolve_accelerator(t.accelerator)
    precision, plugins = precision_args(run.precision, accelerator)
    accum = run.optim.accumulate_grad_batches
    progress, bar = progress_callbacks(t)
    max_steps = t.max_steps if t.stop_at_step is None else min(t.max_steps, t.stop_at_step)
    periodic = PeriodicCheckpoint(run.run_dir, t.checkpoint_every_n_steps, t.keep_checkpoints)
    preempt = preempt_callback(t.preempt_signals, periodic)
    watchdog = watchdog_callback(run.run_dir, t.hang_timeout_s)
    callbacks = [
        *([watchdog] if watchdog else []),  # first: its marks bracket the other callbacks
        periodic,
        ThroughputLogger(COMPUTE_DTYPE[run.precision.name]),
        ReplicaCheck(run.run_dir),
        StabilityCallback(
            run.monitor,
            run.rollback,
            run.fault,
            run.run_dir,
            accum,
            skip_items=run.data.skip_items,
            layer_panels=run.logger.layer_panels,
        ),  # fmt: skip
        NormAudit(run.audit, run.run_dir),  # after the stability callback: sees its verdict
        StopAtModelStep(max_steps),
        *progress,
        *extra_callbacks,
        *([preempt] if preempt else []),  # a Checkpoint after the periodic one: the last word
    ]
    return L.Trainer(
        accelerator=accelerator,
        precision=precision,
        plugins=[*plugins, AtomicCheckpointIO()],
        max_steps=-1,  # StopAtModelStep ends the run: global_step never rewinds, the model does
        max_epochs=-1,
        accumulate_grad_batches=accum,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval * accum,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,
        deterministic=t.deterministic,
        use_distributed_sampler=False,  # stabilize.data shards by rank itself
        enable_progress_bar=bar,
        enable_model_summary=run.verbose,  # off: runner.describe prints the run in one line
        callbacks=callbacks,
        logger=build_loggers(run.logger, run) or False,
        default_root_dir=run.run_dir,
        **device_args(t, LaunchEnv.detect()),
    )
