"""``stabilize-replay --spike RUN``: the damage of a loss spike the run survived, measured by
a counterfactual (docs/design-spikes.md section 4).

From the run's last step checkpoint before the spike (its initial state when there is
none), the window up to N steps after it is replayed in this process (gap_bisect.Window,
the run's own config and LR schedule) once as it happened and once per remedy:

- ``skip``: the spike's step as if its planted fault had not fired (``fault.enabled=false``
  for the window); a spike no fault planted: its batches never trained on (the
  ``skip_batch`` rung: the data positions of the spike's step skipped by the sampler from
  the window's start, the step training on the next batch, as a resume with them in
  ``skipped_batches.json`` would);
- ``clip``: the gradients clipped at a norm of 1 (``optim.grad_clip=1``);
- ``lower_lr``: the ladder's ``lower_lr`` rung after a rollback to the checkpoint: the LR
  scale multiplied by ``rollback.remedy.lower_lr.factor`` from there, warming back to the
  schedule after its ``recover_after`` steps, and a planted fault (transient: a rolled
  back spike does not recur) off; a spike no fault planted meets its own batch again, at
  the lower LR. The LR lives in the checkpoint's state, not in the config, so the replay
  sets the remedy's state on its module at the start.

Each branch is scored on the held-out batches (``final_eval.json``'s ``batch_loss``); the
damage is the as-happened branch's held-out loss minus the remedy's, paired by batch, with
its standard error, and in units of seed noise when reference seeds are given (the judge's
``s sqrt(1 + 1/n)``, report/gap.py): **lasting damage** outside the judge's band (t(0.975,
n-1) of those units), else none. The recovery: the first step after the spike from which
the as-happened branch's training loss stays within the reference's per-step band of the
remedy's (each smoothed over 5 steps), judged at the steps every reference logged and
counted from the step after the spike: "back after K steps" (0: never outside the band
where judged), or "not back within N".
The remedy with the least damage left, then the fastest recovery, is named.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning as L

from stabilize.replay.gap_bisect import (
    Window,
    _checkpoints,
    _keep,
    _loads,
    _paired,
    train_losses,
)
from stabilize.report.gap import t975
from stabilize.report.rundirs import check_run_dirs

SMOOTH = 5  # steps the per-step losses are averaged over for the recovery


def _skip(values: dict) -> None:
    values["fault"]["enabled"] = False


def _clip(values: dict) -> None:
    values["optim"]["grad_clip"] = 1.0


class _LowerLR(L.Callback):
    """The lower_lr rung, as a rollback to the replay's start would apply it."""

    def on_train_start(self, trainer, pl_module):
        from stabilize.rollback.remedies import LowerLR, LowerLRConfig

        st = pl_module.train_state
        cfg = pl_module.cfg.rollback.remedy.get("lower_lr") or LowerLRConfig()
        LowerLR().apply(st, cfg)
        st.lr_since = st.model_step  # as the controller stamps a rollback


class _SkipSpikeBatch(L.Callback):
    """The skip_batch rung for a spike no fault planted: the data positions of the spike's
    step, counted from the window's start over the positions the run already skips, are
    skipped by the sampler (``TrainState.skipped``, which it shares)."""

    def __init__(self, spike: int):
        self.spike = spike

    def on_train_start(self, trainer, pl_module):
        st = pl_module.train_state
        per_step = int(pl_module.cfg.optim.accumulate_grad_batches)
        first = (self.spike - 1 - st.model_step) * per_step  # micro-steps before the spike's
        pos, seen, found = st.data_step, 0, []
        while len(found) < per_step:
            if pos not in st.skipped:
                if seen >= first:
                    found.append(pos)
                seen += 1
            pos += 1
        st.skipped |= set(found)  # in place: the sampler holds this set
        self.positions = found


