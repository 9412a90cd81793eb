"""A finished cell, read from its run dir: what ``stabilize-map`` reports per cell.

- the final loss: the mean training loss of the last ``tail_steps`` steps (non-finite when
  any of them is); the held-out bits per byte (``final_eval.json``);
- diverged, and the step: a non-finite loss, or a final loss no better than the loss at
  initialization L0 (Wortsman et al. 2023 clip a cell there); the step is the first
  non-finite event's, else the first from which the loss stays above L0;
- the first monitor that fired (a warning or a would-roll-back verdict) and its mechanism;
- early grad-norm statistics (min, median, max over steps 1..``early_steps``);
- the largest attention-logit bound and the final output log Z (Wortsman's two signals).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stabilize.map.spec import Cell, MapSpec

MECHANISMS = {
    "overflow": "fp16 overflow",
    "activation": "activation above the fp16 line",
    "attn_logit": "attention-logit growth",
    "attn_entropy": "attention-entropy collapse",
    "log_z": "output log Z growth",
    "loss_spike": "loss spike",
    "grad_spike": "grad-norm spike",
    "loss_scale": "loss-scale collapse",
    "nonfinite": "non-finite loss or gradient",
}


def cell_dir(root: Path, cell: Cell) -> Path:
    """Where a cell's run lives under the map's root."""
    return root / "cells" / cell.recipe / cell.key


def finished(run_dir: Path) -> bool:
    """A cell is finished once its run ended (done, or aborted: divergence is a result)."""
    try:
        status = json.loads((run_dir / "result.json").read_text()).get("status")
    except (OSError, ValueError):
        return False
    return status in ("done", "aborted")


@dataclass
class CellResult:
    recipe: str
    lr: float
    seed: int
    status: str
    loss0: float | None  # the first step's loss: the model at initialization
    final_loss: float
    bpb: float | None
    diverged: bool
    diverged_step: int | None
    first_monitor: str | None
    first_step: int | None
    mechanism: str | None
    grad_early: dict[str, float] | None  # min, median, max
    attn_logit_max: float | None
    log_z_final: float | None
    seconds: float | None  # config.json to result.json: the run, not the interpreter start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def read_cell(run_dir: Path, cell: Cell, spec: MapSpec, loss0: float | None = None) -> CellResult:
    """``loss0``: the recipe's loss at initialization (None: this cell's own first step)."""
    from stabilize.report.load import load_run_dir, per_step

    run = load_run_dir(run_dir)
    rows = per_step(run.rows)
    loss = {int(r["x"]): r["train/loss"] for r in rows if "train/loss" in r}
    grad = {int(r["x"]): r["train/grad_norm"] for r in rows if "train/grad_norm" in r}
    steps = sorted(loss)
    own0 = loss[steps[0]] if steps else None
    l0 = loss0 if loss0 is not None else own0
    tail = [loss[s] for s in steps[-spec.tail_steps :]]
    final = sum(tail) / len(tail) if tail and all(map(math.isfinite, tail)) else math.nan
    # the divergence step: the first from which the loss stays non-finite or above L0
    good = [s for s in steps if math.isfinite(loss[s]) and l0 is not None and loss[s] <= l0]
    after = [s for s in steps if not good or s > good[-1]]
    nonfinite = [e for e in run.events if e["monitor"] == "nonfinite"]
    diverged = not math.isfinite(final) or (l0 is not None and final >= l0) or bool(nonfinite)
    first = next((e for e in run.events if e["kind"] in ("warn", "rollback")), None)
    early = [grad[s] for s in sorted(grad) if s <= spec.early_steps and math.isfinite(grad[s])]
    logits = [v for r in rows for k, v in r.items() if k.startswith("attn_logit/") and _finite(v)]
    log_z = [r["log_z/max"] for r in rows if _finite(r.get("log_z/max"))]
    took = (run_dir / "result.json").stat().st_mtime - (run_dir / "config.json").stat().st_mtime
    where = f" at {first['layer']}" if first and first.get("layer") else ""
    return CellResult(
        recipe=cell.recipe, lr=cell.lr, seed=cell.seed, status=run.status, loss0=own0,
        final_loss=final,
        bpb=(run.final_eval or {}).get("bpb"),
        diverged=diverged,
        diverged_step=(nonfinite[0]["step"] if nonfinite else after[0] if after else None)
        if diverged else None,
        first_monitor=first["monitor"] if first else None,
        first_step=first["step"] if first else None,
        mechanism=MECHANISMS.get(first["monitor"], first["monitor"]) + where if first else None,
        grad_early={"min": min(early), "median": statistics.median(early), "max": max(early)}
        if early else None,
        attn_logit_max=max(logits) if logits else None,
        log_z_final=log_z[-1] if log_z else None,
        seconds=round(took, 1),
    )  # fmt: skip
