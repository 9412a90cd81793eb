"""Time forward+backward of every norm type x backend x reduction x dtype, side by side.

Each candidate is the real module from ``build_norm`` (parameters cast to the input dtype,
autocast off), run forward and then backward with a fixed random upstream gradient into x
and the parameters. Every time is printed in milliseconds and as a ratio to two references
measured in the same rounds, in the same dtype and shape:

- ``F.layer_norm`` with gamma and beta (the bar a norm has to meet), and
- ``out.copy_(x)``, a plain memory copy: the physical floor for a memory-bound op.

Fairness on a noisy machine: every candidate is warmed up first (its first call, which
includes torch.compile for compiled ones and the one-time C++ build, or cache load, of the
``fused`` CPU kernel, is reported separately and not counted), then all
candidates of a (dtype, shape) group run round-robin, one call each per round with the order
rotated every round, and the median per candidate is kept.

Targets (CPU, from the issue):
- T1: the ``auto`` backend's RMSNorm (fp32 reduction) is no slower than F.layer_norm:
  ratio <= 1.1, in every dtype, at every shape.
- T2: an fp32 reduction costs at most 10% over one in the input dtype, for 16-bit inputs:
  explicit-fp32 vs explicit-input, and auto-fp32 vs explicit-input. For fp32 inputs the two
  reductions are the same computation, so T2 does not apply there.

Usage: python scripts/bench_norms.py [--quick] [--shapes 4096x2048] [--markdown-out PATH]
--quick: 1024x512 only, 3 rounds (< 60 s with a cold compile cache). On a shared machine whose
cores are busy, --threads 1 avoids OpenMP stalls; the "spread %" column (IQR / median) shows noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch
import torch.nn.functional as F

from benchmarks.stats import load_average, md_table, quartiles
from stabilize.norms import (
    BACKENDS,
    NORM_TYPES,
    REDUCTION_DTYPES,
    NormConfig,
    build_norm,
    has_cpp_compiler,
)
from stabilize.numerics import DTYPES

LIMIT = 1.10  # T1 and T2 both allow 10%
NOISY = 0.5  # interquartile range above half the median: the verdict is not to be trusted
SAME_NOTE = ["reduction=input for fp32 inputs is the same computation as fp32: not repeated.", ""]


def first_clause(err: Exception) -> str:
    """The short reason of a package error: its text up to the first ': ' / '. '."""
    return re.split(r"[.:;](?:\s|$)", str(err), maxsplit=1)[0].strip()


def timed_ms(fn, device: torch.device) -> float:
    """Wall time of one call in ms; on CUDA, synchronise so queued kernels are counted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def make_candidate(kind: str, backend: str, red: str, x, g) -> dict:
    """A row for one combination: its fwd+bwd closure, or the reason it is n/a."""
    row = {"type": kind, "backend": backend, "reduction": red, "resolved": "-"}
    try:
        norm = build_norm(x.shape[-1], NormConfig(type=kind, backend=backend, reduction_dtype=red))
        norm = norm.to(x.device, x.dtype)
        row["resolved"] = norm.resolve_backend(x)
    except (ValueError, RuntimeError) as e:
        return {**row, "na": first_clause(e)}
    if row["resolved"] == "compiled" and x.device.type == "cpu" and not has_cpp_compiler():
        return {**row, "na": "no C++ compiler for inductor on CPU"}
    inputs = [x, *norm.parameters()]
    # autograd.grad rather than .backward(): nothing accumulates into .grad between reps.
    row["fn"] = lambda: torch.autograd.grad(norm(x), inputs, g)
    return row


def warm_up(live: list[dict], device: torch.device) -> list[dict]:
    """Call each candidate twice, timing the first (compile) call; return those that ran."""
    for i, r in enumerate(live):
        try:
            r["first_ms"] = timed_ms(r["fn"], device)  # includes torch.compile where it applies
            timed_ms(r["fn"], device)
        except (ValueError, RuntimeError) as e:
            r["na"] = first_clause(e)
            del r["fn"]
        what = " ".join(r[k] for k in ("type", "backend", "reduction", "resolved") if r[k] != "-")
        done = f"n/a ({r['na']})" if "na" in r else f"first call {r['first_ms']:.0f} ms"
        print(f"  [{i + 1}/{len(live)}] {what}: {done}", file=sys.stderr, flush=True)
    return [r for r in live if "fn" in r]


