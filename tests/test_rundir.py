"""Run directories with an identity and checkpoints that prove themselves (issue 12, items
1-4 and 10): real processes where a crash, a move or a relaunch is the point (SIGKILL,
``mv``, the CLI's exit codes), in-process ``run()`` elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stabilize.io import FOOTER_LEN, DamagedFile, atomic_torch_save, verified_load, verify
from stabilize.lit.checkpoint import resolve_resume
from stabilize.run.rundir import RunDirError, checkpoint_steps
from stabilize.train import run

from conftest import FAST, compose_run, csv_losses, train_cli

COMMON = [*FAST, "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=2",
          "rollback.durable_every=0"]  # fmt: skip


@pytest.fixture
def cli(monkeypatch, capsys):
    """``stabilize-train COMMON OVERRIDES`` into ``run_dir`` ($STABILIZE_RUN_DIR), in this
    process exactly as the console script runs it."""

    def launch(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
        env = {"STABILIZE_RUN_DIR": str(run_dir)}
        return train_cli([*COMMON, *overrides], run_dir.parent, monkeypatch, capsys, env)

    return launch


def tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``d`` with its size and mtime: what a refused launch must not touch."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")}


def ckpt_names(d: Path) -> list[str]:
    return sorted(p.name for p in (d / "checkpoints").iterdir())


def model_step(path: Path) -> int:
    return checkpoint_steps(path)[0]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped at model step 7 (checkpoints every 2): last.ckpt holds step 7, the
    newest periodic one step 6, so a fallback is visible in the step it resumes from."""
    d = tmp_path_factory.mktemp("stopped") / "run"
    out = run(compose_run(d, [*COMMON, "trainer.stop_at_step=7"]))
    assert out["model_step"] == 7
    assert ckpt_names(d) == ["last.ckpt", *(f"step-{s:06d}.ckpt" for s in (2, 4, 6))]
    return d


# ---- the file layer -------------------------------------------------------------------------
def test_checksum_footer_is_verified_and_plain_torch_load_still_works(tmp_path):
    path = tmp_path / "x.ckpt"
    atomic_torch_save({"w": torch.arange(5000.0)}, path)
    assert verify(path) is True
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(5000.0))
    assert torch.equal(verified_load(path)["w"], torch.arange(5000.0))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit
    path.write_bytes(raw)
    with pytest.raises(DamagedFile, match=r"x\.ckpt is damaged: its SHA-256"):
        verified_load(path)
    legacy = tmp_path / "old.ckpt"  # no footer: written before checksums existed
    torch.save({"w": torch.ones(3)}, legacy)
    assert verify(legacy) is False and verified_load(legacy)["w"].sum() == 3


# ---- item 1: a run dir holds one run --------------------------------------------------------
def test_fresh_launch_into_a_run_dir_is_refused_and_touches_nothing(stopped, tmp_path, cli):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    before = tree(d)
    r = cli(d)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(d) in lines[0] and "resume=auto" in lines[0] and "STABILIZE_RUN_DIR" in lines[0]
    assert tree(d) == before  # not even Hydra's .hydra/ was written
    with pytest.raises(RunDirError, match="already holds a run"):  # run() without Hydra too
        run(compose_run(d, COMMON))
    assert tree(d) == before


def test_restart_moves_the_earlier_run_aside_and_starts_over(stopped, tmp_path, cli):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    old_last = (d / "checkpoints" / "last.ckpt").read_bytes()
    r = cli(d, "resume=restart", "trainer.max_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moved the earlier run's" in r.stderr
    (attic,) = d.glob("replaced-*")
    assert (attic / "checkpoints" / "last.ckpt").read_bytes() == old_last
    assert [p.name for p in (d / "csv").iterdir()] == ["version_0"]  # a new run's logs
    assert model_step(d / "checkpoints" / "last.ckpt") == 4
    assert ckpt_names(d) == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]


