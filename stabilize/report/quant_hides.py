"""What a quantized arm hides: its GEMM operands' headroom over the run, beside its gap.

An arm whose Linears train in 8 or 4 bits (``quant=...``) logs, per operand, the probe's
series (``q_sat/``, ``q_clip/``, ``q_sqnr/``, ``q_under/`` keyed ``<layer>.x|w|dy``,
stabilize/stability/quant_sites.py). A format that clips instead of overflowing ends in no
NaN, so "no NaN" says nothing; what it cost is in these series and in the gap to the
reference. Over every quantized operand and every logged step of the run:

- the largest saturated share (values past the format's max after scaling, counted before
  the cast that hides them), and the operand and step where it was;
- the largest clipped-block share (block formats: blocks whose amax the scale pushed past
  the max);
- the lowest SQNR in dB of a quantized operand against its high-precision value;
- the largest underflow share (non-zero values that became 0).

``quant_words`` gives the verdict of such an arm in the words its numbers allow: a gap
inside the reference's seed band is "no measurable gap", never "fixed"; one above it
"trains worse"; the hidden cost is named with its number and operand beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.report.load import Run
from stabilize.report.verdict import TAIL, Reference, Verdict, gap_words

# the column's name, the series prefix, and which end of the run counts (max, or min)
COLUMNS = (
    ("max saturated share", "q_sat/", max),
    ("max clipped-block share", "q_clip/", max),
    ("min SQNR (dB)", "q_sqnr/", min),
    ("max underflow share", "q_under/", max),
)
NOTE = (
    "*max saturated share* .. *max underflow share*: over every quantized GEMM operand "
    "(`<layer>.x` fprop's input, `.w` its weight, `.dy` the grad-output) and every logged "
    "step, the largest share of values past the format's max after scaling (counted before "
    "the cast, which clips them to the max), of blocks clipped so (block formats), of non-zero "
    "values flushed to 0, and the lowest SQNR of a quantized operand against its "
    "high-precision value; in brackets the operand and step. `-`: not a quantized arm. "
    "*what it hides*, for a quantized arm: the same four, in words."
)


@dataclass
class Extreme:
    value: float
    where: str  # <layer>.<operand>
    step: int


@dataclass
class QuantHides:
    saturated: Extreme
    clipped: Extreme
    sqnr_db: Extreme
    underflow: Extreme
    saturated_steps: int  # logged steps with any saturated value

    def cells(self) -> list[str]:
        return [
            _cell(self.saturated, "{:.2%}"),
            _cell(self.clipped, "{:.2%}"),
            _cell(self.sqnr_db, "{:.1f}"),
            _cell(self.underflow, "{:.2%}"),
        ]


def _cell(e: Extreme, fmt: str) -> str:
    if e.value == 0 and fmt.endswith("%}"):
        return "0"
    return f"{fmt.format(e.value)} ({e.where}, step {e.step})"


def _extreme(run: Run, prefix: str, pick) -> Extreme | None:
    found = []
    for key in run.keys(prefix):
        for x, v in run.series(key):
            if v is not None and math.isfinite(v):
                found.append((v, key.removeprefix(prefix), int(x)))
    if not found:
        return None
    # the extreme value, and its first occurrence (the earliest step, then the key)
    best = pick(v for v, _, _ in found)
    v, where, step = min((f for f in found if f[0] == best), key=lambda f: (f[2], f[1]))
    return Extreme(v, where, step)


def quant_hides(run: Run) -> QuantHides | None:
    """The run's extremes over its quantized operands (None: no ``q_`` series)."""
    got = [_extreme(run, prefix, pick) for _, prefix, pick in COLUMNS]
    if any(e is None for e in got):
        return None
    steps = {
        int(x)
        for key in run.keys("q_sat/")
        for x, v in run.series(key)
        if v is not None and math.isfinite(v) and v > 0
    }
    return QuantHides(*got, saturated_steps=len(steps))


def hidden_words(h: QuantHides) -> str:
    """What the format hid, in words, each number with its operand and step."""
    parts = []
    s = h.saturated
    if s.value > 0:
        parts.append(
            f"it saturated up to {s.value:.2%} of {s.where} (step {s.step}; saturated values "
            f"on {h.saturated_steps} logged steps), clipped to the format's max with no inf "
            "or NaN to show it"
        )
    else:
        parts.append("no operand saturated")
    if h.clipped.value > 0:
        c = h.clipped
        parts.append(f"up to {c.value:.2%} of {c.where}'s blocks clipped (step {c.step})")
    if h.underflow.value > 0:
        u = h.underflow
        parts.append(f"up to {u.value:.2%} of {u.where} flushed to 0 (step {u.step})")
    q = h.sqnr_db
    parts.append(f"its lowest SQNR {q.value:.1f} dB ({q.where}, step {q.step})")
    return "; ".join(parts)


def quant_words(
    arm: str, v: Verdict, h: QuantHides, band: tuple[float, float] | None
) -> tuple[str, str]:
    """The label and sentence of a quantized arm that finished without NaN (``v``: its
    verdict; ``band``: the reference's held-out bpb band). "No NaN" is never "fixed": the
    gap decides, in seed-noise units."""
    hid, gap = hidden_words(h), gap_words(v)
    if v.inside is None or band is None:
        label = "no NaN (no spread to judge)"
        how = f"gap to the reference {gap}, with 1 reference seed: no spread to judge it by"
    elif v.inside:
        label = "no NaN, no measurable gap"
        how = (
            f"no measurable gap to the reference ({gap}; inside the reference's band "
            f"{band[0]:.3f}-{band[1]:.3f} bpb)"
        )
    else:
        label = "no NaN, trains worse"
        how = (
            f"it trains worse than the reference ({gap}; above the reference's band "
            f"{band[0]:.3f}-{band[1]:.3f} bpb)"
        )
    return label, f'{arm}: no NaN, which is not "fixed": {how}; what it hides: {hid}.'


def judge_quant(runs: list[Run], ref: Reference | None, vs: list[Verdict]) -> dict:
    """Each quantized run's ``QuantHides`` by arm name; the verdict of each quantized arm
    that finished without NaN against a reference is rewritten in ``quant_words``' terms
    (a NaN, a collapse or a missing reference keep the 16-bit words)."""
    hides = {r.arm: h for r in runs if (h := quant_hides(r)) is not None}
    for v in vs:
        h = hides.get(v.arm)
        if h is not None:  # what its format hid, not the gap the columns before give
            v.hides = hidden_words(h)
        if h is not None and ref is not None and v.nan_stopped and not v.dies:
            v.label, v.words = quant_words(v.arm, v, h, ref.band("bpb"))
    return hides


def quant_rows(rows: list[list[str]], vs: list[Verdict], hides: dict) -> list[list[str]]:
    """The verdict table (``verdict_rows``) with the four columns before its last two;
    unchanged without a quantized arm."""
    if not hides:
        return rows
    cells = {v.arm: hides[v.arm].cells() for v in vs if v.arm in hides}
    names = [name for name, _, _ in COLUMNS]
    out = [rows[0][: -len(TAIL)] + names + rows[0][-len(TAIL) :]]
    arms = [None] * (len(rows) - 1 - len(vs)) + [v.arm for v in vs]  # the reference row first
    for row, arm in zip(rows[1:], arms, strict=True):
        add = cells.get(arm, ["-"] * len(names))
        out.append(row[: -len(TAIL)] + add + row[-len(TAIL) :])
    return out
