"""The monitors' cost measured inside one run: on and off in alternating blocks of steps.

Two separate runs (bench_monitors.py's pairs) see the shared machine at different moments;
a neighbour's job landing on one of them moves the estimate by more than the 3% it looks
for. Here a single training run switches every monitor and the snapshots off and on every
BLOCK steps in ABBA order (on, off, off, on, ...), so a drift of the machine's speed hits
both arms alike and a linear one cancels within each quad of blocks.

"Off" is what ``monitor=off rollback=off`` does: the probe's hooks are removed (norms stop
collecting statistics) and the stability callback's per-step work is skipped, so no gather,
no monitors, no per-layer logging, no snapshot. "On" puts them back (a new probe; the
monitors keep their windows). The first step of each block carries the switch and is left
out; a block holds one memory snapshot (every 10 steps) when on. The run writes no durable
snapshot (one every 100 steps would land in one block only); its cost, timed directly by
bench_monitors.py, is added back amortised. The estimate is the median over quads of
(on blocks) / (off blocks) - 1, in wall-clock and in process CPU time.
"""

from __future__ import annotations

import statistics

from benchmarks.lib import StepClock, train_with
from benchmarks.stats import ABBA, BLOCK, block_means, position_overhead, quad_overheads
from stabilize.lit.stability import StabilityCallback
from stabilize.stability import HEAD
from stabilize.stability.probe import StabilityProbe


class Toggle(StepClock):
    """Both clocks after every step, and the monitors switched at each block's first step."""

    def __init__(self, warmup: int):
        super().__init__()
        self.warmup = warmup
        self.on: dict[int, bool] = {}  # block index -> monitors on

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        cb = next(cb for cb in trainer.callbacks if isinstance(cb, StabilityCallback))
        self.sc = cb.engine
        self.model = pl_module.model
        self.judge = self.sc.judge
        self.stamp(0)

    def _switch(self, on: bool) -> None:
        sc = self.sc
        if on and sc.probe is None:
            sc.probe = StabilityProbe(self.model, lead=HEAD)
        elif not on and sc.probe is not None:
            sc.probe.remove()
            sc.probe = None
        # an instance attribute: the callback's on_before_optimizer_step calls it
        sc.judge = self.judge if on else (lambda *a, **k: None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        g = trainer.global_step
        if g >= self.warmup and (g - self.warmup) % BLOCK == 0:
            b = (g - self.warmup) // BLOCK
            self.on[b] = ABBA[b % 4]
            self._switch(self.on[b])


class FingerprintToggle(Toggle):
    """Monitors on in every block; only the replica fingerprint (gather.py) is switched: in
    "on" blocks the gather computes it every ``every`` steps, as a multi-process run does
    (the fingerprint is computed and gathered whatever the world size here: one process
    has nothing to compare it with, but pays the same)."""

    def __init__(self, warmup: int, every: int = 10):
        super().__init__(warmup)
        self.every = every

    def _switch(self, on: bool) -> None:
        sc = self.sc
        n = self.every if on else 0

        def gather():
            due = bool(n) and (sc.host.train_state.model_step + 1) % n == 0
            return sc.gather(sc.loop, sc.host, sc.loop.optimizer(), sc.probe, replicas=due)

        sc.gather_step = gather  # an instance attribute: the engine's judge calls it


def toggle_bench(
    cfg, steps: int, warmup: int, durable_ms: float, durable_every: int, clock=None
) -> dict:
    """One run of ``cfg`` (monitors and rollback on, durable snapshots off) with ``steps``
    toggled steps after ``warmup``; the durable write (``durable_ms`` every
    ``durable_every`` steps) is added back amortised. ``clock``: what is toggled (default:
    every monitor and the snapshots, ``Toggle``)."""
    n_blocks = (steps // (4 * BLOCK)) * 4
    clock = clock or Toggle(warmup)
    train_with(cfg, clock)
    out = {}
    for key in ("t", "cpu"):
        means = block_means(getattr(clock, key), warmup, n_blocks)
        off_step = statistics.median(m for b, m in enumerate(means) if not clock.on[b])
        extra = (durable_ms / 1000 / durable_every / off_step) if durable_every else 0.0
        quads = quad_overheads(means)
        out[key] = [q + extra for q in quads]
        out[f"{key}_step_ms"] = 1000 * off_step
        out[f"{key}_positions"] = (
            position_overhead(getattr(clock, key), clock.on, warmup, n_blocks) + extra
        )
    out["quads"] = len(out["t"])
    return out


def toggled(clock: Toggle, warmup: int, n_blocks: int) -> dict:
    """Per clock (``t`` wall, ``cpu`` process time): the median ms/step of the off and the
    on blocks, and each quad's overhead (on / off - 1)."""
    import statistics

    out: dict = {}
    for key in ("t", "cpu"):
        means = block_means(getattr(clock, key), warmup, n_blocks)
        for state in ("off", "on"):
            out[f"{key}_{state}_ms"] = 1000 * statistics.median(
                m for b, m in enumerate(means) if clock.on[b] == (state == "on")
            )
        out[key] = quad_overheads(means)
    return out


def toggle_args(ap, configs) -> None:
    """The toggle benchmarks' common options (scripts/bench_logits.py, bench_curvature.py)."""
    ap.add_argument("--quick", action="store_true", help="tiny only, 160 steps")
    ap.add_argument("--steps", type=int, default=400, help="toggled steps (whole quads of blocks)")
    ap.add_argument("--warmup", type=int, default=10, help="untoggled steps first")
    ap.add_argument("--configs", default="tiny,small", help=f"of {sorted(configs)}")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--precision", default="fp32", help="a configs/precision name")


def toggled_rows(results: list[dict], extra=lambda q: []) -> list[list]:
    """Per config and clock: config, clock, off and on ms/step, the median quad's overhead,
    the quads' range, ``extra(quads)``'s cells, the number of quads."""
    import statistics

    from benchmarks.stats import span

    rows = []
    for r in results:
        for key, clock in (("t", "wall"), ("cpu", "CPU")):
            q = r[key]
            rows.append([
                r["name"], clock, f"{r[f'{key}_off_ms']:.2f}", f"{r[f'{key}_on_ms']:.2f}",
                f"{100 * statistics.median(q):+.1f}%",
                span([100 * x for x in q], "{:+.1f}%") if len(q) > 1 else "-",
                *extra(q), r["quads"],
            ])  # fmt: skip
    return rows
