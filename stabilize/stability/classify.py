"""Re-run classification: what kind of fault was it? (docs/rollback.md)

On a ROLLBACK verdict the step is replayed in-process, from the same weights (the step was
made a no-op) and the same micro-batches, the fault's hooks included (localize.replay),
and the replay's statistics go through the same gather and a copy of the monitors that
called the fault:

- the monitor does not call it again: **transient** (a flipped bit, a bad host; Megatron-LM
  re-runs a step to tell these apart, but by restarting the job). The ranks blamed are
  those whose own loss (else grad norm) changed between the step and its replay.
- it does: the next micro-batches (the data positions after the step's) are replayed from
  the same weights. The monitor calls that one too: **deterministic** (the model's state or
  numerics: the numerics rungs of the ladder). It does not: **data-linked** (the failure
  comes with these batches and not with others): their data positions (those whose loss
  was non-finite on some rank; else all of the step's) are skipped for good.

The replicas monitor's divergence is transient by nature and comes classified.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

from stabilize.monitors import ROLLBACK, Event, MonitorSuite, StepStats
from stabilize.stability.gather import CHUNKS, StepGather
from stabilize.stability.localize import gather_reports, replay

# monitors whose fault is localized in the forward and the backward (non-finite values)
LOCALIZED = ("nonfinite", "loss_scale")


def _differ(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isfinite(a) != math.isfinite(b)
    return abs(a - b) > 1e-5 * max(abs(a), abs(b), 1e-30)


def blame(before: list[tuple], after: list[tuple]) -> list[int]:
    """The ranks whose loss changed in the replay; none: those whose grad norm did."""
    for k in (0, 1):
        ranks = [
            r for r, (x, y) in enumerate(zip(before, after, strict=True)) if _differ(x[k], y[k])
        ]
        if ranks:
            return ranks
    return list(range(len(before)))


class Classifier:
    def __init__(self, gather: StepGather, suite: MonitorSuite):
        self.gather, self.suite = gather, suite

    def calls_again(self, stats: StepStats, monitor: str) -> bool:
        """Would ``monitor`` call for a rollback on ``stats``? (A copy of the monitors, in
        the state the faulty step left them, judges: the live ones are not touched.)"""
        judge = copy.deepcopy(self.suite)
        return any(e.kind == ROLLBACK and e.monitor == monitor for e in judge.update(stats))

    def _run(self, loop, host, probe, detailed, batches, positions, trace):
        if probe is not None:
            probe.reset(detailed=detailed, device=host.device)
        r = replay(loop, host, batches, positions, trace=trace)
        no_fp = torch.full((CHUNKS,), -1.0, device=host.device)
        return self.gather.reduce(loop, host, r["head"], no_fp, probe), r

    def __call__(
        self,
        loop,
        host,
        event: Event,
        probe,
        detailed: bool,
        batches: list,
        positions: list[int],
        *,
        classify: bool,
        localize: bool,
    ) -> dict[str, Any]:
        """What goes into the fault event's ``extra``: ``localization`` (per rank) and with
        ``classify`` the ``class``, the replay's numbers, ``ranks`` (transient) or
        ``batches`` (data-linked)."""
        before = list(self.gather.ranks)
        stats, r = self._run(loop, host, probe, detailed, batches, positions, localize)
        mine = {"losses": r["losses"], **({"loc": r["localization"]} if localize else {})}
        reports = gather_reports(loop, mine)
        info: dict[str, Any] = {}
        if localize:
            info["localization"] = [x["loc"] for x in reports]
        if not classify:
            return info
        info["replay"] = {"loss": stats.loss, "grad_norm": stats.grad_norm}
        if not self.calls_again(stats, event.monitor):
            return {**info, "class": "transient", "ranks": blame(before, self.gather.ranks)}
        # the same batches fail again from the same weights: do other batches?
        other, nxt = host.other_batches(positions)
        if not other:  # no other batch to try: model or data cannot be told apart
            why = "the same batches fail again; no other batches to tell the model from the data"
            return {**info, "unclassified": why}  # no class: the whole ladder
        stats2, _ = self._run(loop, host, probe, detailed, other, nxt, False)
        info["other_batches"] = {"positions": nxt, "loss": stats2.loss}
        if self.calls_again(stats2, event.monitor):
            return {**info, "class": "deterministic"}
        bad = [
            q
            for i, q in enumerate(positions)
            if any(not math.isfinite(x["losses"][i]) for x in reports)
        ]
        bad = bad or list(positions)
        rows = bad_rows(loop, host, [batches[positions.index(q)] for q in bad], bad)
        if probe is not None:  # the per-row forward went through the probe's hooks
            probe.reset(detailed=detailed, device=host.device)
        items = [it for x in gather_reports(loop, {"rows": rows}) for it in x["rows"]]
        return {**info, "class": "data", "batches": bad, "items": items}


def bad_rows(loop, host, batches: list, positions: list[int]) -> list[dict[str, Any]]:
    """This rank's sequences whose own loss is non-finite, one forward per micro-batch
    (no gradient): the rows of a causal LM do not mix, so a row's loss is its own. Each
    by training block index and content hash (``skip_rows`` steps over them)."""
    from stabilize.data import block_hash

    model, inj, rank = host.model, host.injector, host.global_rank
    sampler, step = host.train_sampler(), host.train_state.model_step + 1
    out: list[dict[str, Any]] = []
    if sampler is None:  # sequences cannot be named without the item indices
        return out
    with torch.no_grad():
        for (x, y), pos in zip(batches, positions, strict=True):
            host.seed_dropout(pos)
            if inj is not None:
                inj.begin(step, pos)
            with loop.forward_context():
                logits = model(x)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            row_ok = torch.isfinite(ce.view(y.shape)).all(dim=1).tolist()
            items = sampler.batch_for_step(pos, rank)
            for j in (j for j, ok in enumerate(row_ok) if not ok):
                digest = block_hash(x[j].cpu(), y[j].cpu())
                out.append({"index": items[j], "hash": digest, "rank": rank,
                            "data_step": pos, "row": j})  # fmt: skip
    return out
