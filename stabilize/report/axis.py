"""One step axis for the table and every plot: the model's own step (``train/step``).

The loggers count Lightning's global step (optimizer steps taken, monotonic, what W&B
needs), but a rollback rewinds the model: the steps after the restored one are taken
again. The table speaks of model steps (the events carry them), so the plots do too. A
rolled-back attempt is not hidden: it becomes its own piece, drawn faded from the restored
step to where it was abandoned; the kept trajectory, what the model that finished went
through, is one line.

How a rollback shows in the logs (``stabilize/stability/``: ``sink.py`` writes the
stability row, ``controller.py`` restores): at the global step of a rollback, the
stability row says the attempted step while the module's row, written after the restore,
says the restored one; the batch Lightning fetched before the restore is then logged once
more at the restored step without being trained on (a stale batch). The events file names
the global step, the attempted step and the restored one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from stabilize.report.load import Run


@dataclass(frozen=True)
class Rewind:
    """One rollback: at global step ``x`` the attempt at model step ``at`` was dropped and
    the model restored to step ``to``, with ``remedy`` applied."""

    x: float
    at: int
    to: int
    remedy: str = ""


@dataclass
class Piece:
    """A line piece in model steps: the kept trajectory, or an abandoned attempt (it starts
    at the step it was restored to, and ends where the rollback dropped it)."""

    xs: list[int]
    ys: list[float]
    abandoned: bool


def rewinds(run: Run) -> list[Rewind]:
    """Every rollback of a run, in order. From events.jsonl when it has them (exact); from
    the rows otherwise (the W&B API: a drop of ``train/step`` between logged rows)."""
    out = []
    for e in run.events:
        if e.get("monitor") == "rollback" and e.get("kind") == "rollback":
            if e.get("global_step") is None:
                continue
            extra = e.get("extra") or {}
            to = extra.get("restored_step")
            at = int(e["step"])
            out.append(
                Rewind(
                    float(e["global_step"]),
                    at,
                    int(at - 1 if to is None else to),
                    str(extra.get("remedy") or ""),
                )
            )
    if out:
        return out
    steps = _steps_by_x(run)
    prev_x, prev = None, None
    for x in sorted(steps):
        s = max(steps[x])
        if prev is not None and s < prev:
            out.append(Rewind(prev_x, prev, s))
        prev_x, prev = x, s
    return out


def _steps_by_x(run: Run) -> dict[float, list[int]]:
    by_x: dict[float, list[int]] = defaultdict(list)
    for r in run.rows:
        if "train/step" in r:
            by_x[r["x"]].append(int(r["train/step"]))
    return by_x


def model_steps(run: Run) -> dict[float, int | None]:
    """{global x: the model step that row belongs to}; None for a stale batch's row (logged
    after a restore, not trained on: no step of the model)."""
    at_rewind = {rw.x: rw for rw in rewinds(run)}
    by_x = _steps_by_x(run)
    out: dict[float, int | None] = {}
    cur, restored = 0, None
    for x in sorted({r["x"] for r in run.rows}):
        if x in at_rewind:  # the attempt itself, dropped by the rollback
            rw = at_rewind[x]
            out[x], cur, restored = rw.at, rw.to, rw.to
            continue
        if not by_x.get(x):  # validation rows: the model's step at that point
            out[x] = cur
            continue
        s = max(by_x[x])
        if restored is not None and s <= restored:
            out[x] = None  # the stale batch after a restore
            continue
        out[x] = cur = s
    return out


def pieces(run: Run, key: str) -> list[Piece]:
    """One metric in model steps: the kept trajectory first, then each abandoned attempt."""
    steps = model_steps(run)
    rws = sorted(rewinds(run), key=lambda r: r.x)
    pts = [(x, steps.get(x), v) for x, v in run.series(key)]
    pts = [(x, s, v) for x, s, v in pts if s is not None]
    # segment i holds the points up to (and including) rewind i's global step
    bounds = [rw.x for rw in rws]
    segments: list[list[tuple[int, float]]] = [[] for _ in range(len(rws) + 1)]
    for x, s, v in pts:
        i = sum(1 for b in bounds if x > b)
        segments[i].append((s, v))
    # a point survives iff no later rollback restored to a step before it
    keep_up_to = [min((rw.to for rw in rws[i:]), default=None) for i in range(len(segments))]
    kept: list[tuple[int, float]] = []
    out: list[Piece] = []
    for seg, limit in zip(segments, keep_up_to, strict=True):
        if limit is None:
            kept += seg
            continue
        kept += [(s, v) for s, v in seg if s <= limit]
        lost = [(s, v) for s, v in seg if s > limit]
        if lost:
            anchor = [p for p in kept if p[0] <= limit][-1:]  # start at the restored step
            out.append(Piece([s for s, _ in anchor + lost], [v for _, v in anchor + lost], True))
    return [Piece([s for s, _ in kept], [v for _, v in kept], False), *out]
