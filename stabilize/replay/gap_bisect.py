"""``stabilize-replay --gap RUN --reference REF...``: the fewest precision sites whose switch
to fp32 closes a run's gap to its reference (docs/design-precision.md section 3).

1. The judge (report/gap.py) first: a run whose gap is inside the seed noise has nothing
   significant to close, and the bisection says so without a replay.
2. A window of W model steps is replayed from the run's last checkpoint at or before the
   step the gap opens (its initial state when there is none: the same seed builds the same
   model), in this process (a run of several ranks with their global batch), with the
   run's own config (``trainer.stop_at_step``: the LR
   schedule stays the run's), each replay scored on the held-out batches
   (``final_eval.json``'s ``batch_loss``). Replay A switches nothing; replay B switches
   every site to fp32: the model's (``model/fp32_sites.py``: its norms, linear layers and
   attention cores) and the run's (``run_sites``: the loss, the master weights, the
   optimizer's state, where they are 16-bit).
   The window's gap is G = mean over batches of (A - B), its error the batches' standard
   error; G within two of them: not a precision gap at these sites.
3. A set S of sites closes ``(A - S) / G`` of it; ``minimize`` (the norm and data
   bisections' halving) finds the fewest sites that close >= ``share`` (80%). Replays are
   counted: A, B, one per halving, a confirmation: at most ceil(log2(sites)) + 3 for one
   culprit. The overrides that apply the result (``override``): ``++model.fp32_modules=
   [...]`` for the modules, and each run site's own key.

The replays are deterministic (the same state, data order and seeds): what differs between
them is the switch alone, so their differences need no seed band. The gap itself is also
given in the judge's units of seed noise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from stabilize.exits import EXIT_CONFIG
from stabilize.replay.bisect import minimize
from stabilize.report.gap import bisection_words, tail_words
from stabilize.report.rundirs import check_run_dirs


def _loads(saved: dict):
    """A run dir's config as a replay rebuilds it (``check_run_dirs``' ``loads``)."""
    from stabilize.run.config import RunConfig

    return RunConfig.from_saved(saved)


# sites of the run, not of a module, each switched back by its own key
LOSS = "loss"  # model.loss_dtype=logits -> fp32
MASTER = "optim.master"  # bf16-true without a master copy -> optim.master_dtype=fp32
OPTIM_STATE = "optim.state"  # optim.state_dtype=bf16 -> fp32
RUN_SITES = (LOSS, MASTER, OPTIM_STATE)


def run_sites(cfg) -> list[str]:
    """The run's precision sites besides the model's modules, where they are not fp32: the
    loss, the master weights (bf16-true without an fp32 master copy: its AdamW moments are
    bf16 too, and an fp32 master brings fp32 moments with it), the optimizer's state. (The
    gradient all-reduce is a site of a multi-rank run; the window replays run in one
    process, where there is no all-reduce to switch.)"""
    out = [LOSS] if cfg.model.loss_dtype != "fp32" else []
    bf16_weights = cfg.precision.name == "bf16-true" and cfg.optim.master_dtype == "param"
    if bf16_weights and cfg.trainer.strategy != "fsdp":  # no fp32 masters under FSDP (yet)
        out.append(MASTER)
    return out + ([OPTIM_STATE] if cfg.optim.state_dtype != "fp32" else [])


def _checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's step checkpoints by model step (``step-NNNNNN.ckpt``)."""
    out = {}
    for p in (run_dir / "checkpoints").glob("step-*.ckpt"):
        try:
            out[int(p.stem.split("-")[1])] = p
        except (IndexError, ValueError):
            continue
    return out


def train_losses(run_dir: Path) -> dict[int, float]:
    """{model step: training loss} from a run dir's CSV (every version, the later value of
    a step kept)."""
    import csv

    out: dict[int, float] = {}
    for f in sorted((run_dir / "csv").glob("version_*/metrics.csv"),
                    key=lambda p: int(p.parent.name.split("_")[1])):  # fmt: skip
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss") and row.get("train/step"):
                    out[int(float(row["train/step"]))] = float(row["train/loss"])
    return out


