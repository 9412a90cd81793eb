"""What the activation forecast's per-step refit costs (it refits every step).

    python scripts/bench_forecast.py [--steps 300] [--layers 2,24] [--step-reps 20]

The forecaster (stabilize/monitors/forecast.py) is fed one value per unit per step, as the
activation monitor feeds it: a unit is (norm, line), two lines (|x| max vs 256, row RMS vs
255.94/sqrt(D)) for each norm of a default pre-norm GPT of that depth (built on the meta
device; a pre-norm block's output is the next norm's input, so it adds no unit). The series
are a slow exponential climb with 5% noise, so every unit is fitted every step (the worst
case: a unit with too few points is not; "fitted" counts the last step's projections).
Printed per depth: the refit's median and 90th percentile per
step (host clock, after 20 warm-up steps), and, measured in the same process, its share of
one fp32 training step of the tiny GPT (forward, backward, AdamW; ``model=tiny``, batch 8 x
64 tokens, plain torch), the smallest step this harness runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from stabilize.model import GPT, GPTConfig
from stabilize.monitors.forecast import ForecastConfig, LineForecaster
from stabilize.norms import Norm

WARMUP = 20


def norm_names(n_layer: int) -> list[str]:
    """The norms of a default (pre-norm) GPT of ``n_layer`` blocks, built on the meta
    device: the layers the activation monitor forecasts."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer))
    return [name for name, m in model.named_modules() if isinstance(m, Norm)]


def refit_times(n_layer: int, steps: int, seed: int = 0) -> tuple[list[float], int, int]:
    """Seconds per ``LineForecaster.update`` for a GPT of ``n_layer`` blocks, after the
    warm-up; the units fed each step and those the last update projected."""
    rng = np.random.default_rng(seed)
    norms = norm_names(n_layer)
    level = rng.uniform(0.01, 0.1, len(norms))
    fc, out, fitted = LineForecaster(ForecastConfig()), [], 0
    for step in range(steps):
        ratio = level * np.exp(0.01 * step) * (1 + 0.05 * rng.standard_normal(len(norms)))
        values = {}
        for name, r in zip(norms, ratio, strict=True):
            values[(name, "abs")] = (float(r) * 256.0, 256.0)
            values[(name, "rms")] = (float(r) * 5.66, 5.66)
        t = time.perf_counter()
        fitted = len(fc.update(values))
        out.append(time.perf_counter() - t)
    return out[WARMUP:], len(values), fitted


def tiny_step_time(reps: int = 20) -> float:
    """Median seconds of one fp32 training step of the tiny GPT, plain torch."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 64))
    times = []
    for _ in range(reps + 3):
        t = time.perf_counter()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", default="2,24", help="GPT depths (2: tiny, 24: gpt-1.3b)")
    ap.add_argument("--step-reps", type=int, default=20, help="tiny training steps timed")
    args = ap.parse_args(argv)
    step = tiny_step_time(args.step_reps)
    print(f"tiny GPT fp32 training step (plain torch): {1e3 * step:.1f} ms (median)")
    print("| blocks | units | fitted | refit ms/step (median) | p90 | share of a tiny step |")
    print("|---|---|---|---|---|---|")
    for n in (int(v) for v in args.layers.split(",")):
        ts, units, fitted = refit_times(n, args.steps + WARMUP)
        med, p90 = statistics.median(ts), float(np.percentile(ts, 90))
        print(
            f"| {n} | {units} | {fitted} | {1e3 * med:.2f} | {1e3 * p90:.2f} | {med / step:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
