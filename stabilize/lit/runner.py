"""One training run: ``RunConfig`` -> the run dir's files and the final metrics.

``stabilize/train.py`` (Hydra's app) imports this only when a run starts, so that
``stabilize-train --help`` and a config error never load Lightning.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from stabilize.compat import wandb_started
from stabilize.elastic import PeerLost, peer_lost_line
from stabilize.lit import final_eval
from stabilize.lit.build import build_trainer, resolve_accelerator
from stabilize.lit.checkpoint import PeriodicCheckpoint, resolve_resume
from stabilize.lit.module import GPTLitModule
from stabilize.lit.preempt import Preempted
from stabilize.lit.watchdog import Watchdog, gone_ranks
from stabilize.norms import Norm, auto_backend
from stabilize.run.config import RunConfig
from stabilize.run.preflight import preflight
from stabilize.run.quiet import described, quiet
from stabilize.run.rundir import (
    RunDirError,
    at_the_end,
    checkpoint_steps,
    claim,
    stamp,
    sweep_temporaries,
    unlock,
)
from stabilize.stability import StabilityAbort
from stabilize.stability.view import norm_summary


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run(cfg: RunConfig, callbacks: Sequence[L.Callback] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says (plus any extra Lightning callbacks); returns the final
    metrics (floats), where things are, and the state the run ended in (``ended_with``)."""
    preflight(cfg)  # every start-up check, before anything is written (ConfigError)
    run_dir = Path(cfg.run_dir)
    # Everything about the run dir is settled before anything is written to it: a fresh
    # start refused or moved aside (run/rundir.py), the checkpoint verified (or the newest
    # intact one chosen), a finished run left alone.
    moved = claim(run_dir, cfg.resume)  # and its lock, held until the run ends
    try:
        return _claimed_run(cfg, callbacks, run_dir, moved)
    except RunDirError:  # refused before training (no intact checkpoint): as it found it
        unlock(run_dir, refused=True)
        raise
    finally:
        unlock(run_dir)


