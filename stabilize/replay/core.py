"""Replay a failing step from its repro bundle, in this process (``stabilize-replay``).

The bundle (stability/bundle.py) is checked first (``bundle_files.open_bundle``): every
file its manifest lists must be there with its size and SHA-256, inside the bundle, and no
other file beside them; its format this one; ``meta.json`` of the shape the replay reads;
otherwise one line naming the file, exit 2. A model we did not build is rebuilt only with
the code the user allows (``rebuild.CodeChoice``). Then the model is rebuilt from the
bundle's config and state, and the step's micro-batches (every rank's, under DDP) run
forward and backward as training ran them: the same dropout seeds (seed, data position,
rank), the run's autocast and loss scale, the fault injector in the state it had (a
harness fault recurs), the gradients averaged over the ranks as DDP does. Forward and
backward localization are on (the first module whose output, then whose gradient, went
non-finite).

It prints the replayed loss and gradient norm beside the recorded ones and whether the
failure reproduces: a bundle written by one rank in fp32 on a CPU is compared bit for bit;
in 16-bit precision, from several ranks (whose all-reduce sums in another order) or from a
GPU (other kernels), within a relative 1e-4. The replay runs on the CPU. Exit 0: it
reproduces; 1: it does not.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from stabilize.replay.bundle_files import FOREIGN, BadBundle, Bundle, open_bundle
from stabilize.replay.rebuild import NO_CODE, CodeChoice
from stabilize.replay.step import TOLERANCE, recorded_batches, replay_step, select_rows


def check(bundle: Path) -> dict[str, Any]:
    """The bundle's meta, once every file matches its manifest and the directory is closed
    (``bundle_files.open_bundle``); else ``BadBundle``."""
    return open_bundle(bundle).meta


def replay(
    bundle: Path | Bundle,
    fp32_sites: frozenset[str] = frozenset(),
    rows: frozenset | None = None,
    code: CodeChoice = NO_CODE,
) -> dict[str, Any]:
    """Replay the bundle's step; ``fp32_sites``: norms whose reduction runs in fp32;
    ``rows``: only these sequences, as (rank, micro-batch, row) (None: all of them);
    ``code``: what the user allowed a model we did not build to import (replay/rebuild.py).
    ``bundle``: a path, or a ``Bundle`` already opened (a bisection's many replays)."""
    import torch

    from stabilize.run.config import RunConfig

    b = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    meta = b.meta
    if meta.get("host", {}).get("kind") in FOREIGN:  # a model we did not build
        from stabilize.replay.rebuild import replay_module

        model, step = _rebuilt(meta["host"], code)  # refused in one line before any import
        state, ranks = b.load("state.pt"), _ranks(b)
        return replay_module(model, step, meta, _state(b, state), ranks, fp32_sites,
                             select_rows(rows))  # fmt: skip
    try:
        cfg = RunConfig.from_saved(meta["config"])  # a bundle of an older version too
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # ConfigError is a ValueError
        raise BadBundle(f"{b.root / 'meta.json'}: its config does not load ({e})") from None
    if meta.get("state_sharded"):  # FSDP: the ranks' shards, into one unsharded model
        state = sharded_state(b.root / "state", cfg)
    else:
        state = _state(b, b.load("state.pt"))
    ranks = _ranks(b)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _run(b.root, meta, cfg, state, ranks, fp32_sites, rows)
    finally:
        torch.use_deterministic_algorithms(was)


def _state(b: Bundle, state: Any) -> dict[str, Any]:
    """``state.pt`` as the replay reads it: a dict with the model's tensors and the train
    state; else ``BadBundle`` (a file that loads but is not a bundle's state)."""
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict)
            and isinstance(state.get("train_state"), dict)):  # fmt: skip
        raise BadBundle(f"{b.root / 'state.pt'}: not a bundle's state (needs 'model' and "
                        "'train_state')")  # fmt: skip
    return state


def _ranks(b: Bundle) -> list[dict]:
    """``batch.pt``'s rank records, each with its rank, data positions and micro-batches."""
    raw = b.load("batch.pt")
    ranks = raw.get("ranks") if isinstance(raw, dict) else None
    ok = isinstance(ranks, list) and bool(ranks)
    for r in ranks if ok else ():
        ok = (
            ok
            and isinstance(r, dict)
            and isinstance(r.get("rank"), int)
            and isinstance(r.get("positions"), list)
            and ("batches" in r or ("x" in r and "y" in r))
        )
        if ok:
            try:
                ok = len(recorded_batches(r)) == len(r["positions"])
            except (TypeError, ValueError):
                ok = False
    if not ok:
        raise BadBundle(f"{b.root / 'batch.pt'}: not a bundle's batch (needs 'ranks', each "
                        "with its rank, data positions and micro-batches)")  # fmt: skip
    return ranks


