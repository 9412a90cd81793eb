"""Rebuilding a model we did not write from its bundle, and replaying its step.

A bundle's ``meta.json`` ``host`` *names* the code that made its model (stability/bundle.py,
format 2): a LightningModule's ``pkg.mod:Class`` and its ``hparams`` (what
``self.save_hyperparameters()`` saved; Lightning's ``load_from_checkpoint`` rebuilds the same
way, ``cls(**hparams)``), a user-given ``factory``, or a Guard's model factory and loss. A
name in a file is not a choice to run it: a bundle travels, and anyone can write any
``meta.json`` and recompute its manifest. So the replay imports such code only when the user
says so on the command line (``CodeChoice``), as Hugging Face's ``trust_remote_code`` does:

- ``--trust-code``: import what the bundle names, from this process's environment (never
  from the bundle);
- ``--factory pkg.mod:fn`` (and ``--loss pkg.mod:fn`` for a Guard's bundle): the user's own
  code, whatever the bundle names.

Without either, the replay says in one line which code it would import, and runs nothing
(``CannotRebuild``; the CLI exits 2). Our own GPT is rebuilt from its config alone and needs
no flag. Hyperparameters are plain data: a ``{"__class__": ...}`` value (``lit.host.plain``
writes one for a config object) is rebuilt only through ``CONFIG_CLASSES``, a registry of
the config classes the harness knows, never by importing the path the file gives.

The replay runs the module's own ``training_step`` on each recorded micro-batch (``self.log``
muted) under the recorded autocast and loss scale, forward and backward, with the
localization trace on the watched network (``host.model_path``), as ``core._run`` does for
our GPT.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class CannotRebuild(Exception):
    """The bundle's module cannot be made again in this process (why, in one line)."""


@dataclass(frozen=True)
class CodeChoice:
    """What the user allowed on the command line; the bundle's own names count only with
    ``trust_code``."""

    trust_code: bool = False
    """Import the module, factory and loss the bundle names (``--trust-code``)."""
    factory: str | None = None
    """The user's ``pkg.mod:fn`` that builds the model (``--factory``), in place of the
    bundle's: a LightningModule's is called with the saved hyperparameters, a Guard's with
    none."""
    loss: str | None = None
    """A Guard bundle's loss, ``pkg.mod:fn(model, batch)`` (``--loss``)."""


NO_CODE = CodeChoice()  # no flag given: nothing the bundle names is imported


def code_flags(code: CodeChoice) -> str:
    """The command-line flags that gave ``code`` (a suggested next command repeats them)."""
    flags = ["--trust-code"] if code.trust_code else []
    flags += [f"--factory {code.factory}"] if code.factory else []
    flags += [f"--loss {code.loss}"] if code.loss else []
    return "".join(f"{f} " for f in flags)


def check_target(target: Any, what: str) -> str:
    """``target`` as ``pkg.mod:Name``, or ``CannotRebuild`` naming ``what``."""
    mod, _, qual = str(target).partition(":")
    if not isinstance(target, str) or not mod or not qual:
        raise CannotRebuild(f"{what}={target!r} is not 'pkg.mod:Name'")
    if mod == "__main__":
        raise CannotRebuild(
            f"{target} is defined in a script; move it to a module or give "
            "StabilityCallback(factory='pkg.mod:fn')"
        )
    return target


def _resolve(target: str):
    mod, _, qual = check_target(target, "the target").partition(":")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise CannotRebuild(f"{target}: {e}") from None
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise CannotRebuild(f"{target}: module {mod!r} has no {part!r}")
        obj = getattr(obj, part)
    return obj


def code_needed(host: dict[str, Any], code: CodeChoice) -> list[str]:
    """The bundle-named code that rebuilding ``host`` would import and that ``code`` has
    not allowed (empty: the rebuild may go on)."""
    if host.get("kind") not in ("lightning", "guard") or code.trust_code:
        return []
    if host["kind"] == "guard":
        named = [] if code.factory else [("model factory", host.get("factory"))]
        named += [] if code.loss else [("loss", host.get("loss"))]
    else:
        what = "factory" if host.get("factory") else "module"
        named = [] if code.factory else [(what, host.get("factory") or host.get("module"))]
    return [f"{what} {name}" for what, name in named if name]


def rebuild_module(host: dict[str, Any], code: CodeChoice = NO_CODE):
    """What a bundle's ``host`` names, built afresh with what ``code`` allows: ``(model,
    step)``, the network the trace watches and ``step(batch) -> loss``, the run's own
    training step (a LightningModule's ``training_step``, ``self.log`` muted; a Guard's
    ``loss_fn``)."""
    # the targets a rebuild would import (a Lightning run's factory stands for its module:
    # a module defined in a script with a factory beside it is the factory's case)
    used = "factory" if host.get("factory") else "module"
    named = ("factory", "loss") if host.get("kind") == "guard" else (used,)
    for what in named:  # a script's class: no flag imports it
        if host.get(what) and not (code.loss if what == "loss" else code.factory):
            check_target(host[what], what)
    refused = code_needed(host, code)
    if refused:
        flags = "--factory pkg.mod:fn" + (" and --loss pkg.mod:fn" if host["kind"] == "guard"
                                          else "")  # fmt: skip
        raise CannotRebuild(
            f"replaying it imports {' and '.join(refused)}, named by its meta.json; a "
            f"bundle's files never choose code to run: pass --trust-code to import them, or "
            f"{flags} to name your own"
        )
    if host["kind"] == "hf":
        model = _resolve(code.factory)() if code.factory else _hf_model(host, code)
        return model, lambda batch: model(**batch)["loss"]
    if host["kind"] == "guard":
        factory, loss = code.factory or host.get("factory"), code.loss or host.get("loss")
        if not factory:
            raise CannotRebuild("the run gave no Guard(factory='pkg.mod:fn') to build its model")
        if not loss:
            raise CannotRebuild("no loss recorded (Guard(loss_fn=...), a module-level function)")
        model, loss_fn = _resolve(factory)(), _resolve(loss)
        return model, lambda batch: loss_fn(model, batch)
    module = _lightning_module(host, code)
    path = host.get("model_path") or ""

    def step(batch):
        from stabilize.lit.host import _muted

        with _muted(module):
            out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    return (module.get_submodule(path) if path else module), step