# name -> (its words, an edit of the replay's config, its callbacks), for a planted spike
# and for one no fault planted
REMEDIES = {
    "skip": (("the spike's step without its planted fault", _skip, ()),
             ("the spike's batch skipped, the skip_batch rung", None, (_SkipSpikeBatch,))),
    "clip": (("gradients clipped at norm 1", _clip, ()),) * 2,
    "lower_lr": (("a rollback with the LR lowered, the lower_lr rung", _skip, (_LowerLR,)),
                 ("a rollback with the LR lowered, the lower_lr rung", None, (_LowerLR,))),
}  # fmt: skip


def spike_step(run_dir: Path) -> int:
    """The first loss or grad-norm spike of the run (events.jsonl), else the step of its
    planted grad_spike fault; ValueError when there is neither."""
    events = run_dir / "events.jsonl"
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e.get("monitor") in ("loss_spike", "grad_spike"):
                return int(e["step"])
    fault = json.loads((run_dir / "config.json").read_text()).get("fault", {})
    if fault.get("enabled") and fault.get("kind") == "grad_spike":
        return int(fault["step"])
    raise ValueError(f"{run_dir}: no spike to measure (no loss_spike or grad_spike event, no "
                     "planted grad_spike fault); give its step with --at")  # fmt: skip


def _smooth(curve: dict[int, float], steps: list[int]) -> list[float]:
    out = []
    for i in range(len(steps)):
        win = [curve[s] for s in steps[max(0, i - SMOOTH + 1) : i + 1] if s in curve]
        out.append(statistics.fmean(win) if win else math.nan)
    return out


def _band(refs: list[Path], steps: list[int]) -> dict[int, float] | None:
    """{step: the half-width of the reference's band for one more seed there}, at the steps
    of ``steps`` every reference logged (each seed's loss averaged over its last SMOOTH
    logged points there); None with fewer than 3 seeds."""
    curves = [train_losses(r) for r in refs]
    if len(curves) < 3:
        return None
    common = [s for s in steps if all(s in c for c in curves)]
    out = {}
    for i, s in enumerate(common):
        win = common[max(0, i - SMOOTH + 1) : i + 1]
        means = [statistics.fmean(c[t] for t in win) for c in curves]
        n = len(means)
        out[s] = t975(n - 1) * statistics.stdev(means) * math.sqrt(1 + 1 / n)
    return out


