"""Gradient accumulation with monitors and rollback, through a real
Lightning Trainer on CPU (tiny model) and a real torchrun launch."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from stabilize.data.sampler import StepSampler
from stabilize.train import run

from conftest import FAST, compose_run, launch_sh, read_csv_metrics, series

A = 4  # micro-batches per optimizer step
COMMON = [
    *FAST,
    "logger=none",
    "trainer.max_steps=8",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    "rollback.snapshot_every=2",
    "rollback.durable_every=0",
]


class WindowCheck(L.Callback):
    """At every optimizer step Lightning takes: how many fresh micro-batches the module
    trained in the window, and the steps it stands at (the window's alignment)."""

    def __init__(self):
        self.windows: list[tuple[int, int, int]] = []  # (micro, model_step, data_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.windows.append(
            (pl_module.micro, pl_module.train_state.model_step, pl_module.train_state.data_step)
        )


def events(run_dir, monitor: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    evs = map(json.loads, lines)
    return [e for e in evs if e["kind"] == "rollback" and e["monitor"] == monitor]


def weights(run_dir) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=False)["state_dict"]


def test_a_step_of_accumulated_micro_batches_reads_the_items_of_one_big_batch():
    """Step k at accumulation A and batch b reads micro-steps A*k .. A*k + A-1: the same
    A*b items, in the same order, as step k at accumulation 1 and batch A*b."""
    small = StepSampler(1000, 2, seed=7, num_steps=None)
    big = StepSampler(1000, 2 * A, seed=7, num_steps=None)
    for k in (0, 1, 5, 124, 125):  # 125: the step that straddles the first epoch's end
        micro = [i for j in range(A) for i in small.batch_for_step(A * k + j)]
        assert micro == big.batch_for_step(k)


