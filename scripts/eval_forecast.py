"""Score the activation monitor's forecast on a labelled set of real tiny runs.

    python scripts/eval_forecast.py [--quick] [--save runs.json | --load runs.json]
                                    [--horizon N] [--set monitor.activation.KEY=VALUE ...]

The set: natural growth (the ``nan_repro_natural`` recipe, no injection, LR 1e-2 / 3e-2 /
1e-1 x 3 seeds x pre/post placement; 40 steps, 80 at LR 1e-2, which grows slowest), the
injected drift (``activation_drift``: one outlier channel, and all channels), and healthy
runs (LR 2e-3, no fault; fp32, and fp16 with eps 1e-3 as the main job's large_eps arm). The
others are fp32 with the ``explicit`` norm backend reducing in fp32: nothing overflows, so a
run goes on past its crossings; the probe measures each norm's largest row RMS; the lines
are the ones an fp16 reduction would cross (|x| max 256, row RMS 255.94/sqrt(D)).

Ground truth does not come from the monitors: float64 hooks on every norm's input and every
block's output measure |x| max and the largest row RMS of each training step. The forecast
is the ``ActivationMonitor`` a run builds (``line=fp16_square``), fed the run's recorded
per-step ``StepStats``: the monitor is a function of those alone, so replaying them gives
the events the live run would have logged, and other settings can be scored without
retraining (``--load``). Prints one markdown table (stabilize/monitors/forecast_score.py),
and the natural runs again by learning rate. The full set is 24 runs (``--quick``: 4): about
2 minutes on a quiet machine; on a shared one use ``nice -n 10`` and ``--save`` (an
interrupted set resumes from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from stabilize.monitors.activations import ActivationConfig, ActivationMonitor  # noqa: E402
from stabilize.monitors.events import StepStats  # noqa: E402
from stabilize.monitors.forecast_score import RunScore, first_crossings, table  # noqa: E402
from stabilize.norms import Norm  # noqa: E402
from stabilize.numerics import sum_of_squares_rms_limit  # noqa: E402

BASE = [
    "experiment=nan_repro_natural",
    "precision=fp32",
    "norm.reduction_dtype=fp32",
    "norm.backend=explicit",  # reports each norm's largest row RMS
    "logger=none",
    "rollback=off",
    "trainer.val_check_interval=100000",
    "trainer.limit_val_batches=0",
    "trainer.checkpoint_every_n_steps=100000",
    "trainer.progress=none",
    "audit.every=0",
]


def recipes(quick: bool) -> list[tuple[str, str, list[str]]]:
    """(group, name, overrides) of every run of the set, interleaved so that a set cut short
    (``--save`` keeps every finished run) still holds every group."""
    drift = [
        "fault=activation_drift", "optim.lr=2e-3", "fault.layer=0", "fault.step=8",
        "fault.target_step=null", "fault.cross_step=32", "fault.target=1e5",
        "trainer.max_steps=50",
    ]  # fmt: skip

    def natural(lr, place, seed):
        ov = [f"optim.lr={lr}", f"norm.placement={place}", f"seed={seed}"]
        # LR 1e-2 grows slowest: 80 steps, so that its warnings' horizons mostly end in the run
        ov.append(f"trainer.max_steps={80 if lr < 2e-2 else 40}")
        return ("natural", f"lr{lr:g}-{place}-s{seed}", ov)

    def injected(channels):  # one outlier channel; all channels (spread growth)
        return ("injected", f"drift-ch{channels}", [*drift, f"fault.channels={channels}"])

    def healthy(place, fp16=False):  # fp16: the main job's large_eps arm before its drift
        ov = ["optim.lr=2e-3", f"norm.placement={place}", "trainer.max_steps=80"]
        if fp16:
            ov += ["precision=fp16-mixed", "norm.reduction_dtype=fp16", "norm.eps=1e-3"]
        return ("healthy", f"lr2e-3-{place}" + ("-fp16-eps1e-3" if fp16 else ""), ov)

    if quick:
        return [natural(3e-2, "pre", 1), injected("1"), healthy("pre"), natural(1e-1, "post", 1)]
    out = [
        natural(1e-2, "pre", 1), natural(1e-2, "post", 1), natural(3e-2, "pre", 1),
        injected("1"), healthy("pre"), natural(1e-1, "pre", 1), injected("null"),
        natural(1e-1, "post", 1), natural(3e-2, "post", 1), healthy("post"),
    ]  # fmt: skip
    for seed in (2, 3):
        for lr in (1e-2, 3e-2, 1e-1):
            out += [natural(lr, place, seed) for place in ("pre", "post")]
    return out + [healthy("pre", fp16=True), healthy("post", fp16=True)]


class Recorder(L.Callback):
    """Each training step's StepStats (the monitors' input) and, apart from them, float64
    |x| max and largest row RMS of every norm's input and every block's output."""

    def __init__(self):
        self.steps: list[dict] = []
        self.truth: dict[str, list[float]] = {}
        self.handles: list = []
        self.dims: dict[str, int] = {}
        self.alias: dict[str, str] = {}

    def on_train_start(self, trainer, pl_module):
        model = pl_module.model
        for name, m in model.named_modules():
            if isinstance(m, Norm):
                self.dims[name] = m.dim
                self.handles.append(m.register_forward_pre_hook(self._norm_hook(name, m.kind)))
        for i, block in enumerate(model.h):
            self.handles.append(block.register_forward_hook(self._block_hook(f"h.{i}")))
        stab = next(c for c in trainer.callbacks if type(c).__name__ == "StabilityCallback")
        self.stab, self.alias = stab, dict(stab.probe._alias)

    def _norm_hook(self, name, kind):
        def hook(module, args):
            if module.training:
                with torch.no_grad():
                    x = args[0].detach().double()
                    xc = x - x.mean(-1, keepdim=True) if kind == "layernorm" else x
                    rms = xc.square().mean(-1).sqrt().max().item()
                    self._fold(name, x.abs().max().item(), rms)

        return hook

    def _block_hook(self, name):
        def hook(module, args, out):
            if module.training:
                self._fold(name, out.detach().double().abs().max().item(), -1.0)

        return hook

    def _fold(self, name, amax, rms):
        a, r = self.truth.get(name, (0.0, -1.0))
        self.truth[name] = [max(a, amax), max(r, rms)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.truth = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = self.stab.last
        if s is None or (self.steps and self.steps[-1]["stats"]["step"] == s.step):
            return
        self.steps.append({"stats": dataclasses.asdict(s), "truth": self.truth})

    def on_train_end(self, trainer, pl_module):
        for h in self.handles:
            h.remove()


def record(group: str, name: str, overrides: list[str], root: Path) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import stabilize.train  # noqa: F401  (the config's resolvers)
    from stabilize.lit.config import RunConfig
    from stabilize.paths import config_dir
    from stabilize.train import run

    run_dir = root / name
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        keys = {o.split("=")[0] for o in overrides}  # a recipe's own value replaces BASE's
        base = [o for o in BASE if o.split("=")[0] not in keys]
        cfg = compose("train", overrides=[f"run_dir={run_dir}", *base, *overrides])
    rec = Recorder()
    rc = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    run(rc, callbacks=(rec,))
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(rec.steps) < rc.trainer.max_steps:  # Lightning ends a run on SIGTERM: not a result
        raise SystemExit(f"{name}: stopped at step {len(rec.steps)}; not recorded")
    return {"group": group, "name": name, "dims": rec.dims, "alias": rec.alias, "steps": rec.steps}


def truth_units(r: dict, threshold: float) -> dict[int, dict]:
    """step -> layer -> (float64 value / line, 1): the nearer of the layer's lines (|x| max vs
    ``threshold``; a norm's largest row RMS vs 255.94/sqrt(D)), either of which overflows a
    16-bit reduction of that tensor. Aliased blocks (a pre-norm block's output is the next
    norm's input) are left to their norm."""
    out = {}
    for st in r["steps"]:
        units = {}
        for layer, (amax, rms) in st["truth"].items():
            if layer in r["alias"]:
                continue
            ratio = amax / threshold
            if layer in r["dims"]:
                ratio = max(ratio, rms / sum_of_squares_rms_limit(torch.float16, r["dims"][layer]))
            units[layer] = (ratio, 1.0)
        out[st["stats"]["step"]] = units
    return out


def replay(r: dict, cfg: ActivationConfig) -> list[tuple[str, int]]:
    """The forecast warnings the run's monitor logs, as (layer, step)."""
    mon = ActivationMonitor.from_config("activation", cfg)
    alias = r["alias"]
    out = []
    for st in r["steps"]:
        d = dict(st["stats"])
        d.setdefault("norm_dim", r["dims"])
        for e in mon.update(StepStats(**d)):
            if e.monitor == "forecast" and e.kind == "warn" and e.layer not in alias:
                out.append((e.layer, e.step))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller set (~3 min)")
    p.add_argument("--save", type=Path, help="write the recorded runs here (JSON; runs already "
                   "in it are kept, not rerun)")  # fmt: skip
    p.add_argument("--load", type=Path, help="score runs recorded by --save; no training")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a monitor.activation setting for the forecast (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    settings = {"line": "fp16_square"}
    for kv in args.set:
        key, _, value = kv.partition("=")
        key = key.removeprefix("monitor.activation.")
        field = {f.name: f for f in dataclasses.fields(ActivationConfig)}.get(key)
        if field is None or not value:
            print(f"--set {kv!r}: not a monitor.activation KEY=VALUE", file=sys.stderr)
            return 2
        settings[key] = _parse(value, type(getattr(ActivationConfig(), key)))
    cfg = ActivationConfig(**settings)
    t0 = time.time()
    if args.load:
        runs = json.loads(args.load.read_text())
    else:
        # a --save file from an interrupted set: its finished runs are kept, not rerun
        runs = json.loads(args.save.read_text()) if args.save and args.save.exists() else []
        done = {r["name"] for r in runs}
        with tempfile.TemporaryDirectory(prefix="eval_forecast-") as tmp:
            for i, (group, name, ov) in enumerate(recipes(args.quick)):
                if name in done:
                    continue
                print(f"[{i + 1}] {group} {name} ({time.time() - t0:.0f} s)", file=sys.stderr)
                runs.append(record(group, name, ov, Path(tmp)))
                if args.save:  # after every run: a long set interrupted keeps what it made
                    args.save.write_text(json.dumps(runs))
    scores = []
    for r in runs:
        truth = truth_units(r, cfg.threshold)
        scores.append(
            RunScore(
                r["name"],
                r["group"],
                len(r["steps"]),
                first_crossings(truth),
                replay(r, cfg),
                cfg.horizon,
                first=cfg.forecast_start,
            )  # fmt: skip
        )
    print(f"forecast: {', '.join(f'{k}={v}' for k, v in settings.items())}, horizon "
          f"{cfg.horizon}; {len(runs)} runs, {time.time() - t0:.0f} s")  # fmt: skip
    print(table(scores))
    by_lr = [  # the same runs regrouped (the counts are made again, from zero)
        dataclasses.replace(s, group=f"natural lr {s.name.split('-')[0][2:]}", timely={},
                            true_warnings=0, undetermined=0)
        for s in scores if s.group == "natural"
    ]  # fmt: skip
    if by_lr:  # where the natural misses are: the early crossings of the highest LR
        print("\nnatural growth by learning rate:")
        print(table(by_lr).replace("| all but healthy |", "| natural, all |"))
    print(
        f"warnable: crossings at step >= {cfg.forecast_start + 5} (the first forecast is at "
        f"step {cfg.forecast_start}, 5 steps ahead of it)"
    )
    for s in scores:
        missed = sorted((c, u) for u, c in s.crossings.items() if u not in s.timely)
        if missed or len(s.warnings) > s.true_warnings:
            false = [w for w in s.warnings if not _followed(w, s)]
            print(f"  {s.name}: missed {missed[:4]}; false warnings {false[:4]}", file=sys.stderr)
    return 0


def _parse(value: str, kind: type):
    if kind is bool:
        return value.lower() in ("1", "true", "yes")
    return kind(value)


def _followed(w, s: RunScore) -> bool:
    c = s.crossings.get(w[0])
    return c is not None and w[1] < c <= w[1] + s.horizon


if __name__ == "__main__":
    sys.exit(main())
