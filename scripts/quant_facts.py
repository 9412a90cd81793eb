"""Print the measured facts behind docs/design-formats.md: headroom counts and delayed scaling.

    python scripts/quant_facts.py            # counts and the delayed-scaling growth table
    python scripts/quant_facts.py --cost     # also Float8Linear's emulation cost (torchao)

Three tensors of 1024 x 1024 (seed 0): Gaussian; heavy-tailed (Student t, 3 degrees of
freedom); Gaussian with one channel (column) 100x larger, the outlier-feature shape of LLM
activations. Each under every scheme the ``quant`` recipes use, with the six headroom counts.
Then a tensor growing by a factor r each step under delayed scaling (history 16 and 1024,
margin 0 and 1): the share of steps whose largest value is clipped.
"""

from __future__ import annotations

import argparse
import time

import torch

from stabilize.quant.headroom import Headroom, headroom
from stabilize.quant.quantize import Scheme
from stabilize.quant.scaling import DelayedScaling

SCHEMES = {
    "fp8 tensor e4m3": Scheme("tensor", "e4m3"),
    "fp8 tensor e5m2": Scheme("tensor", "e5m2"),
    "fp8 rowwise e4m3": Scheme("rowwise", "e4m3", pow2=True),
    "mxfp8 floor": Scheme("mx", "e4m3", scale_rounding="floor"),
    "mxfp8 rceil": Scheme("mx", "e4m3", scale_rounding="rceil"),
    "nvfp4": Scheme("nvfp4", "e2m1"),
}


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(1024, 1024, generator=gen)
    chi2 = torch.randn(3, 1024, 1024, generator=gen).pow(2).sum(0) / 3
    student = torch.randn(1024, 1024, generator=gen) / chi2.sqrt()
    outlier = torch.randn(1024, 1024, generator=gen)
    outlier[:, 7] *= 100
    return {"gaussian": gauss, "student-t3": student, "outlier channel": outlier}


def counts_table() -> None:
    names = Headroom.names()
    print("| tensor | scheme | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for tname, x in tensors().items():
        for sname, scheme in SCHEMES.items():
            c = Headroom.unstack(headroom(x, scheme).stack())
            cells = [f"{c['amax']:.3g}", f"{c['amax_ratio']:.4f}"]
            cells += [f"{c[k]:.2e}" for k in ("saturated", "underflow", "clipped_blocks")]
            cells.append(f"{c['sqnr_db']:.1f}")
            print(f"| {tname} | {sname} | " + " | ".join(cells) + " |")


def growth_table(steps: int = 200) -> None:
    base = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    cols = ("growth per step", "history", "margin", "steps clipped", "first clipped", "saturated")
    print("\n| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|")
    for rate in (1.01, 1.03, 1.04, 1.05, 1.5, 2.1):
        for hist in (16, 1024):
            for margin in (0, 1):
                state = DelayedScaling(history=hist, margin=margin)
                clipped, first, sat = 0, None, 0.0
                for step in range(steps):
                    x = base * rate ** min(step, 60)  # grows for 60 steps, then holds
                    h = headroom(x, Scheme("delayed"), scale=state.scale)
                    state.update(x.abs().amax())
                    if step == 0:
                        continue  # scale 1 before any history: not the growth's doing
                    if h.clipped_blocks.item() > 0:
                        clipped += 1
                        first = step if first is None else first
                    sat += h.saturated.item()
                print(
                    f"| {rate} | {hist} | {margin} | {clipped} / {steps - 1} | {first} | "
                    f"{sat / (steps - 1):.2e} |"
                )


def cost_table(width: int = 512, steps: int = 20) -> None:
    from stabilize.quant import ao

    def step_time(model, autocast):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, width)
        best = float("inf")
        for _ in range(steps):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            best = min(best, time.perf_counter() - t0)
        return best

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    base = step_time(mlp(), autocast=True)
    print(f"\nMLP {width} -> {4 * width} -> {width}, batch 256, best of {steps} steps")
    print("| arm | step ms | vs bf16 |\n|---|---|---|")
    print(f"| bf16 autocast | {base * 1e3:.1f} | 1.00 |")
    for recipe in ("tensorwise", "rowwise"):
        m = mlp()
        ao.convert_float8(m, recipe, emulate=True)
        t = step_time(m, autocast=True)
        print(f"| Float8Linear {recipe}, emulate | {t * 1e3:.1f} | {t / base:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost", action="store_true", help="also time torchao's fp8 emulation")
    args = p.parse_args()
    counts_table()
    growth_table()
    if args.cost:
        cost_table()


if __name__ == "__main__":
    main()
