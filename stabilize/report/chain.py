"""The chain of events of one run, as the report tells it.

Every rollback and abort is its own line (with its remedy: a reader follows the ladder);
other events are grouped by (monitor, kind): one line at the first occurrence, naming the
other layers flagged at that step and how often and over which steps it recurred, so a
scaler skip on every step reads as one line, not fifty. A monitor's ROLLBACK verdict in a
run with rollback off rolled nothing back: it says "would roll back (rollback off)".
"""

from __future__ import annotations

from typing import Any

from stabilize.report.load import Run


def rollback_enabled(run: Run) -> bool | None:
    """Whether the run had rollback on: its config says, else whether one happened."""
    rb = run.config.get("rollback")
    if isinstance(rb, dict) and "enabled" in rb:
        return bool(rb["enabled"])
    if any(e.get("monitor") == "rollback" for e in run.events):
        return True
    return None


def _word(kind: str, rollback_on: bool | None) -> str:
    if kind != "rollback":
        return kind
    if rollback_on is False:
        return "would roll back (rollback off)"
    return "calls for a rollback" if rollback_on else "rollback verdict"


def _steps(events: list[dict[str, Any]]) -> str:
    steps = sorted({int(e["step"]) for e in events if e.get("step") is not None})
    if len(steps) < 2:  # once, or the layers of one step (named by "also")
        return ""
    return f" ({len(events)} times, steps {steps[0]}-{steps[-1]})"


def _action(e: dict[str, Any]) -> str:
    """A rollback or abort line: what was done, with the remedy first."""
    extra = e.get("extra") or {}
    if e.get("kind") == "abort":
        return f"step {e.get('step')}: **abort** ({e.get('monitor')}) {e.get('message', '')}"
    remedy = extra.get("remedy")
    head = f"**rollback**, remedy `{remedy}`" if remedy else "**rollback**"
    return f"step {e.get('step')}: {head}: {e.get('message', '')}"


def chain(run: Run) -> list[str]:
    """The story as it happened, one line per rollback/abort and per kind of event."""
    on = rollback_enabled(run)
    slots: list[Any] = []  # a line (str) or a group key, in order of first occurrence
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in run.events:
        if e.get("kind") == "info":
            continue
        if e.get("monitor") == "rollback" or e.get("kind") == "abort":
            slots.append(_action(e))
            continue
        key = (e.get("monitor"), e.get("kind"))
        if key not in groups:
            groups[key] = []
            slots.append(key)
        groups[key].append(e)
    out = []
    for slot in slots:
        if isinstance(slot, str):
            out.append(slot)
            continue
        evs = groups[slot]
        first = evs[0]
        also = []
        for e in evs[1:]:  # the other layers flagged at the same step
            layer = e.get("layer")
            if e.get("step") == first.get("step") and layer and layer not in also:
                also.append(layer)
        msg = first.get("message") or f"{first.get('monitor')} {first.get('layer') or ''}".strip()
        line = f"step {first.get('step')}: **{_word(first.get('kind'), on)}** ({slot[0]}) {msg}"
        if also:
            line += f"; also {', '.join(also)} at that step"
        out.append(line + _steps(evs))
    return out