class Window:
    """Replays of W steps of ``run_dir`` from ``start`` with sets of sites in fp32."""

    def __init__(self, run_dir: Path, start: int, steps: int, work: Path):
        from stabilize.run.config import RunConfig

        self.saved = json.loads((run_dir / "config.json").read_text())
        self.cfg = RunConfig.from_saved(self.saved)
        self.start, self.steps, self.work = start, steps, work
        self.ckpt = _checkpoints(run_dir).get(start) if start else None
        if self.ckpt is not None:  # a damaged one: one line naming it, before any replay
            from stabilize.lit.checkpoint import verify_checkpoint

            verify_checkpoint(self.ckpt)  # DamagedFile, a ValueError
        # a run of several ranks replays in this one process with their global batch: the
        # same items per step (data/sampler.py), the checkpoint whole (DDP) or resharded
        # on load (FSDP's DCP directory)
        reps = run_dir / "replicas.json"
        self.world = int(json.loads(reps.read_text()).get("world_size", 1)) if reps.exists() else 1
        self.replays = 0
        self.last: dict[str, Any] = {}  # the last replay's final_eval.json
        self.curve: dict[int, float] = {}  # the last replay's training loss per model step

    def score(self, fp32: frozenset[str], precision: dict | None = None, edit=None,
              what: str = "", callbacks=()) -> list[float]:  # fmt: skip
        """The held-out batch losses after the window, ``fp32`` switched (``precision``:
        another ``precision`` section for the window, the tail's; ``edit``: called with the
        replay's config values to change them, ``what`` says how in its line). The
        training loss of every step of the window is kept in ``self.curve``; ``callbacks``:
        Lightning callbacks for the replay's run."""
        from stabilize.lit.runner import run
        from stabilize.run.config import RunConfig

        self.replays += 1
        values = json.loads(json.dumps(self.saved))
        out = self.work / f"replay-{self.replays}"
        values.update(run_dir=str(out), resume=str(self.ckpt) if self.ckpt else "none")
        values["model"]["fp32_modules"] = sorted(set(fp32) - set(RUN_SITES))
        if LOSS in fp32:
            values["model"]["loss_dtype"] = "fp32"
        if MASTER in fp32:
            values["optim"]["master_dtype"] = "fp32"
        if OPTIM_STATE in fp32:  # the optimizer's state back at fp32
            values["optim"]["state_dtype"] = "fp32"
        if precision is not None:
            values["precision"] = precision
        if edit is not None:
            edit(values)
        if self.world > 1:
            values["data"]["batch_size"] = int(values["data"]["batch_size"]) * self.world
            values["trainer"].update(devices=1, num_nodes=1)
            if values["trainer"].get("strategy") != "fsdp":  # FSDP2 runs on one rank too
                values["trainer"]["strategy"] = "auto"
        values["logger"].update(wandb=False, csv=True)  # every step's loss: self.curve
        values["trainer"].update(stop_at_step=self.start + self.steps, progress="none",
                                 log_every_n_steps=1)  # fmt: skip
        values.setdefault("monitor", {}).setdefault("curvature", {})["enabled"] = False
        log = self.work / "replays.log"  # the replays' own output: a line each here instead
        chatter = logging.getLogger("lightning.pytorch")  # its restore lines go to a handler
        level = chatter.level
        try:
            with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                chatter.setLevel(logging.WARNING)
                run(RunConfig.from_saved(values), callbacks)
        except BaseException:  # what the replay printed, before its traceback
            said = "".join(log.read_text().splitlines(True)[-20:])
            if said:
                print(said, end="", file=sys.stderr)
            raise
        finally:
            chatter.setLevel(level)
        score = self.last = json.loads((out / "final_eval.json").read_text())
        self.curve = train_losses(out)
        which = "nothing" if not fp32 else f"{len(fp32)} site{'s' if len(fp32) > 1 else ''}"
        prec = "" if precision is None else f" under {precision['name']}"
        what = what or f"with {which} in fp32{prec}"
        print(f"  replay {self.replays}: steps {self.start}-{self.start + self.steps} {what}: "
              f"held-out loss {score['loss']:.4f}", flush=True)  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        if not score.get("batch_loss"):
            raise ValueError("the replay's held-out score has no per-batch losses")
        return score["batch_loss"]


