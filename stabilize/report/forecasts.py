"""Each forecast warning beside what came of it: its estimated lead and its real one.

A forecast event (``monitors/activations.py``) names a layer, the line it projected that
layer to cross (``extra.line``: ``rms``, a row's fp16 sum of squares passing 65504; ``abs``,
one |x| passing 256), and its estimate of the steps left (the event's value, as natural
growth slows; ``extra.at_this_rate``: at the current rate). The crossing itself is an event
of that layer too: an ``overflow`` (its fp16 reduction overflowed: the rms line) or an
``activation`` one (its |x| max passed 256), at the exact step. The real lead is the
optimizer steps taken from the warning to the first such event after it (in a run that
rolled back, steps taken, not the model's rewound ones); "never" when none came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stabilize.report.load import Run, _num

# the event that shows each line crossed
CROSSING = {"rms": "overflow", "abs": "activation"}
LINE_NAME = {"rms": "row RMS: fp16 sum of squares", "abs": "|x| max 256"}


@dataclass
class Warned:
    step: int  # the model step of the warning
    layer: str
    line: str  # "rms" | "abs"
    estimate: float | None  # steps left, as natural growth slows (the warning's headline)
    at_this_rate: float | None
    crossed_at: int | None = None  # the model step of the crossing
    lead: int | None = None  # steps taken from the warning to the crossing


def taken(e: dict[str, Any]) -> int:
    """The optimizer steps taken when an event came (Lightning's step, which a rollback does
    not rewind; the model's step for an event without one)."""
    g = e.get("global_step")
    return int(g if g is not None else e["step"])


def warned(run: Run) -> list[Warned]:
    """Every forecast warning of the run, in order, with its real lead."""
    ev = run.events
    out = []
    for i, e in enumerate(ev):
        if e.get("monitor") != "forecast" or e.get("kind") == "info":
            continue
        extra = e.get("extra") or {}
        line = str(extra.get("line", "rms"))
        w = Warned(int(e["step"]), str(e.get("layer")), line, _num(e.get("value")),
                   _num(extra.get("at_this_rate")))  # fmt: skip
        want = CROSSING.get(line)
        for later in ev[i + 1 :]:
            if later.get("monitor") == want and later.get("layer") == w.layer:
                w.crossed_at, w.lead = int(later["step"]), taken(later) - taken(e)
                break
        out.append(w)
    return out


HEADER = ["run", "warned at step", "layer", "line", "estimated lead", "real lead", "crossed at"]


def forecast_rows(runs: list[Run]) -> list[list[str]]:
    """The table of every run's warnings (only the header when there were none)."""
    rows = [HEADER]
    for r in runs:
        for w in warned(r):
            est = "-" if w.estimate is None else f"~{w.estimate:.0f}"
            if w.at_this_rate is not None:
                est += f" (~{w.at_this_rate:.0f} at that step's rate)"
            crossed = "never" if w.crossed_at is None else (
                f"step {w.crossed_at} ({CROSSING.get(w.line, '?')})"
            )  # fmt: skip
            rows.append([r.arm, str(w.step), w.layer, LINE_NAME.get(w.line, w.line), est,
                         "never" if w.lead is None else str(w.lead), crossed])  # fmt: skip
    return rows
