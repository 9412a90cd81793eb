"""bench_monitors.py's tables and verdicts, from the results its ``bench`` returns per config.

Five tables: step times per arm, the overhead estimates of the run pairs, where the on-arm's
extra CPU time goes, the snapshot / restore timings, and the in-run ABBA toggle
(monitor_toggle.py, with ``--toggle-steps``). Then the restore's verdict per config. The
harness's cost has no verdict here: the pairs and the toggle compare Lightning with the
harness against Lightning with it switched off, not against a bare loop (whatever stays on
when it is switched off is in both arms); the verdict is scripts/bench_cost.py's. Their
overhead lines say so.
"""

from __future__ import annotations

import os
import statistics

import torch

from benchmarks.monitor_clock import PARTS
from benchmarks.stats import BLOCK, print_table, quartiles, span

RESTORE_MAX = 1.0  # steps
TIMINGS = ("snapshot", "durable", "handover", "restore", "rollback")


def _quartiles(xs: list[float]) -> str:
    q1, q2, q3 = quartiles(xs)
    return f"{q2:+.1f}% ({q1:+.1f} to {q3:+.1f}; {min(xs):+.1f} to {max(xs):+.1f})"


def _pairs_tables(results: list[dict], args) -> None:
    print(
        f"\n{args.precision}, logger {args.logger}, {args.steps} timed steps after "
        f"{args.warmup}, {args.repeats} pairs (off/on interleaved), {torch.get_num_threads()} "
        f"torch threads, load average {args.load:.1f} at start on {os.cpu_count()} cores; "
        f"median (min to max) over pairs\n"
    )
    head = ["config", "params", "off ms/step", "on ms/step", "off CPU ms/step", "on CPU ms/step"]
    arms = [(k, arm) for k in ("ms", "cpu") for arm in ("off", "on")]  # the columns' order
    rows = [
        [res["name"], f"{res['params'] / 1e6:.2f}M", *(span(res[k][a], "{:.2f}") for k, a in arms)]
        for res in results
    ]
    print_table(head, rows)
    print(
        f"\nOverhead on/off - 1 per pair, median (min to max) over pairs. Block median: "
        f"median over {BLOCK}-step blocks of paired block ratios + the durable snapshot "
        f"amortised (the verdict); window: ratio of the window means.\n"
    )
    head = ["config", "block median (verdict)", "window", "CPU block median", "CPU window"]
    keys = ("robust", "ratios", "cpu_robust", "cpu_ratios")
    rows = [
        [res["name"], *(span([100 * x for x in res[k]], "{:+.1f}%") for k in keys)]
        for res in results
    ]
    print_table(head, rows)


def _cost_tables(results: list[dict], args) -> None:
    print(
        "\nWhere the on-arm's extra time goes, ms per step in the window (median over runs, "
        "% of the off step); rest = CPU overhead - parts:\n"
    )
    head = ["config", "CPU overhead", *PARTS.values(), "rest (hooks, norm stats, loggers)"]
    rows = []
    for res in results:
        p, base = res["parts"], statistics.median(res["cpu"]["off"])
        over = statistics.median(res["cpu"]["on"]) - base
        rest = over - sum(p.values())
        cells = [f"{v:.3f} ({100 * v / base:.1f}%)" for v in [*p.values(), rest]]
        rows.append([res["name"], f"{over:+.3f} ({100 * over / base:+.1f}%)", *cells])
    print_table(head, rows)
    print(
        f"\nSnapshot / restore, median of {args.reps}, ms and (x off-arm step time); "
        "rollback = the whole _rollback:\n"
    )
    head = ["config", "state MB", "step ms", "snapshot", "durable write"]
    head += ["its hand-over (background)", "restore", "rollback"]
    rows = []
    for res in results:
        step, t = statistics.median(res["ms"]["off"]), res["timings"]
        cells = [f"{t[k]:.2f} ({t[k] / step:.2f}x)" for k in TIMINGS]
        rows.append([res["name"], f"{res['snapshot_mb']:.1f}", f"{step:.2f}", *cells])
    print_table(head, rows)


def _toggle_table(results: list[dict]) -> None:
    toggled = [r for r in results if r["toggled"]]
    if not toggled:
        return
    print(
        f"\nIn one run, monitors switched on and off every {BLOCK} steps in ABBA order "
        f"(benchmarks/monitor_toggle.py): on/off - 1 per quad of blocks, median (quartiles, "
        f"min to max) over quads, durable write amortised:\n"
    )
    head = ["config", "quads", "off ms/step", "wall (verdict)", "CPU"]
    head.append("per-position medians, wall (cross-check)")
    rows = []
    for res in toggled:
        tg = res["toggled"]
        cells = [_quartiles([100 * x for x in tg[k]]) for k in ("t", "cpu")]
        positions = f"{100 * tg['t_positions']:+.1f}%"
        rows.append([res["name"], tg["quads"], f"{tg['t_step_ms']:.2f}", *cells, positions])
    print_table(head, rows)


def _verdicts(res: dict) -> None:
    est = res["toggled"]["t"] if res["toggled"] else res["robust"]
    how = "in-run ABBA toggle" if res["toggled"] else "block median of run pairs"
    q1, ratio, q3 = quartiles(est)
    print(
        f"overhead {res['name']}: on/off - 1 ({how}) = {100 * ratio:+.1f}% (quartiles "
        f"{100 * q1:+.1f} to {100 * q3:+.1f}): against Lightning with the harness off, not "
        "what a user pays (no verdict: scripts/bench_cost.py)"
    )
    steps = res["timings"]["rollback"] / statistics.median(res["ms"]["off"])
    verdict = "PASS" if steps < RESTORE_MAX else "FAIL"
    print(
        f"target {res['name']}: restore from memory (whole _rollback) = {steps:.2f} steps "
        f"(< {RESTORE_MAX:g}) {verdict}"
    )


def report(results: list[dict], args) -> None:
    """Every table, then the verdicts."""
    _pairs_tables(results, args)
    _cost_tables(results, args)
    _toggle_table(results)
    print()
    for res in results:
        _verdicts(res)