def _hf_model(host: dict[str, Any], code: CodeChoice):
    """A Hugging Face Trainer's model: its config through transformers' registry, its class
    by name among transformers' own model classes (a class from elsewhere, a model's remote
    code, only with ``--trust-code``)."""
    import transformers

    config = rebuild_value(host.get("config"), "config")  # before any import
    target = check_target(host.get("model_class"), "model_class")
    name = target.partition(":")[2]
    cls = getattr(transformers, name, None)
    ours = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
    if not ours:
        if not code.trust_code:
            raise CannotRebuild(
                f"replaying it imports model class {target}, named by its meta.json and not "
                "one of transformers' own; a bundle's files never choose code to run: pass "
                "--trust-code to import it, or --factory pkg.mod:fn to name your own"
            )
        cls = _resolve(target)
    torch = importlib.import_module("torch")
    torch.manual_seed(0)  # the weights come from the bundle's state
    return cls(config)


# ---- hyperparameters: plain data, config classes by registry -------------------------------
def _hf_config(fields: dict[str, Any]):
    """A Hugging Face config, its class taken from transformers' own registry by the
    ``model_type`` field (``AutoConfig``), never from a path in the file."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CannotRebuild("the hyperparameters hold a Hugging Face config and transformers "
                            "is not installed (pip install -e '.[hf]')") from None  # fmt: skip
    kind = fields.get("model_type")
    try:
        return AutoConfig.for_model(kind, **{k: v for k, v in fields.items() if k != "model_type"})
    except ValueError:
        raise CannotRebuild(f"model_type {kind!r} is no Hugging Face config type") from None


def _gpt_config(fields: dict[str, Any]):
    from stabilize.model.config import GPTConfig

    return GPTConfig(**fields)


def _run_config(fields: dict[str, Any]):
    from stabilize.run.config import RunConfig

    return RunConfig.from_saved(fields)  # an older version's settings too


# ``__class__`` value -> builder; a Hugging Face config is matched by its module's prefix
CONFIG_CLASSES = {
    "stabilize.model.config:GPTConfig": _gpt_config,
    "stabilize.run.config:RunConfig": _run_config,
}
HF_CONFIGS = "transformers.models."


def rebuild_value(value: Any, where: str = "hparams") -> Any:
    """The inverse of ``lit.host.plain``: plain data as it is; a config object through
    ``CONFIG_CLASSES`` (or transformers' registry); any other ``__class__``, refused."""
    if isinstance(value, dict) and "__class__" in value:
        cls = value["__class__"]
        fields = {k: rebuild_value(v, f"{where}.{k}") for k, v in value.items()
                  if k != "__class__"}  # fmt: skip
        build = CONFIG_CLASSES.get(cls) if isinstance(cls, str) else None
        if build is None and isinstance(cls, str) and cls.startswith(HF_CONFIGS) and \
                cls.endswith("Config"):  # fmt: skip
            build = _hf_config
        if build is None:
            allowed = ", ".join([*CONFIG_CLASSES, f"{HF_CONFIGS}*:*Config"])
            raise CannotRebuild(f"{where}.__class__={cls!r} is not a config class the harness "
                                f"rebuilds (allowed: {allowed}); nothing was imported")  # fmt: skip
        try:
            return build(fields)
        except (TypeError, ValueError) as e:
            raise CannotRebuild(f"{where}: {cls} does not take these fields ({e})") from None
    if isinstance(value, dict):
        return {k: rebuild_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [rebuild_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _lightning_module(host: dict[str, Any], code: CodeChoice):
    target = code.factory or host.get("factory") or host.get("module")
    hparams = host.get("hparams") or {}
    if not isinstance(hparams, dict):
        raise CannotRebuild(f"hparams is {type(hparams).__name__}; must be a JSON object")
    hparams = rebuild_value(hparams)  # before any import: a refused value runs nothing
    build = _resolve(target)
    try:
        return build(**hparams)
    except TypeError as e:
        hint = "" if (code.factory or host.get("factory")) else \
            " (call self.save_hyperparameters() in __init__)"  # fmt: skip
        raise CannotRebuild(f"{target}(**hparams) failed: {e}{hint}") from None


def replay_module(model, step, meta: dict, state: dict, ranks: list[dict], fp32_sites,
                  select=None) -> dict:  # fmt: skip
    """The recorded step through ``step`` (see ``rebuild_module``), as ``step.replay_step``
    replays our GPT's: the harness's own fault, if the run planted one, planted again;
    ``select``: a subset of the rows (the data bisection)."""
    from stabilize.replay.step import replay_step

    model.load_state_dict(state["model"])
    inj = None
    if meta["host"].get("fault"):
        from stabilize.faults import FaultInjector, fault_config

        inj = FaultInjector(fault_config(meta["host"]["fault"]))
    return replay_step(model, step, meta, state, ranks, fp32_sites, inj,
                       precision=meta["precision"], select=select)  # fmt: skip