def test_accumulation_gives_the_losses_of_one_big_batch(tmp_path):
    """fp32, monitors and rollback on: accumulation 4 at batch 2 logs, per optimizer step,
    the loss of accumulation 1 at batch 8 (the mean over the step's micro-batches), and
    ends with nearly the same weights."""
    check = WindowCheck()
    acc = run(
        compose_run(
            tmp_path / "acc", [*COMMON, "data.batch_size=2", f"optim.accumulate_grad_batches={A}"]
        ),
        callbacks=[check],
    )
    one = run(compose_run(tmp_path / "one", [*COMMON, "data.batch_size=8"]))
    assert acc["model_step"] == one["model_step"] == 8
    assert acc["global_step"] == one["global_step"] == 8
    assert check.windows == [(A, k, A * (k + 1)) for k in range(8)]
    la = series(read_csv_metrics(tmp_path / "acc"), "train/loss")
    lb = series(read_csv_metrics(tmp_path / "one"), "train/loss")
    assert sorted(la) == sorted(lb) == list(range(8))  # one row per optimizer step
    for k in la:
        assert la[k] == pytest.approx(lb[k], rel=1e-5, abs=0), (k, la[k], lb[k])
    # Adam divides by sqrt(v): an element whose gradient is ~0 moves by ~lr whatever its
    # rounding, so the weights agree to a few lr x 1e-3, not to the losses' 1e-5
    wa, wb = weights(tmp_path / "acc"), weights(tmp_path / "one")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-5)
    ckpt = torch.load(tmp_path / "acc" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["data_step"] == A * 8


@pytest.mark.parametrize(
    "ladder, skip",
    [("retry", 0), ("skip_data", 3)],  # 3: not a multiple of the window
)
def test_a_rollback_mid_run_lands_on_a_window_and_replays_it_whole(ladder, skip, tmp_path):
    """A transient NaN at step 7, accumulation 4, dropout on: every window Lightning
    steps holds exactly 4 fresh micro-batches (the stale prefetched batch is not counted),
    the data position is A x model_step (+ the skip), and with ``retry`` the run ends with
    the fault-free run's weights, bit for bit."""
    common = [
        *COMMON,
        "data.batch_size=2",
        f"optim.accumulate_grad_batches={A}",
        "model.dropout=0.1",
        f"rollback.ladder=[{ladder}]",
        f"rollback.remedy.skip_data.batches={skip or 20}",
    ]
    check = WindowCheck()
    hit = run(
        compose_run(tmp_path / "hit", [*common, "fault=nan_loss", "fault.step=7"]),
        callbacks=[check],
    )
    (done,) = events(tmp_path / "hit", "rollback")
    assert done["extra"]["restored_step"] == 6 and done["extra"]["remedy"] == ladder
    assert hit["model_step"] == 8 and hit["global_step"] == 9  # the bad step, then 7 again
    assert all(micro == A for micro, _, _ in check.windows), check.windows
    # the window after the rollback starts at the restored position (+ the skip)
    steps = [(m, d) for _, m, d in check.windows]
    assert steps[6:] == [(6, 28), (6, 28 + skip), (7, 32 + skip)]
    ckpt = torch.load(tmp_path / "hit" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["data_step"] == A * 8 + skip
    if ladder == "retry":
        run(compose_run(tmp_path / "clean", common))
        wa, wb = weights(tmp_path / "clean"), weights(tmp_path / "hit")
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name


def test_fp16_unscales_and_updates_the_scaler_once_per_optimizer_step(tmp_path):
    """fp16 with accumulation: the loss is scaled per micro-batch, but GradScaler unscales,
    steps and updates once per window (a second unscale_ before update() raises), so its
    growth tracker counts optimizer steps, not micro-batches."""
    cfg = compose_run(
        tmp_path,
        [
            *COMMON,
            "trainer.max_steps=4",
            "precision=fp16-mixed",
            "precision.growth_interval=1000",
            "data.batch_size=2",
            f"optim.accumulate_grad_batches={A}",
        ],
    )
    check = WindowCheck()
    out = run(cfg, callbacks=[check])
    assert out["model_step"] == out["global_step"] == 4
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    scaler = ckpt["MixedPrecision"]
    assert scaler["_growth_tracker"] == 4 and scaler["scale"] == 2.0**16
    assert [w[0] for w in check.windows] == [A] * 4


def test_resume_with_accumulation_continues_like_the_uninterrupted_run(tmp_path):
    common = [*COMMON, "data.batch_size=2", "optim.accumulate_grad_batches=2"]
    run(compose_run(tmp_path / "full", common))
    run(compose_run(tmp_path / "cut", [*common, "trainer.stop_at_step=5"]))
    out = run(compose_run(tmp_path / "cut", [*common, "resume=auto"]))
    assert out["model_step"] == 8
    a = series(read_csv_metrics(tmp_path / "full"), "train/loss")
    b = series(read_csv_metrics(tmp_path / "cut"), "train/loss")
    assert sorted(b) == list(range(8))
    for k in range(5, 8):
        assert abs(a[k] - b[k]) <= 1e-6, (k, a[k], b[k])
    ckpt = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["data_step"] == 16


def test_torchrun_accumulation_rollback_on_both_ranks_keeps_replicas_identical(tmp_path):
    """2 ranks (gloo), accumulation 2, a NaN on rank 1 at step 6: both ranks roll back
    together, replay on whole windows and end with identical replicas."""
    run_dir = tmp_path / "run"
    args = [a for a in COMMON if not a.startswith("trainer.progress")]
    r = launch_sh(
        run_dir,
        *args,
        "trainer.accelerator=cpu",
        "data.batch_size=2",
        "optim.accumulate_grad_batches=2",
        "fault=nan_loss",
        "fault.step=6",
        "fault.rank=1",
        "rollback.ladder=[skip_data]",
        "rollback.remedy.skip_data.batches=3",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (done,) = events(run_dir, "rollback")
    assert done["extra"]["restored_step"] == 4
    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["identical"]
    assert [x["model_step"] for x in rep["ranks"]] == [8, 8]
    assert [x["data_step"] for x in rep["ranks"]] == [2 * 8 + 3] * 2
