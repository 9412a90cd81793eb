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
