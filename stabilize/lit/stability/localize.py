"""NaN localization: where in the forward did a non-finite value first appear?

Runs only on a non-finite event, so healthy steps pay nothing: this step's forward is
replayed (the weights not yet updated, the step having been made a no-op) with a hook on
every module, and the first module in execution order whose output is non-finite is
reported, with whether its input already was. Every rank localizes its own copy; the
reports are gathered so that rank 0's event names each rank's.
"""

from __future__ import annotations

from typing import Any

import torch


def _finite(t) -> bool:
    ts = [t] if isinstance(t, torch.Tensor) else [x for x in t if isinstance(x, torch.Tensor)]
    return all(bool(torch.isfinite(x).all()) for x in ts if x.is_floating_point())


def localize_nonfinite(trainer, pl_module, batch) -> list[dict[str, Any]]:
    """Replay ``batch``'s forward; one report per rank (a list of one without DDP)."""
    model = pl_module.model
    names = {m: n for n, m in model.named_modules()}
    first: dict[str, Any] = {}

    def hook(module, args, out):
        if not first and not _finite(out):
            first.update(module=names[module] or "model", input_finite=_finite(args))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        x, _y = batch
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            model(x)
    finally:
        for h in handles:
            h.remove()
    mine = first or {
        "module": None,
        "note": "the forward was finite: the non-finite value arose in the loss or after it",
    }
    mine["rank"] = trainer.global_rank
    if trainer.world_size == 1:
        return [mine]
    every: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(every, mine)
    return every
