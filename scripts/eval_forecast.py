"""Score the activation monitor's forecast on a labelled set of real runs.

    python scripts/eval_forecast.py [--quick | --core] [--save runs.json | --load runs.json]
                                    [--set monitor.activation.KEY=VALUE ...] [--doc DOC]

The set (benchmarks/forecast_set.py): natural growth (``nan_repro_natural``, no injection, at
LR 1e-2 / 3e-2 / 1e-1), the injected drift (``activation_drift``) and healthy runs, on every
placement (pre, post, sandwich, DeepNorm), two widths and depths, three norm types, two
corpora, fp32 and a real fp16 reduction; ``--core`` is the first 24 runs (tiny, pre/post),
on which the forecast's settings were chosen. The fp32 runs reduce in fp32 with the
``explicit`` backend: nothing overflows, so a run goes on past its crossings; the lines are
the ones an fp16 reduction would cross (|x| max 256, row RMS 255.94/sqrt(D)).

Ground truth does not come from the monitors: float64 hooks on every norm's input and every
block's output measure |x| max and the largest row RMS of each training step. The forecast
is the ``ActivationMonitor`` a run builds (``line=fp16_square``), fed the run's recorded
per-step ``StepStats``: the monitor is a function of those alone, so replaying them gives
the events the live run would have logged, and other settings can be scored without
retraining (``--load``). Prints markdown tables (benchmarks/forecast_score.py) by
kind of run, placement, precision and the other axes, and the targets each placement and
precision misses (exit 1 when one is missed). ``--save`` keeps every finished run: an
interrupted set resumes from it. ``--doc docs/forecast.md`` writes the tables there.
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

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L
import torch

from benchmarks.docblock import write_measured
from benchmarks.forecast_score import (
    RunScore,
    first_crossings,
)
from benchmarks.forecast_set import (
    BASE,
    CODE,
    code_corpus,
    core,
    holdout,
    holdout2,
    holdout3,
    holdout4,
    holdout5,
    holdout6,
    tags,
    wide,
)
from benchmarks.forecast_tables import (
    activation_config,
    relabel_crossed,
    report,
    score,
    truth_units,
)
from stabilize.monitors.activations import ActivationConfig
from stabilize.monitors.forecast import FLAT_KEYS, ForecastConfig
from stabilize.norms import Norm

# the holdouts, each recorded before and scored after one change (benchmarks/forecast_set.py)
HOLDOUTS = {"holdout": holdout, "holdout2": holdout2, "holdout3": holdout3, "holdout4": holdout4,
            "holdout5": holdout5, "holdout6": holdout6}  # fmt: skip


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
        self.stab, self.alias = stab, dict(stab.probe.units.alias)

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
    from stabilize.paths import config_dir
    from stabilize.run.config import RunConfig
    from stabilize.train import run

    run_dir = root / name
    overrides = [o.replace(CODE, str(code_corpus(root / "code.txt"))) for o in overrides]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 runs of the core set (~1 min)")
    p.add_argument("--core", action="store_true", help="the core set only (24 runs)")
    p.add_argument("--save", type=Path, help="write the recorded runs here (JSON; runs already "
                   "in it are kept, not rerun)")  # fmt: skip
    p.add_argument("--holdout", action="store_true", help="also the holdout set (scripts/"
                   "forecast_set.py: not scored while the last change was chosen)")  # fmt: skip
    p.add_argument("--holdout2", action="store_true", help="also the second holdout "
                   "(forecast_set.holdout2: recorded before, scored after, the change that "
                   "followed the first holdout; long healthy runs)")  # fmt: skip
    p.add_argument("--holdout3", action="store_true", help="also the third holdout "
                   "(forecast_set.holdout3: recorded before, scored after, the expiring "
                   "warning)")  # fmt: skip
    p.add_argument("--holdout4", action="store_true", help="also the fourth holdout "
                   "(forecast_set.holdout4: recorded before, scored after, the rule for the "
                   "sandwich placement's sublayer-output norms)")  # fmt: skip
    p.add_argument("--holdout5", action="store_true", help="also the fifth holdout "
                   "(forecast_set.holdout5: no change between its recording and its "
                   "scoring)")  # fmt: skip
    p.add_argument("--holdout6", action="store_true", help="also the sixth holdout "
                   "(forecast_set.holdout6: recorded before, scored after, the rule for the "
                   "sandwich placement's near misses)")  # fmt: skip
    p.add_argument("--holdouts-only", action="store_true", help="record (or score) only the "
                   "holdouts asked for, not core + wide")  # fmt: skip
    p.add_argument("--load", type=Path, help="score runs recorded by --save; no training")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a monitor.activation setting for the forecast (repeatable)")  # fmt: skip
    p.add_argument("--doc", type=Path, help="also write the tables into this doc, between its "
                   "<!-- eval_forecast:begin/end --> markers")  # fmt: skip
    p.add_argument("--doc-block", default="eval_forecast", metavar="NAME",
                   help="the doc's block to write: <!-- NAME:begin/end -->")  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="also score the settings of "
                   "forecast_set.SWEEP, one changed at a time: the trade-off table")  # fmt: skip
    args = p.parse_args(argv)
    settings = {"line": "fp16_square"}
    for kv in args.set:
        key, _, value = kv.partition("=")
        key = key.removeprefix("monitor.activation.")
        name = FLAT_KEYS.get(key) or key.removeprefix("forecast.")  # flat names as recorded
        own = "." not in key and key != "forecast" and hasattr(ActivationConfig(), key)
        default = (
            getattr(ForecastConfig(), name, None) if not own else getattr(ActivationConfig(), key)
        )
        if default is None or not value:
            print(f"--set {kv!r}: not a monitor.activation KEY=VALUE", file=sys.stderr)
            return 2
        settings[key] = _parse(value, type(default))
    cfg = activation_config(settings)
    t0 = time.time()
    plan = [] if args.holdouts_only else core(args.quick)
    plan += [] if args.quick or args.core or args.holdouts_only else wide()
    held = {k: {name for _, name, _ in f()} for k, f in HOLDOUTS.items()}
    for k, f in HOLDOUTS.items():
        plan += f() if getattr(args, k) else []
    in_core = {name for _, name, _ in core()}
    if args.load:  # a holdout is scored only when asked for (--holdout, --holdout2, ...)
        left = {n for k in held if not getattr(args, k) for n in held[k]}
        if args.holdouts_only:  # and nothing but the holdouts asked for
            left |= {name for _, name, _ in core() + wide()}
        runs = [r for r in json.loads(args.load.read_text()) if r["name"] not in left]
    else:
        # a --save file from an interrupted set: its finished runs are kept, not rerun
        runs = json.loads(args.save.read_text()) if args.save and args.save.exists() else []
        done = {r["name"] for r in runs}
        with tempfile.TemporaryDirectory(prefix="eval_forecast-") as tmp:
            for i, (group, name, ov) in enumerate(plan):
                if name in done:
                    continue
                print(f"[{i + 1}/{len(plan)}] {group} {name} ({time.time() - t0:.0f} s)",
                      file=sys.stderr)  # fmt: skip
                runs.append({**record(group, name, ov, Path(tmp)), "tags": tags(ov)})
                if args.save:  # after every run: a long set interrupted keeps what it made
                    args.save.write_text(json.dumps(runs))
    ovs = {name: ov for _, name, ov in plan}
    tag = {r["name"]: {**r.get("tags", tags(ovs.get(r["name"], []))),
                       "set": "core" if r["name"] in in_core
                       else next((k for k in held if r["name"] in held[k]), "wide")}
           for r in runs}  # fmt: skip
    crossings = {r["name"]: first_crossings(truth_units(r, cfg.threshold)) for r in runs}
    runs, moved = relabel_crossed(runs, crossings)
    text, misses = report(runs, settings, tag, crossings, args.sweep, time.time() - t0)
    if moved:
        first = {n: min(crossings[n].values()) for n in moved}
        text += ("\n\nLabelled healthy, crossed a line (float64), scored as natural: " + ", ".join(
            f"{n} (step {first[n]})" for n in moved) + ".")  # fmt: skip
    print(text)
    scores = score(runs, cfg, crossings)
    for s in scores:
        missed = sorted((c, u) for u, c in s.crossings.items() if u not in s.timely)
        if missed or len(s.warnings) > s.true_warnings:
            false = [w for w in s.warnings if not _followed(w, s)]
            print(f"  {s.name}: missed {missed[:4]}; false warnings {false[:4]}", file=sys.stderr)
    if args.doc and write_measured(args.doc, args.doc_block, "eval_forecast.py", argv, text):
        return 2
    return 0 if not misses else 1


def _parse(value: str, kind: type):
    if kind is bool:
        return value.lower() in ("1", "true", "yes")
    return kind(value)


def _followed(w, s: RunScore) -> bool:
    c = s.crossings.get(w[0])
    return c is not None and w[1] < c <= w[1] + s.horizon


if __name__ == "__main__":
    sys.exit(main())
