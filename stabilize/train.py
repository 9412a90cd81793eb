"""The Hydra entry point: ``stabilize-train`` = ``python -m stabilize.train``.

Hydra stops here: the composed DictConfig is resolved, turned into a typed ``RunConfig``
(which validates every key and value before any work starts) and handed to ``run``.

Multi-process runs are launched with torchrun (scripts/launch.sh): every rank runs this app,
Lightning spawns nothing, and all ranks share one run dir (``STABILIZE_RUN_ID``, or
torchrun's own run id). Sweeps with ``-m`` run members one after another in this process;
a sweep of torchrun launches is scripts/sweep.sh (multirun inside torchrun is broken
upstream).
"""

from __future__ import annotations

import difflib
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# Only what Hydra's app needs to start: ``stabilize-train --help`` and a bad override cost
# Hydra and the config dataclasses' defaults, which every option file starts from (read from
# their cache: the dataclasses' modules load torch and the data stack); Lightning loads when
# a run starts (scripts/bench_startup.py measures it; tests/test_startup.py checks it).
import hydra
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from stabilize.config_store import store as store_defaults
from stabilize.elastic import fresh_store_for_restart, restart_count
from stabilize.exits import (
    EXIT_ABORT,
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_PREEMPTED,
    file_error,
    one_line,
)
from stabilize.paths import config_dir
from stabilize.registry import on_change
from stabilize.run.rundir import RunDirError, check_name, claim, elastic_resume, unlock_all
from stabilize.validate import ConfigError

if TYPE_CHECKING:
    from stabilize.run.config import RunConfig
    from stabilize.run.keys import Section

CONFIG_DIR = config_dir()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_launch_time: str | None = None  # this launch's, taken once (``main`` starts a new launch)


def run_id() -> str:
    """One id for all ranks of a launch: ours, else torchrun's rendezvous id, else the time
    this launch first asked for it: Hydra resolves ``hydra.run.dir`` more than once, and two
    readings of the clock a second apart made two run dirs of one launch."""
    global _launch_time
    rid = os.environ.get("STABILIZE_RUN_ID")
    if not rid:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if elastic != "none":
            return elastic
        if _launch_time is None:
            _launch_time = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        rid = _launch_time
    return rid


# Resolvers used by configs/train.yaml's hydra section; registered before Hydra starts.
OmegaConf.register_new_resolver("stabilize.run_id", run_id, replace=True)
OmegaConf.register_new_resolver(
    "stabilize.rank_suffix", lambda: "" if _rank() == 0 else f"-rank{_rank()}", replace=True
)


def relaunch_subdir(output_dir: str) -> str:
    """``/relaunch-<time>`` when rank 0 launches into a dir that already holds a run (a
    resume, or a retry that fails on a config error), else "": Hydra then records this
    launch in ``.hydra/relaunch-<time>/`` and the run's first record, ``.hydra/``, stays
    as it was (the report names a run by its ``overrides.yaml``; a mistyped retry must not
    rename it). Ranks > 0 keep one ``.hydra-rankN/`` each: rank 0 writes config.json while
    they may still be starting, so they could not tell a first launch from a later one."""
    # Hydra resolves ``hydra.output_subdir`` lazily, at every access (its save, then
    # ``_discard_hydra_output``): the first answer per dir is kept, or a second access a
    # second later would name another time, and after the app wrote config.json
    if output_dir not in _RELAUNCH:
        held = _rank() == 0 and (Path(output_dir) / "config.json").exists()
        _RELAUNCH[output_dir] = (
            "/relaunch-" + datetime.now().strftime("%Y-%m-%d_%H-%M-%S") if held else ""
        )
    return _RELAUNCH[output_dir]


_RELAUNCH: dict[str, str] = {}  # output dir -> its relaunch subdir, once decided


OmegaConf.register_new_resolver("stabilize.relaunch_subdir", relaunch_subdir, replace=True)

