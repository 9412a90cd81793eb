"""A fault soak: 2-rank torchrun jobs interrupted at random, against uninterrupted twins.

    python scripts/soak.py                          # 5 jobs x 600 steps (~10 min on 2 cores)
    python scripts/soak.py --jobs nan_loss --steps 60 --gap 8 --seed 1
    python scripts/soak.py --doc                    # and write docs/operations.md's block

Each job (``scripts/launch.sh --nproc-per-node 2 --max-restarts 20``, the tiny GPT on CPU
over gloo, one harness fault planted) is interrupted at random (the kinds and gaps drawn
from ``--seed``; which step each hits depends on the machine's speed): SIGKILL of a rank,
SIGTERM of the job, SIGSTOP of a rank. A launch that exits non-zero is launched again with
``resume=auto``, as a scheduler requeues it; then its twin runs uninterrupted. Prints, per
interruption, the steps lost and the restart's seconds by milestone, and per job the
effective training time and whether its end is bitwise its twin's (docs/operations.md). A
job with no progress for ``3 x --hang + 120`` s is ended and said to have needed a human.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.soak import (
    KINDS,
    final_state,
    job_row,
    phases,
    relaunched,
    tables,
)

ROOT = Path(__file__).resolve().parents[1]


def faults(steps: int) -> dict[str, list[str]]:
    """One harness fault per job, planted a third of the way in."""
    at = max(2, steps // 3)
    return {
        "nan_loss": ["fault=nan_loss", f"fault.step={at}"],
        "inf_grad": ["fault=inf_grad", f"fault.step={at}", "fault.param=h.1.mlp.c_fc.weight"],
        "grad_spike": ["fault=grad_spike", f"fault.step={at}", "fault.factor=1e4"],
        "poisoned_item": ["fault=poisoned_item", f"fault.step={at}"],
        "stream_drift": [
            "fault=stream_drift",
            f"fault.step={at}",
            f"fault.target_step={at + max(1, steps // 3)}",
        ],
    }


def common(args) -> list[str]:
    from benchmarks.drills import DRILL_MONITORS

    return [
        f"trainer.max_steps={args.steps}",
        "trainer.log_every_n_steps=1",
        "trainer.progress=plain",
        "trainer.val_check_interval=100000",
        "trainer.limit_val_batches=2",
        "trainer.final_eval_batches=4",
        f"trainer.checkpoint_every_n_steps={args.every}",
        f"trainer.hang_timeout_s={args.hang}",
        "trainer.accelerator=cpu",
        "data.batch_size=4",
        "model.block_size=64",
        "logger=none",
        *DRILL_MONITORS,
    ]


class Launch:
    """One ``launch.sh`` process; its console lines read by a thread, each with its time."""

    def __init__(self, run_dir: Path, overrides: list[str], restarts: int, log: list | None = None):
        env = {**os.environ, "STABILIZE_RUN_DIR": str(run_dir), "HF_DATASETS_OFFLINE": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "PYTHON": sys.executable}  # fmt: skip
        cmd = ["bash", str(ROOT / "scripts" / "launch.sh"), "--nproc-per-node", "2",
               "--max-restarts", str(restarts), *overrides]  # fmt: skip
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.log = log if log is not None else []  # the job's lines over all its launches
        self.log.append((self.t0, "[soak] launched\n"))
        self.steps: list[tuple[float, int]] = []  # (time, model step) of each step line
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            t = time.monotonic()
            self.lines.append((t, line))
            self.log.append((t, line))
            head = line.split()
            if len(head) > 1 and head[0] == "step" and "/" in head[1]:
                with contextlib.suppress(ValueError):
                    self.steps.append((t, int(head[1].split("/")[0])))

    def tail(self, n: int = 30) -> str:
        return "".join(line for _, line in self.lines[-n:])


def _beat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / "ranks" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _interrupt(kind: str, launch: Launch, run_dir: Path, rank: int) -> bool:
    if kind == "term_job":
        launch.p.send_signal(signal.SIGTERM)
        return True
    beat = _beat(run_dir, rank)
    if beat is None or not _alive(beat["pid"]):
        return False
    os.kill(beat["pid"], signal.SIGKILL if kind == "kill_rank" else signal.SIGSTOP)
    return True


def soak(name: str, run_dir: Path, overrides: list[str], args, rng: random.Random) -> dict:
    """The job, interrupted and requeued until it ends with exit 0 (or needs a human)."""
    kinds, weights = list(KINDS), list(KINDS.values())
    events: list[dict] = []
    launches, human, rc, t_start = 0, False, None, time.monotonic()
    pending: dict | None = None  # the interruption whose restart is not seen yet
    log: list[tuple[float, str]] = []
    # 0: done; 2: a config error (a requeue changes nothing); else requeued
    while launches < args.max_launches and rc not in (0, 2) and not human:
        resume = "resume=auto" if launches else "resume=none"  # a scheduler's requeue
        launch = Launch(run_dir, [*overrides, resume], args.restarts, log)
        launches += 1
        due = None  # when the next interruption goes
        while launch.p.poll() is None:
            time.sleep(0.05)
            now = time.monotonic()
            last = launch.steps[-1] if launch.steps else None
            # closed by the first step of a new process (a step in flight when the signal
            # came, which SIGTERM lets finish, is not a restart)
            back = relaunched(log, pending["t"]) if pending is not None else None
            if back is not None and last and last[0] > back:
                first = next(s for s in launch.steps if s[0] > back)
                pending.update(resumed=first[1] - 1, restart_s=first[0] - pending["t"],
                               phases=phases(log, pending["t"], first[0]))  # fmt: skip
                # a SIGTERM lets the step in flight finish and checkpoint: nothing is lost
                pending["lost"] = max(0, pending["step"] - pending["resumed"])
                pending = None
            training = pending is None and last is not None and last[1] < args.steps - 1
            if training and due is None:
                due = now + rng.expovariate(1.0 / args.gap)
            if training and now >= due:
                kind, rank = rng.choices(kinds, weights)[0], rng.randrange(2)
                if _interrupt(kind, launch, run_dir, rank):
                    pending = {"kind": kind, "rank": rank, "t": now, "step": last[1]}
                    events.append(pending)
                due = None
            progress = max([launch.t0, *(t for t, _ in launch.steps[-1:])])
            if now - progress > 3 * args.hang + 120:  # frozen beyond the watchdog's reach
                human = True
                _kill_all(launch, run_dir)
        rc = launch.p.wait()
        if pending is not None:
            pending["exit"] = rc  # it ended this launch: the requeue closes it
        if rc != 0:
            print(
                f"[soak] {name}: launch {launches} exited {rc}"
                + ("" if human else "; requeued with resume=auto"),
                file=sys.stderr,
                flush=True,
            )
    return {"events": events, "launches": launches, "wall_s": time.monotonic() - t_start,
            "human": human, "rc": rc, "tail": launch.tail()}  # fmt: skip


def _kill_all(launch: Launch, run_dir: Path) -> None:
    os.killpg(launch.p.pid, signal.SIGKILL)
    for r in (0, 1):
        beat = _beat(run_dir, r)
        if beat and _alive(beat["pid"]):
            os.kill(beat["pid"], signal.SIGCONT)
            os.kill(beat["pid"], signal.SIGKILL)


def twin(run_dir: Path, overrides: list[str], args) -> dict:
    """The same job uninterrupted: its wall time and its seconds per step (the median gap
    between step lines)."""
    launch = Launch(run_dir, [*overrides, "resume=none"], 0)
    rc = launch.p.wait()
    time.sleep(0.1)  # the reader thread's last lines
    gaps = [b[0] - a[0] for a, b in zip(launch.steps, launch.steps[1:], strict=False)]
    return {"rc": rc, "wall_s": time.monotonic() - launch.t0, "tail": launch.tail(),
            "step_s": statistics.median(gaps) if gaps else float("nan")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="nan_loss,inf_grad,grad_spike,poisoned_item,stream_drift")
    p.add_argument("--steps", type=int, default=600, help="model steps per job (600)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (20)")
    p.add_argument("--hang", type=float, default=20, help="trainer.hang_timeout_s (20)")
    p.add_argument("--gap", type=float, default=8.0,
                   help="mean seconds of training between interruptions (8)")  # fmt: skip
    p.add_argument("--restarts", type=int, default=20, help="torchrun --max-restarts (20)")
    p.add_argument("--max-launches", type=int, default=40, help="requeues at most (40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="where the run dirs go (kept)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--doc", action="store_true", help="write docs/operations.md's soak block")
    args = p.parse_args(argv)
    table = faults(args.steps)
    names = args.jobs.split(",")
    bad = [n for n in names if n not in table]
    if bad or args.steps < 6 or args.every < 1 or args.gap <= 0 or args.hang <= 0:
        what = f"--jobs {bad[0]!r} (allowed: {', '.join(table)})" if bad else \
            "--steps >= 6, --every >= 1, --gap > 0 and --hang > 0"  # fmt: skip
        print(f"soak.py: not allowed: {what}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows, events, t0 = [], [], time.monotonic()
    for name in names:
        overrides = [*common(args), *table[name]]
        print(f"[soak] {name}: soaked run", file=sys.stderr, flush=True)
        soaked = soak(name, out / f"{name}-soaked", overrides, args, rng)
        print(f"[soak] {name}: twin", file=sys.stderr, flush=True)
        tw = twin(out / f"{name}-twin", overrides, args)
        a = _read(out / f"{name}-soaked", soaked)
        b = _read(out / f"{name}-twin", tw)
        events += [{"job": name, **e} for e in soaked["events"]]
        rows.append(job_row(name, soaked, tw, a, b, args.steps))
        print(f"[soak] {name}: {rows[-1]['interruptions']} interruptions, "
              f"{'bitwise' if rows[-1]['bitwise'] else 'NOT bitwise'} equal to its twin, "
              f"{time.monotonic() - t0:.0f} s so far", file=sys.stderr, flush=True)  # fmt: skip
    from benchmarks.docblock import commit, cpu

    head = (
        f"`python scripts/soak.py --jobs {args.jobs} --steps {args.steps} --every "
        f"{args.every} --hang {args.hang:g} --gap {args.gap:g} --seed {args.seed}` at "
        f"{commit()}, {cpu()}, {os.cpu_count()} cores, {time.monotonic() - t0:.0f} s:"
    )
    body = head + "\n\n" + tables(rows, events)
    print(body)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "events": [{k: v for k, v in e.items() if k != "t"} for e in events],
                },
                indent=1,
            )
        )
    if args.doc:
        from benchmarks.docblock import write_block

        return write_block(ROOT / "docs" / "operations.md", "soak", body, "soak.py")
    return 0 if all(r["bitwise"] and r["done"] for r in rows) else 1


def _read(run_dir: Path, launch: dict) -> dict | None:
    try:
        return final_state(run_dir)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        print(
            f"[soak] {run_dir.name}: no final state ({type(e).__name__}: {e}); exit "
            f"{launch['rc']}; its last lines:\n{launch['tail']}",
            file=sys.stderr,
        )
        return None


if __name__ == "__main__":
    sys.exit(main())
