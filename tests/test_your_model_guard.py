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
from your_lm import nan_once  # noqa: E402

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
    r = subprocess.run([str(exe), "--bisect", "--trust-code", str(bundles[0])],
                       capture_output=True, text=True,
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


class HalfRMSNorm(torch.nn.Module):
    """A user's own RMSNorm that reduces in fp16 (its sum of squares rounds to inf from
    65520 on), not ours and not swapped: found by duck typing, its reduction measured."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.half()
        ss = (h * h).sum(-1, keepdim=True)
        return (h * torch.rsqrt(ss / h.shape[-1] + self.eps)).to(x.dtype) * self.weight


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.proj = HalfRMSNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class _Tiny(torch.nn.Module):
    def __init__(self, d=64, vocab=256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _tiny_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_a_users_own_fp16_norm_is_counted_as_its_reduction_overflows(tmp_path):
    """A norm that is not ours and reduces in fp16: the probe counts the rows whose fp16 sum
    of squares overflows (and that come out as zeros) as a float64 count of the fp16-rounded
    squares does, step by step, on rows that differ (some over the line, some under)."""
    from stabilize.norms.surgery import find_norms

    torch.manual_seed(0)
    model = _Tiny()
    with torch.no_grad():  # rows of RMS ~30: sums of squares around 65520 at D = 64
        model.emb.weight.mul_(30.0)
    assert {n.reduction_dtype for n in find_norms(model)} == {"fp16"}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(model, opt, run_dir=tmp_path / "run", loss_fn=_tiny_loss,
                            rollback={"enabled": False}, log_every=1)  # fmt: skip
    names = [n.name for n in find_norms(model)]
    ref: dict[str, int] = {}

    def count(name):
        def hook(module, args):
            ref[name] = ref.get(name, 0) + _overflow_rows(args[0])[0]

        return hook

    for n in names:
        model.get_submodule(n).register_forward_pre_hook(count(n))
    seen = []
    for step, batch in enumerate(guard.batches(_data()), 1):
        ref.clear()
        loss = _tiny_loss(model, batch)
        loss.backward()
        v = guard.before_step(loss)
        got = {n: guard.last.norm_overflow[n] for n in names}
        assert got == {n: float(ref[n]) for n in names}, (step, got, ref)
        assert {n: guard.last.norm_collapsed[n] for n in names} == got  # finite rows: dead
        seen.append(got)
        if v.apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 3:
            break
    guard.close()
    rows = 8 * 32
    assert any(0 < c < rows for s in seen for c in s.values()), seen


def test_a_rolled_back_step_leaves_the_users_loop_and_scaler_going(tmp_path):
    """Rollback on, fp16 autocast with a GradScaler: a NaN planted once in block 1's output
    at step 4 is judged before the optimizer step; before_step returns apply=False with the
    model, optimizer and scaler already restored, and the user's loop (skipping that step)
    goes on: the next unscale_ finds the scaler ready, and the model ends healthy."""
    model = build("fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = stabilize.Guard(model, opt, scaler, run_dir=tmp_path / "run", loss_fn=lm_loss,
                            rollback={"snapshot_every": 2})  # fmt: skip
    model.model.layers[1].register_forward_hook(nan_once(4))  # step 4's forward, once
    verdicts = []
    for step, batch in enumerate(guard.batches(_data(n=96)), 1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, batch)
        scaler.scale(loss).backward()
        v = guard.before_step(loss)
        verdicts.append(v)
        if v.apply:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if step == 10:
            break
    guard.close()
    assert [v.apply for v in verdicts].count(False) == 1
    bad = next(v for v in verdicts if not v.apply)
    assert bad.step == 4 and any(e.monitor == "nonfinite" for e in bad.events)
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (rolled,) = [e for e in events if e["monitor"] == "rollback"]
    assert rolled["extra"]["restored_step"] == 2 and rolled["extra"]["class"] == "transient"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # 10 batches: steps 1-3 applied, step 4 judged bad and the model back at step 2, then
    # 6 more applied
    assert json.loads((tmp_path / "run" / "result.json").read_text())["model_step"] == 8


def test_the_amp_clipping_recipe_runs_under_the_guard(tmp_path):
    """torch's AMP recipe: unscale_, clip, then the Guard judges (it reads that the scaler
    already unscaled and does not again: a second unscale_ raises) and the scaler steps.
    The norm the monitors judged is the clipped one."""
    model = build("fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = stabilize.Guard(model, opt, scaler, run_dir=tmp_path / "run", loss_fn=lm_loss)
    norms = []
    for step, batch in enumerate(guard.batches(_data()), 1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert guard.before_step(loss).apply
        norms.append(guard.last.grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if step == 3:
            break
    guard.close()
    assert guard.model_step == 3 and all(n <= 0.5 + 1e-4 for n in norms), norms
