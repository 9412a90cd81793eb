"""A checkpoint whose pickle would run code is refused before any of it runs (issue 22,
item 6): through ``resume=PATH``, through ``resume=auto`` after its checksum footer was made
to match, and in a sharded (DCP) index; ``resume_trusted=true`` is the one way round. The
harness's own files load with ``weights_only=True``: a real run's checkpoints, snapshots
and a real DCP index, written by the real code, not built by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_errors import cli, one_message

from stabilize.io import DamagedFile, atomic_torch_save, verified_load
from stabilize.train import run
from stabilize.trust import UntrustedFile, check_dcp_index, torch_load

from conftest import FAST, compose_run

BASE = [*FAST, "logger=none"]


class Payload:
    """Unpickling this creates ``marker`` (``open``): the stand-in for any command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_checkpoint(marker: Path) -> dict:
    return {"stabilize": {"model_step": 1}, "x": Payload(marker)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real 4-step fp16 run with a NaN rolled back by a remedy: the checkpoint holds a
    GradScaler's state and the remedies applied."""
    run_dir = tmp_path_factory.mktemp("trust") / "run"
    over = [
        *BASE,
        "precision=fp16-mixed",
        "fault=nan_loss",
        "fault.step=3",
        "rollback.ladder=[skip_batch]",
        "trainer.checkpoint_every_n_steps=2",  # periodic checkpoints beside last.ckpt
        "rollback.snapshot_every=1",
        "rollback.durable_every=2",
    ]
    run(compose_run(run_dir, over))
    return run_dir


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, 1 process
def test_the_harness_own_files_load_with_weights_only(trained, tmp_path):
    ckpts = sorted((trained / "checkpoints").glob("*.ckpt"))
    snaps = sorted((trained / "snapshots").glob("*.pt"))
    assert len(ckpts) >= 2 and snaps  # last.ckpt and a periodic one
    for path in [*ckpts, *snaps]:
        assert torch_load(path, map_location="cpu") is not None  # weights_only=True
    state = torch_load(trained / "checkpoints" / "last.ckpt")["stabilize"]
    assert state["remedies"] == ["skip_batch"]  # the rollback's state is in it, plain
    # a DCP directory written by torch.distributed.checkpoint itself: its index passes
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)
    check_dcp_index(tmp_path)


def test_a_pickle_that_runs_code_is_refused_through_resume_path(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    bad = tmp_path / "evil.ckpt"
    torch.save(evil_checkpoint(marker), bad)
    code, err = cli([*BASE, f"resume={bad}", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path,
                    monkeypatch, capsys)  # fmt: skip
    line = one_message(err)
    assert code == 2 and not marker.exists(), line
    assert str(bad) in line and "io.open" in line and "resume_trusted=true" in line
    assert not (tmp_path / "r").exists()  # nothing written
    # the flag is the one way round: trusted, the same file runs its payload on load
    trusted = [*BASE, f"resume={bad}", "resume_trusted=true", f"hydra.run.dir={tmp_path / 'r'}"]
    code, err = cli(trusted, tmp_path, monkeypatch, capsys)
    assert marker.exists() and code == 2  # loaded (ran), then refused: no 'state_dict' in it


def test_a_swapped_last_ckpt_with_a_good_checksum_is_refused_by_resume_auto(
    trained, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(trained, run_dir)
    marker = tmp_path / "ran"
    # written by the harness's own checksummed writer: the footer matches the bytes
    atomic_torch_save(evil_checkpoint(marker), run_dir / "checkpoints" / "last.ckpt")
    before = (run_dir / "result.json").read_text()
    code, err = cli([*BASE, "resume=auto", "trainer.max_steps=6", f"hydra.run.dir={run_dir}"],
                    tmp_path, monkeypatch, capsys)  # fmt: skip
    line = one_message(err)
    assert code == 2 and not marker.exists(), line
    assert "last.ckpt" in line and "io.open" in line and "resume_trusted" in line
    assert (run_dir / "result.json").read_text() == before
    assert json.loads(before)["status"] == "done"
    # a snapshot swapped the same way does not load either (rollback treats it as damaged)
    snap = run_dir / "snapshots" / "evil.pt"
    atomic_torch_save({"step": 1, "state": Payload(marker), "wall": 0.0}, snap)
    with pytest.raises(DamagedFile, match="does not load"):
        verified_load(snap)
    assert not marker.exists()


def test_a_dcp_index_that_runs_code_is_refused(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedFile, match="io.open"):
        check_dcp_index(tmp_path)
    assert not marker.exists()
    with pytest.raises(UntrustedFile, match="io.open"):
        torch_load(_saved(tmp_path / "x.pt", Payload(marker)))
    assert not marker.exists()


def _saved(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path
