"""What each arm's step costs against the reference's, only as measured paired.

The runs' own tokens/s is no cost: the arms of a scenario run at different moments, two at
a time, on a machine other work shares, so a ratio of two runs' step times is the machine's
load as much as the arm's cost (measured: every arm read 1.35-1.52, bf16 included, whose
step is ~0.13 of an fp16 one here). ``scripts/arm_cost.py`` measures it paired instead: in
one process, each arm's training step (its model, AdamW, autocast and GradScaler as its
config says; no monitors, whose cost is the same in every arm) in rounds, the arms in
alternating order (forward, then reversed), so that a change of the machine's speed hits
every arm of a round alike. It writes ``cost.json``:

    {"what": ..., "cpu": ..., "threads": 1, "rounds": 12, "steps": 1, "clock": "cpu",
     "step_s": {"reference": [s, ...], "bf16": [s, ...], ...}}   # one value per round

(``clock``: with one thread the process's CPU time, which other work on the machine does
not inflate; else the wall clock; both are kept, ``wall_step_s`` and ``cpu_step_s``.)

Per round, an arm's ratio is its step time over the reference's in the same round; the
cell is the median ratio over rounds and its range (min-max). Without ``cost.json`` the
report has no cost column (and says where the cost is measured).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

REFERENCE = "reference"


def load_cost(path: str | Path | None) -> dict[str, Any] | None:
    """``cost.json`` as scripts/arm_cost.py writes it; None when absent (ValueError: bad)."""
    if path is None or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a cost file ({e})") from e
    step_s = data.get("step_s") if isinstance(data, dict) else None
    if not isinstance(step_s, dict) or REFERENCE not in step_s:
        raise ValueError(f"{path}: no step_s of the {REFERENCE!r} arm")
    return data


def ratios(cost: dict[str, Any]) -> dict[str, list[float]]:
    """Per arm, its step over the reference's, round by round (the reference: all 1)."""
    ref = cost["step_s"][REFERENCE]
    out = {}
    for arm, times in cost["step_s"].items():
        out[arm] = [t / r for t, r in zip(times, ref, strict=False) if r > 0]
    return out


def cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def cost_cells(cost: dict[str, Any], arms: dict[str, Any]) -> dict[str, str]:
    """{display name: cell} for every arm judged; ``arms``: display name -> (configured
    arm, ArmSummary). An arm that was not timed (the remedy: its step changes with its
    rung) gets what it did cost: the steps it took for the model's steps."""
    r = ratios(cost)
    out = {REFERENCE: cell(r[REFERENCE])}
    for name, (arm, a) in arms.items():
        if arm in r:
            out[name] = cell(r[arm])
        elif a.steps_taken > a.steps:
            out[name] = (f"not timed; {a.steps_taken} optimizer steps taken for {a.steps} "
                         "(its rollbacks undid the rest)")  # fmt: skip
        else:
            out[name] = "not timed"
    return out


def cost_note(cost: dict[str, Any] | None) -> str:
    if cost is None:
        return (
            "No step-cost column: the runs' own step times are not comparable (they ran at "
            "different moments on a shared machine); `scripts/arm_cost.py` measures each "
            "arm's step paired with the reference's (`scripts/repro_nan.sh` runs it)."
        )
    clock = {"cpu": "process CPU time", "wall": "wall clock"}.get(cost.get("clock"), "time")
    return (
        f"*step time / reference*: each arm's training step ({cost.get('what', 'bare step')}) "
        f"over the reference's, timed in one process in {cost.get('rounds', '?')} rounds "
        f"(arms alternating, forward then reversed; {clock}) on {cost.get('cpu', 'this CPU')}, "
        f"{cost.get('threads', '?')} thread(s): the median ratio over rounds (its range); by "
        "`scripts/arm_cost.py` (`cost.json`)."
    )
