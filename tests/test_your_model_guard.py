"""Issue 36, "Done when" 2: Hugging Face's LlamaForCausalLM (2 layers, 64 wide, from a
config) in a plain loop through ``stabilize.Guard``, fp16 CPU autocast with a GradScaler,
its norms swapped for ours reducing in fp16 (tests/your_llama.py). A residual drift planted
by the harness's own ``stream_drift`` fault makes the norms' fp16 sums of squares overflow:
the Guard's per-norm overflow counts equal an independent float64 count on the norm inputs
(hooks of the test's own), step by step; the step's bundle is replayed by
``stabilize-replay --bisect`` in a fresh process, which names the norms to put in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stabilize

pytest.importorskip("transformers")

from your_llama import build, lm_loss  # noqa: E402

HERE = Path(__file__).parent
FP16_INF_FROM = 65520.0  # the smallest float64 sum that fp16 rounds to inf
STEPS = 8


def _data(n=64, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = (torch.randint(0, 200, (n, 1), generator=g) + torch.arange(t + 1)) % 255
    return [(seq[i : i + 8, :-1], seq[i : i + 8, 1:]) for i in range(0, n, 8)]


def _overflow_rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows whose fp16-rounded squares sum past 65520 in float64, rows within 5% of it):
    an RMSNorm's reduction in fp16, counted independently of its code."""
    x16 = x.detach().half()
    finite = torch.isfinite(x16).all(-1)
    ss = x16.double().square().half().double().sum(-1)
    near = finite & ((ss - FP16_INF_FROM).abs() < 0.05 * FP16_INF_FROM)
    return int((finite & (ss >= FP16_INF_FROM)).sum()), int(near.sum())


def test_guard_counts_fp16_overflow_exactly_and_bisect_names_the_norms(tmp_path):
    model = build("fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run = tmp_path / "run"
    # the stream after block 0 pinned to |x| max 300 from step 4: rows whose RMS passes
    # 255.94 / sqrt(64) = 32 overflow the fp16 sum of squares of every norm that reads them
    fault = {"kind": "stream_drift", "layer": 0, "step": 4, "target": 300.0, "target_step": 5}
    rollback = {"enabled": False, "bundle": "always"}  # a bundle on the first warning
    guard = stabilize.Guard(model, opt, scaler, run_dir=run, loss_fn=lm_loss,
                            factory="your_llama:build", fault=fault, rollback=rollback,
                            log_every=1)  # fmt: skip
    names = [n for n, m in model.named_modules() if isinstance(m, stabilize_norm())]
    ref: dict[str, list[int]] = {}
    near = 0

    def count(name):
        def hook(module, args):
            nonlocal near
            if module.training:
                rows, close = _overflow_rows(args[0])
                ref[name] = [*ref.get(name, []), rows]
                near += close

        return hook

    for n in names:  # after the Guard's own hooks: they see what the norm receives
        model.get_submodule(n).register_forward_pre_hook(count(n))
    seen: list[dict[str, float]] = []
    for step, batch in enumerate(guard.batches(_data()), 1):
        ref.clear()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, batch)
        scaler.scale(loss).backward()
        verdict = guard.before_step(loss)
        seen.append({n: guard.last.norm_overflow[n] for n in names})
        want = {n: float(sum(ref[n])) for n in names}
        assert seen[-1] == want, (verdict.step, seen[-1], want)
        if verdict.apply:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if step == STEPS:
            break
    guard.close()
    # stabilize-report reads the Guard's run dir as it reads ours
    from stabilize.report import main as report_main

    assert report_main([str(run)]) == 0
    (arm,) = json.loads((run / "report" / "summary.json").read_text())
    assert (arm["precision"], arm["reduction"], arm["status"]) == ("fp16-mixed", "fp16", "done")
    assert arm["first_overflow"] == next(i for i, s in enumerate(seen) if sum(s.values())) + 1
    # before the drift none, after it some rows of some norms but not all (the counts tell
    # rows apart), rows near the line included (they agreed too)
    assert sum(seen[0].values()) == 0 and sum(seen[-1].values()) > 0
    rows = 8 * 32
    assert any(0 < v < rows for s in seen for v in s.values()), seen
    assert near > 0
    # the overflow monitor's verdict left a bundle; --bisect names the norms, in a fresh process
    first = next(i for i, s in enumerate(seen) if sum(s.values()) > 0) + 1
    bundles = sorted((run / "bundles").glob(f"step-{first:06d}-*"))
    assert bundles, sorted((run / "bundles").iterdir())
    meta = json.loads((bundles[0] / "meta.json").read_text())
    host = {k: v for k, v in meta["host"].items() if k != "fault"}
    assert host == {"kind": "guard", "factory": "your_llama:build",
                    "loss": "your_llama:lm_loss", "model_path": ""}  # fmt: skip
    assert meta["host"]["fault"]["kind"] == "stream_drift"  # the replay plants it again
    assert meta["precision"] == "fp16-mixed"
    exe = Path(sys.executable).parent / "stabilize-replay"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    r = subprocess.run([str(exe), "--bisect", str(bundles[0])], capture_output=True, text=True,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    over = [n for n in names if seen[first - 1][n] > 0]
    head, call = r.stdout.strip().splitlines()
    named = head.split("fp32 at ")[1].split(" clears")[0].split(", ")
    assert named == over, (named, over)  # exactly the norms that overflowed
    assert call.startswith("in the model's build, after its swap: stabilize.swap_norms(model, ")
    # the printed call, made on a fresh build: those norms reduce in fp32, the rest in fp16
    fresh = build("fp16")
    eval(call.split(": ", 1)[1], {"stabilize": stabilize, "model": fresh})  # noqa: S307
    got = {n: m.reduction_dtype for n, m in fresh.named_modules() if n in names}
    assert got == {n: "fp32" if n in over else "fp16" for n in names}


def stabilize_norm():
    from stabilize.norms import Norm

    return Norm
