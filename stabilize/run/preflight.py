"""Start-up checks: every setting that needs more than the config itself, checked before
anything is written.

``RunConfig`` checks each value and the cross-field rules on construction; what it cannot
know is checked here, at the top of ``train.run`` (before the run dir is made):

- the world size: ``fault.rank`` must be a rank of this launch (``WORLD_SIZE`` under
  torchrun, else devices x nodes);
- the model's names and widths: ``fault.param`` must be one of its parameters,
  ``fault.site`` one of its modules, ``model.fp32_modules`` its paths, ``quant.layers``
  globs its Linears of block-divisible widths (the model is built on the meta device, so
  this costs no memory, a Hugging Face one from the model keys without its weights;
  building it also runs the norms' own checks);
- the data: every local file has content, the corpus is large enough for a block and for
  each rank's validation batch (the token cache is built here, stabilize/data/cache.py, and
  the run's loaders reuse it; the tokenizer's ids were checked against ``model.vocab_size``
  by ``RunConfig``); a fault on content names one of its training blocks (``fault.item``);
- ``model.hf.weights``: a local ``save_pretrained`` directory whose config agrees with our
  model keys (read from disk here, not when the config is built);
- ``resume=PATH``: the file exists and is a checkpoint (checked before the data: a typo
  costs no tokenizing);
- ``trainer.accelerator=gpu``: a CUDA device is visible; ``logger.mode=online``: W&B has an
  API key.

A ``ValueError`` raised while building the config or running these checks is a config
error: it is re-raised as ``ConfigError`` (the CLI prints it on one line, exit code 2).
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stabilize.data import build_dataloaders
from stabilize.faults import fault_class
from stabilize.model import GPT
from stabilize.model.fp32_sites import apply_fp32_modules
from stabilize.quant.config import check_quant
from stabilize.run.config import RunConfig
from stabilize.trust import UntrustedFile, check_dcp_index, torch_load
from stabilize.validate import ConfigError

RESUME_ALLOWED = (
    "allowed: 'none', 'auto', 'restart' or a checkpoint file written by stabilize-train"
)


@contextmanager
def config_errors() -> Iterator[None]:
    """A ValueError raised inside is a config error (``ConfigError``, same message)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_config(values: dict[str, Any]) -> RunConfig:
    """The resolved Hydra values -> a ``RunConfig``; any refusal is a ``ConfigError``. In
    a group torchrun restarted, ``resume`` is what the restart needs (``elastic_resume``)."""
    from stabilize.run.rundir import elastic_resume

    if "run_dir" in values and "resume" in values:
        values["resume"], line = elastic_resume(str(values["resume"]), values["run_dir"])
        if line and int(os.environ.get("RANK", "0")) == 0:
            print(line, file=sys.stderr, flush=True)
    with config_errors():
        return RunConfig.from_dict(values)


def world_size(cfg: RunConfig) -> int:
    """Processes in this launch: torchrun's ``WORLD_SIZE``, else devices x nodes."""
    from stabilize.run.env import LaunchEnv

    env = LaunchEnv.detect()
    if env.torchrun:
        return env.world_size
    devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
    return devices * cfg.trainer.num_nodes


def preflight(cfg: RunConfig) -> None:
    """Every start-up check (module docstring); raises ``ConfigError``, writes nothing.
    The cheap ones come first: a typo in a resume path or a missing GPU is reported before
    the corpus is tokenized."""
    check_accelerator(cfg.trainer.accelerator)
    check_resume(cfg.resume, cfg.trainer.strategy, cfg.resume_trusted)
    check_wandb_login(cfg)
    world = world_size(cfg)
    check_fault_rank(cfg, world)
    check_hf_weights(cfg)
    with config_errors(), torch.device("meta"):  # the run's model, no memory: its names
        if cfg.model.hf is None:
            model = GPT(cfg.model)
        else:  # a Hugging Face architecture from the model keys (its weights not read)
            from stabilize.model.hf_arch import hf_skeleton

            model = hf_skeleton(cfg.model)
        apply_fp32_modules(model, cfg.model.fp32_modules)  # model.fp32_modules: its paths
    check_fault_param(cfg, [name for name, _ in model.named_parameters()])
    check_fault_site(cfg, [name for name, _ in model.named_modules()])
    with config_errors():  # the quant globs and widths, on the same meta model
        check_quant(model, cfg.quant)
    tokens = cfg.data.batch_size * cfg.model.block_size
    if cfg.quant.name == "nvfp4" and cfg.quant.nvfp4.rht and tokens % 16:
        raise ConfigError(
            f"quant.nvfp4.rht=true is not allowed with data.batch_size x model.block_size = "
            f"{tokens} tokens a micro-batch; allowed: a multiple of 16 (its transform mixes "
            "tokens in 16s)"
        )
    check_data(cfg, world)


