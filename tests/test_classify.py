"""Re-run classification, replica fingerprints and backward localization.

The 2-rank cases (each class on rank 1 of 2, the bitflip named by the replica check) are
in tests/test_stability.py's torchrun test, next to the other faults on two ranks.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_stability import BASE, events, kinds

from stabilize.monitors import Event
from stabilize.monitors.replicas import divergent
from stabilize.rollback import RollbackConfig, RollbackPolicy, Snapshot, SnapshotRing
from stabilize.stability.gather import fingerprint, fingerprint_chunks, join_chunks
from stabilize.train import run

from conftest import compose_run


def test_the_fingerprint_sees_every_single_bit_flip_exactly():
    """Each of the 32 bits of an fp32 element (and the 16 of a bf16 one), flipped alone in
    any parameter, changes the fingerprint by exactly +-2^bit (the integer reference), and
    the fingerprint survives its trip through four fp32 slots."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(37, 11, generator=g), torch.randn(5, generator=g).bfloat16()]
    base = int(fingerprint(params))
    assert join_chunks(fingerprint_chunks(fingerprint(params)).tolist()) == base % 2**64
    rng = random.Random(0)
    for p in params:
        ints = {2: torch.int16, 4: torch.int32}[p.element_size()]
        for bit in range(8 * p.element_size()):
            i = rng.randrange(p.numel())
            flipped = [q.clone() for q in params]
            view = flipped[[id(q) for q in params].index(id(p))].view(-1)[i : i + 1].view(ints)
            before = int(view)
            view ^= (1 << bit) if bit < 8 * p.element_size() - 1 else -(1 << bit)
            assert int(fingerprint(flipped)) - base == int(view) - before != 0


def test_the_divergent_rank_is_the_minority_and_on_a_tie_the_one_unlike_rank_0():
    assert divergent((7, 7, 7)) == []
    assert divergent((7, 9, 7, 7)) == [1]
    assert divergent((9, 7, 7)) == [0]  # a majority outvotes rank 0
    assert divergent((7, 9)) == [1]  # two ranks: rank 0 is the reference


def test_the_class_picks_the_rungs_that_fit_it_then_the_ladder_orders_them():
    cfg = RollbackConfig(
        ladder=["retry", "skip_batch", "lower_lr", "fp32_reduction"], max_rollbacks=10
    )
    pol, ring = RollbackPolicy(cfg), SnapshotRing(3)
    ring.push(Snapshot(0, {}))

    def decide(cls, step):
        extra = {"class": cls} if cls else {}
        return pol.decide(Event("rollback", "nonfinite", step, "", extra=extra), ring)

    # transient and data-linked: their one rung every time (each is a new fault)
    assert [decide("transient", s).remedy for s in (2, 3)] == ["retry", "retry"]
    assert [decide("data", s).remedy for s in (4, 5)] == ["skip_batch", "skip_batch"]
    # deterministic: climbs the numerics rungs, then gives up
    assert [decide("deterministic", 6).remedy, decide("deterministic", 6).remedy] == [
        "lower_lr",
        "fp32_reduction",
    ]
    assert decide("deterministic", 6).action == "abort"
    # unclassified (classify=false): the whole ladder, as before
    assert RollbackPolicy(cfg).decide(Event("rollback", "x", 2, ""), ring).remedy == "retry"


def test_a_data_linked_batch_is_skipped_recorded_and_stays_skipped_on_resume(tmp_path):
    """poisoned_batch at data position 3 (step 4): the replay fails, the next batch from the
    same weights does not: data-linked, skipped. Resumed from the step-1 checkpoint (the
    rollback to step 2 rewrote the later ones; this one predates the skip), the run skips
    it again from skipped_batches.json and ends on the first launch's weights exactly."""
    common = [
        *BASE,
        "fault=poisoned_batch",
        "fault.batch=3",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=1",
        "trainer.keep_checkpoints=10",
    ]
    out = run(compose_run(tmp_path, common))
    assert out["model_step"] == 6
    (v,) = [e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "nonfinite"]
    assert (v["step"], v["extra"]["class"], v["extra"]["batches"]) == (4, "data", [3])
    assert v["extra"]["other_batches"]["positions"] == [4]
    saved = json.loads((tmp_path / "skipped_batches.json").read_text())["batches"]
    assert [b["data_step"] for b in saved] == [3] and len(saved[0]["items"]) == 1
    first = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert first["stabilize"]["skipped"] == [3]
    assert first["stabilize"]["data_step"] == 7  # 6 steps, one position skipped
    step1 = tmp_path / "checkpoints" / "step-000001.ckpt"
    assert torch.load(step1, weights_only=False)["stabilize"].get("skipped") == []
    again = run(compose_run(tmp_path, [*common, f"resume={step1}"]))
    assert again["model_step"] == 6
    # the poisoned batch never came back: still the one verdict of the first launch
    assert len([e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "nonfinite"]) == 1
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    for k, t in first["state_dict"].items():
        assert torch.equal(t, last["state_dict"][k]), k


def test_the_fp16_reduction_overflow_at_init_is_localized_to_a_norm_in_the_backward(tmp_path):
    """fp16-mixed with an fp16 RMSNorm reduction at init: the norms' backward overflows
    (rows of RMS below ~0.0245, docs/norms.md), the scaler skips every step, and the skip
    streak's replay names a norm as the first module whose gradient went non-finite, with
    a finite gradient reaching it; the forward was finite. The numerics rung fp32_reduction
    then trains."""
    from stabilize.norms import Norm

    out = run(
        compose_run(
            tmp_path,
            [
                *BASE,
                "precision=fp16-mixed",
                "norm=rmsnorm",
                "norm.reduction_dtype=fp16",
                "monitor.loss_scale.max_consecutive_skips=1",
                "rollback.ladder=[retry,fp32_reduction]",
                "trainer.max_steps=3",
            ],
        )
    )
    assert out["model_step"] == 3
    (v,) = [e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "loss_scale"]
    (loc,) = v["extra"]["localization"]
    assert loc["module"] is None and loc["grad_incoming_finite"] is True
    from stabilize.model import GPT

    cfg = compose_run(tmp_path / "x", ["norm=rmsnorm"]).model
    norms = {n for n, m in GPT(cfg).named_modules() if isinstance(m, Norm)}
    assert loc["grad_module"] in norms
    assert v["extra"]["class"] == "deterministic"
    (done,) = [e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "rollback"]
    assert done["extra"]["remedy"] == "fp32_reduction"  # the ladder's numerics rung


@pytest.mark.parametrize("flip", ["param", "grad"])
def test_a_bitflip_fires_once_on_its_rank_after_the_backward(flip):
    from stabilize.faults import FaultInjector, fault_config

    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.zeros_like(model.weight)
    cfg = fault_config(kind="bitflip", step=2, rank=1, param="weight", bit=3, flip=flip)
    other = FaultInjector(cfg, rank=0)
    inj = FaultInjector(cfg, rank=1)
    target = model.weight if flip == "param" else model.weight.grad
    before = target.detach().clone()
    for step in (1, 2, 2, 3):  # a replayed step 2 flips nothing
        other.begin(step)
        other.disarm(model)
        inj.begin(step)
        inj.disarm(model)
    changed = target.detach().view(-1).view(torch.int32) ^ before.view(-1).view(torch.int32)
    assert changed.tolist() == [1 << 3] + [0] * (target.numel() - 1)
