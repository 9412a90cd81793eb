"""What the harness costs, part by part: the arms of scripts/bench_cost.py and their table.

An arm is one training loop in the benchmark's process: the bare loop of bench_step.py, the
same loop under a ``Guard`` with every default on, the Guard with one part of the engine
off, the Lightning path (the driver). ``Part`` says how its arm switches the part off: Hydra
overrides (what a user can set), or a patch on that Guard's own engine (an instance
attribute: the other arms keep the class's method), for parts no setting turns off alone.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

import stabilize.stability.probe as probe_module
from benchmarks.stats import md_table


def _no_op(*args, **kwargs):
    return None


def _no_params(guard) -> None:
    """The log-step statistics (per-block gradient norm, update ratio, g^2 / v_hat) off."""
    if guard.engine.probe is not None:
        guard.engine.probe.record_params = _no_op


def _no_verdicts(guard) -> None:
    """The monitors' own work (the suite's update: windows, forecasts, verdicts) off."""
    guard.engine.suite.update = lambda stats: []


def _no_logs(guard) -> None:
    """The step's logs off (the metrics.csv row every step, the per-layer rows on log steps)."""
    guard.engine.log_stats = _no_op


@dataclass(frozen=True)
class Part:
    name: str  # the table's words
    overrides: tuple[str, ...] = ()
    patch: object = None  # called with the arm's Guard, once built
    how: str = ""  # how it is switched off, in the table

    @property
    def arm(self) -> str:
        return f"guard - {self.name}"


LOGITS = (
    "monitor.attn_logit.enabled=false",
    "monitor.attn_entropy.enabled=false",
    "monitor.log_z.enabled=false",
)
PARTS = (
    Part(
        "the logit monitors (attention bound every step, head entropy, log Z)",
        LOGITS,
        how="`" + " ".join(LOGITS) + "`",
    ),
    Part(
        "the log-step statistics (per-block gradient norm, update ratio, g^2/v)",
        patch=_no_params,
        how="`probe.record_params` a no-op",
    ),
    Part(
        "the monitors' verdicts (windows, forecasts)",
        patch=_no_verdicts,
        how="`suite.update` returns no event",
    ),
    Part(
        "the step's logs (metrics.csv, per-layer rows)",
        patch=_no_logs,
        how="`engine.log_stats` a no-op",
    ),
    Part(
        "the snapshots (memory ring every 10 steps)",
        ("rollback.enabled=false",),
        how="`rollback.enabled=false`",
    ),
)
ALL_OFF = Part("every part at once (the whole engine)", ("monitor=off", "rollback=off"),
               how="`monitor=off rollback=off`")  # fmt: skip


# The parts timed directly inside the full Guard's blocks: (its words, the objects' methods)
TIMED = {
    "hooks": "the forward hooks' passes (largest magnitudes, the attention bound, entropy rows)",
    "record_params": "the log-step statistics",
    "gather": "the gather and its host sync (net of the log-step statistics and of the "
    "total gradient norm, which the bare loop computes too, for its clipping)",
    "update": "the monitors' verdicts",
    "log_stats": "the step's logs",
    "snapshot": "the snapshots",
}
TIMED_ARM = "guard, timed"  # a Guard of its own: its clocks never slow the verdict's arm
_HOOK_FNS = ("absmax_into", "head_norm_max", "sampled_queries", "lowest_head_entropy")


