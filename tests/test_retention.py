"""Bounded disk: durable snapshots and periodic checkpoints are kept by
count, so a long run's disk use does not grow with its length."""

from __future__ import annotations

import pytest

from stabilize.rollback import DurableWriter, Snapshot, prune_durable
from stabilize.train import run

from conftest import FAST, compose_run


def test_a_long_run_keeps_only_the_newest_snapshots_and_checkpoints(tmp_path):
    """60 steps, a durable snapshot and a checkpoint every 10: with the defaults (3 durable
    snapshots, 5 checkpoints) the newest ones stay, the rest are gone."""
    cfg = compose_run(
        tmp_path,
        [
            *FAST,
            "logger=none",
            "model.block_size=32",
            "data.batch_size=2",
            "trainer.max_steps=60",
            "trainer.log_every_n_steps=10",
            "trainer.val_check_interval=100",
            "trainer.checkpoint_every_n_steps=10",
            "rollback.snapshot_every=10",
            "rollback.durable_every=10",
        ],
    )
    assert (cfg.rollback.keep_durable, cfg.trainer.keep_checkpoints) == (3, 5)  # the defaults
    run(cfg)
    snaps = sorted(p.name for p in (tmp_path / "snapshots").glob("*.pt"))
    assert snaps == [f"snapshot-{s:06d}.pt" for s in (40, 50, 60)]
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["last.ckpt", *(f"step-{s:06d}.ckpt" for s in (20, 30, 40, 50, 60))]


@pytest.mark.parametrize("keep", [-1, 1, 2])
def test_durable_snapshots_are_pruned_to_the_newest_by_step(keep, tmp_path):
    """Written out of order, as after a rollback (step 30 again after 40): the newest by
    step are kept; -1 keeps every file."""
    writer = DurableWriter(background=True, keep=keep)
    for step in (10, 20, 40, 30, 50):
        writer.submit(Snapshot(step, {"w": step}), tmp_path)
    writer.close()
    names = sorted(p.name for p in tmp_path.glob("snapshot-*.pt"))
    want = [10, 20, 30, 40, 50] if keep == -1 else [10, 20, 30, 40, 50][-keep:]
    assert names == [f"snapshot-{s:06d}.pt" for s in want]
    assert prune_durable(tmp_path, 5) == []  # nothing over the count: nothing deleted


@pytest.mark.parametrize("value", [0, -2])
def test_retention_counts_are_positive_or_minus_one(value, tmp_path):
    with pytest.raises(ValueError, match=f"rollback.keep_durable={value}"):
        compose_run(tmp_path, [f"rollback.keep_durable={value}"])


def test_a_damaged_durable_snapshot_is_named_on_load(tmp_path):
    """Durable snapshots carry the same checksum footer as checkpoints (stabilize/io.py):
    one flipped byte is caught on load with the file's name, not unpickled into wrong
    weights."""
    import torch

    from stabilize.io import DamagedFile
    from stabilize.rollback import load_durable, save_durable

    snap = Snapshot(7, {"w": torch.arange(4096, dtype=torch.float32)}, 1.0)
    path = save_durable(snap, tmp_path)
    assert torch.equal(load_durable(path).state["w"], snap.state["w"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFile, match=path.name):
        load_durable(path)
