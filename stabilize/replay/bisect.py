"""The two bisections of ``stabilize-replay`` over a repro bundle (core.py replays).

- ``--bisect`` (``precision``): the fewest norms whose reduction in fp32 clears the step,
  printed as a ``++model.norm_sites`` override.
- ``--data`` (``data``): the fewest sequences of the step that still fail it, each named by
  its training block index and content hash (``stabilize.data.block_hash``), recorded in
  the run dir's ``skipped_items.json`` (a resume steps over them, in every epoch) and
  printed as a ``++data.skip_items`` override for other runs on the same corpus. Where the
  live run classed the fault as not data-linked (deterministic, transient: the bundle's
  events), they are named and nothing is written unless ``--record`` asks.

Both halve (``minimize``) and count replays: one culprit among n costs log2(n) + 3
(precision: the first replay, every norm in fp32, one per halving, the confirmation) and
log2(n) + 2 (data: no all-rows replay, the first one is it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stabilize.replay.bundle_files import FOREIGN
from stabilize.replay.core import fails, replay
from stabilize.replay.rebuild import NO_CODE, CodeChoice, code_flags
from stabilize.replay.step import recorded_batches, rows_of


# ---- precision: the fewest norms in fp32 that clear the step --------------------------------
def precision(bundle: Path, code: CodeChoice = NO_CODE) -> dict[str, Any]:
    """The smallest set of norms whose reduction in fp32 clears the failing step, found by
    halving (``minimize``; one culprit: log2(sites) + 3 replays, with the first and the
    all-norms one). ``code``: what a model we did not build may import."""
    from stabilize.replay.bundle_files import open_bundle

    bundle = open_bundle(bundle)  # checked once, every replay from the same verified bytes
    first = replay(bundle, code=code)
    sites = sorted(n for n, d in first["dtypes"].items() if d != "fp32")
    count = 1
    out = {"sites": sites, "failing": fails(first), "overflowed": first["overflowed"]}
    if not out["failing"] or not sites:
        return {**out, "culprits": None, "replays": count}
    memo: dict[frozenset, bool] = {}

    def clears(switched: frozenset) -> bool:
        nonlocal count
        if switched not in memo:
            count += 1
            memo[switched] = not fails(replay(bundle, switched, code=code))
        return memo[switched]

    if not clears(frozenset(sites)):
        return {**out, "culprits": [], "replays": count}  # not a norm-precision failure
    culprits = sorted(minimize(sites, clears))
    return {**out, "culprits": culprits, "replays": count}


bisect = precision  # the name the first bisection had


def override(culprits: list[str]) -> str:
    """The Hydra override that switches exactly those norms' reductions to fp32."""
    return (
        "++model.norm_sites={" + ",".join(f"{c}:{{reduction_dtype:fp32}}" for c in culprits) + "}"
    )


def swap_call(culprits: list[str]) -> str:
    """For a model we did not build: the ``swap_norms`` call that switches exactly those
    norms' reductions to fp32 (after the build's own swap)."""
    sites = ", ".join(f'"{c}": {{"reduction_dtype": "fp32"}}' for c in culprits)
    return f"stabilize.swap_norms(model, sites={{{sites}}})"


def precision_main(bundle: Path, code: CodeChoice = NO_CODE) -> int:
    from stabilize.replay.bundle_files import open_bundle

    opened = open_bundle(bundle)  # before anything is read of it
    foreign = opened.meta.get("host", {}).get("kind") in FOREIGN
    b = precision(bundle, code)
    head = f"bisection over {len(b['sites'])} norms with a 16-bit reduction, {b['replays']} replays"
    if b["failing"] and not b["sites"]:  # it reproduces: the norms are not why
        print(f"{head}: the step fails in the replay, but every norm of the run already "
              "reduces in fp32: there is no 16-bit norm to bisect; the sequences that fail "
              f"it: stabilize-replay --data {code_flags(code)}{bundle}")  # fmt: skip
        return 1
    if b["culprits"] is None:
        print(f"{head}: the step does not fail in the replay (nothing to bisect)")
        return 1
    if not b["culprits"]:
        print(f"{head}: every norm in fp32 does not clear it: not a norm-precision failure")
        return 1
    print(f"{head}: fp32 at {', '.join(b['culprits'])} clears the step "
          f"(overflowed in the replay: {', '.join(b['overflowed']) or 'none'})")  # fmt: skip
    if foreign:  # no Hydra config to override: the model's own build
        print(f"in the model's build, after its swap: {swap_call(b['culprits'])}")
        return 0
    print(f'run with: "{override(b["culprits"])}"')  # quoted: a shell would expand {a,b}
    return 0