def _paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a - b) over the batches and its standard error."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return statistics.fmean(d), se


def gap_bisect(run_dir: Path, refs: list[Path], window: int | None = None, share: float = 0.8,
               work: Path | None = None, judged=None) -> dict[str, Any]:  # fmt: skip
    """The judge, then the bisection (see the module doc); a dict of what was found.
    ``judged(lines)``: called with the judge's lines before any replay. ``ValueError``, before
    anything is read further, where a dir is not a finished, scored run (check_run_dirs)."""
    from stabilize.model import build_model
    from stabilize.model.fp32_sites import sites
    from stabilize.report.gap import judge
    from stabilize.report.load import load_run_dir

    check_run_dirs(run_dir, refs, loads=_loads)
    j = judge(load_run_dir(run_dir), [load_run_dir(r) for r in refs])
    out: dict[str, Any] = {"judge": j.lines(), "real": j.primary.real if j.primary else None,
                           "replays": 0, "culprits": None}  # fmt: skip
    if judged is not None:
        judged(out["judge"])
    if not out["real"]:
        return out
    steps = int(json.loads((run_dir / "config.json").read_text())["trainer"]["max_steps"])
    opens = j.steps.opens_at or steps
    start = max((s for s in _checkpoints(run_dir) if s < opens), default=0)
    w = min(window or 50, steps - start)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        win = Window(run_dir, start, w, Path(tmp))
        all_sites = sites(build_model(win.cfg.model)) + run_sites(win.cfg)
        out.update(start=start, window=w, sites=all_sites, share=share)
        a = win.score(frozenset())
        b = win.score(frozenset(all_sites))
        g, se = _paired(a, b)
        out.update(gap=g, gap_se=se, noise=j.primary.noise)
        if g <= 2 * se:
            out.update(replays=win.replays, culprits=[])
            return out
        scores: dict[frozenset, list[float]] = {frozenset(): a, frozenset(all_sites): b}

        def losses(subset: frozenset) -> list[float]:
            if subset not in scores:
                scores[subset] = win.score(subset)
            return scores[subset]

        def closes(subset: frozenset) -> bool:
            return _paired(a, losses(subset))[0] / g >= share

        found = sorted(minimize(all_sites, closes), key=all_sites.index)
        closed, closed_se = _paired(a, losses(frozenset(found)))
        out.update(replays=win.replays, culprits=found, closed=closed / g,
                   closed_se=closed_se / g)  # fmt: skip
    return out


RUN_OVERRIDES = {
    LOSS: "model.loss_dtype=fp32",
    MASTER: "optim.master_dtype=fp32",
    OPTIM_STATE: "optim.state_dtype=fp32",
}


def override(culprits: list[str]) -> str:
    """The Hydra overrides that run exactly those sites in fp32."""
    mods = [c for c in culprits if c not in RUN_OVERRIDES]
    out = [RUN_OVERRIDES[c] for c in culprits if c in RUN_OVERRIDES]
    return " ".join(([f'"++model.fp32_modules=[{",".join(mods)}]"'] if mods else []) + out)


