"""Two "nodes" on one machine: scripts/launch.sh --nnodes 2 run twice on
localhost, meeting through a c10d rendezvous under one --run-id, share one run dir and roll
back together when a NaN hits only the second node's rank."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, ROOT

MAX_STEPS = 8
FAULT_STEP = 5
OVERRIDES = [
    *[o for o in FAST if not o.startswith("trainer.progress")],
    "trainer.accelerator=cpu",
    "logger=none",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.val_check_interval=100",
    "rollback.snapshot_every=2",
    "rollback.durable_every=0",
    # retry: the data position rewinds too, so model and data steps both end at MAX_STEPS
    "rollback.ladder=[retry]",
    "fault=nan_loss",
    f"fault.step={FAULT_STEP}",
    "fault.rank=1",  # only node 1's rank sees the NaN; the verdict must reach node 0
    "name=two_nodes",
]
TIMEOUT_S = 240


def free_port() -> int:
    """A port the OS says is free on 127.0.0.1 (released before torchrun binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_node(node_rank: int, port: int, run_id: str, run_dir: Path, cwd: Path):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(
        PYTHON=sys.executable,
        STABILIZE_RUN_DIR=str(run_dir),
        OMP_NUM_THREADS="1",  # two launches share the cores
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",  # gloo's pairs on loopback only
    )
    cmd = [
        str(ROOT / "scripts" / "launch.sh"),
        "--nnodes", "2",
        "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--run-id", run_id,
        "--node-rank", str(node_rank),
        *OVERRIDES,
    ]  # fmt: skip
    with open(cwd / f"node{node_rank}.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(p: subprocess.Popen) -> None:
    """Kill a launch and its ranks (its own session), if it still runs."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
        p.wait()


# slow (20 s): two ranks rolling back together stays in the default suite
# (test_stability.py's torchrun case); this adds the two-node rendezvous
@pytest.mark.slow
def test_two_nodes_on_localhost_share_one_run_and_roll_back_together(tmp_path):
    run_dir = tmp_path / "run"
    port, run_id = free_port(), f"two-nodes-{os.getpid()}"
    nodes = [launch_node(r, port, run_id, run_dir, tmp_path) for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in nodes:
            stop(p)
    logs = "\n".join(
        f"--- node {r} (exit {p.returncode}) ---\n{(tmp_path / f'node{r}.log').read_text()[-4000:]}"
        for r, p in enumerate(nodes)
    )
    assert [p.returncode for p in nodes] == [0, 0], logs
    # one run dir for both nodes, nothing else in the working directory
    assert sorted(q.name for q in tmp_path.iterdir()) == ["node0.log", "node1.log", "run"]
    assert (run_dir / ".hydra").is_dir() and (run_dir / ".hydra-rank1").is_dir()

    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rollbacks = [e for e in evs if e["kind"] == "rollback"]
    verdicts = [e for e in rollbacks if e["monitor"] != "rollback"]
    restores = [e for e in rollbacks if e["monitor"] == "rollback"]
    # rank 0 writes the events once, though the NaN was node 1's
    assert [(e["monitor"], e["step"]) for e in verdicts] == [("nonfinite", FAULT_STEP)], logs
    (done,) = restores
    assert done["extra"]["restored_step"] <= FAULT_STEP - 1
    assert done["extra"]["remedy"] == "retry"

    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["world_size"] == 2 and rep["identical"], rep  # both ranks restored alike
    assert [r["model_step"] for r in rep["ranks"]] == [MAX_STEPS, MAX_STEPS]
    assert [r["data_step"] for r in rep["ranks"]] == [MAX_STEPS, MAX_STEPS]
    assert rep["global_step"] > MAX_STEPS  # the replayed steps count for Lightning
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "done" and result["model_step"] == MAX_STEPS