# The key table of ``--keys`` is read from the cache of this source, unless a registry may
# hold a name from outside the package: one loaded before this module (a plugin, a test),
# or one changed after the nodes below loaded the built-in names.
REGISTRY_MODULES = ("stabilize.monitors", "stabilize.rollback", "stabilize.faults",
                    "stabilize.norms")  # fmt: skip
_keys_live = any(m in sys.modules for m in REGISTRY_MODULES)

# The dataclasses' defaults, which every option file of configs/ starts from, stored before
# any config is composed: by the CLI, and by whoever imports this module to compose configs/.
store_defaults()


def _registry_changed() -> None:
    global _keys_live
    _keys_live = True


on_change(_registry_changed)


def _sweep_group() -> str | None:
    """In a Hydra multirun, the sweep's directory name groups its members in W&B."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return Path(hc.sweep.dir).name
    except ValueError:  # not running under Hydra
        pass
    return None


def run(cfg: RunConfig, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says (plus any extra Lightning callbacks); returns the final
    metrics (floats) and where things are (``stabilize/lit/runner.py``, imported here:
    ``--help`` and a config error never load Lightning). The start-up's log lines (the
    token cache, matplotlib's font cache) wait for the run's description (run/quiet.py)."""
    from stabilize.run.quiet import held_until_described

    with held_until_described(cfg.verbose):
        from stabilize.lit.runner import run as _run

        return _run(cfg, callbacks)


def _stability_abort() -> type[BaseException]:
    """``StabilityAbort``, imported only when an exception reaches ``_app``'s handler for
    it (an ``except`` clause's expression is evaluated only then), so a config error does
    not load Lightning to test against it."""
    from stabilize.stability import StabilityAbort

    return StabilityAbort


def _preempted() -> type[BaseException]:
    """``Preempted``, imported only when an exception reaches the handler (as above)."""
    from stabilize.lit.preempt import Preempted

    return Preempted


