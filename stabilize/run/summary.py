"""The run's last words on the console: steps taken vs asked, every
rollback (step, the verdict that caused it, the snapshot it went back to, the remedy) and
the config the run ended with where a remedy changed it; for a run the policy stopped
(``abort_summary``), the verdict it gave up on, the rollbacks before it, the layers nearest
the line and where the whole diagnosis is; and the straggler line the watchdog logs live.

Read from what the run left: ``events.jsonl`` (each rollback event, and the verdict event
just before it, at the same step), and the state ``runner.ended_with`` read off the live
module (the LR scale, the norms' reduction dtypes, the data position). No Lightning here.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from stabilize.report.rollbacks import Rollback, rollbacks
from stabilize.stability.grad_scan import origin

STRAGGLER_SHARE = 1.2  # a rank this much slower than the median rank is named

SHOWN = ("train/loss", "val/loss", "val/bpb", "final/val_bpb")  # on the done: line
MESSAGE_CHARS = 100  # a verdict's message, cut to this on the console (events.jsonl has it all)


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def rollback_line(n: int, rb: Rollback) -> str:
    c = rb.cause
    cause = f"{c['monitor']}: {_cut(c['message'])}" if c else "cause not in events.jsonl"
    did = ", ".join(f"{k} {v}" for k, v in rb.did.items())
    return (
        f"  rollback {n} at step {rb.step} ({cause}) -> back to step "
        f"{rb.restored_step}, remedy {rb.remedy}" + (f" ({did})" if did else "")
    )


def changed_config(cfg, ended: dict[str, Any]) -> list[str]:
    """``key before -> after`` for what the remedies changed (``cfg``: the RunConfig)."""
    out = []
    scale = ended.get("lr_scale", 1.0)
    lowered = ended.get("lr_lowered", scale)
    lr = cfg.optim.lr
    if scale != 1.0:
        out.append(f"optim.lr x{scale:g} ({lr:g} -> {lr * scale:g})")
    elif lowered != 1.0:
        out.append(f"optim.lr x{lowered:g} after a rollback, warmed back to {lr:g} (lower_lr)")
    dtypes = ended.get("reduction_dtypes") or []
    asked = cfg.model.norm.reduction_dtype
    if dtypes and dtypes != [asked]:
        out.append(f"norm.reduction_dtype {asked} -> {', '.join(dtypes)}")
    if ended.get("batches_skipped"):
        out.append(f"data: {ended['batches_skipped']} batches skipped")
    return out


def final_summary(cfg, result: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """The console lines ending a finished run (rank 0 prints them)."""
    t = cfg.trainer
    asked = t.max_steps if t.stop_at_step is None else min(t.max_steps, t.stop_at_step)
    m = result["metrics"]
    rbs = rollbacks(events)
    steps = f"done: {result['model_step']} steps ({asked} asked"
    extra = result["global_step"] - result["model_step"]
    if rbs and extra > 0:
        steps += f"; {extra} more were run and undone by {len(rbs)} rollback(s)"
    metrics = ", ".join(f"{k} {m[k]:.4f}" for k in SHOWN if k in m)
    lines = [steps + ")" + (f", {metrics}" if metrics else "")]
    lines += [rollback_line(i + 1, rb) for i, rb in enumerate(rbs)]
    scanned = grad_scan_line(events)
    if scanned:
        lines.append(scanned)
    changed = changed_config(cfg, result.get("ended_with") or {})
    if changed:
        lines.append("ended with: " + "; ".join(changed) + " (the remedies')")
    elif rbs:
        lines.append("ended with: the config asked for (no remedy changed it)")
    unfired = unfired_line(result.get("fault"))
    if unfired:
        lines.append(unfired)
    if len(result.get("ranks") or []) > 1:
        lines.append(ranks_line(result["ranks"]))
    if result.get("wandb_offline_dir"):
        d = result["wandb_offline_dir"]
        lines.append(f"W&B offline run: {d} (to upload: wandb sync {d})")
    if result.get("hf_dir"):
        lines.append(f"Hugging Face model: {result['hf_dir']} (from_pretrained loads it)")
    lines.append(f"run dir: {result['run_dir']}")
    return lines


def unfired_line(fault: dict[str, Any] | None) -> str | None:
    """An armed fault that never fired: a quiet run is then no drill."""
    if not fault or fault.get("fired"):
        return None
    return (
        f"fault {fault['kind']} was armed but never fired: it fires {fault['trigger']}, and "
        "no step of this run did; nothing above was caused by it"
    )


def grad_scan_line(events: list[dict[str, Any]]) -> str | None:
    """The first step whose own gradients were found non-finite, and the module named."""
    for e in events:
        info = (e.get("extra") or {}).get("grad_scan") or {}
        if info.get("grad_module"):
            return f"first non-finite gradient, at step {e['step']}: {origin(info)}"
    return None


def ranks_line(ranks: list[dict[str, Any]]) -> str:
    """Each rank's own time per step (its batch wait and forward: no collective runs there
    under DDP) and its share of the median rank's (lit/watchdog.py); stragglers named."""
    cells = [f"rank {r['rank']} {r['own_ms_per_step']:.1f} ms ({r['share']:.2f}x)" for r in ranks]
    slow = [r["rank"] for r in ranks if r["share"] >= STRAGGLER_SHARE]
    tail = f"; straggler: rank {', '.join(map(str, slow))}" if slow else ""
    return "own time per step (batch wait + forward): " + ", ".join(cells) + tail


