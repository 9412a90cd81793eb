"""Training tokens/s through the Lightning loop vs a bare PyTorch loop, on the same model.

Each config (``tiny``; ``small`` = tiny with 4 layers) is composed with Hydra as the CLI
does it and trained two ways in this process, on the same seed, model and batches:

- lightning: ``stabilize.train.run(cfg)`` with what a real run has on: CSV logger, W&B
  offline (run dir in a temp dir), ThroughputLogger, periodic checkpoints at the default
  interval (fsynced), gradient clipping, LR schedule, logs every 10 steps, plain progress
  lines (muted). Validation is OFF (``limit_val_batches=0``): it is evaluation, not training
  throughput, and the bare loop has nothing to match it (it would add ~3% at the defaults).
- bare: ``GPT`` from the same GPTConfig, the same train DataLoader (``build_dataloaders``),
  AdamW on ``param_groups``, ``lr_factor`` via LambdaLR, ``get_total_norm`` +
  ``clip_grads_with_norm_``, the same precision (autocast; for fp16-mixed a GradScaler,
  unscaled before clipping, as Lightning's MixedPrecision plugin does).
  Both end at the same loss (printed per run): the same work is timed.

Timing: both paths stamp ``perf_counter`` after every optimizer step (Lightning: a callback
passed with ``run(cfg, callbacks=...)``; its ``on_train_batch_end`` runs after the LR
scheduler step and before the checkpoint callback, which Lightning orders last).
tokens/s = tokens of steps (warmup, warmup + steps] / (t[warmup + steps] - t[warmup]): start-up
(Trainer, W&B, tokenizing) and the first slow steps are out; the window holds the same steps
plus what Lightning adds, at the defaults (10 + 100) exactly one periodic checkpoint and ten
log flushes, i.e. their amortised cost. This is fairer than differencing the wall time of two
runs (their LR schedules and checkpoint counts differ) and finer than the logged
``perf/tokens_per_s``, shown as a cross-check ("logged": harmonic mean of the CSV's values).

Pairs (bare, lightning) repeat with the order alternating; medians per path are reported,
and the verdict is the median per-pair ratio lightning/bare (target >= 0.95). On a busy
2-core machine two OpenMP threads stall whenever another job holds a core (steps 5-10x
slower): the header prints the load average; use --threads 1 there.

Usage: python scripts/bench_step.py [--quick] [--steps 100] [--repeats 3]
       [--configs tiny,small] [--precision fp32|bf16-mixed|fp16-mixed] [--threads N]
       [--set monitor=off rollback=off]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L
import torch
import torch.nn.functional as F

import stabilize
from benchmarks.lib import CONFIGS as BASE_CONFIGS
from benchmarks.lib import (
    StepClock,
    add_run_args,
    compose_cfg,
    prepare,
    run_overrides,
    train_with,
)
from benchmarks.stats import print_table, span
from stabilize.data import build_dataloaders
from stabilize.lit.build import resolve_accelerator
from stabilize.lit.module import lr_factor, param_groups
from stabilize.run.config import RunConfig
from stabilize.run.model import build_run_model

CONFIGS = BASE_CONFIGS
AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
TARGET = 0.95


def lightning_path(cfg: RunConfig, edges: tuple[int, int]) -> tuple[dict, float, float | None]:
    """(step -> time, final train/loss, tokens/s the run itself logged)."""
    clock = StepClock(edges)
    out = train_with(cfg, clock)  # W&B's service process stopped: not during a bare pass
    logged = [
        float(row["perf/tokens_per_s"])
        for f in Path(cfg.run_dir).glob("csv/version_*/metrics.csv")
        for row in csv.DictReader(f.read_text().splitlines())
        if row.get("perf/tokens_per_s")
    ]
    tps = statistics.harmonic_mean(logged) if logged else None
    return clock.t, out["metrics"]["train/loss"], tps


def lm_batch_loss(model, batch) -> torch.Tensor:
    """One micro-batch's loss, as the bare loop computes it (the Guard's re-run)."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def bare_steps(cfg: RunConfig, guard_dir: Path | None = None, patch=None):
    """The bare loop, one optimizer step per ``next()``: yields the step's loss tensor.
    ``guard_dir``: the same loop under ``stabilize.Guard`` (the run's monitor and rollback
    settings; the Guard unscales, judges and clips where the bare loop unscales and clips);
    ``patch``: called with that Guard once built (bench_cost.py's parts)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # as run() does
    device = torch.device(resolve_accelerator(cfg.trainer.accelerator))
    model = build_run_model(cfg).to(device).train()  # its quant section applied too
    o, total = cfg.optim, cfg.trainer.max_steps
    opt = torch.optim.AdamW(
        param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, o, total))
    loader, _ = build_dataloaders(
        cfg.data, cfg.model.block_size, num_steps=total, val_batches=cfg.trainer.limit_val_batches
    )
    dtype = AUTOCAST[cfg.precision.name]
    scaler = None
    if cfg.precision.name == "fp16-mixed":
        p = cfg.precision
        scaler = torch.amp.GradScaler(
            device.type, init_scale=p.init_scale, growth_interval=p.growth_interval
        )
    guard = None
    if guard_dir is not None:
        guard = stabilize.Guard(model, opt, scaler, scheduler=sched, run_dir=guard_dir,
                                loss_fn=lm_batch_loss, clip=o.grad_clip, monitor=cfg.monitor,
                                rollback=cfg.rollback,
                                log_every=cfg.trainer.log_every_n_steps)  # fmt: skip
        if patch is not None:
            patch(guard)
    params = list(model.parameters())
    for x, y in guard.batches(loader) if guard is not None else loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = lm_batch_loss(model, (x, y))
        (scaler.scale(loss) if scaler else loss).backward()
        if guard is not None:
            apply = guard.before_step(loss).apply
        else:
            apply = True
            if scaler:
                scaler.unscale_(opt)
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if o.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, o.grad_clip, norm, foreach=True)
        if apply and scaler:
            scaler.step(opt)
            scaler.update()
        elif apply:
            opt.step()
        if apply:
            sched.step()
        yield loss


def bare_path(cfg: RunConfig, edges: tuple[int, int]) -> tuple[dict, float]:
    """(step -> time, final loss)."""
    t, cuda, loss = {}, resolve_accelerator(cfg.trainer.accelerator) == "cuda", None
    for step, loss in enumerate(bare_steps(cfg), start=1):  # noqa: B007  (the last is returned)
        if step in edges and cuda:
            torch.cuda.synchronize()
        t[step] = time.perf_counter()
    return t, loss.item()


def bench(name: str, args, tmp: Path) -> dict:
    warm, total = args.warmup, args.warmup + args.steps
    overrides = [
        *run_overrides(CONFIGS[name], args.precision, total, "wandb"),
        *args.set,
    ]
    rates: dict[str, list[float]] = {"bare": [], "lightning": []}
    ratios, logged = [], []
    for r in range(args.repeats):
        pair = {}
        for path in ("bare", "lightning") if r % 2 == 0 else ("lightning", "bare"):
            cfg = compose_cfg(str(tmp / f"{name}-{r}-{path}"), overrides)
            if path == "bare":
                t, loss = bare_path(cfg, (warm, total))
            else:
                t, loss, tps = lightning_path(cfg, (warm, total))
                logged.append(tps)
            tokens = args.steps * cfg.data.batch_size * cfg.model.block_size
            pair[path] = tokens / (t[total] - t[warm])
            rates[path].append(pair[path])
            # the same work: both paths end at the same loss (to float rounding)
            print(f"  {name} #{r} {path:9s} {pair[path]:7.0f} tok/s  loss {loss:.4f}", flush=True)
        ratios.append(pair["lightning"] / pair["bare"])
    every = cfg.trainer.checkpoint_every_n_steps
    return {
        "name": name,
        "tokens": cfg.data.batch_size * cfg.model.block_size,
        "params": sum(p.numel() for p in build_run_model(cfg).parameters()),
        "ckpts": total // every - warm // every,
        "rates": rates,
        "ratios": ratios,
        "logged": [v for v in logged if v is not None],
    }


def report(results: list[dict], args) -> None:
    print(
        f"\n{args.precision}, {args.steps} timed steps after {args.warmup}, {args.repeats} "
        f"pairs, {torch.get_num_threads()} torch threads, load average {args.load:.1f} at start "
        f"on {os.cpu_count()} cores; tok/s: median (min-max)\n"
    )
    head = [
        "config",
        "params",
        "tok/step",
        "bare tok/s",
        "lightning tok/s",
        "logged tok/s",
        "bare ms/step",
        "lightning ms/step",
        "overhead ms/step",
        "ckpts in window",
        "ratio L/bare",
    ]
    rows = []
    for res in results:
        b, lt = res["rates"]["bare"], res["rates"]["lightning"]
        ms = [1000 * res["tokens"] / statistics.median(x) for x in (b, lt)]
        logged = f"{statistics.median(res['logged']):.0f}" if res["logged"] else "-"
        rows.append(
            [
                res["name"],
                f"{res['params'] / 1e6:.2f}M",
                res["tokens"],
                span(b, "{:.0f}", sep="-"),
                span(lt, "{:.0f}", sep="-"),
                logged,
                f"{ms[0]:.1f}",
                f"{ms[1]:.1f}",
                f"{ms[1] - ms[0]:+.1f}",
                res["ckpts"],
                span(res["ratios"], "{:.3f}", sep="-"),
            ]
        )
    print_table(head, rows)
    print()
    for res in results:
        ratio = statistics.median(res["ratios"])
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        print(f"target {res['name']}: lightning/bare = {ratio:.3f} (>= {TARGET}) {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=3, pairs="(bare, lightning)")
    ap.add_argument("--precision", default="fp32", choices=sorted(AUTOCAST))
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra overrides for both paths, e.g. monitor=off rollback=off "
        "(the training loop alone; the defaults include the monitors)",
    )
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    report(results, args)


if __name__ == "__main__":
    main()
