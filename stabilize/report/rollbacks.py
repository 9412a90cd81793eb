"""Each rollback of a run, told from its events: which fault it answered, what its rung of
the ladder changed, and whether that change lasted.

A rollback event (``monitor == "rollback"``) follows the verdicts that called for it, logged
at the same optimizer step taken (``global_step``). What a rung changes and how long it
lasts follows from what a restore puts back (stabilize/stability/controller.py: the
snapshot holds the model, the optimizer, the model step and the data position, not the LR
scale nor the norms' reduction dtype):

- ``skip_data`` moves the data position: a later rollback to a step at or before the one
  this rollback restored puts the old position back, and the skip is undone;
- ``lower_lr`` scales the LR for the rest of the run (no restore puts it back);
- ``fp32_reduction`` switches the norms for the rest of the run;
- ``retry`` changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# keys of a rollback event's ``extra`` that are not the remedy's own account of itself
NOT_REMEDY = {"restored_step", "remedy", "localization", "diagnosis"}


@dataclass
class Rollback:
    step: int  # the model step where the fault was seen
    restored_step: int | None
    remedy: str
    answered: list[str] = field(default_factory=list)  # "monitor@step: message"
    effect: str = ""
    undone_by: int | None = None  # the number (1-based) of the rollback that undid it
    cause: dict[str, Any] | None = None  # the first verdict event that called for it
    did: dict[str, Any] = field(default_factory=dict)  # the remedy's own account (extra)

    def line(self, n: int) -> str:
        why = "; ".join(self.answered) or "?"
        back = f", back to step {self.restored_step}" if self.restored_step is not None else ""
        lasted = (
            f" (undone by rollback {self.undone_by}: it restored an earlier data position)"
            if self.undone_by
            else ""
        )
        return f"{n}. step {self.step}{back}: answered {why}. {self.remedy}: {self.effect}{lasted}."


def _effect(extra: dict[str, Any]) -> str:
    remedy = extra.get("remedy")
    if remedy == "skip_data":
        return f"skipped {extra.get('skip_batches', '?')} batches"
    if remedy == "lower_lr":
        return f"LR x{extra.get('lr_factor', '?')} for the rest of the run"
    if remedy == "fp32_reduction":
        return f"{extra.get('norms_switched', '?')} norms reduce in fp32 from here on"
    if remedy == "retry":
        return "nothing changed (a transient fault should not recur)"
    return ", ".join(f"{k}={v}" for k, v in extra.items() if k not in ("remedy", "restored_step"))


def rollbacks(events: list[dict[str, Any]]) -> list[Rollback]:
    """The run's rollbacks in order, each with the verdicts logged at its optimizer step."""
    out: list[Rollback] = []
    verdicts: dict[Any, dict[str, list[str]]] = {}  # step taken -> {monitor@step: layers}
    causes: dict[Any, dict[str, Any]] = {}  # step taken -> its first verdict event
    for e in events:
        if e.get("kind") != "rollback":
            continue
        at = e.get("global_step", e.get("step"))
        if e.get("monitor") != "rollback":
            causes.setdefault(at, e)
            layers = verdicts.setdefault(at, {}).setdefault(
                f"{e.get('monitor')}@{e.get('step')}", []
            )
            if e.get("layer") and e["layer"] not in layers:
                layers.append(e["layer"])
            continue
        extra = e.get("extra") or {}
        answered = [
            v + (f" ({', '.join(layers)})" if layers else "")
            for v, layers in verdicts.pop(at, {}).items()
        ]
        out.append(
            Rollback(
                step=int(e.get("step", 0)),
                restored_step=extra.get("restored_step"),
                remedy=str(extra.get("remedy", "?")),
                answered=answered,
                effect=_effect(extra),
                cause=causes.pop(at, None),
                did={k: v for k, v in extra.items() if k not in NOT_REMEDY},
            )
        )
    for i, rb in enumerate(out):
        if rb.remedy != "skip_data" or rb.restored_step is None:
            continue
        for j in range(i + 1, len(out)):
            later = out[j].restored_step
            if later is not None and later <= rb.restored_step:
                rb.undone_by = j + 1
                break
    return out


def rollback_lines(events: list[dict[str, Any]]) -> list[str]:
    return [rb.line(n) for n, rb in enumerate(rollbacks(events), 1)]


def answered_skips(events: list[dict[str, Any]]) -> list[int]:
    """Steps of the GradScaler skips that a loss-scale verdict answered: the run of
    consecutive skips ending at each ``loss_scale`` rollback verdict. Such skips are
    non-finite gradients the scale could not calibrate away (a skip the scale recovered from
    on its own is its calibration). The run's length is the skip's own ``consecutive``
    count at the verdict's step, else the verdict's ("11 consecutive scaler skips")."""
    out: set[int] = set()
    last: dict[int, int] = {}  # model step -> its latest skip's consecutive count (0: unsaid)
    for e in events:
        if e.get("monitor") != "loss_scale":
            continue
        step = int(e.get("step", 0))
        if e.get("kind") == "skip":
            last[step] = int((e.get("extra") or {}).get("consecutive") or 0)
            continue
        if e.get("kind") != "rollback" or step not in last:  # a verdict on no skip: a floor
            continue
        said = re.match(r"(\d+) consecutive scaler skips", str(e.get("message", "")))
        run = last[step] or (int(said.group(1)) if said else 1)
        out |= set(range(step - run + 1, step + 1))
    skipped = {int(e.get("step", 0)) for e in events
               if e.get("monitor") == "loss_scale" and e.get("kind") == "skip"}  # fmt: skip
    return sorted(out & skipped)