# the watchdog's live line (lit/watchdog.py): once every rank has this many steps behind it
STRAGGLER_STEPS = 20


def straggler_line(beats: dict[int, dict]) -> str | None:
    """From the watchdog's beats: the ranks whose own time per step (``own_s / steps``) is
    at least ``STRAGGLER_SHARE`` x the median rank's, as one line; None when none are yet."""
    per = {r: b["own_s"] / b["steps"] for r, b in beats.items()
           if b.get("steps", 0) >= STRAGGLER_STEPS and "own_s" in b}  # fmt: skip
    if len(per) < 2 or len(per) < len(beats):
        return None
    median = statistics.median(per.values()) or 1.0
    slow = {r: t / median for r, t in per.items() if t / median >= STRAGGLER_SHARE}
    if not slow:
        return None
    cells = ", ".join(f"rank {r} {1e3 * per[r]:.1f} ms ({s:.2f}x)" for r, s in sorted(slow.items()))
    return (f"[watchdog] straggler: {cells} against the median rank's {1e3 * median:.1f} ms "
            "of own time per step (batch wait + forward)")  # fmt: skip


def abort_summary(diagnosis: dict[str, Any], events: list[dict[str, Any]], run_dir) -> list[str]:
    """The console lines ending a run the rollback policy gave up on (exit code 3), read
    from the diagnosis the controller wrote (``diagnosis.json``) and the run's events: the
    same rollback lines as a finished run's summary, so the two read alike."""
    d = diagnosis
    where = f" in {d['layer']}" if d.get("layer") else ""
    lines = [f"stability abort at step {d.get('step')}: {d.get('reason')}"]
    if d.get("monitor"):
        lines.append(f"  the verdict: {d['monitor']}{where}: {_cut(d.get('message', ''))}")
    rbs = rollbacks(events)
    lines += [rollback_line(i + 1, rb) for i, rb in enumerate(rbs)]
    if not rbs:
        lines.append("  no rollback before it")
    scan = d.get("grad_scan") or {}
    if scan.get("grad_module"):
        lines.append(f"  first non-finite gradient: {origin(scan)}")
    top = d.get("act_max_top") or []
    if top:
        lines.append("  largest |x| at the last step: " + ", ".join(f"{k} {v:.3g}" for k, v in top))
    near = d.get("forecast_steps_left") or {}
    if near:
        lines.append(
            "  forecast, steps to the line: " + ", ".join(f"{k} {v:.0f}" for k, v in near.items())
        )
    lines.append(f"diagnosis: {Path(run_dir) / 'diagnosis.json'}")
    lines.append(f"run dir: {run_dir}")
    return lines
