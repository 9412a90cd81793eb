"""The fault soak's measurements and tables (``scripts/soak.py`` runs the jobs): where a
restart's seconds go, the bitwise comparison of a job's end with its twin's, and the
Markdown it prints."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

KINDS = {"kill_rank": 14, "term_job": 7, "stop_rank": 8}  # a scheduler's mix, by weight


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


def relaunched(log: list[tuple[float, str]], t: float) -> float | None:
    """When new processes were started after ``t`` (torchrun's restart or a requeue)."""
    words = MILESTONES["relaunched"]
    return next((u for u, line in log if u > t and any(w in line for w in words)), None)


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
