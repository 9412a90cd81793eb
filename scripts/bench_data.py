"""The data layer's figures: tokenization throughput, a training rank's peak memory
as the corpus grows, and the start-up of a launch that finds its token cache.

A corpus of --mb MB is generated from CPython's pydoc topics (paragraphs reshuffled with a
seeded RNG per copy: real prose, but a repetitive one, so BPE's per-word cache hits more
often than on a web corpus: read the BPE figure as an upper bound).

1. Throughput: bytes and BPE (``data.vocab_size`` --vocab) tokenize the loaded corpus into a
   token file (encode + write + checksum; loading and BPE training timed apart). BPE runs on
   the first --bpe-mb MB (its encoding is ~100x slower than bytes); the time for the whole
   --mb corpus is then extrapolated, and printed as such.
2. Peak RSS of a training rank: 2-rank torchrun launches (CPU, tiny model, a few steps) on a
   --small-mb corpus and on the --mb one, each launch wrapped in a process that reads
   ``ru_maxrss`` of its reaped children (torchrun and its ranks: the largest rank). The
   first launch per corpus builds the cache; the second finds it. Target: ratio <= 1.1 on
   cache hits (the mapped tokens are shared page cache, read only where a batch lies).
3. Start-up: from the launch to the moment the last rank has its tokens mapped (the time
   stamp of its "memory-mapped" log line), the cache-hit launch as a share of the first;
   and the data part alone (the slowest rank's ``open_token_cache``: build or check + map).
   The launches get their own, cold, datasets cache.

Usage: python scripts/bench_data.py [--mb 200] [--small-mb 20] [--bpe-mb 20] [--vocab 8192]
       [--steps 3]        (reduced: --mb 40 --small-mb 4 --bpe-mb 4)
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import datasets

from benchmarks.stats import load_average, md_row, md_table
from stabilize.data import (
    ByteTokenizer,
    DataConfig,
    embedded_corpus,
    load_corpus,
    stream_dtype,
    train_bpe,
)
from stabilize.data.token_file import write_tokens
from stabilize.data.tokenizer import encode_documents, text_batches

ROOT = Path(__file__).resolve().parents[1]  # not benchmarks.lib's: no Lightning here

WRAP = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)\n"
)
STAMP = re.compile(r"^\[([-\d]+ [:\d]+,\d{3})\].*token cache \w+: memory-mapped.* in ([.\d]+) s")


def make_corpus(path: Path, mb: float, seed: int = 0) -> Path:
    """About ``mb`` MB of prose: the pydoc topics' paragraphs, reshuffled per copy."""
    paras = [p for t in embedded_corpus()["text"] for p in t.split("\n\n") if p.strip()]
    rng, target, size = random.Random(seed), int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            rng.shuffle(paras)
            chunk = "\n\n".join(paras) + "\n\n"
            f.write(chunk)
            size += len(chunk.encode("utf-8"))
    return path


def throughput(tmp: Path, corpus: Path, bpe_corpus: Path, vocab: int) -> list[tuple]:
    rows = []
    for name, path in (("bytes", corpus), ("bpe", bpe_corpus)):
        cfg = DataConfig(source="local", paths=[str(path)])
        t0 = time.perf_counter()
        ds = load_corpus(cfg)
        load_s, train_s = time.perf_counter() - t0, 0.0
        tok = ByteTokenizer()
        if name == "bpe":
            t0 = time.perf_counter()
            tok = train_bpe(text_batches(ds, "text"), vocab)
            train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pieces = encode_documents(text_batches(ds, "text"), tok)
        dtype = stream_dtype(tok.vocab_size)
        n, _ = write_tokens(tmp / f"{name}.bin", pieces, dtype, tok.vocab_size)
        enc_s = time.perf_counter() - t0
        mb = path.stat().st_size / 1e6
        rows.append((name, mb, n, load_s, train_s, enc_s))
    return rows