def check_hf_weights(cfg: RunConfig) -> None:
    """``model.hf.weights``: the directory holds a Hugging Face config that agrees with our
    model keys (``hf_arch.check_weights``), before the model loads the weights from it."""
    hf = cfg.model.hf
    if hf is None or hf.weights is None:
        return
    from stabilize.model.hf_arch import check_weights

    with config_errors():
        check_weights(cfg.model)


def check_accelerator(accelerator: str) -> None:
    """``trainer.accelerator=gpu`` (or ``cuda``) needs a CUDA device this process can see."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    why = (
        "this torch is a CPU-only build"
        if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    )
    raise ConfigError(
        f"trainer.accelerator={accelerator!r} is not allowed here: {why}; allowed: 'cpu' or "
        f"'auto' (the GPU when there is one, else the CPU)"
    )


def check_wandb_login(cfg: RunConfig) -> None:
    """An online W&B run needs an API key; without one wandb.init fails after the run has
    started. ``wandb.login(prompt=False, verify=False)`` is wandb's own lookup (the
    ``WANDB_API_KEY`` variable, its settings files, ``~/.netrc`` for its host): it prompts
    for nothing, checks nothing with the server, and returns False when there is no key."""
    mode = cfg.logger.wandb_mode()
    if not cfg.logger.wandb or mode != "online":
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return  # what wandb reads first; no need to load wandb to know
    import wandb

    from stabilize.run.quiet import quiet

    with quiet(cfg.verbose):  # its "credentials loaded" lines: W&B's banner, silenced
        if wandb.login(key=None, verify=False, prompt=False):
            return
    key = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "logger.mode='online'"
    raise ConfigError(
        f"{key} is not allowed without a W&B API key (none in WANDB_API_KEY, wandb's settings "
        f"or ~/.netrc); allowed: run `wandb login` (or set WANDB_API_KEY) first, or "
        f"logger.mode=offline (and `wandb sync` later)"
    )


def check_fault_rank(cfg: RunConfig, world: int) -> None:
    rank = cfg.fault.rank
    if cfg.fault.kind != "none" and rank is not None and rank >= world:
        raise ConfigError(
            f"fault.rank={rank} is not allowed in a launch of {world} process(es) (the fault "
            f"would never fire); allowed: null (every rank) or 0 .. {world - 1}"
        )


def check_fault_site(cfg: RunConfig, names: list[str]) -> None:
    """``fault.site`` (``biased_round``): a module path of the model."""
    site = getattr(cfg.fault, "site", None)
    if site is None or site in names:
        return
    shown = [n for n in names if n and (not n.startswith("h.") or n.startswith("h.0."))]
    raise ConfigError(f"fault.site={site!r} is not a module of the model; allowed: e.g. "
                      f"{shown[:16]} (and the same under the other blocks)")  # fmt: skip


def check_fault_param(cfg: RunConfig, names: list[str]) -> None:
    param = getattr(cfg.fault, "param", None)  # the kinds aimed at one parameter
    if param is None or param in names:
        return
    # A deep model has hundreds of names: list those outside the blocks and block 0's.
    shown = [n for n in names if not n.startswith("h.") or n.startswith("h.0.")]
    more = (
        f" (and the same under h.1 .. h.{cfg.model.n_layer - 1})" if cfg.model.n_layer > 1 else ""
    )
    raise ConfigError(
        f"fault.param={param!r} is not a parameter of the model; allowed: {shown}{more}"
    )


def check_data(cfg: RunConfig, world: int) -> None:
    """Local files with content; a corpus the blocks and ranks fit; ids < vocab_size."""
    for p in cfg.data.paths:
        if os.path.getsize(p) == 0:
            raise ConfigError(
                f"data.paths={cfg.data.paths!r} is not allowed: {p!r} is empty; allowed: "
                "files with at least one document"
            )
    with config_errors(), _quiet_datasets():
        # Through the token cache: built here, once per node, mapped; the run's
        # own loaders then find it. The ids were checked against the model by RunConfig.
        train, _ = build_dataloaders(
            cfg.data,
            cfg.model.block_size,
            rank=0,
            world_size=world,
            num_steps=None,
            val_batches=cfg.trainer.limit_val_batches,
        )
        # a fault on content (``fault.item``) names a block of this corpus: its own check
        # (``bind_data``), here rather than at train start, after the run dir and W&B run
        # exist; a disabled fault's settings are checked too
        fault_class(cfg.fault.kind)(cfg.fault).bind_data(train.dataset)


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No datasets progress bars on stderr from the check (an error must stay one line).
    A cached corpus needs no ``datasets`` at all: it is not imported for this (0.5-0.7 s of
    import time per process, at every start and restart); one imported inside reads the
    variable."""
    import sys

    key = "HF_DATASETS_DISABLE_PROGRESS_BARS"
    ds = sys.modules.get("datasets")
    was_on = ds is not None and ds.utils.logging.is_progress_bar_enabled()
    saved = os.environ.get(key)
    if ds is not None:
        ds.utils.logging.disable_progress_bar()
    else:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        # on again only where it was: one imported inside read the variable at import, and
        # would refuse (a two-line warning) to turn on
        ds = sys.modules.get("datasets")
        if ds is not None and was_on:
            ds.utils.logging.enable_progress_bar()


