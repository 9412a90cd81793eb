"""Each rollback told from the events (stabilize/report/rollbacks.py), checked against what
the run did: skip_data's skip is undone by a later rollback to the same snapshot, measured by
the batch the first step after each restore trains on."""

from __future__ import annotations

import json

import pytest

from stabilize.report import load_run_dir
from stabilize.report.rollbacks import rollbacks
from stabilize.stability import StabilityAbort
from stabilize.train import run

from conftest import FAST, compose_run

FAULT = 6  # persistent: every attempt at step 6 fails; the snapshot at step 4 is restored


def test_a_skip_undone_by_the_next_rollback_is_told_as_undone(tmp_path, capsys):
    cfg = compose_run(
        tmp_path,
        [
            *FAST,
            "logger=none",
            "trainer.max_steps=8",
            "trainer.val_check_interval=100",
            "fault=nan_loss",
            f"fault.step={FAULT}",
            "fault.persistent=true",
            "rollback.snapshot_every=2",
            "rollback.classify=false",  # the ladder as written, in order
            "rollback.ladder=[skip_data,lower_lr]",
            "rollback.max_rollbacks=2",
        ],
    )
    with pytest.raises(StabilityAbort):
        run(cfg)  # the persistent fault outlasts the ladder
    # the console's step lines are the kept trajectory's: none for a rolled-back attempt
    steps = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert steps and not any("loss nan" in x for x in steps), steps
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    rbs = rollbacks(events)
    assert [(rb.step, rb.restored_step, rb.remedy) for rb in rbs] == [
        (FAULT, 4, "skip_data"),
        (FAULT, 4, "lower_lr"),
    ]
    assert rbs[0].answered[0].startswith(f"nonfinite@{FAULT}")
    assert rbs[0].undone_by == 2 and rbs[1].undone_by is None
    # measured: step 5 follows each restore of the step-4 snapshot. Its loss (the restored
    # weights, before any update) is the original one again after rollback 2 (the data
    # position was restored), and not after rollback 1's skip (another batch)
    rows = load_run_dir(tmp_path).rows
    fifth = [r["train/loss"] for r in rows if r.get("train/step") == 5 and "train/loss" in r]
    assert len(fifth) == 3
    assert fifth[1] != fifth[0] and fifth[2] == fifth[0]


def test_a_lowered_lr_that_did_not_stop_the_fault_is_taken_back_by_the_next_rung(tmp_path):
    """A persistent fault: lower_lr (the LR halved) does not stop it, so the next rollback's
    rung takes it back (the LR scale is 1 again, said in its event); skip_data does not stop
    it either and is kept, with why."""
    cfg = compose_run(
        tmp_path,
        [*FAST, "logger=none", "trainer.max_steps=8", "trainer.val_check_interval=100",
         "fault=nan_loss", f"fault.step={FAULT}", "fault.persistent=true",
         "rollback.snapshot_every=2", "rollback.classify=false",
         "rollback.ladder=[lower_lr,skip_data,retry]", "rollback.max_rollbacks=3"],
    )  # fmt: skip
    with pytest.raises(StabilityAbort):
        run(cfg)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    rolled = [e["extra"] for e in events if e["monitor"] == "rollback" and e["kind"] == "rollback"]
    assert [x["remedy"] for x in rolled] == ["lower_lr", "skip_data", "retry"]
    assert "undone" not in rolled[0] and "kept" not in rolled[0]
    assert rolled[1]["undone"] == {"lower_lr": {"lr_scale": 1.0}}  # 0.5, taken back
    assert rolled[2]["kept"] == {"skip_data": "the batches it passed over are behind the run "
                                 "(never trained on)"}  # fmt: skip
