"""A ladder that knows what a rung changes: the diagnosed site orders the rungs, a rung that
would change nothing is passed over and named, and a lowered LR warms back to its schedule
after a healthy window (hand-computed scales; a real Trainer for the end to end)."""

from __future__ import annotations

import json

import pytest

from stabilize.model import GPT, GPTConfig
from stabilize.monitors.events import Event
from stabilize.norms import set_reduction_dtype
from stabilize.rollback import RollbackConfig, RollbackPolicy, Snapshot, SnapshotRing
from stabilize.rollback.remedies import LowerLRConfig, get_remedy, lr_scale_at
from stabilize.run.summary import changed_config
from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics

LADDER = ["retry", "skip_batch", "lower_lr", "fp32_reduction"]


def _policy():
    pol, ring = RollbackPolicy(RollbackConfig(ladder=LADDER, max_rollbacks=10)), SnapshotRing(3)
    ring.push(Snapshot(0, {}))
    return pol, ring


def _event(monitor, step=6):
    return Event("rollback", monitor, step, "", extra={"class": "deterministic"})


def test_an_overflowed_reduction_takes_fp32_reduction_before_lower_lr():
    pol, ring = _policy()
    first, second = (pol.decide(_event("overflow"), ring) for _ in range(2))
    assert (first.remedy, second.remedy) == ("fp32_reduction", "lower_lr")
    assert pol.decide(_event("overflow"), ring).action == "abort"
    # another site keeps the ladder's own order
    pol, ring = _policy()
    assert pol.decide(_event("nonfinite"), ring).remedy == "lower_lr"


def test_a_rung_that_would_change_nothing_is_passed_over_and_named():
    model = GPT(GPTConfig(norm={"reduction_dtype": "fp32"}))
    fp32 = get_remedy("fp32_reduction")

    class State:
        pass

    state = State()
    state.model = model
    assert fp32.unchanged(state, None) == "every norm already reduces in fp32"
    set_reduction_dtype(model, "fp16")
    assert fp32.unchanged(state, None) is None
    set_reduction_dtype(model, "fp32")
    pol, ring = _policy()

    def unchanged(rung):
        return fp32.unchanged(state, None) if rung == "fp32_reduction" else None

    d = pol.decide(_event("overflow"), ring, unchanged)
    assert d.remedy == "lower_lr" and d.skipped == [
        ("fp32_reduction", "every norm already reduces in fp32")
    ]
    # the next rollback for the same fault starts after both: nothing is left
    assert pol.decide(_event("overflow"), ring, lambda r: None).action == "abort"


def test_lr_scale_warms_back_after_the_healthy_window_by_hand():
    cfg = LowerLRConfig(factor=0.5, recover_after=10, warmup=4)
    # lowered at step 20: x0.5 through step 30, then 0.5 + 0.5 * t / 4 for t = step - 30
    assert [lr_scale_at(0.5, 20, s, cfg) for s in (20, 30, 31, 32, 34, 50)] == [
        0.5, 0.5, 0.625, 0.75, 1.0, 1.0,
    ]  # fmt: skip
    assert lr_scale_at(0.25, 20, 31, cfg) == pytest.approx(0.25 + 0.75 / 4)
    never = LowerLRConfig(recover_after=0)
    assert lr_scale_at(0.5, 20, 10_000, never) == 0.5
    assert lr_scale_at(1.0, None, 5, cfg) == 1.0


def test_a_lowered_lr_warms_back_in_a_real_run(tmp_path):
    """A persistent NaN at step 5 answered by lower_lr (the only rung): the LR is x0.5
    from the restored step until 6 healthy steps have passed, then ramps back over 3."""
    cfg = compose_run(
        tmp_path,
        [
            *FAST,
            "logger=none",
            "trainer.max_steps=20",
            "optim.warmup_steps=1",
            "optim.schedule=linear",
            "optim.min_lr_ratio=1.0",  # a flat schedule: the LR is the scale times lr
            "fault=nan_loss",
            "fault.step=5",
            "rollback.snapshot_every=2",
            "rollback.ladder=[lower_lr]",
            "rollback.classify=false",
            "rollback.remedy.lower_lr.recover_after=6",
            "rollback.remedy.lower_lr.warmup=3",
            "monitor.loss_spike.enabled=false",
        ],
    )
    out = run(cfg)
    assert changed_config(cfg, out["ended_with"]) == [
        f"optim.lr x0.5 after a rollback, warmed back to {cfg.optim.lr:g} (lower_lr)"
    ]
    # warmed back by the end: the summary says so instead of "optim.lr x0.5"
    assert out["model_step"] == 20 and out["ended_with"]["lr_scale"] == 1.0
    assert out["ended_with"]["lr_lowered"] == 0.5
    rows = read_csv_metrics(tmp_path)
    lr = {int(r["train/step"]): r["train/lr"] for r in rows if "train/lr" in r}
    base = lr[2]  # before the fault: the flat schedule
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    (rb,) = [e for e in events if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    since = rb["extra"]["restored_step"]
    # the LR logged at model step s was set for step s (a function of the model's step);
    # step `since` itself is logged twice (the faulty step's row, rewound), skip it
    for s, v in lr.items():
        if s == since:
            continue
        want = 1.0 if s < since else lr_scale_at(0.5, since, s, LowerLRConfig(0.5, 6, 3))
        assert v == pytest.approx(base * want, rel=1e-6), (s, v, base, want)
    assert lr[since + 6] == pytest.approx(base * 0.5) and lr[since + 9] == pytest.approx(base)
