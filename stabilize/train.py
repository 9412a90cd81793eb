"""The Hydra entry point: ``stabilize-train`` = ``python -m stabilize.train``.

Hydra stops here: the composed DictConfig is resolved, turned into a typed ``RunConfig``
(which validates every key and value before any work starts) and handed to ``run``.

Multi-process runs are launched with torchrun (scripts/launch.sh): every rank runs this app,
Lightning spawns nothing, and all ranks share one run dir (``STABILIZE_RUN_ID``, or
torchrun's own run id). Sweeps with ``-m`` run members one after another in this process;
a sweep of torchrun launches is scripts/sweep.sh (multirun inside torchrun is broken
upstream).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from stabilize.lit.build import build_trainer
from stabilize.lit.checkpoint import checkpoint_steps, resolve_resume
from stabilize.lit.config import RunConfig
from stabilize.lit.module import GPTLitModule
from stabilize.lit.rundir import RunDirError, already_finished, claim
from stabilize.lit.stability import StabilityAbort
from stabilize.paths import config_dir

CONFIG_DIR = config_dir()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_id() -> str:
    """One id for all ranks of a launch: ours, else torchrun's rendezvous id, else the time."""
    rid = os.environ.get("STABILIZE_RUN_ID")
    if not rid:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        rid = elastic if elastic != "none" else datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return rid


# Lightning's own use of a deprecated torch API: noise in every run's output.
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")

# Resolvers used by configs/train.yaml's hydra section; registered before Hydra starts.
OmegaConf.register_new_resolver("stabilize.run_id", run_id, replace=True)
OmegaConf.register_new_resolver(
    "stabilize.rank_suffix", lambda: "" if _rank() == 0 else f"-rank{_rank()}", replace=True
)


def _sweep_group() -> str | None:
    """In a Hydra multirun, the sweep's directory name groups its members in W&B."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return Path(hc.sweep.dir).name
    except ValueError:  # not running under Hydra
        pass
    return None


def run(cfg: RunConfig, callbacks: Sequence[L.Callback] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says (plus any extra Lightning callbacks); returns the final
    metrics (floats) and where things are."""
    run_dir = Path(cfg.run_dir)
    # Everything about the run dir is settled before anything is written to it: a fresh
    # start refused or moved aside (lit/rundir.py), the checkpoint verified (or the newest
    # intact one chosen), a finished run left alone.
    moved = claim(run_dir, cfg.resume)
    if moved:
        print(moved, file=sys.stderr, flush=True)
    t = cfg.trainer
    try:
        ckpt = resolve_resume(cfg.resume, run_dir)
        done = ckpt and already_finished(run_dir, ckpt, t.max_steps, t.stop_at_step)
    except ValueError as e:  # no intact checkpoint, not a checkpoint: one line, exit 2
        raise RunDirError(str(e)) from None
    if done:
        if _rank() == 0:
            print(done, flush=True)
        step, global_step = checkpoint_steps(ckpt)
        return {
            "metrics": {},
            "run_dir": str(run_dir),
            "model_step": step,
            "global_step": global_step,
            "resumed_from": ckpt,
            "nothing_to_train": True,
        }
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    if _rank() == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    module = GPTLitModule(cfg)
    trainer = build_trainer(cfg, list(callbacks))
    try:
        if trainer.is_global_zero and trainer.loggers:
            for lg in trainer.loggers:
                lg.log_hyperparams(cfg.to_dict())
        trainer.fit(module, ckpt_path=ckpt)
    except BaseException as e:  # the report tells a finished run from one that stopped
        status = "aborted" if isinstance(e, StabilityAbort) else "failed"
        _write_result(run_dir, status, module, trainer, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        _finish_wandb(trainer)
    _write_result(run_dir, "done", module, trainer)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "metrics": metrics,
        "run_dir": str(run_dir),
        "model_step": module.model_step,
        "global_step": trainer.global_step,
        "resumed_from": ckpt,
    }


def _write_result(run_dir: Path, status: str, module, trainer, error: str | None = None) -> None:
    """run_dir/result.json: how the run ended (done | aborted | failed), at which steps."""
    if _rank() != 0:
        return
    result = {
        "status": status,
        "model_step": module.model_step,
        "global_step": trainer.global_step,
        "error": error,
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))


def _finish_wandb(trainer: L.Trainer) -> None:
    """Close the W&B run so the next member of a sweep (same process) gets its own."""
    from lightning.pytorch.loggers import WandbLogger

    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg.experiment.finish()


class RunDirGuard(Callback):
    """Hydra callback (configs/train.yaml ``hydra.callbacks``): claims the run dir before
    Hydra writes its ``.hydra/`` files into it, so a refused launch leaves the dir exactly
    as it was. ``run()`` claims it again for callers without Hydra (a no-op after this)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        raw = OmegaConf.to_container(config, resolve=False).get("run_dir")
        # run_dir defaults to ${hydra:runtime.output_dir}, which Hydra fills in only later
        default = raw is None or "hydra:runtime" in str(raw)
        run_dir = config.hydra.run.dir if default else config.run_dir
        try:
            moved = claim(run_dir, str(config.resume))
        except RunDirError as e:  # Hydra turns a callback's exception into a warning
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        if moved:
            print(moved, file=sys.stderr, flush=True)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    values = OmegaConf.to_container(cfg, resolve=True)
    group = _sweep_group()
    if group and not values["logger"].get("group"):
        values["logger"]["group"] = group
    run_cfg = RunConfig.from_dict(values)
    try:
        result = run(run_cfg)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except StabilityAbort as e:
        if _rank() == 0:
            print(
                "stability abort: " + json.dumps(e.diagnosis, indent=2, default=str),
                file=sys.stderr,
                flush=True,
            )
        sys.exit(3)
    m = result["metrics"]
    if _rank() == 0 and not result.get("nothing_to_train"):
        summary = ", ".join(
            f"{k} {m[k]:.4f}" for k in ("train/loss", "val/loss", "val/bpb") if k in m
        )
        print(
            f"done: {result['global_step']} steps, {summary}\nrun dir: {result['run_dir']}",
            flush=True,
        )
    return m.get("val/loss")  # for Hydra sweepers that optimise


if __name__ == "__main__":
    sys.exit(main())