class PartClock:
    """perf_counter around the engine's parts, in one Guard's blocks only (``active``; a
    Guard run for this alone, ``TIMED_ARM``, not the one the verdict reads):
    instance attributes on that Guard's engine, probe and suite; the probe module's pass
    functions wrapped once (the hooks call them by their module name), counting only
    while this clock is active."""

    def __init__(self):
        self.spent: defaultdict[str, float] = defaultdict(float)
        self.steps = 0
        self.active = False
        self.guard = None  # the Guard it times (print_cuts reads its model)

    def _timed(self, key: str, fn):
        def wrapped(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - t0

        return wrapped

    def attach(self, guard) -> None:
        self.guard, e = guard, guard.engine
        e.gather_step = self._timed("gather", e.gather_step)
        guard.host.grad_total_norm = self._timed("grad_norm", guard.host.grad_total_norm)
        if e.probe is not None:  # monitor=off: no probe
            e.probe.record_params = self._timed("record_params", e.probe.record_params)
        e.suite.update = self._timed("update", e.suite.update)
        e.log_stats = self._timed("log_stats", e.log_stats)
        e.snapshot = self._timed("snapshot", e.snapshot)
        for name in _HOOK_FNS:
            setattr(probe_module, name, self._timed("hooks", getattr(probe_module, name)))

    def per_step_ms(self) -> dict[str, float]:
        """ms per step of each part (the gather's net of the statistics and the norm it
        calls; the norm is computed once a step, for the gather and the clipping alike)."""
        ms = {k: 1000 * v / max(self.steps, 1) for k, v in self.spent.items()}
        ms["gather"] = ms.get("gather", 0.0) - ms.get("record_params", 0.0) - ms.get("grad_norm", 0)
        return {k: ms.get(k, 0.0) for k in TIMED}


@dataclass
class Times:
    """Each arm's step times (seconds), per round: {arm: [the steps of its blocks, in order]}."""

    rounds: list[dict[str, list[float]]] = field(default_factory=list)

    def add(self, arm: str, steps: list[float]) -> None:
        self.rounds[-1].setdefault(arm, []).extend(steps)

    def complete(self, per_round: int) -> list[dict[str, list[float]]]:
        """The rounds in which every arm ran its ``per_round`` steps."""
        return [r for r in self.rounds if r and all(len(v) == per_round for v in r.values())]


def robust_ms(rounds: list[dict[str, list[float]]], arm: str) -> float:
    """``arm``'s time per step, robust to the shared machine's stalls: per position in the
    round (an arm's steps line up round to round: the log step and the snapshot fall at the
    same positions), the median over rounds; their mean. Periodic work counts in full, a
    stall that hits one block at one position is dropped."""
    n = len(rounds[0][arm])
    return statistics.fmean(statistics.median(r[arm][i] for r in rounds) for i in range(n))


def boot(rounds, fn, draws: int = 400) -> tuple[float, float, float]:
    """``fn(rounds)`` and a 90% bootstrap interval over rounds (resampled with replacement,
    seeded: the same times print the same figures)."""
    rng = random.Random(0)
    got = [fn([rounds[rng.randrange(len(rounds))] for _ in rounds]) for _ in range(draws)]
    qs = statistics.quantiles(got, n=20)
    return fn(rounds), qs[0], qs[-1]


def ratio_of(arm: str, ref: str = "bare"):
    """``ref``'s robust time per step / ``arm``'s: its throughput relative to ``ref``."""
    return lambda rounds: robust_ms(rounds, ref) / robust_ms(rounds, arm)


def cost_of(arm: str):
    """``arm``'s robust time per step over the bare loop's - 1, in points of a step."""
    return lambda rounds: 100 * (robust_ms(rounds, arm) / robust_ms(rounds, "bare") - 1)


def means(rounds: list[dict[str, list[float]]]) -> list[dict[str, float]]:
    """Per round, each arm's mean time per step."""
    return [{a: statistics.fmean(v) for a, v in r.items()} for r in rounds]


def ratios(rounds: list[dict[str, float]], arm: str, ref: str = "bare") -> list[float]:
    """Per round: ``ref``'s time per step / ``arm``'s (its throughput relative)."""
    return [r[ref] / r[arm] for r in rounds]


def _fmt(t: tuple[float, float, float], fmt: str) -> tuple[str, str]:
    return fmt.format(t[0]), f"{fmt.format(t[1])} to {fmt.format(t[2])}"


def adapter_rows(rounds, adapters: list[tuple[str, str, str]]) -> list[list[str]]:
    """Per adapter (arm, words, the arm of its own bare loop): the robust ms/step of that
    loop and its own, the ratio and its 90% interval, the per-round ratios' median and
    quartiles beside them."""
    rows = []
    for arm, words, ref in adapters:
        r = boot(rounds, ratio_of(arm, ref))
        per = ratios(means(rounds), arm, ref)
        qs = statistics.quantiles(per, n=4) if len(per) > 1 else per * 3
        rows.append([words, len(rounds), f"{1000 * robust_ms(rounds, ref):.1f}",
                     f"{1000 * robust_ms(rounds, arm):.1f}", *_fmt(r, "{:.3f}"),
                     f"{qs[1]:.3f} ({qs[0]:.3f} to {qs[2]:.3f})"])  # fmt: skip
    return rows


def part_rows(rounds, parts: list[Part]) -> tuple[list[list[str]], dict[str, float]]:
    """The part-by-part table: per part, the Guard's cost with it off and its share (the
    full Guard's cost - that; 90% interval); then every part off at once (the engine's
    whole share; what is left is the Guard's own wrapper), and what no switch separates
    (the engine's share - the parts'). Returns the rows and the points: ``full`` (the
    Guard's cost), ``engine`` (its share), ``parts`` (the shares' sum), ``left``."""
    full = cost_of("guard")
    rows, total = [], 0.0
    for p in [*parts, ALL_OFF]:
        own = cost_of(p.arm)
        share = boot(rounds, lambda rs, own=own: full(rs) - own(rs))
        if p is not ALL_OFF:
            total += share[0]
        rows.append([p.name, p.how, f"{own(rounds):+.2f}", *_fmt(share, "{:+.2f}")])
    engine = share[0]  # ALL_OFF's, the last
    rows.append(["not switched apart (the norms' hooks, the gather and its host sync)",
                 "every part - the parts above", "", f"{engine - total:+.2f}", ""])  # fmt: skip
    med = {"full": full(rounds), "engine": engine, "parts": total,
           "left": cost_of(ALL_OFF.arm)(rounds)}  # fmt: skip
    return rows, med


def print_parts(rounds, parts: list[Part]) -> None:
    rows, m = part_rows(rounds, parts)
    head = ["part", "switched off by", "Guard's cost with it off (pts)", "its share (pts)",
            "share's 90% interval"]  # fmt: skip
    print("\n".join(md_table(head, rows)))
    print(f"\nthe Guard costs {m['full']:+.2f} points of a bare step: "
          f"the engine {m['engine']:+.2f} (the named parts {m['parts']:+.2f} of it), its "
          f"wrapper with every part off {m['left']:+.2f}")  # fmt: skip


def print_timed(rounds, clock: PartClock) -> None:
    """The parts timed inside the full Guard's blocks: ms per step and points of the bare
    loop's median step; their sum against the Guard's cost measured side by side."""
    bare = robust_ms(rounds, "bare") * 1000
    ms = clock.per_step_ms()
    rows = [[TIMED[k], f"{v:.2f}", f"{100 * v / bare:+.2f}"] for k, v in ms.items()]
    total = sum(ms.values())
    rows.append(["their sum", f"{total:.2f}", f"{100 * total / bare:+.2f}"])
    print("\n".join(md_table(["part (timed in the full Guard's blocks)", "ms/step",
                                "points of a bare step"], rows)))  # fmt: skip
    full, timed = cost_of("guard")(rounds), cost_of(TIMED_ARM)(rounds)
    print(f"\nthe Guard's cost side by side: {full:+.2f} points; the timed parts "
          f"{100 * total / bare:+.2f} of them, the rest {full - 100 * total / bare:+.2f} "
          f"(not attributed); the timed "
          f"Guard itself, its clocks on: {timed:+.2f}")  # fmt: skip


def print_cuts(clock: PartClock, reps: int = 5) -> None:
    """This round's two cuts, timed on the full Guard's own model and optimizer after the
    rounds (its last step's gradients, AdamW's state): the log-step statistics through the
    C++ pass against the torch ops it replaced (``block_grad_update_norms`` with ``keep``:
    the torch path the curvature still takes), and a memory snapshot's time on the training
    thread with its copy on a thread (``rollback.copy_async``) and without, the thread's
    copy waited for after the timing (its own time, which the step no longer waits for)."""
    from stabilize.stability.param_stats import block_grad_update_norms

    g = clock.guard
    probe, opt, engine = g.engine.probe, g.optimizer, g.engine
    if probe is None or not any(p.grad is not None for p in g.model.parameters()):
        return
    idx = torch.tensor(probe._param_index)
    norm = g.host.grad_total_norm()

    def stats(keep: bool):
        return lambda: block_grad_update_norms(probe.param_groups, idx, opt, norm, g.clip, keep)

    sharder = engine.controller.sharder
    hold = sharder.host_async

    def snap(on_thread: bool):
        def run():
            sharder.host_async = on_thread
            engine.snapshot()

        return run

    rows, what = [], [("log-step statistics, torch ops", stats(True)),
                      ("log-step statistics, the C++ pass", stats(False)),
                      ("snapshot, copied on the training thread", snap(False)),
                      ("snapshot, parameters and AdamW state on a thread", snap(True))]  # fmt: skip
    for words, fn in what:
        times = []
        for _ in range(reps):
            sharder.fence()  # a copy still in flight is the previous call's, not this one's
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        sharder.fence()
        rows.append([words, f"{1000 * statistics.median(times):.2f}"])
    sharder.host_async = hold
    print("\n".join(md_table(["what (on the full Guard's model, after the rounds)",
                              f"ms on the training thread, median of {reps}"], rows)))  # fmt: skip
