"""Where the stability probe's time goes inside a real tiny run, and one of its passes alone.

    python scripts/probe_clock.py [--steps 100] [--threads 1]

Wraps each probe method and forward hook, and the stability callback's hooks, with a
perf_counter (the run syncs once a step anyway; on CPU nothing is asynchronous) over
``--steps`` steps after 20 of warm-up, and prints ms per step for each. Then times the
attention bound's q pass (``head_norm_max``) on a q tensor captured from the same
model, hot and alone (the kernel, and torch's vector_norm it replaced, side by side),
beside the in-run time of the hook that runs it.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L
import torch

import stabilize.lit.stability as CB
import stabilize.stability.probe as P
from benchmarks.lib import CONFIGS, compose_cfg, run_overrides, train_with
from stabilize.model.gpt import GPT

spent: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()
ON = [False]


def clocked(label, f):
    def g(*a, **k):
        if not ON[0]:
            return f(*a, **k)
        t = time.perf_counter()
        out = f(*a, **k)
        spent[label] += time.perf_counter() - t
        calls[label] += 1
        return out

    return g


def instrument() -> None:
    for name in ("record_norm", "record_log_z", "record_params", "reset"):
        setattr(P.StabilityProbe, name, clocked(name, getattr(P.StabilityProbe, name)))
    for name in ("_q_hook", "_k_hook", "_block_hook"):  # hook factories: clock what they make
        make = getattr(P.StabilityProbe, name)
        setattr(P.StabilityProbe, name,
                lambda self, i, make=make, name=name: clocked(name, make(self, i)))  # fmt: skip
    for name in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
        hook = getattr(CB.StabilityCallback, name)
        setattr(CB.StabilityCallback, name, clocked(f"callback.{name}", hook))


class Window(L.Callback):
    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 20:
            ON[0], self.t0 = True, time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 20 + self.steps:
            ON[0], self.t1 = False, time.perf_counter()


def q_alone(cfg, reps: int = 300) -> dict[str, float]:
    """µs a call of the q hook's op on a q tensor of the same model and batch (the strided
    view the hook gets), hot, alone: the kernel (``head_norm_max``) and torch's
    ``vector_norm(q).amax``, interleaved in rounds so a drift hits both."""
    model = GPT(cfg.model).train()
    got = {}
    model.h[0].attn.q_norm.register_forward_hook(lambda m, a, out: got.setdefault("q", out))
    model(torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.block_size)))
    q = got["q"].detach()
    ops = {
        "head_norm_max": lambda: P.head_norm_max(q),
        "vector_norm": lambda: torch.linalg.vector_norm(q.float(), dim=-1).amax(dim=(0, 2)),
    }
    spent = dict.fromkeys(ops, 0.0)
    with torch.no_grad():
        for _ in range(10):
            for name, op in ops.items():
                op()
                t = time.perf_counter()
                for _ in range(reps // 10):
                    op()
                spent[name] += time.perf_counter() - t
    return {k: 1e6 * v / (reps // 10 * 10) for k, v in spent.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    instrument()
    with tempfile.TemporaryDirectory(prefix="probe_clock-") as tmp:
        overrides = run_overrides(CONFIGS["tiny"], "fp32", 25 + a.steps, "wandb")
        cfg = compose_cfg(str(Path(tmp) / "r"), overrides)
        w = Window(a.steps)
        train_with(cfg, w)
    n = a.steps
    print(f"tiny fp32, {a.threads} thread(s): {1000 * (w.t1 - w.t0) / n:.2f} ms a step over {n}")
    for k, v in sorted(spent.items(), key=lambda t: -t[1]):
        print(f"  {k:36s} {1000 * v / n:7.3f} ms a step ({calls[k]} calls)")
    per_call = 1e6 * spent["_q_hook"] / max(calls["_q_hook"], 1)
    alone = q_alone(cfg)
    print(f"q hook: {per_call:.0f} µs a call in the run; its op alone, hot: "
          f"{alone['head_norm_max']:.0f} µs (torch's vector_norm: {alone['vector_norm']:.0f} µs, "
          f"{alone['vector_norm'] / alone['head_norm_max']:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
