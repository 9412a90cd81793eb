"""What the harness costs, part by part: the arms of scripts/bench_cost.py and their table.

An arm is one training loop in the benchmark's process: the bare loop of bench_step.py, the
same loop under a ``Guard`` with every default on, the Guard with one part of the engine
off, the Lightning path (the driver). ``Part`` says how its arm switches the part off: Hydra
overrides (what a user can set), or a patch on that Guard's own engine (an instance
attribute: the other arms keep the class's method), for parts no setting turns off alone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks.stats import md_table


def _no_op(*args, **kwargs):
    return None


def _no_params(guard) -> None:
    """The log-step statistics (per-block gradient norm, update ratio, g^2 / v_hat) off."""
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
    Part("the logit monitors (attention bound every step, head entropy, log Z)", LOGITS,
         how="`" + " ".join(LOGITS) + "`"),  # fmt: skip
    Part("the log-step statistics (per-block gradient norm, update ratio, g^2/v)",
         patch=_no_params, how="`probe.record_params` a no-op"),  # fmt: skip
    Part("the monitors' verdicts (windows, forecasts)", patch=_no_verdicts,
         how="`suite.update` returns no event"),  # fmt: skip
    Part("the step's logs (metrics.csv, per-layer rows)", patch=_no_logs,
         how="`engine.log_stats` a no-op"),  # fmt: skip
    Part("the snapshots (memory ring every 10 steps)", ("rollback.enabled=false",),
         how="`rollback.enabled=false`"),  # fmt: skip
)
ALL_OFF = Part("every part at once (the whole engine)", ("monitor=off", "rollback=off"), how="`monitor=off rollback=off`")


@dataclass
class Times:
    """Seconds per step of each arm's blocks, per round: {arm: [[block, block], ...]}."""

    rounds: list[dict[str, list[float]]] = field(default_factory=list)

    def add(self, arm: str, seconds_per_step: float) -> None:
        self.rounds[-1].setdefault(arm, []).append(seconds_per_step)

    def complete(self) -> list[dict[str, float]]:
        """Per complete round, each arm's mean time per step over its two blocks."""
        full = [r for r in self.rounds if r and all(len(v) == 2 for v in r.values())]
        return [{a: sum(v) / 2 for a, v in r.items()} for r in full]


def ratios(rounds: list[dict[str, float]], arm: str) -> list[float]:
    """Per round: the bare loop's time per step / ``arm``'s (its throughput relative)."""
    return [r["bare"] / r[arm] for r in rounds]


def costs(rounds: list[dict[str, float]], arm: str) -> list[float]:
    """Per round: ``arm``'s time per step over the bare loop's - 1, in points of a step."""
    return [100 * (r[arm] / r["bare"] - 1) for r in rounds]


def _q(xs: list[float], fmt: str) -> tuple[str, str]:
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3
    return fmt.format(qs[1]), f"{fmt.format(qs[0])} to {fmt.format(qs[2])}"


def adapter_rows(rounds, adapters: list[tuple[str, str]]) -> list[list[str]]:
    """Per adapter (arm, words): bare ms/step, its ms/step, the ratio's median, quartiles."""
    rows = []
    for arm, words in adapters:
        med, qs = _q(ratios(rounds, arm), "{:.3f}")
        bare = 1000 * statistics.median(r["bare"] for r in rounds)
        own = 1000 * statistics.median(r[arm] for r in rounds)
        rows.append([words, len(rounds), f"{bare:.1f}", f"{own:.1f}", med, qs])
    return rows


def part_rows(rounds, parts: list[Part]) -> tuple[list[list[str]], dict[str, float]]:
    """The part-by-part table: per part, the Guard's cost with it off and its share (the
    full Guard's cost - that, per round; median, quartiles); then every part off at once
    (the engine's whole share; what is left is the Guard's own wrapper), and what no switch
    separates (the engine's share - the parts' medians). Returns the rows and the medians:
    ``full`` (the Guard's cost), ``engine`` (its share), ``parts`` (the shares' sum),
    ``left`` (every part off)."""
    full = costs(rounds, "guard")
    rows, total = [], 0.0
    for p in [*parts, ALL_OFF]:
        own = costs(rounds, p.arm)
        share = [f - o for f, o in zip(full, own, strict=True)]
        if p is not ALL_OFF:
            total += statistics.median(share)
        rows.append([p.name, p.how, _q(own, "{:+.2f}")[0], *_q(share, "{:+.2f}")])
    engine = statistics.median(share)  # ALL_OFF's, the last
    rows.append(["not switched apart (the norms' hooks, the gather and its host sync)",
                 "everything - the parts above", "", f"{engine - total:+.2f}", ""])  # fmt: skip
    med = {"full": statistics.median(full), "engine": engine, "parts": total,
           "left": statistics.median(costs(rounds, ALL_OFF.arm))}  # fmt: skip
    return rows, med


def print_parts(rounds, parts: list[Part]) -> None:
    rows, m = part_rows(rounds, parts)
    head = ["part", "switched off by", "Guard's cost with it off (pts)",
            "its share (pts, median)", "share's quartiles"]  # fmt: skip
    print("\n".join(md_table(head, rows)))
    print(f"\nthe Guard costs {m['full']:+.2f} points of a bare step (median over rounds): "
          f"the engine {m['engine']:+.2f} (the named parts {m['parts']:+.2f} of it), its "
          f"wrapper with every part off {m['left']:+.2f}")  # fmt: skip
