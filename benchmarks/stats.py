"""The benchmarks' robust statistics and their markdown tables.

Pure Python (no torch, no Lightning), so the norm benchmark imports it without the training
stack. Why robust: this machine is shared, and one stall of another job on our core moves a
ratio of two window means by several percent (see bench_monitors.py's docstring). So the
estimates here are medians: of repeated timings, of paired blocks of steps, of ABBA quads.
"""

from __future__ import annotations

import os
import statistics
import time

BLOCK = 10  # steps per block: one log step and one memory snapshot at the defaults
ABBA = (True, False, False, True)  # on, off, off, on: a linear drift cancels within a quad


# ---- medians and spreads ---------------------------------------------------------------
def median_time(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn``, in seconds."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); a single value is its own quartiles."""
    return tuple(statistics.quantiles(xs, n=4)) if len(xs) > 1 else (xs[0],) * 3


def median_interval(xs: list[float], level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median (the sign test's): the k-th
    smallest and k-th largest of ``xs`` for the largest k whose coverage, 1 - 2 P(Bin(n,
    1/2) < k), is at least ``level``; (low, high, its coverage). Too few values for
    ``level``: the whole range and its coverage (n = 4: 0.875; n = 8 gives the 2nd to 7th
    at 0.930, n = 12 the 3rd to 10th at 0.961)."""
    from math import comb

    xs, n = sorted(xs), len(xs)
    below = 0.0  # P(Bin(n, 1/2) < k), for k = 1, 2, ...
    k, coverage = 1, 1 - 2 * 0.5**n
    while k < n / 2:
        below += comb(n, k - 1) * 0.5**n
        nxt = 1 - 2 * (below + comb(n, k) * 0.5**n)
        if nxt < level:
            break
        k, coverage = k + 1, nxt
    return xs[k - 1], xs[n - k], coverage


def span(xs: list[float], fmt: str, sep: str = " to ") -> str:
    """``median (min<sep>max)``, each formatted with ``fmt``."""
    m, lo, hi = (fmt.format(f(xs)) for f in (statistics.median, min, max))
    return f"{m} ({lo}{sep}{hi})"


def load_average() -> float:
    """The 1-minute load average (how many processes want a core), NaN where unknown: over
    cores - threads, other jobs stall the OpenMP threads of a timed op."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


# ---- paired blocks of two runs (bench_monitors.py's pairs) ------------------------------
def window_blocks(stamps: dict[int, float], warm: int, total: int) -> list[float]:
    """Time per step of each block of BLOCK steps in the window (warm, total] (one block if
    shorter); ``stamps``: global step -> time after that step."""
    size = min(BLOCK, total - warm)
    edges = range(warm, total + 1, size)
    return [(stamps[b] - stamps[a]) / size for a, b in zip(edges, edges[1:], strict=False)]


def block_overhead(on: list[float], off: list[float]) -> float:
    """Median over blocks of block-i on / block-i off - 1."""
    return statistics.median(a / b - 1 for a, b in zip(on, off, strict=True))


# ---- ABBA blocks inside one run (monitor_toggle.py) -------------------------------------
def block_means(stamps: dict[int, float], warmup: int, n_blocks: int) -> list[float]:
    """Mean step time of each block, its first step (the switch) left out."""
    out = []
    for b in range(n_blocks):
        first = warmup + b * BLOCK + 1  # global step after the block's first step
        last = warmup + (b + 1) * BLOCK
        out.append((stamps[last] - stamps[first]) / (last - first))
    return out


def quad_overheads(means: list[float]) -> list[float]:
    """Per ABBA quad: mean of its on blocks / mean of its off blocks - 1."""
    out = []
    for q in range(len(means) // 4):
        m = means[4 * q : 4 * q + 4]
        out.append((m[0] + m[3]) / (m[1] + m[2]) - 1)
    return out


def position_overhead(stamps: dict[int, float], on: dict[int, bool], warmup: int, n: int):
    """A cross-check of the quad median, robust to stalls in another way: for each position
    in a block (the switch step left out), the median step time over the on blocks and over
    the off blocks; the overhead is sum(on medians) / sum(off medians) - 1. Work done once
    per block (the log step, the snapshot) sits at one position and counts in full; a stall
    of the machine lands in one block at one position, and a median drops it."""
    per: dict[bool, list[list[float]]] = {arm: [[] for _ in range(BLOCK)] for arm in (True, False)}
    for b in range(n):
        for pos in range(2, BLOCK + 1):  # global steps after steps 2..BLOCK of the block
            g = warmup + b * BLOCK + pos
            per[on[b]][pos - 1].append(stamps[g] - stamps[g - 1])
    on_sum = sum(statistics.median(x) for x in per[True] if x)
    off_sum = sum(statistics.median(x) for x in per[False] if x)
    return on_sum / off_sum - 1


# ---- markdown ---------------------------------------------------------------------------
def md_row(cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(head: list[str], rows) -> list[str]:
    """A markdown table's lines: the header, its rule, then one line per row of cells."""
    return [md_row(head), "|" + "---|" * len(head), *(md_row(r) for r in rows)]


def print_table(head: list[str], rows) -> None:
    """Print a markdown table."""
    print("\n".join(md_table(head, rows)))


def print_interleaved(results: list[dict], arm: str, key: str, target: float) -> None:
    """The table and the verdicts of a step-interleaved pair (bench_interleaved.py,
    bench_guard.py): per config its blocks' bare and ``arm`` ms/step (``bms``, ``key``), the
    ratios' median and quartiles, then ``target <config>: ...`` judged on the median as
    printed (3 decimals: the verdict never contradicts the number beside it)."""
    print(f"| config | quads | bare ms/step | {arm} ms/step | ratio (median) | quartiles |")
    print("|---|---|---|---|---|---|")
    for r in results:
        q = statistics.quantiles(r["ratios"], n=4) if len(r["ratios"]) > 1 else r["ratios"] * 3
        print(
            f"| {r['name']} | {len(r['ratios'])} | {1000 * statistics.median(r['bms']):.1f} "
            f"| {1000 * statistics.median(r[key]):.1f} | {statistics.median(r['ratios']):.3f} "
            f"| {q[0]:.3f} to {q[2]:.3f} |"
        )
    print()
    for r in results:
        ratio = round(statistics.median(r["ratios"]), 3)
        verdict = "PASS" if ratio >= target else "FAIL"
        print(f"target {r['name']}: {arm} / bare, step-interleaved = {ratio:.3f} "
              f"(>= {target}) {verdict}")  # fmt: skip