class RunDirGuard(Callback):
    """Hydra callback (configs/train.yaml ``hydra.callbacks``): claims the run dir before
    Hydra writes its ``.hydra/`` files into it, so a refused launch leaves the dir exactly
    as it was. ``run()`` claims it again for callers without Hydra (a no-op after this)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_name(config)  # before Hydra makes runs/${name}/...: name=../../x escapes
        raw = OmegaConf.to_container(config, resolve=False).get("run_dir")
        # run_dir defaults to ${hydra:runtime.output_dir}, which Hydra fills in only later
        default = raw is None or "hydra:runtime" in str(raw)
        run_dir = config.hydra.run.dir if default else config.run_dir
        resume, _ = elastic_resume(str(config.resume), run_dir)  # said by build_config
        try:
            moved = claim(run_dir, resume)
        except RunDirError as e:  # Hydra turns a callback's exception into a warning
            print(f"stabilize-train: {one_line(str(e))}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CONFIG)
        if moved:
            print(moved, file=sys.stderr, flush=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_name(config)  # before the launcher makes multirun/${name}/...


def _check_name(config: DictConfig) -> None:
    """``name`` is one directory (``lit/rundir.check_name``), refused before any is made."""
    try:
        name = config.name
    except OmegaConfBaseException:  # an interpolation that fails: the app names it
        return
    try:
        check_name(name)
    except ConfigError as e:  # every rank refuses: rank 0 says so (``_fail``)
        _fail(EXIT_CONFIG, str(e))


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _app(cfg: DictConfig) -> float | None:
    """One run (or one member of a ``-m`` sweep). A config error, a stability abort and a
    file error end it here with one line and their exit code (``stabilize/exits.py``)."""
    group = _sweep_group()
    try:
        try:
            values = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
            raise ConfigError(str(e)) from e
        if group and not values["logger"].get("group"):
            values["logger"]["group"] = group
        from stabilize.run.preflight import build_config  # torch, data: not for --help

        cfg_run = build_config(values)
        result = run(cfg_run)  # run() checks the rest before it writes
    except (ConfigError, RunDirError) as e:
        _discard_hydra_output()  # only where the dir holds no run of its own
        _fail(EXIT_CONFIG, one_line(str(e)), every_rank=True)
    except _stability_abort() as e:
        if _rank() == 0:
            from stabilize.run.summary import abort_summary, read_events

            lines = abort_summary(e.diagnosis, read_events(cfg_run.run_dir), cfg_run.run_dir)
            print("\n".join(lines), file=sys.stderr, flush=True)
        _fail(EXIT_ABORT, None)
    except _preempted() as e:  # checkpointed at the signal: one line, the requeue code
        _fail(EXIT_PREEMPTED, str(e))
    except OSError as e:  # a full disk, a permission: name the file, no traceback
        _fail(EXIT_CRASH, file_error(e), every_rank=True)
    m = result["metrics"]
    if _rank() == 0 and not result.get("nothing_to_train"):
        from stabilize.run.summary import final_summary, read_events

        lines = final_summary(cfg_run, result, read_events(result["run_dir"]))
        print("\n".join(lines), flush=True)
    return m.get("val/loss")  # for Hydra sweepers that optimise


# Under torchrun a rank > 0 that stops on a config error or an abort waits this long before
# it exits: torchrun stops every rank as soon as one exits, and rank 0, which prints the
# message and writes result.json, should be the one to go first.
RANK0_GRACE_S = 5.0


def _fail(code: int, message: str | None, every_rank: bool = False) -> NoReturn:
    """Print ``stabilize-train: message`` (rank 0; every rank when ``every_rank``, after the
    grace period on ranks > 0, in case rank 0 did not fail) and exit with ``code``."""
    if _rank() > 0:
        time.sleep(RANK0_GRACE_S)  # torchrun usually ends this rank here, after rank 0
    if message and (_rank() == 0 or every_rank):
        prefix = "" if _rank() == 0 else f"[rank {_rank()}] "
        print(f"stabilize-train: {prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _discard_hydra_output() -> None:
    """Nothing is written on a config error, but Hydra made the run dir (its ``.hydra*/``
    and log file) before the app ran: remove those when the dir holds no run of its own
    (no config.json), then the dir and its empty parents up to the working directory; in a
    dir holding a run, remove this launch's ``.hydra/relaunch-*/`` record only (the log
    keeps the failed launch's lines: it is appended to)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except ValueError:  # not running under Hydra
        return
    unlock_all()  # this launch's run-dir lock, and its file where no run is in the dir
    out = Path(hc.runtime.output_dir)
    if (out / "config.json").exists():  # a run's own dir: only this launch's Hydra record
        if hc.output_subdir and "/relaunch-" in hc.output_subdir:
            shutil.rmtree(out / hc.output_subdir, ignore_errors=True)
        return
    if hc.output_subdir:
        shutil.rmtree(out / hc.output_subdir, ignore_errors=True)
    log = OmegaConf.select(hc.job_logging, "handlers.file.filename", default=None)
    if log and Path(log).parent == out:
        for h in list(logging.root.handlers):  # closed and detached: nothing reopens it
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == Path(log).resolve():
                logging.root.removeHandler(h)
                h.close()
        Path(log).unlink(missing_ok=True)
    cwd = Path.cwd().resolve()
    d = out.resolve()
    while d != cwd and cwd in d.parents:
        try:
            d.rmdir()  # only an empty dir: another rank's files keep it
        except OSError:
            break
        d = d.parent