# ---- data: the fewest sequences that still fail the step -------------------------------------
def minimize(cand: list, holds) -> list:
    """The fewest of ``cand`` for which ``holds(subset)`` (true of ``cand`` as a whole):
    the step still fails with only these rows, or clears with only these norms switched.
    One culprit: only the first half is tried at each level (the other must hold it), and
    the result is confirmed once: log2(n) + 1 calls. If the confirmation fails (it needs
    members of both halves), each half is minimized with the other held."""

    def fast(c: list) -> list:
        while len(c) > 1:
            a, b = c[: len(c) // 2], c[len(c) // 2 :]
            c = a if holds(frozenset(a)) else b
        return c

    one = fast(cand)
    if len(cand) == 1 or holds(frozenset(one)):
        return one

    def shrink(c: list, held: frozenset) -> list:
        if len(c) <= 1:
            return c
        a, b = c[: len(c) // 2], c[len(c) // 2 :]
        if holds(held | frozenset(a)):
            return shrink(a, held)
        if holds(held | frozenset(b)):
            return shrink(b, held)
        ka = shrink(a, held | frozenset(b))
        return ka + shrink(b, held | frozenset(ka))

    return shrink(cand, frozenset())


def row_hash(batch: Any, j: int) -> str:
    """Row ``j``'s content hash in any batch layout: SHA-256 over each of its tensors' row
    (dtype, shape and bytes, in the batch's order), first 16 hex digits."""
    import hashlib

    import torch

    n, h = rows_of(batch), hashlib.sha256()

    def walk(b: Any) -> None:
        if isinstance(b, torch.Tensor) and b.dim() and b.shape[0] == n:
            t = b[j].detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(b, dict):
            for k in b:
                walk(b[k])
        elif isinstance(b, (list, tuple)):
            for v in b:
                walk(v)

    walk(batch)
    return h.hexdigest()[:16]


def data(bundle: Path, code: CodeChoice = NO_CODE) -> dict[str, Any]:
    """The step's sequences that alone still fail it, by rank, micro-batch, row, data
    position, training block index (our corpus; None for a loader we do not own) and
    content hash. ``code``: what a model we did not build may import."""
    from stabilize.data import block_hash
    from stabilize.replay.bundle_files import open_bundle
    from stabilize.replay.core import _ranks

    bundle = open_bundle(bundle)  # checked once, every replay from the same verified bytes
    first = replay(bundle, code=code)
    ranks = _ranks(bundle)
    rows = [(r["rank"], m, j) for r in ranks for m, b in enumerate(recorded_batches(r))
            for j in range(rows_of(b))]  # fmt: skip
    out: dict[str, Any] = {"rows": len(rows), "failing": fails(first), "replays": 1}
    if not out["failing"]:
        return {**out, "culprits": None}
    memo: dict[frozenset, bool] = {}

    def fails_with(subset: frozenset) -> bool:
        if subset not in memo:
            out["replays"] += 1
            memo[subset] = fails(replay(bundle, rows=subset, code=code))
        return memo[subset]

    found = minimize(rows, fails_with)
    by_rank = {r["rank"]: r for r in ranks}
    culprits = []
    for rank, m, j in sorted(found):
        r = by_rank[rank]
        ours = r.get("items") is not None  # our corpus: the block index and its hash
        culprits.append({
            "rank": rank, "micro": m, "row": j, "data_step": r["positions"][m],
            "index": r["items"][m][j] if ours else None,
            "hash": block_hash(r["x"][m][j], r["y"][m][j]) if ours
            else row_hash(recorded_batches(r)[m], j),
        })  # fmt: skip
    return {**out, "culprits": culprits, "ours": all(r.get("items") is not None for r in ranks)}


def skip_override(culprits: list[dict]) -> str:
    """The Hydra override that skips exactly those sequences in another run."""
    return "++data.skip_items=[" + ",".join(f"'{c['index']}:{c['hash']}'" for c in culprits) + "]"


def record(bundle: Path, culprits: list[dict]) -> Path | None:
    """Add the culprits to the bundle's run dir's ``skipped_items.json`` (the entries
    already there stay). None when the bundle is not inside a run dir."""
    from stabilize.stability.controller import add_skipped_items

    run_dir = bundle.resolve().parent.parent
    if bundle.resolve().parent.name != "bundles" or not (run_dir / "config.json").is_file():
        return None
    return add_skipped_items(run_dir, [{**c, "bundle": bundle.name} for c in culprits])


def live_class(bundle: Path) -> str | None:
    """The class the live run gave the bundled fault (classify.py: transient, deterministic,
    data), from the step's events the bundle keeps; None where it gave none (rollback or
    classification off, no other batch to tell model from data)."""
    from stabilize.replay.bundle_files import open_bundle

    events = open_bundle(bundle).meta["events"]
    classed = (e["extra"].get("class") for e in events if isinstance(e.get("extra"), dict))
    return next((c for c in classed if c), None)


# what the run's own re-run saw, for a class that is not data-linked
NOT_DATA = {
    "deterministic": "the step failed again on the next micro-batches, replayed from the same "
    "weights: the model's state or numerics, not these sequences",
    "transient": "the step did not fail again when the run replayed it: not these sequences",
}


def data_main(bundle: Path, code: CodeChoice = NO_CODE, force: bool = False) -> int:
    """``force`` (``--record``): record the sequences even where the live run classed the
    fault as not data-linked."""
    cls = live_class(bundle)
    b = data(bundle, code)
    head = f"data bisection over {b['rows']} sequences, {b['replays']} replays"
    if b["culprits"] is None:
        print(f"{head}: the step does not fail in the replay (nothing to bisect)")
        return 1
    if b["ours"]:
        names = "; ".join(
            f"block {c['index']} (hash {c['hash']}; rank {c['rank']}, data position "
            f"{c['data_step']}, row {c['row']})"
            for c in b["culprits"]
        )
    else:  # a loader we do not own: named by its position in the run and the row's content
        names = "; ".join(
            f"row {c['row']} of the loader's batch {c['data_step']} (counted from 0 over the "
            f"run; rank {c['rank']}; content hash {c['hash']})"
            for c in b["culprits"]
        )
    print(f"{head}: the step fails with {len(b['culprits'])} of them: {names}")
    if cls in NOT_DATA and not force:
        # skipping data changes what every later resume trains on: a tool that edits the
        # run's future takes the run's own verdict over a bisection that any row can pass
        # when the whole model fails
        norms = cls == "deterministic"
        again = f"stabilize-replay --bisect {code_flags(code)}{bundle}"
        hint = f"the norms to switch, if any: {again}; " if norms else ""
        print(f"not recorded: the run classed this fault {cls} ({NOT_DATA[cls]}); skipping "
              f"them would change what a resume trains on, not the fault ({hint}--record "
              "records them anyway)")  # fmt: skip
        return 1
    path = record(bundle, b["culprits"])
    if not b["ours"]:
        where = f"recorded in {path}; " if path is not None else ""
        print(f"{where}the harness does not own this loader and does not skip them: drop "
              "them from your data (stabilize.replay.bisect.row_hash(batch, row) is the "
              "content hash)")  # fmt: skip
        return 0
    if path is not None:
        print(f"recorded in {path}: the run's resume steps over them, in every epoch")
    print(f'other runs on this corpus: "{skip_override(b["culprits"])}"')
    return 0
