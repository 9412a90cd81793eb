"""The benchmarks' shared statistics and tables (benchmarks/stats.py), and the size rule
for the scripts that use them (issue 10: no script over ~300 lines)."""

from __future__ import annotations

import pytest

from benchmarks.stats import (  # noqa: E402
    BLOCK,
    block_overhead,
    md_table,
    quartiles,
    span,
    window_blocks,
)

from conftest import ROOT


def test_md_table_prints_the_scripts_markdown():
    # the exact lines bench_monitors.py printed by hand before the tables were shared
    lines = md_table(["config", "quads", "off ms/step"], [["tiny", 1, "84.20"]])
    assert lines == [
        "| config | quads | off ms/step |",
        "|---|---|---|",
        "| tiny | 1 | 84.20 |",
    ]


def test_span_and_quartiles():
    assert span([3.0, 1.0, 2.0], "{:.2f}") == "2.00 (1.00 to 3.00)"  # bench_monitors
    assert span([3.0, 1.0, 2.0], "{:.0f}", sep="-") == "2 (1-3)"  # bench_step
    assert quartiles([5.0]) == (5.0, 5.0, 5.0)  # one run is its own quartiles
    q1, q2, q3 = quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert q1 < q2 == 3.0 < q3


def test_paired_blocks_drop_one_stall():
    """Two runs of 100 ms steps; the on-run pays 2 ms more per step, and one 50 ms stall
    lands in one of its blocks: the window ratio is moved by it, the block median is not."""
    warm, total = 10, 60
    off = {g: 100.0 * g for g in range(total + 1)}
    on, t = {warm: 0.0}, 0.0
    for g in range(warm + 1, total + 1):
        t += 102.0 + (50.0 if g == 25 else 0.0)
        on[g] = t
    b_on, b_off = window_blocks(on, warm, total), window_blocks(off, warm, total)
    assert len(b_on) == (total - warm) // BLOCK == 5
    assert block_overhead(b_on, b_off) == pytest.approx(0.02)
    window = (on[total] - on[warm]) / (off[total] - off[warm]) - 1
    assert window > 0.02 + 0.009  # what the median is for
    # a window shorter than a block is one block
    assert window_blocks(off, warm, warm + 3) == [pytest.approx(100.0)]


def test_no_script_over_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "scripts").glob("*.py")}
    assert sizes and all(n <= 300 for n in sizes.values()), sizes


def test_median_interval_is_the_sign_tests_by_hand():
    """Coverage 1 - 2 P(Bin(n, 1/2) < k), by hand: n = 8, k = 2: 1 - 2 (1 + 8) / 256;
    n = 12, k = 3: 1 - 2 (1 + 12 + 66) / 4096 (k = 4 would give 0.854 < 0.9); n = 4 is too
    few for 0.9: the whole range, 1 - 2 / 16."""
    from benchmarks.stats import median_interval

    assert median_interval([5.0, 1.0, 3.0, 2.0, 8.0, 7.0, 4.0, 6.0]) == (2.0, 7.0, 1 - 18 / 256)
    assert median_interval(list(range(12))) == (2, 9, 1 - 2 * 79 / 4096)
    assert median_interval([3.0, 1.0, 2.0, 0.0]) == (0.0, 3.0, 1 - 2 / 16)