def _rebuilt(host: dict[str, Any], code: CodeChoice):
    from stabilize.replay.rebuild import CannotRebuild, rebuild_module

    try:
        return rebuild_module(host, code)
    except CannotRebuild as e:
        raise BadBundle(f"cannot rebuild the module: {e}") from None


def sharded_state(path: Path, cfg) -> dict[str, Any]:
    """An FSDP bundle's ``state/`` (a torch.distributed.checkpoint directory, one shard per
    rank), read into an unsharded model's state dict: DCP reassembles each tensor from its
    shards by its global shape. Only the model is read (the replay steps no optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from stabilize.io import verified_load
    from stabilize.rollback.dcp import REST
    from stabilize.run.model import build_run_model
    from stabilize.trust import check_dcp_index

    check_dcp_index(path)  # before DCP unpickles its index with no allow-list
    model = build_run_model(cfg)
    want = {"model": get_model_state_dict(model)}  # the keys DCP saved them under
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(want, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, want["model"])
    return {"model": model.state_dict(), **verified_load(path / REST)["state"]}


def _run(bundle, meta: dict, cfg, state: dict, ranks: list[dict], fp32_sites, rows) -> dict:
    import torch

    from stabilize.faults import FaultInjector
    from stabilize.lit.module import step_seed
    from stabilize.model.logits import lm_loss
    from stabilize.run.model import build_run_model

    model = build_run_model(cfg)
    model.load_state_dict(state["model"])
    model.z_loss = state["train_state"].get("z_loss", cfg.model.z_loss)
    inj = FaultInjector(cfg.fault) if cfg.fault.kind != "none" else None

    def forward(batch):
        x, y = batch
        return lm_loss(model(x), y, model.z_loss)

    def reseed(pos: int, rank: int) -> None:
        if cfg.model.dropout > 0:
            torch.default_generator.manual_seed(step_seed(cfg.seed, pos, rank))

    return replay_step(model, forward, meta, state, ranks, fp32_sites, inj,
                       precision=cfg.precision.name, reseed=reseed,
                       select=select_rows(rows))  # fmt: skip


def fails(out: dict[str, Any]) -> bool:
    """The replayed step fails: a norm's reduction overflowed, or the loss or the gradient
    norm is not finite."""
    bad = [v for v in (out["loss"], out["grad_norm"]) if v is None or not math.isfinite(v)]
    return bool(out["overflowed"] or bad)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.6g}"


def backward_words(bwd: dict[str, Any]) -> str:
    """The replay's backward localization in words (the live console's, grad_scan.origin,
    name the same module from the same trace)."""
    name = bwd.get("grad_module")
    if not name:
        return "finite"
    if bwd.get("from_loss"):
        fwd = bwd.get("from_forward")
        made = f"the forward's non-finite output (first in {fwd})" if fwd else "the loss"
        return f"non-finite from the loss on: made by {made}, not in the backward"
    made = "finite: it made the value" if bwd.get("grad_incoming_finite") else "non-finite"
    return f"first non-finite gradient in {name} (its incoming gradient {made})"


def report(bundle: Path, out: dict[str, Any]) -> list[str]:
    m, rec = out["meta"], out["meta"]["recorded"]
    how = "bit for bit" if out["exact"] else f"within {TOLERANCE:g} relative"
    monitors = ", ".join(dict.fromkeys(e["monitor"] for e in m["events"])) or "on demand"
    fwd = out["forward"]
    bwd = out["backward"]
    lines = [
        f"replay of step {m['step']} ({monitors}; {m['precision']}, {m['world_size']} rank(s)) "
        f"from {bundle}",
        f"  loss {_fmt(out['loss'])} (recorded {_fmt(rec['loss'])}), grad norm "
        f"{_fmt(out['grad_norm'])} (recorded {_fmt(rec['grad_norm'])}), compared {how}",
        "  forward: " + (f"first non-finite output in {fwd['module']}" if fwd else "finite"),
        "  backward: " + backward_words(bwd),
    ]
    ok = out["same_loss"] and out["same_grad_norm"]
    lines.append(f"reproduces: {'yes' if ok else 'no'}")
    return lines