def _claimed_run(cfg: RunConfig, callbacks, run_dir: Path, moved: str | None) -> dict[str, Any]:
    if moved:
        print(moved, file=sys.stderr, flush=True)
    t = cfg.trainer
    try:
        ckpt = resolve_resume(cfg.resume, run_dir, cfg.resume_trusted)
        end = ckpt and at_the_end(run_dir, ckpt, t.max_steps, t.stop_at_step, cfg.resume_trusted)
    except ValueError as e:  # no intact checkpoint, not a checkpoint: one line, exit 2
        raise RunDirError(str(e)) from None
    if end and _rank() == 0:
        print(end.line, flush=True)
    if end and end.finished:
        step, global_step = checkpoint_steps(ckpt, cfg.resume_trusted)
        return {
            "metrics": {},
            "run_dir": str(run_dir),
            "model_step": step,
            "global_step": global_step,
            "resumed_from": ckpt,
            "nothing_to_train": True,
        }
    stamp(run_dir)  # accepted: the lock file names this launch from here on
    swept = sweep_temporaries(run_dir)
    if swept:
        print(swept, file=sys.stderr, flush=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    if _rank() == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    with quiet(cfg.verbose):
        module = GPTLitModule(cfg)
        trainer = build_trainer(cfg, [*callbacks, *([EndingOnly()] if end else [])])
        dog = watchdog_of(trainer)
        if _rank() == 0:
            print(describe(cfg, module, ckpt, ending=bool(end)), flush=True)
        described()  # the start-up's held log lines follow it (run/quiet.py)
        kernel_now(cfg, module)
        wandb_dir = None
        try:
            if trainer.is_global_zero and trainer.loggers:
                for lg in trainer.loggers:
                    lg.log_hyperparams(cfg.to_dict())
            trainer.fit(module, ckpt_path=ckpt, weights_only=not cfg.resume_trusted)
            score, fault = _ending(cfg, run_dir, module, trainer, dog)
        except BaseException as e:  # the report tells a finished run from one that stopped
            status = "aborted" if isinstance(e, StabilityAbort) else "failed"
            if isinstance(e, Preempted):
                status = "preempted"
            error = f"{type(e).__name__}: {e}"
            _write_result(run_dir, status, module, trainer, error, fault_outcome(module))
            lost = peer_lost_line(e, _rank(), gone_ranks(run_dir, trainer.world_size, _rank()))
            if lost is None:
                raise
            _say_peer_lost(lost, e, cfg.verbose)
            raise PeerLost(lost) from e
        finally:
            if dog is not None:
                dog.close()  # done already, unless the run or its ending stopped
            wandb_dir = _finish_wandb(trainer)
    ending = ["replicas.json", *(["final_eval.json"] if score is not None else [])]
    hf_dir = _save_hf(cfg, module, run_dir)
    _write_result(run_dir, "done", module, trainer, fault=fault, ending=ending)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if score is not None:
        metrics.update({"final/val_loss": score["loss"], "final/val_bpb": score["bpb"]})
    return {
        "metrics": metrics,
        "run_dir": str(run_dir),
        "model_step": module.train_state.model_step,
        "global_step": trainer.global_step,
        "resumed_from": ckpt,
        "ended_with": ended_with(module),
        "ranks": rank_shares(trainer),
        "wandb_offline_dir": wandb_dir,
        "fault": fault,
        "hf_dir": hf_dir,
    }


def _save_hf(cfg: RunConfig, module: GPTLitModule, run_dir: Path) -> str | None:
    """A ``model=hf`` run's final weights as a ``save_pretrained`` directory, ``run_dir/hf``
    (rank 0; not under FSDP, whose shards a rank cannot write alone, nor where the norm
    group replaced the architecture's own norms: their parameters are not the class's)."""
    hf = cfg.model.hf
    if hf is None or hf.norm_type != "arch" or cfg.trainer.strategy == "fsdp" or _rank() != 0:
        return None
    from stabilize.model.hf_arch import save_hf

    save_hf(module.model, run_dir / "hf")
    return str(run_dir / "hf")


class EndingOnly(L.Callback):
    """A resume at the stop step whose ending is missing (``rundir.at_the_end``): the fit
    loop stops before its first batch, so Lightning goes straight to every callback's
    ``on_train_end`` (the replicas check, the audit) and the runner's ending follows."""

    def on_train_start(self, trainer, pl_module):
        trainer.should_stop = True
        # the checkpoint it resumed from holds this very state: the final save would write
        # it again (minutes for a large model)
        state = (pl_module.train_state.model_step, trainer.global_step)
        for cb in trainer.callbacks:
            if isinstance(cb, PeriodicCheckpoint):
                cb._saved = state


def _ending(cfg: RunConfig, run_dir: Path, module, trainer, dog: Watchdog | None):
    """After fit (whose ``on_train_end`` callbacks ran the replicas check, the audit and the
    final save), every rank: the held-out score and the armed fault's outcome, the watchdog
    marking each batch; then ``done``, past the run's last collective."""
    if dog is not None:
        dog.phase("final_eval")
    score = _score_held_out(cfg, run_dir, module, trainer, dog.tick if dog else None)
    fault = fault_outcome(module, trainer)  # every rank: a collective, the run's last
    if dog is not None:
        dog.finish()
    return score, fault


def _say_peer_lost(line: str, error: BaseException, verbose: bool) -> None:
    """A peer's death in one line (gloo's own traceback only with ``verbose=true``): the
    launch line and the dead rank's own exit say the rest."""
    if verbose:
        traceback.print_exception(error, file=sys.stderr)
    print(f"stabilize-train: {line}", file=sys.stderr, flush=True)


def _arch(m) -> str:
    return "GPT" if m.hf is None else {"llama": "Llama", "gpt2": "GPT-2"}[m.hf.arch]


def _norm_type(m, module) -> str:
    """The norms' type: the group's, or a Hugging Face model's own kind(s) (norm_type=arch)."""
    if m.hf is None or m.hf.norm_type == "group":
        return m.norm.type
    return str(norm_summary(module.model)["type"])


def describe(cfg: RunConfig, module: GPTLitModule, ckpt: str | None, ending=False) -> str:
    """The run in one line (in place of Lightning's model summary table)."""
    m, n = cfg.model, cfg.model.norm
    params = sum(p.numel() for p in module.model.parameters())
    start = f"resuming {ckpt}" if ckpt else f"{cfg.trainer.max_steps} steps"
    if ending:
        start = f"its ending alone, from {ckpt}"
    return (
        f"stabilize-train: {m.name} {_arch(m)} ({params:,} parameters, {m.n_layer} layers x "
        f"{m.d_model}), {_norm_type(m, module)} {n.placement} eps {n.eps:g} reduction "
        f"{n.reduction_dtype}, "
        f"{cfg.precision.name}{_quant(cfg, module)} on "
        f"{resolve_accelerator(cfg.trainer.accelerator)}; {start} -> {cfg.run_dir}"
    )


def _quant(cfg: RunConfig, module: GPTLitModule) -> str:
    """ ", GEMMs in fp8_delayed (8 of 9 Linears)": what ``quant`` made of the model."""
    if not cfg.quant.enabled:
        return ""
    linears = [m for m in module.model.modules() if isinstance(m, nn.Linear)]
    quantized = sum(type(m).__name__ in ("QuantLinear", "Float8Linear") for m in linears)
    return f", GEMMs in {cfg.quant.name} ({quantized} of {len(linears)} Linears)"


def kernel_now(cfg: RunConfig, module: GPTLitModule) -> None:
    """On CPU, ask now for the backend each ``auto`` norm would run: where that is the fused
    kernel, its build starts (or its failure is said) here, one line after the description,
    not mid-run when a remedy first switches a reduction to fp32."""
    if resolve_accelerator(cfg.trainer.accelerator) != "cpu":
        return
    for kind in {m.kind for m in module.model.modules() if isinstance(m, Norm)
                 and m.backend == "auto"}:  # fmt: skip
        auto_backend(kind, "cpu")


def ended_with(module: GPTLitModule) -> dict[str, Any]:
    """What the run's remedies changed, read off the live state: the LR scale, the norms'
    reduction dtype(s), the batches the data position skipped past."""
    accum = module.cfg.optim.accumulate_grad_batches
    return {
        "remedies": list(module.train_state.remedies),
        "lr_scale": module.lr_scale_now(),  # in force at the end (after any warm-back)
        "lr_lowered": module.train_state.lr_scale,  # lower_lr's factors, warmed back or not
        "reduction_dtypes": sorted(
            {m.reduction_dtype for m in module.model.modules() if isinstance(m, Norm)}
        ),
        "batches_skipped": module.train_state.data_step - module.train_state.model_step * accum,
    }


def watchdog_of(trainer) -> Watchdog | None:
    return next((c for c in trainer.callbacks if isinstance(c, Watchdog)), None)


def rank_shares(trainer) -> list[dict[str, Any]] | None:
    """Per rank: own time per step and its share of the median rank's (lit/watchdog.py)."""
    dog = watchdog_of(trainer)
    return dog.shares if dog else None


def fault_outcome(module: GPTLitModule, trainer: L.Trainer | None = None) -> dict | None:
    """The armed fault's outcome (``FaultInjector.outcome``; None: no fault armed). With
    ``trainer`` (a finished run: every rank calls it), "fired" is every rank's answer
    together, one all-reduce: a fault on every rank may fire on one only (``poisoned_item``
    where one rank draws the block), and rank 0 writes result.json."""
    inj = module.injector
    if inj is None:
        return None
    fired = None
    if trainer is not None and trainer.world_size > 1:
        flag = torch.tensor(float(inj.happened), device=module.device)
        fired = bool(trainer.strategy.reduce(flag, reduce_op="sum") > 0)
    return inj.outcome(fired)


def _write_result(
    run_dir: Path, status: str, module, trainer, error: str | None = None, fault=None, ending=()
) -> None:
    """run_dir/result.json: how the run ended (done | aborted | failed | preempted), at which
    steps, the state its remedies left (``ended_with``), what its armed fault did
    (``fault``) and, when done, the files its ending wrote (``ending``: a resume checks
    them, ``rundir.ending_missing``)."""
    if _rank() != 0:
        return
    result = {
        "status": status,
        "model_step": module.train_state.model_step,
        "global_step": trainer.global_step,
        "error": error,
        "ended_with": ended_with(module),
        "ranks": rank_shares(trainer),
        "fault": fault,
        **({"ending": list(ending)} if status == "done" else {}),
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))


def _score_held_out(
    cfg: RunConfig, run_dir: Path, module, trainer: L.Trainer, tick=None
) -> dict | None:
    """After training: the whole held-out split's loss and bits per byte (final_eval.json,
    and ``final/val_*`` in the loggers at the last step); ``tick()`` after each batch."""
    n = cfg.trainer.final_eval_batches
    if n == 0:
        return None
    t = cfg.trainer
    score = final_eval.held_out_score(module, trainer, n, t.final_eval_tokens, tick=tick)
    if score is not None and trainer.is_global_zero:
        final_eval.write(run_dir, score)
        metrics = {"final/val_loss": score["loss"], "final/val_bpb": score["bpb"]}
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)
            lg.save()
    return score


def _finish_wandb(trainer: L.Trainer) -> str | None:
    """Close the W&B run so the next member of a sweep (same process) gets its own; returns
    the offline run's directory (for ``wandb sync``), if the run was offline."""
    from lightning.pytorch.loggers import WandbLogger

    offline = None
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger) and wandb_started(lg):
            exp = lg.experiment
            if exp.settings.mode == "offline" and exp.dir:
                offline = str(Path(exp.dir).parent)  # .../wandb/offline-run-*/files
            exp.finish()
    return offline
