"""Fault drills: every fault kind on 1 process and on 2 ranks (torchrun, gloo), and what the
harness made of it: the monitor that called it (and when), the class the re-run
classification assigned, the ranks it blamed, the remedy chosen and the outcome.

    python scripts/drills.py                # every drill, 1 and 2 ranks (~10 min on 2 cores)
    python scripts/drills.py --ranks 1 --only nan_loss,poisoned_batch
    python scripts/drills.py --keep DIR --reuse   # a drill whose run dir is finished is read

Each drill is a real launch (``stabilize-train``, or ``scripts/launch.sh`` for 2 ranks) of
the tiny model on CPU; the table is read back from the run dirs (events.jsonl,
result.json, replicas.json, skipped_batches.json). Prints a Markdown table, a row as each
drill ends (docs/rollback.md has one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.docblock import commit, cpu, replace_block
from benchmarks.drills import DRILL_MONITORS

ROOT = Path(__file__).resolve().parents[1]

STEPS = 12
COMMON = [
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=100",
    "trainer.limit_val_batches=2",
    "trainer.checkpoint_every_n_steps=100",
    "trainer.progress=plain",
    "trainer.accelerator=cpu",
    "data.batch_size=4",
    "model.block_size=64",
    "optim.warmup_steps=2",
    "logger=none",
    *DRILL_MONITORS,
    "monitor.replicas.every=4",
]
DRIFT = [
    "fault=activation_drift",
    "fault.cross_step=8",
    "fault.step=3",
    "fault.target_step=null",
    "fault.channels=1",
    "norm=rmsnorm",
    "norm.reduction_dtype=fp16",
    "model.init_std=0.1",
    "monitor.activation.on_overflow=rollback",
]
FLIP = ["fault=bitflip", "fault.param=h.1.mlp.c_fc.weight"]
# name -> overrides; a fault aimed at one rank is on the last one (rank 1 of 2)
DRILLS = {
    "nan_loss": ["fault=nan_loss", "fault.step=6"],
    "nan_loss (persistent)": ["fault=nan_loss", "fault.step=6", "fault.persistent=true"],
    "inf_grad": ["fault=inf_grad", "fault.step=6", "fault.param=h.1.mlp.c_fc.weight"],
    "inf_grad (persistent)": [
        "fault=inf_grad",
        "fault.step=6",
        "fault.param=h.1.mlp.c_fc.weight",
        "fault.persistent=true",
    ],
    # no fault: fp16 activations with an fp16 RMSNorm reduction overflow in the backward
    # at init (docs/norms.md); the scaler skips every step
    "fp16 reduction at init": [
        "precision=fp16-mixed",
        "norm=rmsnorm",
        "norm.reduction_dtype=fp16",
        "monitor.loss_scale.max_consecutive_skips=2",
    ],
    "grad_spike": ["fault=grad_spike", "fault.step=8", "fault.factor=1e4"],
    "activation_drift": DRIFT,
    "poisoned_batch": ["fault=poisoned_batch", "fault.batch=5"],
    "bitflip (grad, bit 30)": [*FLIP, "fault.flip=grad", "fault.bit=30", "fault.step=8"],
    "bitflip (param, bit 20)": [*FLIP, "fault.flip=param", "fault.bit=20", "fault.step=5"],
}


def launch(overrides: list[str], ranks: int, run_dir: Path) -> int:
    env = {
        **os.environ,
        "STABILIZE_RUN_DIR": str(run_dir),
        "WANDB_MODE": "offline",
        "HF_DATASETS_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        # one thread per process, as torchrun sets: a second OpenMP thread stalls whenever
        # another job holds a core (measured here: 1-process drills ran 6x slower)
        "OMP_NUM_THREADS": "1",
    }
    if ranks == 1:
        cmd = [sys.executable, "-m", "stabilize.train", *overrides, f"hydra.run.dir={run_dir}"]
    else:
        cmd = [str(ROOT / "scripts" / "launch.sh"), "--nproc-per-node", str(ranks), *overrides]
    r = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True)
    if r.returncode not in (0, 3):
        sys.stderr.write(r.stderr[-3000:])
    return r.returncode


def read(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def summarize(run_dir: Path, rc: int, ranks: int) -> dict[str, str]:
    """One table row's cells from a finished drill's run dir."""
    evs = read(run_dir)
    verdicts = [e for e in evs if e["kind"] == "rollback" and e["monitor"] != "rollback"]
    rolls = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    seen: dict[tuple, dict] = {}
    for v in verdicts:  # the first of a step's verdicts is acted on (a drift: one per norm)
        seen.setdefault((v["monitor"], v["step"]), v)
    detected = ", ".join(f"{m} @{s}" for m, s in seen) or "-"
    classes = ", ".join(str(v["extra"].get("class")) for v in seen.values()) or "-"
    blamed = []
    for v in seen.values():
        x = v["extra"]
        if "ranks" in x:
            blamed.append(f"rank {x['ranks']}")
        if "batches" in x:
            blamed.append(f"batch {x['batches']}")
        for r in x.get("localization", []):  # per rank: the forward's, else the backward's
            if r.get("module"):
                blamed.append(f"rank {r['rank']}: fwd {r['module']}")
            elif r.get("grad_module"):
                came = "" if r.get("grad_incoming_finite") else ", incoming non-finite"
                where = f"bwd {r['grad_module']}{came}"
                if r.get("from_loss"):  # no module made it (localize.py)
                    where = f"fwd {r['from_forward']}" if r.get("from_forward") else "the loss"
                blamed.append(f"rank {r['rank']}: {where}")
    remedies = " -> ".join(e["extra"]["remedy"] for e in rolls) or "-"
    result = {}
    if (run_dir / "result.json").exists():
        result = json.loads((run_dir / "result.json").read_text())
    if rc == 3:
        outcome = "abort (exit 3): ladder exhausted"
    elif rc == 0:
        outcome = f"done, step {result.get('model_step', '?')}"
        rep = run_dir / "replicas.json"
        if ranks > 1 and rep.exists():
            same = json.loads(rep.read_text())["identical"]
            outcome += ", replicas identical" if same else ", REPLICAS DIFFER"
    else:
        outcome = f"failed (exit {rc})"
    return {
        "detected": detected,
        "class": classes,
        "blamed": "; ".join(dict.fromkeys(blamed)) or "-",
        "remedy": remedies,
        "outcome": outcome,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2", help="comma-separated process counts")
    ap.add_argument("--only", default="", help="comma-separated drill names (default: all)")
    ap.add_argument("--keep", default=None, help="keep the run dirs under this directory")
    ap.add_argument("--reuse", action="store_true", help="read finished drills, don't rerun")
    ap.add_argument("--doc", type=Path, help="also write the table into this doc, between its "
                    "<!-- drills:begin/end --> markers (docs/rollback.md)")  # fmt: skip
    args = ap.parse_args()
    names = [n for n in DRILLS if not args.only or n.split(" ")[0] in args.only.split(",")]
    base = Path(args.keep or tempfile.mkdtemp(prefix="drills-"))
    cols = ["fault", "ranks", "detected", "class", "blamed", "remedy", "outcome"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print(f"Drills: tiny GPT on CPU, {STEPS} steps, fault on the last rank; replica check every 4")
    print("\n".join(table), flush=True)
    t_all = time.time()
    for name in names:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
            run_dir = base / f"{slug}-{ranks}p" / "run"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            done = run_dir / "result.json"
            if args.reuse and done.exists():
                status = json.loads(done.read_text()).get("status")
                rc = {"done": 0, "aborted": 3}.get(status, 1)
            else:
                rc = launch([*COMMON, *DRILLS[name], f"fault.rank={ranks - 1}"], ranks, run_dir)
            row = {"fault": name, "ranks": str(ranks), **summarize(run_dir, rc, ranks)}
            table.append("| " + " | ".join(row[c] for c in cols) + " |")
            print(table[-1], flush=True)
            print(f"# {name} on {ranks}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.doc:
        cmd = " ".join(["python scripts/drills.py", *sys.argv[1:]])
        head = (f"Measured by `{cmd}` at commit {commit()}, on {cpu()} (OMP_NUM_THREADS=1 per "
                f"process), {time.time() - t_all:.0f} s. Written by the script: do not edit by "
                "hand.")  # fmt: skip
        err = replace_block(args.doc, "drills", head + "\n\n" + "\n".join(table))
        if err:
            print(f"drills.py: {err}", file=sys.stderr)
            raise SystemExit(2)


if __name__ == "__main__":
    main()
