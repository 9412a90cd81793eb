"""Elastic restarts, for real: ``scripts/launch.sh --max-restarts 1`` with one of 2 torchrun
ranks SIGKILLed mid-run. torchrun restarts the group; it resumes from the newest intact
checkpoint by itself (no ``resume=auto`` typed) and its losses match an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from test_preempt import COMMON, _start
from test_watchdog import _beat_at

from conftest import ROOT, csv_losses, launch_sh

STEPS = 40  # room after the kill at step >= 6, even when beats lag a few steps
ARGS = [
    *[a for a in COMMON if not a.startswith(("trainer.max_steps", "trainer.checkpoint_every"))],
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.hang_timeout_s=4",  # its heartbeat every 0.2 s: the test sees step 6 in time
]


# slow (56 s on 2 cores): the one elastic restart; a rank's death named and the launch's
# exit code stay in the default suite (test_watchdog.py)
@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_which_resumes_by_itself(tmp_path):
    d = tmp_path / "elastic"
    script = str(ROOT / "scripts" / "launch.sh")
    p = _start(["bash", script, "--nproc-per-node", "2", "--max-restarts", "1", *ARGS], d,
               tmp_path)  # fmt: skip
    beat = _beat_at(d, 1, 6, time.time() + 300)  # past the checkpoint at step 4
    os.kill(beat["pid"], signal.SIGKILL)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "elastic restart 1 (torchrun --max-restarts): resume=auto" in out, out[-3000:]
    result = json.loads((d / "result.json").read_text())
    assert result["status"] == "done" and result["model_step"] == STEPS
    # per-rank own time per step, and the summary line naming them
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["own_ms_per_step"] > 0 and r["steps"] > 0 for r in result["ranks"])
    assert "own time per step (batch wait + forward): rank 0 " in out
    # the restarted attempt's rows (the last CSV version) match an uninterrupted run
    versions = sorted((d / "csv").iterdir(), key=lambda v: int(v.name.split("_")[1]))
    assert len(versions) == 2, versions
    resumed = csv_losses(versions[-1])
    assert resumed and max(resumed) == STEPS - 1 and min(resumed) >= 4  # CSV steps from 0
    full = tmp_path / "full"
    r = launch_sh(full, *ARGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = csv_losses(next((full / "csv").iterdir()))
    for step, loss in resumed.items():
        assert abs(ref[step] - loss) <= 1e-6, (step, ref[step], loss)
