"""The public entry points' arguments (``stabilize.Guard``, ``StabilityCallback``), checked
before anything is written.

A misuse is one ``ConfigError`` line naming the argument, its value and what is allowed (the
house wording of ``stabilize/validate.py``); a module or a loop the harness cannot watch is a
``StabilityConfigError``. Every check here runs before the run dir is made, so a refused
setting leaves nothing behind, and the mistakes that used to surface late (a factory found
missing only by a replay, a model path by torch in the middle of a fit) are named where the
user wrote them.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabilize.data import parse_skip_items
from stabilize.faults import FaultConfig, fault_config
from stabilize.monitors import MonitorConfig
from stabilize.rollback import RollbackConfig
from stabilize.stability.driven import StabilityConfigError, refuse_fault, watched_model
from stabilize.validate import ConfigError, build_dataclass, check_positive

_FACTORY = "'pkg.mod:fn' (an importable module and a callable in it, not called here)"


def shown(value: Any) -> str:
    """A value as one short line: a module by its class (its repr is the whole tree), a
    tensor by its shape, a path whole (the user must see which), anything else by its
    repr, cut at 80 characters."""
    if isinstance(value, (str, os.PathLike)) and ("/" in str(value) or os.sep in str(value)):
        return repr(str(value))
    if isinstance(value, nn.Module):
        return f"<{type(value).__name__}>"
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"<{type(value).__name__} of shape {list(shape)}>"
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def refuse(key: str, value: Any, why: str, allowed: str, exc: type = ConfigError):
    """``key=value is not allowed: why; allowed: ...`` (``why`` may be empty)."""
    why = f": {why}" if why else ""
    return exc(f"{key}={shown(value)} is not allowed{why}; allowed: {allowed}")


def _group(cls: type, value: Any, key: str, build):
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise refuse(key, value, "", f"a {cls.__name__}, a dict of its settings or None")
    return build(dict(value or {}))


def settings(monitor: Any, rollback: Any, fault: Any):
    """The three settings groups, as ``stabilize-train``'s: each a dataclass as it is, a dict
    of its keys (each checked), or None for the defaults."""

    def rollback_cfg(values: dict) -> RollbackConfig:
        return build_dataclass(RollbackConfig, values, "rollback")

    return (
        _group(MonitorConfig, monitor, "monitor", lambda v: MonitorConfig.build(v, "monitor")),
        _group(RollbackConfig, rollback, "rollback", rollback_cfg),
        _group(FaultConfig, fault, "fault", fault_config),
    )


def check_run_dir(value: Any, required: bool = False) -> Path | None:
    """A path to a directory, made later if missing: not a file, and under no file."""
    allowed = "a path (str or os.PathLike) to a directory, made if missing"
    if value is None and not required:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise refuse("run_dir", value, "", allowed)
    path = Path(value)
    for p in (path, *path.parents):  # the nearest one that exists must be a directory
        if p.exists():
            if not p.is_dir():
                where = "it" if p == path else repr(str(p))
                raise refuse("run_dir", str(value), f"{where} is a file", allowed)
            break
    return path


def check_factory(value: Any) -> None:
    """``pkg.mod:fn`` names a callable of an importable module (imported, never called: the
    user named it in their own code, as their own choice). A replay in another process
    imports it again, so the running script (``__main__``) is refused."""
    if value is None:
        return
    mod, _, name = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not all(part.isidentifier() for part in (*mod.split("."), *name.split("."))):
        raise refuse("factory", value, "", _FACTORY)
    if mod == "__main__":
        raise refuse("factory", value, "__main__ is the running script, which a replay in "
                     "another process cannot import (move it to a module)", _FACTORY)  # fmt: skip
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as e:
        raise refuse("factory", value, f"module {mod!r} cannot be imported ({e})", _FACTORY) from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise refuse("factory", value, f"{mod!r} has no attribute {name!r}", _FACTORY)
        obj = getattr(obj, part)
    if not callable(obj):
        raise refuse("factory", value, f"it is a {type(obj).__name__}, not callable", _FACTORY)


def check_callback(run_dir, accumulate, model, blocks, factory, skip_items) -> list[str]:
    """The callback's other arguments; returns ``skip_items`` as a list (one string: one
    entry, not its characters)."""
    check_run_dir(run_dir)
    if accumulate is not None:
        check_positive("accumulate", accumulate, integer=True)
    if model is not None and not isinstance(model, (nn.Module, str)):
        raise refuse("model", model, "", "an nn.Module, an attribute path such as 'model' "
                     "(a submodule of the LightningModule) or None")  # fmt: skip
    if blocks is not None and not isinstance(blocks, str):
        raise refuse("blocks", blocks, "", "a glob over module paths ('transformer.h.*') or None")
    check_factory(factory)
    if not isinstance(skip_items, Iterable):
        raise refuse("skip_items", skip_items, "", "a list of 'INDEX:HASH' strings")
    items = [skip_items] if isinstance(skip_items, str) else list(skip_items)
    parse_skip_items(items)
    return items


def check_params(net: nn.Module, value: Any) -> None:
    """The watched network has parameters (``value``: how the user named it)."""
    if next(net.parameters(), None) is None:
        raise refuse("model", value, f"{type(net).__name__} has no parameters",
                     "the network the optimizer trains", StabilityConfigError)  # fmt: skip


def check_guard(model, optimizer, scaler, run_dir, loss_fn, clip, log_every) -> Path:
    """The Guard's own arguments (the settings are the callback's); its run dir."""
    if not isinstance(model, nn.Module):
        raise refuse("model", model, "", "the torch.nn.Module the loop trains")
    check_params(model, model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise refuse("optimizer", optimizer, "", "the torch.optim.Optimizer the loop steps")
    if scaler is not None and not hasattr(scaler, "unscale_"):
        raise refuse("scaler", scaler, "", "a torch.amp.GradScaler or None (the scheduler "
                     "is Guard(scheduler=...))")  # fmt: skip
    if loss_fn is not None and not callable(loss_fn):
        raise refuse("loss_fn", loss_fn, "", "a callable loss_fn(model, batch) or None")
    ok = isinstance(clip, (int, float)) and not isinstance(clip, bool)
    if not ok or not math.isfinite(clip) or clip < 0:
        raise refuse("clip", clip, "", "a finite number >= 0 (0: no clipping)")
    check_positive("log_every", log_every, integer=True)
    return check_run_dir(run_dir, required=True)


def watched(pl_module, model: nn.Module | str | None, fault: FaultConfig) -> nn.Module:
    """The network watched in a LightningModule we did not write (lit/host.py's
    ``watched_model``), with what the callback cannot do on it refused first."""
    if not pl_module.automatic_optimization:
        raise StabilityConfigError(
            f"{type(pl_module).__name__}: manual optimization is not supported by "
            "StabilityCallback (it judges each step between backward and optimizer step)"
        )
    if isinstance(model, str):
        try:
            pl_module.get_submodule(model)
        except AttributeError as e:
            children = [n for n, _ in pl_module.named_children()][:12]
            why = f"{type(pl_module).__name__} has no submodule there ({e})"
            allowed = f"an attribute path to a submodule; top-level children: {children}"
            raise refuse("model", model, why, allowed, StabilityConfigError) from None
    net = watched_model(pl_module, model)
    if model is not None:
        check_params(net, model)
    refuse_fault(fault, gradients=False)
    return net
