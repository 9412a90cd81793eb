"""One recorded step run again: every rank's micro-batches through forward and backward as
training ran them (``replay_step``), for our GPT (core.py) and for a model we did not build
(rebuild.py), with the batch helpers it and the data bisection read (a bundle rank record's
micro-batches, a batch's rows in any layout).

The comparison with the recorded numbers is bitwise where the same kernels ran (one rank,
fp32, written on a CPU), else within ``TOLERANCE`` relative.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

TOLERANCE = 1e-4  # relative, where the comparison cannot be bitwise


def _same(a: float | None, b: float | None, exact: bool) -> bool:
    if a is None or b is None:
        return a is b
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b if exact else abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-30)


def rows_of(batch: Any) -> int:
    """A batch's row count: its first tensor's leading dimension (0 without one)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((n for n in map(rows_of, batch) if n), 0)
    return 0


def take_rows(batch: Any, keep: list[int], n: int) -> Any:
    """Rows ``keep`` of every tensor of ``batch`` with ``n`` rows (dicts, lists and tuples
    kept as they are; other values as they are)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch[keep] if batch.dim() and batch.shape[0] == n else batch
    if isinstance(batch, dict):
        return {k: take_rows(v, keep, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, keep, n) for v in batch)
    return batch


def recorded_batches(r: dict) -> list:
    """A bundle rank record's micro-batches: (x, y) token ids, or as they came."""
    return r.get("batches") or list(zip(r["x"], r["y"], strict=True))


def select_rows(rows: frozenset | None):
    """``replay_step``'s ``select`` for a subset of the sequences, as (rank, micro-batch,
    row) (the data bisection); None: every row."""
    if rows is None:
        return None

    def select(r: dict, m: int, batch):
        n = rows_of(batch)
        keep = [j for j in range(n) if (r["rank"], m, j) in rows]
        return take_rows(batch, keep, n) if keep else None

    return select


class _Overflows:
    """A norm's stats sink (norms/module.py ``stats_sink``): the norms whose reduction
    overflowed in the replay (their per-row statistic is inf), by name."""

    def __init__(self, model):
        from stabilize.norms import Norm

        found = [(n, m) for n, m in model.named_modules() if isinstance(m, Norm)]
        self.names = [n for n, _ in found]
        self.hit: set[str] = set()
        for j, (_, m) in enumerate(found):
            m.stats_sink, m.stats_index = self, j

    def record_norm(self, j, x, ms, kind) -> None:
        import torch

        if ms is not None and bool(torch.isinf(ms).any()):
            self.hit.add(self.names[j])


def replay_step(model, forward, meta: dict, state: dict, ranks: list[dict], fp32_sites, inj,
                *, precision: str, reseed=None, select=None) -> dict:  # fmt: skip
    """Every rank's recorded micro-batches through ``forward(batch) -> loss`` and backward,
    as training ran them: the norms in ``fp32_sites`` switched to fp32, the run's autocast
    and loss scale, the fault injector ``inj`` (or None) planted again as each rank's with
    the course it had, the gradients averaged over the ranks as DDP does; the trace's
    localization and the norms that overflowed. ``reseed(pos, rank)``: dropout's seeds;
    ``select(rank_record, m, batch)``: a subset of a micro-batch's rows (None: skip it)."""
    import torch

    from stabilize.stability.localize import _Trace

    norms = dict(model.named_modules())
    for site in fp32_sites:
        norms[site].reduction_dtype = "fp32"
    if inj is not None:  # attached once: its forward hooks are not removable
        inj.attach(model)
    overflows = _Overflows(model)
    model.train()
    dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    scale = meta["recorded"].get("loss_scale") or 1.0
    scale = scale if scale > 0 else 1.0
    step, world = meta["step"], meta["world_size"]
    losses, sums = [], None
    # after the fault's hooks, as in training: the trace sees what the next module receives
    # (before, a poisoned embedding was charged to the dropout after it)
    trace = _Trace(model)
    try:
        for r in ranks:
            if inj is not None:  # as that rank's, with no firing history: it fires
                inj.rank = inj.fault.rank = r["rank"]
                inj.fault.fired, inj.fault.disabled = set(), False
                if state.get("fault"):
                    inj.fault.restore(state["fault"])  # the course it had (a drift's factor)
            for p in model.parameters():
                p.grad = None
            batches = recorded_batches(r)
            n = len(batches)
            for m, (batch, pos) in enumerate(zip(batches, r["positions"], strict=True)):
                if select is not None and (batch := select(r, m, batch)) is None:
                    continue
                if reseed is not None:
                    reseed(pos, r["rank"])
                if inj is not None:
                    inj.begin(step, pos)
                with (
                    torch.autocast("cpu", dtype=dtype, enabled=dtype is not None),
                    warnings.catch_warnings(),
                ):
                    # a module returning a dataclass (Hugging Face's ModelOutput) gets no
                    # backward hook: its children's name the gradient
                    warnings.filterwarnings("ignore", "For backward hooks to be called")
                    loss = forward(batch)
                if inj is not None:
                    loss = inj.on_loss(step, loss)
                    inj.arm(step, model)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "Full backward hook is firing")
                    (loss * (scale / n)).backward()
                if inj is not None:
                    inj.disarm(model)  # and the fault's after_backward, as in training
                losses.append(float(loss.detach()))
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            if not grads:  # none of this rank's rows in the subset
                continue
            sums = grads if sums is None else [a + b for a, b in zip(sums, grads, strict=True)]
    finally:
        trace.close()
    inv = torch.full((), scale, dtype=torch.float64).reciprocal().float()  # as GradScaler
    grads = [g * inv / world if world > 1 else g * inv for g in sums or []]
    gnorm = float(torch.nn.utils.get_total_norm(grads, foreach=True)) if grads else None
    loss = sum(losses) / len(losses) if losses else None
    # bit for bit only where the same kernels ran: one rank, fp32, written on a CPU
    exact = dtype is None and world == 1 and meta.get("device", "cpu") == "cpu"
    rec = meta["recorded"]
    return {
        "meta": meta,
        "loss": loss,
        "grad_norm": gnorm,
        "exact": exact,
        "same_loss": _same(loss, rec["loss"], exact),
        "same_grad_norm": _same(gnorm, rec["grad_norm"], exact),
        "overflowed": sorted(overflows.hit),
        "dtypes": {n: m.reduction_dtype for n, m in norms.items() if n in overflows.names},
        "forward": trace.forward or None,
        "backward": trace.result(),
    }
