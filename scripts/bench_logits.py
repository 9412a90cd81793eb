"""The cost of the logit monitors and per-block statistics, measured inside one run.

One training run per config, every default monitor and rollback snapshots on throughout; the
new parts are switched off and on every BLOCK steps in ABBA order (on, off, off, on, ...),
as benchmarks/monitor_toggle.py does for the whole stability layer, so a drift of the shared
machine's speed hits both arms alike. "On" is the default config:

- ``monitor.attn_logit``: the attention-logit bound measured on every step (else only on log
  steps) and its line / forecast;
- ``monitor.log_z``: log Z of the final logits every step (read off the loss's log-softmax);
- ``monitor.attn_entropy``: the lowest head entropy on log steps (one sequence's attention
  probabilities at up to 64 query rows, every block);
- the per-block gradient norms and update/weight ratios on log steps (one AdamW-shaped pass
  over the parameters and moments, before the optimizer step).

"Off" removes those three monitors from the suite, measures the bound on log steps only,
drops the log Z hook and the log-step entropy / parameter statistics: the stability layer as
it was before them. The first step of each block carries the switch and is left out; each
block holds one log step (every 10). The estimate is the median over quads of (on blocks) /
(off blocks) - 1, wall clock and process CPU time (target <= 3%).

Usage: python scripts/bench_logits.py [--steps 400] [--warmup 10] [--configs tiny,small]
       [--threads N] [--logger none|wandb]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.lib import CONFIGS, StepClock, compose_cfg, prepare, run_overrides, train_with
from benchmarks.monitor_toggle import Toggle, toggle_args, toggled, toggled_rows
from benchmarks.stats import (
    BLOCK,
    load_average,
    print_table,
)
from stabilize.lit.stability import StabilityCallback

NEW = ("attn_logit", "attn_entropy", "log_z")


class LogitToggle(Toggle):
    """Both clocks after every step; the new monitors and statistics switched at each
    block's first step (the ABBA schedule is Toggle's)."""

    def __init__(self, warmup: int):
        super().__init__(warmup)
        self.state = True

    def on_train_start(self, trainer, pl_module):
        StepClock.on_train_start(self, trainer, pl_module)  # not Toggle's probe switch
        sc = self.sc = next(c for c in trainer.callbacks if isinstance(c, StabilityCallback)).engine
        self.monitors = {k: sc.suite.monitors[k] for k in NEW}
        self.always = sc.detailed_always
        probe, reset = sc.probe, sc.probe.reset

        def gated_reset(detailed=True, device=None, logged=None):
            if not self.state:  # as before them: the bound on log steps, nothing else
                logged = detailed if logged is None else logged
                return reset(detailed=logged, device=device, logged=False)
            return reset(detailed=detailed, device=device, logged=logged)

        probe.reset = gated_reset
        self.stamp(0)

    def _switch(self, on: bool) -> None:
        sc, probe = self.sc, self.sc.probe
        self.state = on
        for k in NEW:
            if on:
                sc.suite.monitors[k] = self.monitors[k]
            else:
                sc.suite.monitors.pop(k, None)
        sc.detailed_always = self.always if on else False
        probe.measure_log_z = on


def bench(name: str, args, tmp: Path) -> dict:
    n_blocks = (args.steps // (4 * BLOCK)) * 4
    total = args.warmup + n_blocks * BLOCK
    common = run_overrides(CONFIGS[name], args.precision, total, args.logger)
    cfg = compose_cfg(str(tmp / name), [*common, "rollback.durable_every=0"])
    clock = LogitToggle(args.warmup)
    train_with(cfg, clock)
    out = {"name": name, "quads": n_blocks // 4, **toggled(clock, args.warmup, n_blocks)}
    print(
        f"  {name}: {100 * statistics.median(out['t']):+.1f}% over {out['quads']} quads", flush=True
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    toggle_args(ap, CONFIGS)
    ap.add_argument("--logger", default="none", choices=["wandb", "none"])
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.steps = min(args.steps, 160)
    with tempfile.TemporaryDirectory(prefix="bench_logits-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    print(
        f"\nthe logit monitors + per-block statistics, toggled ABBA every {BLOCK} steps "
        f"in one run ({args.precision}, load average {args.load:.1f}, then {load_average():.1f})"
    )
    rows = toggled_rows(results)
    head = ["config", "clock", "off ms/step", "on ms/step", "overhead", "quads' range", "quads"]
    print_table(head, rows)
    print("target: overhead <= 3% (the median over quads)")


if __name__ == "__main__":
    main()
