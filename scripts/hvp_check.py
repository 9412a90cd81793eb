"""The Hessian-vector product by differences of gradients against an exact double backward,
on the tiny GPT (docs/design-spikes.md section 2): for three directions (the sign of the
gradient, as AdamW's update goes; the gradient; a random one) and three step sizes, the
curvature u^T H u / ||u||^2 by a forward and by a central difference, each as a relative
error against the double backward (PyTorch's math attention kernel, which has one).

Writes its table into the ``hvp-check`` block of ``--doc`` (docs/design-spikes.md).

Usage: python scripts/hvp_check.py [--threads 2] [--doc docs/design-spikes.md]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch

from benchmarks.docblock import commit, cpu, write_block
from stabilize.model import build_model
from stabilize.model.config import GPTConfig
from stabilize.model.logits import lm_loss
from stabilize.report.markdown import table
from stabilize.stability.curvature import dot64, double_backward_hvp, hvp_difference

RELS = (1e-3, 1e-4, 1e-5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc", type=Path, default=Path("docs/design-spikes.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
    torch.manual_seed(0)
    m = build_model(GPTConfig(n_layer=2, d_model=64, n_head=2, block_size=32, vocab_size=256))
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    ps = list(m.parameters())

    def grad():
        return list(torch.autograd.grad(lm_loss(m(x), y), ps))

    g0 = grad()
    directions = {
        "sign(g) (AdamW-like)": [g.sign() * 1e-3 + 1e-4 * torch.randn_like(g) for g in g0],
        "g": [g.clone() for g in g0],
        "random": [torch.randn_like(g) for g in g0],
    }
    rows = [["direction", "rel", "forward difference", "central difference"]]
    for name, u in directions.items():
        exact = double_backward_hvp(lambda: lm_loss(m(x), y), ps, u)
        uu = float(dot64(u, u))
        want = float(dot64(u, exact)) / uu
        for rel in RELS:
            central, h = hvp_difference(ps, u, grad, rel)
            with torch.no_grad():  # the forward difference: g(theta + h u) - g(theta)
                saved = [p.detach().clone() for p in ps]
                for p, d in zip(ps, u, strict=True):
                    p.add_(d, alpha=h)
            g1 = grad()
            with torch.no_grad():
                for p, s in zip(ps, saved, strict=True):
                    p.copy_(s)
            fwd = float(dot64(u, [a - b for a, b in zip(g1, g0, strict=True)])) / h / uu
            cen = float(dot64(u, central)) / uu
            rows.append([name, f"{rel:g}", f"{100 * (fwd / want - 1):+.3g}%",
                         f"{100 * (cen / want - 1):+.3g}%"])  # fmt: skip
    cmd = "python scripts/hvp_check.py " + shlex.join(sys.argv[1:])
    body = (f"Measured at {commit()} on {cpu()}, {args.threads} threads, with `{cmd.strip()}`: "
            "the tiny GPT in fp32 (2 layers x 64, a batch of 4 x 32 tokens), each quotient's "
            f"error against an exact double backward.\n\n{table(rows)}")  # fmt: skip
    print(body)
    return write_block(args.doc, "hvp-check", body, "hvp_check.py")


if __name__ == "__main__":
    sys.exit(main())