def gap_main(run_dir: Path, refs: list[Path], window: int | None, share: float) -> int:
    def judged(lines: list[str]) -> None:  # the header only once the dirs are accepted
        print(f"gap of {run_dir} to {len(refs)} reference seed(s):", flush=True)
        print("\n".join(f"  {line}" for line in lines), flush=True)

    try:
        b = gap_bisect(run_dir, refs, window, share, judged=judged)
    except ValueError as e:  # a dir that is no finished run, or a replay that cannot score
        print(f"stabilize-replay: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if not b["real"]:
        print("gap bisection: nothing significant to close (the run's gap is not a real gap "
              "against the reference's seed noise)")  # fmt: skip
        return 1
    b["override"] = override(b["culprits"]) if b["culprits"] else None
    _keep(run_dir, "bisection.json", {**b, "references": _names(refs)})
    print(bisection_words(b))
    if not b["culprits"]:
        return 1
    print(f"run with: {b['override']}")
    return 0


def _names(refs: list[Path]) -> list[str]:
    """The reference's run dirs as absolute paths, sorted: what a finding was made against."""
    return sorted(str(Path(r).resolve()) for r in refs)


def _keep(run_dir: Path, name: str, found: dict) -> None:
    """``RUN/gap/<name>``: what was found, which ``stabilize-gap RUN`` shows beside its
    judgement (written whole: a temp file renamed)."""
    from stabilize.io import atomic_write_text

    (run_dir / "gap").mkdir(exist_ok=True)
    atomic_write_text(run_dir / "gap" / name, json.dumps(found, indent=1, default=str))


# ---- the tail counterfactual: the rest of the run at the reference's precision ---------------
def tail(run_dir: Path, refs: list[Path], start: int) -> dict[str, Any]:
    """Fork the run at model step ``start`` (a step checkpoint of it, or 0: its initial
    state) and train to its end at the reference's precision (its ``precision`` section,
    every site in fp32, so no emulated rounding either); the share of the run's held-out gap
    to the reference mean that this recovers, ``(run - tail) / (run - reference)``, with its
    error from the reference's seed noise. The judge (report/gap.py) first, as ``--gap``
    does: a gap inside the seed noise (or one it cannot tell) has no share to recover, and
    the dict says so (``real``, ``judged``: the judge's words) without a replay.
    ``ValueError``, before any replay, where a dir is not a finished, scored run
    (check_run_dirs) or ``start`` has no checkpoint to fork from."""
    from stabilize.model import build_model
    from stabilize.model.fp32_sites import sites
    from stabilize.report.gap import judge
    from stabilize.report.load import load_run_dir

    check_run_dirs(run_dir, refs, loads=_loads)
    if len(refs) < 2:  # before the replay: its share is stated +- the reference's seed noise
        raise ValueError(f"--tail needs 2 or more --reference run dirs (their seed noise "
                         f"bounds the share recovered); got {len(refs)}")  # fmt: skip
    run_score = json.loads((run_dir / "final_eval.json").read_text())["loss"]
    ref_scores = [json.loads((r / "final_eval.json").read_text())["loss"] for r in refs]
    ref_precision = json.loads((refs[0] / "config.json").read_text())["precision"]
    steps = int(json.loads((run_dir / "config.json").read_text())["trainer"]["max_steps"])
    have = sorted(s for s in _checkpoints(run_dir) if s < steps)  # the end: nothing to retrain
    if start and start not in have:
        why = f"{run_dir} has no checkpoint at model step {start}"
        if start >= steps:
            why = f"{run_dir} ends at model step {steps}, nothing after it to retrain"
        kept = (f" or a step it kept a checkpoint at: {', '.join(map(str, have))}" if have else
                " (it kept no step checkpoint before its end)")  # fmt: skip
        raise ValueError(f"--tail={start} is not allowed: {why}; allowed: 0 (its initial "
                         f"state){kept}")  # fmt: skip
    out: dict[str, Any] = {"start": start, "end": steps, "run": run_score,
                           "reference": statistics.fmean(ref_scores),
                           "precision": ref_precision["name"]}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        win = Window(run_dir, start, steps - start, Path(tmp))  # a damaged checkpoint: here
        # the held-out gap judged by --gap's rule: a share of a gap inside the seed noise
        # is a share of noise (it read 148% +- 52% on one such run)
        g = judge(load_run_dir(run_dir), [load_run_dir(r) for r in refs]).heldout
        out.update(real=g.real, judged=g.words())
        if not g.real:
            return {**out, "tail": None, "share": None, "share_se": None}
        every = frozenset(sites(build_model(win.cfg.model)) + run_sites(win.cfg))
        win.score(every, ref_precision)
        forked = win.last["loss"]  # per token over the split, as the run's own score
    gap = run_score - out["reference"]
    return {**out, "tail": forked, "share": (run_score - forked) / gap,
            "share_se": g.noise / abs(gap)}  # fmt: skip


def tail_main(run_dir: Path, refs: list[Path], start: int) -> int:
    t = tail(run_dir, refs, start)
    if t["real"]:  # a decline finds nothing: it leaves tail.json, as --gap its bisection.json
        _keep(run_dir, "tail.json", {**t, "references": _names(refs)})
    print(tail_words(t))
    return 0 if t["real"] else 1