# ---- item 2: moved and copied dirs keep their last.ckpt -------------------------------------
def test_moved_and_copied_run_dirs_resume_and_keep_writing_last_ckpt(tmp_path, cli):
    a = tmp_path / "a"
    run(compose_run(a, [*COMMON, "trainer.stop_at_step=3"]))
    moved = tmp_path / "moved"
    os.rename(a, moved)  # a requeue on another mount path
    r = cli(moved, "resume=auto", "trainer.stop_at_step=5")  # a fresh launch resumes it
    assert r.returncode == 0, r.stderr[-2000:]
    assert ckpt_names(moved) == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]
    assert model_step(moved / "checkpoints" / "last.ckpt") == 5

    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)
    for d in (moved, copy):  # the next resume goes on from the newest step, in each
        out = run(compose_run(d, [*COMMON, "resume=auto", "trainer.stop_at_step=7"]))
        assert out["resumed_from"] == str(d / "checkpoints" / "last.ckpt")
        assert out["model_step"] == 7
        assert ckpt_names(d) == [
            "last.ckpt",
            *(f"step-{s:06d}.ckpt" for s in (2, 4, 6)),
        ]
        assert model_step(d / "checkpoints" / "last.ckpt") == 7


# ---- item 3: a finished run is left alone ---------------------------------------------------
def test_resume_auto_on_a_finished_run_trains_nothing(tmp_path, cli):
    d = tmp_path / "run"
    run(compose_run(d, [*COMMON, "trainer.max_steps=4"]))
    (d / ".hydra").mkdir()  # the first launch's Hydra record (compose_run writes none)
    (d / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.001\n")
    before = tree(d)
    r = cli(d, "resume=auto", "trainer.max_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in r.stdout.splitlines() if "nothing to train" in ln]
    assert len(said) == 1 and "model step 4" in said[0] and "status done" in said[0]
    after = tree(d)
    for key in ("checkpoints/last.ckpt", "result.json", "config.json", ".hydra/overrides.yaml"):
        assert after[key] == before[key]
    assert not [k for k in after if k.startswith("csv/version_1")]
    # the relaunch's own record, beside the first one
    (rec,) = (d / ".hydra").glob("relaunch-*/overrides.yaml")
    assert "resume=auto" in rec.read_text()


# ---- item 4: damaged checkpoints ------------------------------------------------------------
def flip_4k(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 4096] = bytes(b ^ 0xFF for b in raw[mid : mid + 4096])
    p.write_bytes(raw)


DAMAGE = {
    "flipped_4k": flip_4k,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(os.urandom(5000)),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_last_ckpt_falls_back_to_the_newest_intact_one(damage, stopped, tmp_path, capfd):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    last = d / "checkpoints" / "last.ckpt"
    DAMAGE[damage](last)
    out = run(compose_run(d, [*COMMON, "resume=auto"]))
    assert out["resumed_from"] == str(d / "checkpoints" / "step-000006.ckpt")
    assert out["model_step"] == 8  # went on from step 6, not from step 0
    warned = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and str(last) in warned[0] and "step-000006.ckpt" in warned[0]
    assert verify(last) is True and model_step(last) == 8  # written again, whole


def test_no_intact_checkpoint_is_one_line_and_exit_2(stopped, tmp_path, cli):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    for p in (d / "checkpoints").iterdir():
        flip_4k(p)
    before = tree(d)
    r = cli(d, "resume=auto")
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert "no intact checkpoint" in line
    for name in ("last.ckpt", "step-000002.ckpt", "step-000006.ckpt"):
        assert name in line
    after = tree(d)  # Hydra's .hydra/ and log aside, nothing of the run was written
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [k for k in after if k not in before and not k.startswith((".hydra", "train"))]


def test_checkpoint_without_checksum_resumes_with_a_warning(stopped, tmp_path, capfd):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    last = d / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:-FOOTER_LEN])  # as an older version wrote it
    assert resolve_resume("auto", d) == str(last)
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert str(last) in line and "no checksum" in line


# ---- a crash: SIGKILL, then resume=auto -----------------------------------------------------
def test_sigkill_then_resume_auto_matches_the_uninterrupted_run(tmp_path):
    common = [
        *COMMON,
        "trainer.max_steps=30",
        "trainer.checkpoint_every_n_steps=5",
        "trainer.val_check_interval=20",
        "model.dropout=0.1",
    ]
    full = tmp_path / "full"
    run(compose_run(full, common))
    cut = tmp_path / "cut"
    env = {**os.environ, "STABILIZE_RUN_DIR": str(cut)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    p = subprocess.Popen(
        ["stabilize-train", *common],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (cut / "checkpoints" / "step-000010.ckpt").exists():
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL  # killed mid-run, not finished
    start = model_step(cut / "checkpoints" / "last.ckpt")  # where the kill left it
    out = run(compose_run(cut, [*common, "resume=auto"]))
    assert out["resumed_from"] == str(cut / "checkpoints" / "last.ckpt")
    assert 10 <= start < 30 and out["model_step"] == 30
    a = csv_losses(max((full / "csv").iterdir()))
    b = csv_losses(max((cut / "csv").iterdir()))  # the resumed launch's own rows
    assert sorted(b) == list(range(start, 30))  # global step = model step: no rollback here
    for step in b:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    sa = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    sb = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=0)


# ---- item 10: names are model steps ---------------------------------------------------------
def test_checkpoint_names_are_model_steps_after_rollbacks(tmp_path):
    out = run(
        compose_run(
            tmp_path,
            [
                *COMMON,
                "trainer.max_steps=10",
                "fault=nan_loss",
                "fault.step=5",
                "rollback.snapshot_every=2",
                "monitor.loss_spike.enabled=false",
            ],
        )
    )
    assert out["model_step"] == 10 and out["global_step"] > 10  # steps were replayed
    names = ckpt_names(tmp_path)
    assert names == ["last.ckpt", *(f"step-{s:06d}.ckpt" for s in (2, 4, 6, 8, 10))]
    for name in names[1:]:
        model, global_ = checkpoint_steps(tmp_path / "checkpoints" / name)
        assert model == int(name[5:11]), (name, model, global_)
    assert checkpoint_steps(tmp_path / "checkpoints" / "step-000010.ckpt")[1] > 10


# ---- what a user or a kill left behind ------------------------------------------------------
def test_resume_auto_with_every_checkpoint_deleted_is_refused_not_started_over(stopped, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    for p in (d / "checkpoints").iterdir():
        p.unlink()
    before = tree(d)
    with pytest.raises(RunDirError, match="holds a run .* but no checkpoint") as e:
        run(compose_run(d, [*COMMON, "resume=auto"]))
    assert "resume=restart" in str(e.value) and str(d / "checkpoints") in str(e.value)
    assert tree(d) == before  # nothing written, the lock file included


def test_temporaries_of_a_killed_writer_are_swept_on_resume(stopped, tmp_path, capfd):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    left = [
        d / "checkpoints" / ".step-000008.ckpt.tmp-4194304",  # stabilize.io's temp file
        d / "snapshots" / ".snapshot-000008.pt.tmp-1",
    ]
    for p in left:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"half a checkpoint")
    (d / "checkpoints" / "step-000008.ckpt.tmp").mkdir()  # a sharded save's temp dir
    out = run(compose_run(d, [*COMMON, "resume=auto", "trainer.stop_at_step=8"]))
    assert out["model_step"] == 8
    assert not any(p.exists() for p in left)
    assert not (d / "checkpoints" / "step-000008.ckpt.tmp").exists()
    err = capfd.readouterr().err
    assert "removed 3 temporaries a killed writer left" in err
    assert "checkpoints/.step-000008.ckpt.tmp-4194304" in err


def test_one_launch_has_one_run_id_even_when_the_clock_moves_between_readings(monkeypatch):
    """Hydra resolves ``hydra.run.dir`` more than once; each reading of a clock that ticks
    between them made a run dir of its own (seen: two dirs under runs/main for one launch)."""
    import datetime as real

    import stabilize.train as train

    ticks = iter(range(100))

    class Clock:  # a second passes at every reading
        @staticmethod
        def now():
            return real.datetime(2026, 1, 1) + real.timedelta(seconds=next(ticks))

    monkeypatch.delenv("STABILIZE_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(train, "datetime", Clock)
    monkeypatch.setattr(train, "_launch_time", None)  # a new launch, as main() starts one
    first = train.run_id()
    assert train.run_id() == first == "2026-01-01_00-00-00"
    monkeypatch.setattr(train, "_launch_time", None)
    assert train.run_id() == "2026-01-01_00-00-01"  # the next launch reads the clock again
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert train.run_id() == "abc"  # torchrun's: the same on every rank