def main() -> None:
    """``stabilize-train``: Hydra's app, with Hydra's own errors (an unknown group or key, a
    bad override) on one line and exit code 2 instead of its multi-line report."""
    # Hydra re-raises instead of printing its own report (and its stripped traceback of a
    # genuine bug: that one now gets Python's full traceback).
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    if restart_count():  # a group torchrun restarted: its own store (stabilize/elastic.py)
        fresh_store_for_restart()
    store_defaults()  # again: a name registered since this module's import (a plugin)
    global _launch_time
    _launch_time = None  # a launch of its own (tests launch several in one process)
    try:
        if any(a == "--keys" or a.startswith("--keys=") for a in sys.argv[1:]):
            sys.exit(print_keys(sys.argv[1:]))  # Hydra's parser has no such flag: before it
        _app()
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).split("\nConfig search path:")[0]  # Hydra's, for a missing group option
        if isinstance(e.__cause__, OmegaConfBaseException) and str(e.__cause__) not in msg:
            msg += "\n" + str(e.__cause__)
        _fail(EXIT_CONFIG, unknown_key(e, sys.argv[1:]) or one_line(msg), every_rank=True)
    except OSError as e:  # before the app ran: Hydra could not make the run dir
        _fail(EXIT_CONFIG, f"the run dir cannot be made: {file_error(e)}", every_rank=True)
    _close_process_group()


def unknown_key(e: BaseException, overrides: Sequence[str]) -> str | None:
    """Hydra's message for an override of a key no config has ("Could not override
    'model.n_layerz'. To append to your config use +model.n_layerz=3") as one line that
    names the key's group, the close matches or the group's keys, and never suggests
    ``+``: every setting is a dataclass field, so an appended key is refused too. None for
    any other error."""
    cause = e.__cause__
    if not isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return None
    if not str(e).startswith("Could not override") or not cause.full_key:
        return None
    parent, _, key = cause.full_key.rpartition(".")
    node = cause.parent_node
    keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
    prefix = f"{parent}." if parent else ""
    given = next((o for o in overrides if o.split("=", 1)[0] == cause.full_key), cause.full_key)
    if not keys:  # model.n_layer.x: under a value
        return f"{given} is not allowed: {parent} holds a value, not settings"
    where = f"the {parent!r} group" if parent else "the top level"
    line = f"{given} is not allowed: {key!r} is not a setting of {where}"
    close = difflib.get_close_matches(key, keys, n=3)
    if close:
        return line + f"; did you mean {' or '.join(prefix + k for k in close)}?"
    return line + f"; allowed: {', '.join(prefix + k for k in keys)}"


def key_table() -> list[Section]:
    """Every key of the config with its default, meaning and allowed values
    (stabilize/run/keys.py), and what a bare ``stabilize-train`` composes where the default
    options of configs/train.yaml set another value. Read from the cache of this source
    (``_keys_live``): ``--keys`` loads no torch, as ``--help`` does not."""
    from hydra import compose, initialize_config_dir

    from stabilize.config_store import source_hash
    from stabilize.run.keys import build_table, cached_table, with_composed

    table = build_table() if _keys_live else cached_table(source_hash())
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("train"), resolve=False)
    return with_composed(table, composed)


def print_keys(argv: Sequence[str]) -> int:
    """``stabilize-train --keys [PREFIX]``: the keys under PREFIX (all without one), one a
    line, ``key = default (context)  meaning [allowed: ...]``; a prefix no key has: one
    line naming the close matches, exit 2."""
    from stabilize.run.keys import UnknownPrefix, line, select

    args = [a.removeprefix("--keys=") for a in argv if a != "--keys"]
    if len(args) > 1:
        _fail(EXIT_CONFIG, f"--keys takes one PREFIX (e.g. monitor.loss_scale), not {args}")
    try:
        keys = select(key_table(), args[0] if args else "")
    except UnknownPrefix as e:
        _fail(EXIT_CONFIG, str(e))
    print("\n".join(line(k) for k in keys), flush=True)
    return 0


def _close_process_group() -> None:
    """Under torchrun: wait for every rank, then destroy the process group before the
    interpreter exits. Left to exit-time destructors, a gloo rank could abort ("terminate
    called without an active exception") while another node's agent, hosting the
    rendezvous store, had already gone: both launches then failed (CI, two nodes)."""
    dist = sys.modules.get("torch.distributed")  # never imported: no group to close
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