def measure_group(args, dtype_name: str, shape: tuple[int, int]) -> list[dict]:
    """All candidates of one (dtype, shape), plus the two references, measured together."""
    device, dtype = torch.device(args.device), DTYPES[dtype_name]
    torch.manual_seed(args.seed)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device=device, dtype=dtype)  # fixed upstream gradient
    gamma = torch.ones(shape[-1], device=device, dtype=dtype, requires_grad=True)
    beta = torch.zeros(shape[-1], device=device, dtype=dtype, requires_grad=True)
    out, xd = torch.empty_like(x), x.detach()
    ln = lambda: torch.autograd.grad(F.layer_norm(x, shape[-1:], gamma, beta), (x, gamma, beta), g)
    ref = lambda name, fn: dict(type=name, backend="-", reduction="-", resolved="-", fn=fn)
    rows = [ref("F.layer_norm", ln), ref("copy_", lambda: out.copy_(xd))]
    # For fp32 inputs reduction "input" is the same computation as "fp32": not measured twice.
    reds = [r for r in args.reductions if not (dtype_name == "fp32" and r == "input")]
    rows += [make_candidate(k, b, r, x, g) for k in args.types for b in args.backends for r in reds]
    # One compiled function serves every norm in the package and dynamo's recompile_limit (8)
    # would silently send later kinds/dtypes/shapes to eager: start every group afresh.
    torch._dynamo.reset()
    live = warm_up([r for r in rows if "fn" in r], device)
    times, t0 = {id(r): [] for r in live}, time.perf_counter()
    for rep in range(args.reps):  # round-robin, start rotated so no one always goes first
        for r in live[rep % len(live) :] + live[: rep % len(live)]:
            times[id(r)].append(timed_ms(r["fn"], device))
    print(f"  {args.reps} rounds: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for r in live:
        ts = times[id(r)]
        r["ms"] = statistics.median(ts)
        q1, _, q3 = quartiles(ts)
        r["spread"] = (q3 - q1) / r["ms"]  # interquartile range: how much to trust the median
        del r["fn"]
    for r in rows:
        r.update(dtype=dtype_name, shape=f"{shape[0]}x{shape[1]}")
        if "ms" in r:
            r["x_ln"], r["x_copy"] = r["ms"] / rows[0]["ms"], r["ms"] / rows[1]["ms"]
    return rows


def find(rows, **key) -> dict | None:
    """The measured row matching every key=value, if any."""
    hits = [r for r in rows if "ms" in r and all(r[k] == v for k, v in key.items())]
    return hits[0] if hits else None


def targets(rows: list[dict], args) -> list[str]:
    """PASS/FAIL lines for T1 and T2, with the numbers they are decided on."""
    lines = ["", "## Targets", ""]

    def check(label, num, den, den_name):
        if num is None or den is None:
            return f"- {label}: not measured"
        q, spread = num["ms"] / den["ms"], max(num["spread"], den["spread"])
        # A median is only as good as the rounds: flag verdicts whose inputs were too noisy.
        noisy = f"; NOISY (spread {spread:.0%}), rerun" if spread > NOISY else ""
        return (
            f"- {label}: {'PASS' if q <= LIMIT else 'FAIL'}: {num['ms']:.2f} ms "
            f"({num['resolved']}) / {den['ms']:.2f} ms {den_name} = {q:.2f} (limit {LIMIT}){noisy}"
        )

    for s, d in ((s, d) for s in args.shapes for d in args.dtypes):
        key = {"dtype": d, "shape": f"{s[0]}x{s[1]}"}
        where = f"{d} {key['shape']}"
        auto_rms = find(rows, type="rmsnorm", backend="auto", reduction="fp32", **key)
        ln = find(rows, type="F.layer_norm", **key)
        lines.append(check(f"T1 {where} auto rmsnorm vs F.layer_norm", auto_rms, ln, "layer_norm"))
        if d == "fp32":
            lines.append(f"- T2 {where}: does not apply: fp32 and input reductions are the same")
            continue
        for k in args.types:
            base = find(rows, type=k, backend="explicit", reduction="input", **key)
            for b in ("explicit", "auto"):
                r = find(rows, type=k, backend=b, reduction="fp32", **key)
                lines.append(check(f"T2 {where} {k} {b}-fp32 vs explicit-input", r, base, "input"))
    return lines


def markdown(rows: list[dict]) -> list[str]:
    """The result table, n/a rows included with their reason."""
    cols = ["type", "backend", "reduction", "dtype", "shape", "resolved"]
    head = [*cols, "median ms", "x layer_norm", "x copy", "spread %"]
    cells = []
    for r in rows:
        nums = (
            [f"{r['ms']:.3f}", f"{r['x_ln']:.2f}", f"{r['x_copy']:.2f}", f"{100 * r['spread']:.0f}"]
            if "ms" in r
            else [f"n/a: {r['na']}", "", "", ""]
        )
        cells.append([*(r[c] for c in cols), *nums])
    return md_table(head, cells)


def parse_args(argv=None):
    """CLI; lists are comma-separated and checked against the package's names."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def choices(allowed):  # an argparse type: comma-separated names, each in ``allowed``
        def parse(text):
            if bad := [i for i in text.split(",") if i not in allowed]:
                raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
            return text.split(",")

        return parse

    shapes = lambda t: [tuple(int(n) for n in s.split("x")) for s in t.split(",")]
    default_dev = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_dev)
    p.add_argument("--dtypes", type=choices(("fp32", "bf16", "fp16")), default="fp32,bf16,fp16")
    p.add_argument("--types", type=choices(NORM_TYPES), default=",".join(NORM_TYPES))
    p.add_argument("--backends", type=choices(BACKENDS), default=",".join(BACKENDS))
    p.add_argument("--reductions", type=choices(REDUCTION_DTYPES), default="fp32,input")
    p.add_argument("--shapes", type=shapes, default=None, help="default 4096x2048,1024x512")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 12, quick 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1024x512 only, 3 rounds")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--markdown-out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.shapes = args.shapes or ([(1024, 512)] if args.quick else [(4096, 2048), (1024, 512)])
    args.reps = args.reps or (3 if args.quick else 12)
    return args


def main(argv=None) -> int:
    """Measure every group, print the table and the targets, optionally write them out."""
    args = parse_args(argv)
    # auto is measured with the fused kernel, built first if need be, not with the fallback a
    # run uses while the kernel builds in the background (stabilize/cpu_kernels.py)
    os.environ.setdefault("STABILIZE_KERNEL_WAIT", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, rows, load0, n = time.perf_counter(), [], load_average(), torch.get_num_threads()
    # Busy cores make every OpenMP region wait for a descheduled thread: consistent, wrong times.
    busy = load0 > (os.cpu_count() or 1) - n + 0.5
    fix = "try --threads 1" if n > 1 else "use a quieter machine"
    warn = [f"WARNING: load average {load0:.1f} leaves no core free for {n} threads; {fix}.", ""]
    for shape in args.shapes:
        for d in args.dtypes:
            print(f"{d} {shape[0]}x{shape[1]}:", file=sys.stderr, flush=True)
            rows += measure_group(args, d, shape)
    first = [r for r in rows if r.get("resolved") in ("compiled", "fused") and "first_ms" in r]
    report = [
        f"# Norm fwd+bwd on {args.device}: torch {torch.__version__}, "
        f"{n} threads, median of {args.reps} interleaved rounds, "
        f"load average {load0:.1f} -> {load_average():.1f} on {os.cpu_count()} CPUs",
        "",
        *(warn if busy else []),
        *markdown(rows),
        "",
        *(SAME_NOTE if "input" in args.reductions and "fp32" in args.dtypes else []),
        "First calls of compiled and fused candidates (torch.compile, or the fused kernel's "
        "one-time build or load, included; not in the medians; a graph is compiled once per "
        "group, by whichever candidate calls it first):",
        *(
            f"- {r['type']} {r['backend']} ({r['resolved']}) {r['dtype']} {r['shape']}: "
            f"{r['first_ms'] / 1e3:.2f} s"
            for r in first
        ),
        *([] if first else ["- none"]),
        *targets(rows, args),
        "",
        f"Wall time {time.perf_counter() - t0:.0f} s.",
    ]
    text = "\n".join(report)
    print(text)
    if args.markdown_out:
        args.markdown_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