def launch(tmp: Path, corpus: Path, run: str, steps: int, env: dict) -> dict:
    run_dir = tmp / "runs" / run
    args = [
        sys.executable, "-c", WRAP, str(ROOT / "scripts" / "launch.sh"), "--nproc-per-node", "2",
        "trainer.accelerator=cpu", "logger=none", "trainer.progress=none", "data=local",
        f"data.paths=[{corpus}]", f"data.cache_dir={tmp / 'cache'}", f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0", "data.batch_size=4", "model.block_size=64",
        "trainer.checkpoint_every_n_steps=1000",
    ]  # fmt: skip
    start = time.time()
    r = subprocess.run(
        args, env={**env, "STABILIZE_RUN_DIR": str(run_dir)}, capture_output=True, text=True
    )
    wall = time.time() - start
    m = re.search(r"MAXRSS_KB (\d+) (\d+)", r.stdout)
    if m is None or m.group(2) != "0":
        sys.exit(f"launch {run} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    stamps, data_s = [], []
    for log in run_dir.glob("*.log"):
        for line in log.read_text().splitlines():
            if hit := STAMP.match(line):
                stamps.append(datetime.strptime(hit.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
                data_s.append(float(hit.group(2)))
    built = sum(log.read_text().count(": building (") for log in run_dir.glob("*.log"))
    return {
        "rss_mb": int(m.group(1)) / 1024,
        "wall": wall,
        "ready": max(stamps) - start,
        "data": max(data_s),
        "built": built,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="the large corpus, MB")
    ap.add_argument("--small-mb", type=float, default=20.0, help="the small corpus, MB")
    ap.add_argument("--bpe-mb", type=float, default=20.0, help="BPE throughput on this much")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    ap.add_argument("--steps", type=int, default=3, help="training steps per launch")
    args = ap.parse_args(argv)
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as d:
        tmp = Path(d)
        launch_hf = str(tmp / "hf-launches")  # cold for each corpus's first launch
        env = {**os.environ, "HF_DATASETS_CACHE": launch_hf, "PYTHONPATH": str(ROOT)}
        # launch.sh runs $PYTHON's torchrun: this interpreter's, first on PATH.
        env |= {"PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "hf")
        big = make_corpus(tmp / "big.txt", args.mb)
        small = make_corpus(tmp / "small.txt", args.small_mb, seed=1)
        bpe = big if args.bpe_mb >= args.mb else make_corpus(tmp / "bpe.txt", args.bpe_mb, 2)
        print(f"# bench_data: load average {load_average():.1f} on {os.cpu_count()} cores")
        print("\n## Tokenization throughput (load, train and encode timed apart)")
        head = ["tokenizer", "corpus MB", "tokens", "load s", "train s", "encode s", "tokens/s"]
        print("\n".join(md_table(head, [])))
        big_mb = big.stat().st_size / 1e6
        for name, mb, n, load_s, train_s, enc_s in throughput(tmp, big, bpe, args.vocab):
            times = (f"{load_s:.1f}", f"{train_s:.1f}", f"{enc_s:.1f}")
            print(md_row([name, f"{mb:.1f}", f"{n:,}", *times, f"{n / enc_s:,.0f}"]))
            if mb < big_mb * 0.99:
                extra = [f"~{n * big_mb / mb:,.0f}", "", "", f"~{enc_s * big_mb / mb:.0f}", ""]
                label = f"{name} at {big_mb:.0f} MB (extrapolated, linear)"
                print(md_row([label, f"{big_mb:.0f}", *extra]))
        print(f"\n## Two ranks on CPU, {args.steps} steps, bytes (RSS: the largest rank)")
        head = ["corpus MB", "launch", "cache", "peak RSS MB", "data s", "data ready s", "wall s"]
        print("\n".join(md_table(head, [])))
        hits = {}
        for label, path in (("small", small), ("big", big)):
            mb = path.stat().st_size / 1e6
            for k in ("first", "second"):
                r = launch(tmp, path, f"{label}-{k}", args.steps, env)
                cache = "built" if r["built"] else "hit"
                nums = [f"{r['rss_mb']:.0f}", f"{r['data']:.2f}", f"{r['ready']:.1f}"]
                print(md_row([f"{mb:.0f}", k, cache, *nums, f"{r['wall']:.1f}"]))
                hits[label, k] = r
        ratio = hits["big", "second"]["rss_mb"] / hits["small", "second"]["rss_mb"]
        print(f"\npeak RSS, cache hit, {args.mb:g} MB / {args.small_mb:g} MB corpus: "
              f"{ratio:.3f} (target <= 1.1)")  # fmt: skip
        for label in ("small", "big"):
            first, second = hits[label, "first"], hits[label, "second"]
            print(f"start-up of the second launch ({label} corpus): "
                  f"{second['ready'] / first['ready']:.0%} of the first "
                  f"({second['ready']:.1f} s vs {first['ready']:.1f} s); data part: "
                  f"{second['data'] / first['data']:.0%} ({second['data']:.2f} s vs "
                  f"{first['data']:.2f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
