"""The loss-spike detector sees a spike in the first steps of a run and stays quiet through a
healthy run's early descent. Real runs: the same tiny config twice, once with a
real bad update (the gradients of step 12 multiplied by 300, clipping off: the next losses
jump), once without it (``fault.enabled=false``). The spike is checked by hand against the
run's own logged losses: above 1.5x the median of the losses before it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from test_fault_registry import ScaleLoss

from stabilize.faults import register_fault, unregister_fault
from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics

FIRE = 12  # early: the old 50-step warm-up could not have judged it
COMMON = [
    *FAST,
    "logger=none",
    "trainer.max_steps=30",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    "rollback=off",  # the chain as it happens: events only
    "fault.kind=scale_loss",
    f"fault.step={FIRE}",
    "+fault.scale=3",
    "monitor.grad_spike.enabled=false",  # the loss's detector alone
]


def _run(d: Path, extra: list[str]) -> tuple[dict[int, float], list[dict]]:
    run(compose_run(d, [*COMMON, *extra]))
    losses = {int(r["train/step"]): r["train/loss_step"]
              for r in read_csv_metrics(d) if "train/loss_step" in r}  # fmt: skip
    f = d / "events.jsonl"  # a run with no event writes none
    ev = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
    return losses, [e for e in ev if e["monitor"] == "loss_spike"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spike")
    register_fault(ScaleLoss)
    try:
        return _run(root / "healthy", ["fault.enabled=false"]), _run(root / "spiked", [])
    finally:
        unregister_fault(ScaleLoss.kind)


def test_a_healthy_early_descent_raises_no_spike(runs):
    (losses, spikes), _ = runs
    assert losses[1] - losses[FIRE] > 1.0  # it does descend: over a nat by the fault's step
    assert spikes == []


def test_an_early_spike_is_seen_at_its_step(runs):
    (healthy, _), (losses, spikes) = runs
    assert spikes, "no loss_spike event"
    first = spikes[0]["step"]
    assert first == FIRE and [e["step"] for e in spikes] == [FIRE]  # that step, once
    before = statistics.median(losses[s] for s in range(1, first))
    assert losses[first] > 1.5 * before  # a spike by hand: the detector's ratio test
    assert losses[first] > 1.5 * healthy[first]  # and against the healthy run, same step
    # the same steps of the healthy run, judged by the same detector, were quiet
    assert all(healthy[s] < 1.5 * before for s in range(first, first + 3))
