"""A fault soak: 2-rank torchrun jobs interrupted at random, against uninterrupted twins.

    python scripts/soak.py                          # 5 jobs x 300 steps (~25 min on 2 cores)
    python scripts/soak.py --jobs nan_loss --steps 60 --gap 8 --seed 1
    python scripts/soak.py --doc                    # and write docs/operations.md's block

Each job is a real launch (``scripts/launch.sh --nproc-per-node 2 --max-restarts 20``, the
tiny GPT on CPU over gloo, a checkpoint every ``--every`` steps, ``trainer.hang_timeout_s``
= ``--hang``) with one harness fault planted (nan_loss, inf_grad, grad_spike, poisoned_item,
stream_drift). While it trains, interruptions come at random (seeded: ``--seed``), after a
gap of training drawn from an exponential of mean ``--gap`` seconds, of three kinds in the
proportions of a scheduler's life: SIGKILL of one rank (torchrun restarts the group in the
job), SIGTERM of the job (a preemption: exit 4), SIGSTOP of one rank (frozen: the watchdog
names it, exit 5). Whenever the launch exits non-zero it is launched again with
``resume=auto``, as a scheduler requeues it. Then its twin runs the same job uninterrupted.

What it prints (Markdown), from the launches' own step lines and files:
- per interruption: its kind, the step it hit, the step training resumed from (steps lost)
  and the restart's seconds (from the signal to the first new step's line);
- per job: interruptions by kind, steps lost, the median and largest restart, the
  effective training time (the final steps at the twin's seconds per step, over the job's
  wall time; the twin's own beside it), whether the final weights and AdamW moments equal
  the twin's bit for bit, and the final held-out loss beside the twin's.
A job that stops making progress for ``3 x --hang + 120`` s is ended and said to have
needed a human.
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

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"kill_rank": 14, "term_job": 7, "stop_rank": 8}  # the issue's 29 interruptions


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
    from stabilize.bench.drills import DRILL_MONITORS

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


# Where a restart's seconds go: the first console line of each milestone after the signal
MILESTONES = {
    "noticed": ("died", "watchdog:", "preempt", "SIGTERM", "Signals.SIG"),
    "relaunched": ("elastic restart", "[soak] launched"),
    "configured": ("stabilize-train: ",),  # imports, Hydra, the data: the run's first line
    "restored": ("Restored all states",),  # the process group met, the checkpoint loaded
}


def phases(log: list[tuple[float, str]], t: float, first_step: float) -> dict[str, float]:
    """Seconds from each milestone to the next, the signal first and the first new step
    last; a milestone not seen is skipped (its time counts in the next one's)."""
    marks, prev = {}, t
    for name, words in MILESTONES.items():
        hit = next((u for u, line in log if prev <= u <= first_step
                    and any(w in line for w in words)), None)  # fmt: skip
        if hit is not None:
            marks[name], prev = hit - prev, hit
    marks["first step"] = first_step - prev
    return marks


def _relaunched(log: list[tuple[float, str]], t: float) -> float | None:
    """When new processes were started after ``t`` (torchrun's restart or a requeue)."""
    words = MILESTONES["relaunched"]
    return next((u for u, line in log if u > t and any(w in line for w in words)), None)


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
            back = _relaunched(log, pending["t"]) if pending is not None else None
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


def final_state(run_dir: Path) -> dict:
    """The run's end: its last checkpoint's weights and optimizer state, its held-out loss
    and its result."""
    import torch

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)  # fmt: skip
    ev = json.loads((run_dir / "final_eval.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    return {"weights": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"],
            "loss": ev["loss"], "result": result}  # fmt: skip


def bitwise_equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(bitwise_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def job_row(name: str, soaked: dict, tw: dict, a: dict | None, b: dict | None, steps) -> dict:
    ev = soaked["events"]
    restarts = [e["restart_s"] for e in ev if "restart_s" in e]
    lost = [e["lost"] for e in ev if "lost" in e]
    by = {k: sum(e["kind"] == k for e in ev) for k in KINDS}
    done = a is not None and a["result"]["status"] == "done"
    return {
        "job": name, "interruptions": len(ev), **by, "launches": soaked["launches"],
        "steps_lost": sum(lost), "lost_max": max(lost, default=0),
        "restart_median_s": statistics.median(restarts) if restarts else None,
        "restart_max_s": max(restarts, default=None),
        "effective": steps * tw["step_s"] / soaked["wall_s"],
        "twin_effective": steps * tw["step_s"] / tw["wall_s"],
        "bitwise": bool(a and b and bitwise_equal(a["weights"], b["weights"])
                        and bitwise_equal(a["optimizer"], b["optimizer"])),
        "loss": a["loss"] if a else None, "twin_loss": b["loss"] if b else None,
        "status": a["result"]["status"] if a else "missing", "done": done,
        "human": soaked["human"],
    }  # fmt: skip


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def tables(rows: list[dict], events: list[dict]) -> str:
    out = ["| job | interruptions (kill / term / stop) | launches | steps lost (max) | "
           "restart s, median (max) | effective (twin) | weights + AdamW = twin | "
           "held-out loss (twin) | result |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['job']} | {r['interruptions']} ({r['kill_rank']} / {r['term_job']} / "
            f"{r['stop_rank']}) | {r['launches']} | {r['steps_lost']} ({r['lost_max']}) | "
            f"{_f(r['restart_median_s'], '.1f')} ({_f(r['restart_max_s'], '.1f')}) | "
            f"{_f(r['effective'])} ({_f(r['twin_effective'])}) | "
            f"{'bitwise' if r['bitwise'] else 'NO'} | {_f(r['loss'], '.4f')} "
            f"({_f(r['twin_loss'], '.4f')}) | {r['status']}"
            f"{' (needed a human)' if r['human'] else ''} |"
        )  # fmt: skip
    out += ["", "| job | kind | rank | at step | resumed from | lost | restart s | exit |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in events:
        rank = "-" if e["kind"] == "term_job" else e["rank"]
        out.append(f"| {e['job']} | {e['kind']} | {rank} | {e['step']} | "
                   f"{e.get('resumed', '-')} | {e.get('lost', '-')} | "
                   f"{_f(e.get('restart_s'), '.1f')} | {e.get('exit', '-')} |")  # fmt: skip
    out += ["", "Where the restarts' seconds went (median seconds from one milestone to the "
            "next; n: interruptions of that kind):", "",
            "| kind | n | " + " | ".join(["noticed", *list(MILESTONES)[1:], "first step"])
            + " | total |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind in KINDS:
        done = [e for e in events if e["kind"] == kind and "phases" in e]
        if not done:
            continue
        cells = [_f(statistics.median([e["phases"].get(m, 0.0) for e in done]), ".1f")
                 for m in [*MILESTONES, "first step"]]  # fmt: skip
        total = statistics.median([e["restart_s"] for e in done])
        out.append(f"| {kind} | {len(done)} | {' | '.join(cells)} | {total:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="nan_loss,inf_grad,grad_spike,poisoned_item,stream_drift")
    p.add_argument("--steps", type=int, default=300, help="model steps per job (300)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (20)")
    p.add_argument("--hang", type=float, default=20, help="trainer.hang_timeout_s (20)")
    p.add_argument("--gap", type=float, default=20.0,
                   help="mean seconds of training between interruptions (20)")  # fmt: skip
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
    from stabilize.bench.docblock import commit, cpu

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
        from stabilize.bench.docblock import write_block

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
