"""The cost of the curvature pass (``monitor.curvature``, issue 38), measured inside one run.

One training run per config with every default monitor on; ``monitor.curvature`` is switched
off and on every BLOCK steps in ABBA order (on, off, off, on, ...), as the other toggles do,
so a drift of the shared machine's speed hits both arms alike. Each block holds one log step
(every 10), and while on the pass runs on it (``every=1`` here): a block's overhead is one
pass over BLOCK steps. The pass's cost in training steps is that overhead times BLOCK; with
a log step every 10 steps and ``every=10`` (opt-in: the default is 0, off) it is paid once
per 100 steps, so the run's overhead there is the block's divided by 10. g^2 / v_hat
and the update ratio are on in both arms (they cost one pass over AdamW's state on log
steps, as the other per-block statistics: scripts/bench_logits.py).

Usage: python scripts/bench_curvature.py [--quick] [--steps 400] [--warmup 10]
       [--configs tiny,small] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.lib import CONFIGS, StepClock, compose_cfg, prepare, run_overrides, train_with
from benchmarks.monitor_toggle import Toggle, toggle_args, toggled, toggled_rows
from benchmarks.stats import BLOCK, load_average, print_table
from stabilize.lit.stability import StabilityCallback

EVERY = 10  # the table's cadence: log steps per pass, and steps per log step


class CurvatureToggle(Toggle):
    """Both clocks after every step; the curvature pass switched at each block's first step."""

    def on_train_start(self, trainer, pl_module):
        StepClock.on_train_start(self, trainer, pl_module)  # not Toggle's probe switch
        sc = next(c for c in trainer.callbacks if isinstance(c, StabilityCallback))
        self.section = sc.mcfg.sections["curvature"]
        self.stamp(0)

    def _switch(self, on: bool) -> None:
        self.section.enabled = on


def bench(name: str, args, tmp: Path) -> dict:
    n_blocks = (args.steps // (4 * BLOCK)) * 4
    total = args.warmup + n_blocks * BLOCK
    common = run_overrides(CONFIGS[name], args.precision, total, "none")
    cfg = compose_cfg(str(tmp / name), [*common, "rollback.durable_every=0",
                                        "monitor.curvature.every=1"])  # fmt: skip
    clock = CurvatureToggle(args.warmup)
    train_with(cfg, clock)
    out = {"name": name, "quads": n_blocks // 4, **toggled(clock, args.warmup, n_blocks)}
    print(f"  {name}: one pass = {BLOCK * statistics.median(out['cpu']):.2f} steps (CPU time)",
          flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    toggle_args(ap, CONFIGS)
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.steps = min(args.steps, 160)
    with tempfile.TemporaryDirectory(prefix="bench_curvature-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    print(f"\nthe curvature pass, toggled ABBA every {BLOCK} steps in one run ({args.precision}, "
          f"load average {args.load:.1f}, then {load_average():.1f})")  # fmt: skip
    rows = toggled_rows(results, lambda q: [
        f"{BLOCK * statistics.median(q):.2f}",
        f"{100 * statistics.median(q) / EVERY:+.2f}%",
    ])  # fmt: skip
    head = ["config", "clock", "off ms/step", "on ms/step", "block overhead", "quads' range",
            "one pass (steps)", "at every=10", "quads"]  # fmt: skip
    print_table(head, rows)


if __name__ == "__main__":
    main()
