"""More failures end on one line (issue 22, item 7): a full disk at a checkpoint write
(exit 1, the file named).

The full disk is a real OS error in a real subprocess: a file-size limit (``RLIMIT_FSIZE``)
below a checkpoint's size, so the kernel refuses the write (EFBIG).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from stabilize.io import verify
from stabilize.train import run

from conftest import FAST, compose_run


# ---- a full disk at a checkpoint write: a real OS error, in a real subprocess -------------
def _file_size_limit(limit: int):
    def preexec() -> None:  # in the child, before exec: writes past `limit` fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_checkpoint_write_that_fails_names_the_file_and_keeps_the_last_one(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    small = [o for o in FAST if not o.startswith(("trainer.max_steps", "trainer.limit_val"))]
    small += ["logger=none", f"data.cache_dir={cache}", "trainer.limit_val_batches=1"]
    small += ["trainer.final_eval_batches=0"]
    # launch 1, unlimited: 2 steps, last.ckpt at step 2 (and the token cache is built)
    run(compose_run(run_dir, [*small, "trainer.max_steps=2"]))
    last = run_dir / "checkpoints" / "last.ckpt"
    kept = last.read_bytes()
    assert last.stat().st_size > 4 << 20  # the tiny model + AdamW: ~5 MB, over the limit
    # launch 2 goes on to step 4 with no file allowed past 1 MiB: its checkpoint is refused
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    args = ["stabilize-train", *small, "trainer.max_steps=4", "resume=auto"]
    r = subprocess.run(
        [*args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_file_size_limit(1 << 20),
    )
    assert r.returncode == 1, r.stderr[-3000:]  # the run crashed: not a config error
    assert "Traceback" not in r.stderr and "unexpected pos" not in r.stderr, r.stderr
    ours = [x for x in r.stderr.splitlines() if x.startswith("stabilize-train:")]
    assert ours == [f"stabilize-train: File too large: {last}"], r.stderr
    assert last.read_bytes() == kept and verify(last)  # the old one, whole
    assert not list(last.parent.glob(".*.tmp-*"))  # the torn temporary is gone
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "File too large" in result["error"]