def counterfactual(
    run_dir: Path, refs: list[Path], at: int | None = None, steps: int = 50,
    remedies: tuple[str, ...] = tuple(REMEDIES),
) -> dict[str, Any]:  # fmt: skip
    """The branches' held-out damage and recovery (see the module doc), as a dict.
    ``ValueError``, before any replay, where the run is not a run dir of ours, a reference
    not a finished, scored run (check_run_dirs), or the spike is not before the run's end."""
    # the run itself need not have finished: its branches are replayed from a checkpoint
    check_run_dirs(run_dir, refs, run_finished=False, loads=_loads)
    saved = json.loads((run_dir / "config.json").read_text())
    spike = spike_step(run_dir) if at is None else at
    last = int(saved["trainer"]["max_steps"])
    if spike >= last:  # no step after it to replay
        said = f"--at={spike} is not allowed" if at is not None else f"its spike is at {spike}"
        raise ValueError(f"{said}: {run_dir} ends at model step {last}, no step after it to "
                         f"replay; allowed: --at a model step from 1 to {last - 1}")  # fmt: skip
    end = min(spike + steps, last)
    start = max((s for s in _checkpoints(run_dir) if s < spike), default=0)
    planted = bool(saved.get("fault", {}).get("enabled")) and saved["fault"].get("kind") != "none"
    todo = list(remedies)
    out: dict[str, Any] = {"spike": spike, "start": start, "end": end, "branches": {},
                           "planted": planted,
                           "tokens_per_step": int(saved["data"]["batch_size"])
                           * int(saved["model"]["block_size"])
                           * int(saved["optim"]["accumulate_grad_batches"])}  # fmt: skip
    ref_scores = [json.loads((r / "final_eval.json").read_text())["loss"] for r in refs]
    noise = (statistics.stdev(ref_scores) * math.sqrt(1 + 1 / len(ref_scores))
             if len(ref_scores) >= 3 else None)  # fmt: skip
    out["noise"] = noise
    window = list(range(spike + 1, end + 1))  # after the spike's own step
    band = _band(refs, window)
    out["judged_steps"] = len(band) if band else 0
    with tempfile.TemporaryDirectory() as tmp:
        win = Window(run_dir, start, end - start, Path(tmp))
        out["tokens_per_step"] *= win.world  # data.batch_size is each rank's
        happened = win.score(frozenset(), what="as it happened")
        a_curve = _smooth(win.curve, window)
        for name in todo:
            words, edit, callbacks = REMEDIES[name][0 if planted else 1]
            made = [c(spike) if c is _SkipSpikeBatch else c() for c in callbacks]
            b = win.score(frozenset(), edit=edit, what=f"with {words}", callbacks=made)
            skipped = [m.positions for m in made if isinstance(m, _SkipSpikeBatch)]
            gap, se = _paired(happened, b)
            b_curve = _smooth(win.curve, window)
            back = None
            if band:
                judged = [window.index(s) for s in band]
                inside = [abs(a_curve[i] - b_curve[i]) <= band[window[i]] for i in judged]
                out_at = [k for k, ok in enumerate(inside) if not ok]
                if not out_at:
                    back = 0  # never outside the band at a step it is judged at
                elif out_at[-1] + 1 < len(judged):  # back at the next judged step, for good
                    back = window[judged[out_at[-1] + 1]] - window[0]
            sigma = gap / noise if noise else None
            # worse than the remedy by more than the judge's band (or, with no seed noise,
            # by more than two standard errors of the paired batches)
            lasting = gap > 0 and (sigma > t975(len(ref_scores) - 1)
                                   if sigma is not None else gap > 2 * se)  # fmt: skip
            out["branches"][name] = {"words": words, "gap": gap, "gap_se": se, "sigma": sigma,
                                     "lasting": lasting, "back_after": back}  # fmt: skip
            if skipped:
                out["branches"][name]["skipped_data_steps"] = skipped[0]
    out["replays"] = 1 + len(todo)
    return out


def fastest(found: dict[str, Any]) -> str | None:
    """The remedy that left the least damage, then recovered soonest."""
    b = found["branches"]
    if not b:
        return None
    return min(b, key=lambda k: (-b[k]["gap"], b[k]["back_after"] if b[k]["back_after"]
                                 is not None else math.inf))  # fmt: skip


def spike_main(run_dir: Path, refs: list[Path], at: int | None, steps: int) -> int:
    found = counterfactual(run_dir, refs, at, steps)
    _keep(run_dir, "spike.json", found)
    s, e, tokens = found["spike"], found["end"], found["tokens_per_step"]
    print(f"spike counterfactual: the spike at step {s}; steps {found['start']}-{e} replayed "
          f"{found['replays']} times from the run's last checkpoint before it; held out at "
          f"step {e}, {e - s} steps after the spike")  # fmt: skip
    for name, b in found["branches"].items():
        dmg = f"{b['gap']:+.4f} +- {b['gap_se']:.4f} nats"
        if b["sigma"] is not None:
            dmg += f", {b['sigma']:+.1f} sigma of seed noise"
        said = "lasting damage" if b["lasting"] else "no lasting damage"
        if b["back_after"] is not None:
            rec = (f"its training loss back within the reference's per-step band of the "
                   f"remedy's {b['back_after']} steps ({b['back_after'] * tokens:,} tokens) "
                   f"after the spike (judged at the {found['judged_steps']} steps every "
                   "reference logged)")  # fmt: skip
        elif found["noise"] is None:
            rec = "recovery not judged (it needs 3 reference seeds)"
        else:
            rec = f"its training loss not back within the reference's band in {e - s} steps"
        print(f"  {name} ({b['words']}): as it happened minus it: {dmg}: {said}; {rec}")
    best = fastest(found)
    if best is not None:
        print(f"best remedy: {best} ({found['branches'][best]['words']}): the least damage left, "
              "then the soonest back")  # fmt: skip
    return 0
