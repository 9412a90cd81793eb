"""Repro bundles (stability/bundle.py) and ``stabilize-replay`` (stabilize/replay/):
a bundle written by a real run replays in another process; fp32 on CPU bit for bit against
what the run recorded, a 2-rank DDP run within the stated tolerance; a damaged bundle is
one line and exit 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.drills import DRILL_MONITORS
from stabilize.replay import replay
from stabilize.train import run

from conftest import FAST, compose_run, launch_sh, run_cli

BASE = [*FAST, "logger=none", "trainer.max_steps=10", "trainer.val_check_interval=100",
        "trainer.checkpoint_every_n_steps=100", *DRILL_MONITORS]  # fmt: skip
SPIKE = ["fault=grad_spike", "fault.step=8", "fault.factor=1e4"]  # a finite, huge grad norm


def _bundle(run_dir):
    (b,) = sorted((run_dir / "bundles").iterdir())
    return b


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    d = tmp_path_factory.mktemp("spiked")
    run(compose_run(d, [*BASE, *SPIKE]))
    return _bundle(d)


def test_a_bundle_replays_bit_for_bit_in_another_process(spiked):
    meta = json.loads((spiked / "meta.json").read_text())
    assert spiked.name == "step-000008-grad_spike" and meta["world_size"] == 1
    from importlib.metadata import version

    assert meta["versions"]["stabilize"] == version("stabilize")  # was None: no __version__
    files = json.loads((spiked / "manifest.json").read_text())["files"]
    assert set(files) == {"state.pt", "batch.pt", "meta.json"}
    rec = meta["recorded"]
    # in this process: the numbers themselves, against what the run logged
    out = replay(spiked)
    assert out["exact"] and out["loss"] == rec["loss"] and out["grad_norm"] == rec["grad_norm"]
    assert rec["grad_norm"] > 100  # the spike (x1e4 on one gradient) recurred, as recorded
    # and as a user runs it: a fresh process
    r = run_cli(["stabilize-replay", str(spiked)], cwd=spiked)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compared bit for bit" in r.stdout and r.stdout.strip().endswith("reproduces: yes")


def test_a_damaged_or_incomplete_bundle_is_one_line_and_exit_2(spiked, tmp_path, capsys):
    import shutil

    from stabilize.replay import main as replay_main  # stabilize-replay, in this process

    bad = tmp_path / "bad"
    shutil.copytree(spiked, bad)
    raw = bytearray((bad / "state.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (bad / "state.pt").write_bytes(bytes(raw))
    capsys.readouterr()
    assert replay_main([str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        f"stabilize-replay: {bad / 'state.pt'}: damaged (its SHA-256 is not the manifest's)"
    )
    (bad / "manifest.json").unlink()
    assert replay_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "manifest.json: missing" in err and "Traceback" not in err


def test_a_two_rank_ddp_bundle_is_one_copy_and_replays(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in BASE if not a.startswith(("trainer.progress", "logger"))]
    r = launch_sh(run_dir, *args, "logger=none", "trainer.accelerator=cpu", *SPIKE,
                  "fault.rank=1", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    b = _bundle(run_dir)
    meta = json.loads((b / "meta.json").read_text())
    assert meta["world_size"] == 2
    out = replay(b)  # both ranks' micro-batches, their gradients averaged as DDP does
    assert not out["exact"] and out["same_loss"] and out["same_grad_norm"], out
    assert out["meta"]["recorded"]["grad_norm"] > 100


def test_a_step_that_does_not_fail_has_no_sequence_to_bisect(spiked):
    """A grad spike's loss and gradient norm are finite: no row fails, one replay."""
    from stabilize.replay.bisect import data

    b = data(spiked)
    assert (b["failing"], b["culprits"], b["replays"], b["rows"]) == (False, None, 1, 4)


def test_a_bundle_of_an_older_version_replays_without_its_retired_settings(spiked, tmp_path):
    """A bundle of an older version replays: its config's retired setting
    (``forecast_slowing``, now ``forecast.slow_steps``) is dropped and its flat forecast keys
    (``monitor.activation.horizon``, ``forecast_z``, ...: before the forecast had its own
    section) are read as ``monitor.activation.forecast``'s; the step is the same bit for bit.
    Any other unknown key is still refused."""
    import shutil

    from stabilize.monitors.forecast import FLAT_KEYS
    from stabilize.run.config import RunConfig
    from stabilize.stability.bundle import sha256
    from stabilize.validate import ConfigError

    old = tmp_path / spiked.name
    shutil.copytree(spiked, old)
    meta = json.loads((old / "meta.json").read_text())
    act = meta["config"]["monitor"]["activation"]
    nested = act.pop("forecast")
    # what the previous versions wrote: the forecast's settings flat, and a retired one
    act.update({old: nested[new] for old, new in FLAT_KEYS.items() if new != "slow_steps"})
    act["forecast_slowing"] = 1.8
    (old / "meta.json").write_text(json.dumps(meta))
    man = json.loads((old / "manifest.json").read_text())
    f = old / "meta.json"
    man["files"]["meta.json"] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    (old / "manifest.json").write_text(json.dumps(man))
    out = replay(old)
    rec = meta["recorded"]
    assert out["exact"] and out["loss"] == rec["loss"] and out["grad_norm"] == rec["grad_norm"]
    act["bogus_setting"] = 1
    with pytest.raises(ConfigError, match="bogus_setting is not a known setting"):
        RunConfig.from_saved(meta["config"])