def check_resume(resume: str, strategy: str = "auto", trusted: bool = False) -> None:
    """``resume=PATH`` names a file that is a checkpoint: a torch zip archive holding a
    Lightning checkpoint of ours (``state_dict`` and our ``stabilize`` state; loaded
    memory-mapped: the tensors are not read); or, under
    ``trainer.strategy=fsdp``, a sharded checkpoint directory (DCP, lit/fsdp.py)."""
    if resume in ("none", "auto", "restart"):  # modes, not paths (lit/checkpoint.py)
        return
    path = Path(resume)
    if path.is_dir() and (path / "meta.pt").is_file():  # sharded (FSDP): a DCP directory
        if strategy == "fsdp":
            try:
                check_dcp_index(path, trusted)
                torch_load(path / "meta.pt", trusted, map_location="cpu")
            except UntrustedFile as e:
                raise ConfigError(f"resume={resume!r} is not allowed: {e}") from None
            return
        raise ConfigError(
            f"resume={resume!r} is not allowed with trainer.strategy={strategy!r}: it is a "
            f"sharded (FSDP) checkpoint directory; allowed: trainer.strategy=fsdp (any "
            f"number of ranks) to resume from it"
        )
    if not path.is_file():
        raise ConfigError(
            f"resume={resume!r} is not allowed: no such checkpoint file; {RESUME_ALLOWED}"
        )
    reason = None
    if not zipfile.is_zipfile(path):
        reason = "not a torch.save archive"
    else:
        try:
            ckpt = torch_load(path, trusted, map_location="cpu", mmap=True)
        except UntrustedFile as e:
            raise ConfigError(f"resume={resume!r} is not allowed: {e.reason}") from None
        except Exception as e:  # any unreadable archive: say why, briefly
            reason = f"unreadable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        else:
            if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
                reason = "no 'state_dict' in it"
            elif "stabilize" not in ckpt:  # another Lightning project's: no model step
                reason = "no 'stabilize' state in it: not written by stabilize-train"
    if reason:
        raise ConfigError(
            f"resume={resume!r} is not allowed: {str(path)!r} is not a checkpoint ({reason}); "
            f"{RESUME_ALLOWED}"
        )
