"""Rebuilding a LightningModule we did not write from its bundle, and replaying its step.

A bundle's ``meta.json`` ``host`` says how (stability/bundle.py, format 2): the module's
``pkg.mod:Class`` and its ``hparams`` (what ``self.save_hyperparameters()`` saved; Lightning's
``load_from_checkpoint`` rebuilds the same way, ``cls(**hparams)``), or a user-given
``factory`` (``pkg.mod:fn``, called with the same keyword arguments). The import is from this
process's environment, never from the bundle. What cannot be rebuilt is refused in one line
naming what is missing (``CannotRebuild``; the CLI exits 2).

The replay runs the module's own ``training_step`` on each recorded micro-batch (``self.log``
muted) under the recorded autocast and loss scale, forward and backward, with the
localization trace on the watched network (``host.model_path``), as ``core._run`` does for
our GPT.
"""

from __future__ import annotations

import importlib
from typing import Any


class CannotRebuild(Exception):
    """The bundle's module cannot be made again in this process (why, in one line)."""


def _resolve(target: str):
    mod, _, qual = target.partition(":")
    if not mod or not qual:
        raise CannotRebuild(f"{target!r} is not 'pkg.mod:Name'")
    if mod == "__main__":
        raise CannotRebuild(
            f"{target} is defined in a script; move it to a module or give "
            "StabilityCallback(factory='pkg.mod:fn')"
        )
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise CannotRebuild(f"{target}: {e}") from None
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise CannotRebuild(f"{target}: module {mod!r} has no {part!r}")
        obj = getattr(obj, part)
    return obj


def rebuild_module(host: dict[str, Any]):
    """What a bundle's ``host`` names, built afresh: ``(model, step)``, the network the
    trace watches and ``step(batch) -> loss``, the run's own training step (a
    LightningModule's ``training_step``, ``self.log`` muted; a Guard's ``loss_fn``)."""
    if host["kind"] == "guard":
        if not host.get("factory"):
            raise CannotRebuild("the run gave no Guard(factory='pkg.mod:fn') to build its model")
        if not host.get("loss"):
            raise CannotRebuild("no loss recorded (Guard(loss_fn=...), a module-level function)")
        model, loss_fn = _resolve(host["factory"])(), _resolve(host["loss"])
        return model, lambda batch: loss_fn(model, batch)
    module = _lightning_module(host)
    path = host.get("model_path") or ""

    def step(batch):
        from stabilize.lit.host import _muted

        with _muted(module):
            out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    return (module.get_submodule(path) if path else module), step


def _lightning_module(host: dict[str, Any]):
    from stabilize.lit.host import rebuild_value

    target = host.get("factory") or host["module"]
    build = _resolve(target)
    hparams = rebuild_value(host.get("hparams") or {})
    try:
        return build(**hparams)
    except TypeError as e:
        hint = "" if host.get("factory") else " (call self.save_hyperparameters() in __init__)"
        raise CannotRebuild(f"{target}(**hparams) failed: {e}{hint}") from None


def replay_module(model, step, meta: dict, state: dict, ranks: list[dict], fp32_sites,
                  select=None) -> dict:  # fmt: skip
    """The recorded step through ``step`` (see ``rebuild_module``), as ``core.replay_step``
    replays our GPT's: the harness's own fault, if the run planted one, planted again;
    ``select``: a subset of the rows (the data bisection)."""
    from stabilize.replay.core import replay_step

    model.load_state_dict(state["model"])
    inj = None
    if meta["host"].get("fault"):
        from stabilize.faults import FaultInjector, fault_config

        inj = FaultInjector(fault_config(meta["host"]["fault"]))
    return replay_step(model, step, meta, state, ranks, fp32_sites, inj,
                       precision=meta["precision"], select=select)  # fmt: skip
