"""Every private attribute of another library the harness reads, in one place.

Lightning, torch, FSDP2, W&B and datasets give no public way to what these read; each is
named here with why, so a version that renames one fails in ``tests/test_compat.py`` (real
objects of the installed versions, one line naming the attribute) instead of deep inside
a run. Nothing else in the package reads another library's ``_private`` names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


# ---- Lightning ------------------------------------------------------------------------------
def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning's own ``self.log`` rows carry (one less than ``global_step`` inside
    a batch end): per-layer rows logged straight to the loggers line up with them."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def uncount_batch(trainer: Any) -> None:
    """Take the last batch off the epoch loop's batch counters (ready, started, processed,
    completed; current and total): a batch the module skipped must not count towards
    Lightning's ``% accumulate_grad_batches`` tests. The trackers are public, their
    meaning to the loop is not."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        tracker.ready -= 1
        tracker.started -= 1
        tracker.processed -= 1
        tracker.completed -= 1


def wandb_init_kwargs(logger: Any) -> dict:
    """The keyword arguments ``WandbLogger`` will pass to ``wandb.init`` (Lightning passes
    ``anonymous=None``, which wandb warns about in every run)."""
    return logger._wandb_init


def wandb_started(logger: Any) -> bool:
    """Has the ``WandbLogger`` started its run? (``logger.experiment`` would start one.)"""
    return logger._experiment is not None


# ---- torch ----------------------------------------------------------------------------------
def scaler_scale(scaler: Any) -> Any:
    """The GradScaler's scale as a device tensor, or None before its first step:
    ``get_scale()`` is the public way, and it syncs the host on every call."""
    return getattr(scaler, "_scale", None)


def scaler_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Has ``scaler.unscale_(optimizer)`` run since the last ``update()``? (A second call
    raises; the standard clipping recipe calls it before the step.)"""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is OptState.UNSCALED


def found_inf_per_device(scaler: Any, optimizer: Any) -> dict:
    """After ``unscale_``: per device, whether a gradient was inf/NaN (the scaler will skip
    the step), as tensors: no host sync, unlike reading the step's outcome afterwards."""
    return scaler._found_inf_per_device(optimizer)


def foreach_copy_(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for every i in one dispatch (a snapshot of every tensor)."""
    import torch

    torch._foreach_copy_(dst, src)


def dynamo_config() -> Any:
    """torch.compile's settings (the recompile limit a sweep of norm variants passes)."""
    import torch._dynamo

    return torch._dynamo.config


def dtensor_local(obj: Any) -> Any:
    """A DTensor's own local shard (the tensor itself, no autograd view: a snapshot writes
    into a recycled one's buffer), or None for anything else. ``to_local()`` is the public
    way and goes through autograd."""
    return getattr(obj, "_local_tensor", None)


def fsdp_gathered_params(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, the gathered ``nn.Parameter``) for every FSDP2 parameter of ``model`` that a
    forward has gathered: the tensors autograd sees (a hook on the shard never fires)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    if hasattr(fp, "_unsharded_param"):  # gathered once: a forward ran
                        yield fp._param_fqn, fp.unsharded_param


# ---- datasets -------------------------------------------------------------------------------
def dataset_fingerprint(ds: Any) -> str:
    """datasets' own fingerprint of a prepared split (its builder config and data files):
    what datasets itself keys its cache by."""
    return ds._fingerprint
