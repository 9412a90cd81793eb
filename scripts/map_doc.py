"""Write the measured part of docs/map.md from a finished map's directory.

    python scripts/map_doc.py DIR [--doc docs/map.md] [--command "stabilize-map --dir DIR"]

The map's report is rewritten from its cells (``stabilize-map --report``); its summary
tables and claims go between the doc's ``<!-- map:begin -->`` and ``<!-- map:end -->``
markers and its two figures to ``docs/map-*.png``, headed by what produced them: the
command, the commit the map ran at (``map_meta.json``), the cores, jobs and threads, the CPU
and the wall time. Nothing is copied by hand.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.docblock import cpu, write_block
from stabilize.map.report import write_report
from stabilize.map.spec import load_spec


def block(root: Path, command: str, figures: str) -> str:
    meta = json.loads((root / "map_meta.json").read_text())
    report = write_report(load_spec(root / "map_spec.json"), root).read_text()
    body = report[report.index("| recipe | L0 |") : report.index("## Cells")].strip()
    body = body.replace("## Claims", "**Claims** (the verdicts are computed from the numbers):")
    commit = (meta.get("commit") or "unknown")[:7]
    head = (f"Measured by `{command}` at commit {commit}, on {cpu()} ({meta['cpus']} cores, "
            f"{meta['jobs']} cells at a time with hydra/launcher={meta['launcher']}, "
            f"OMP_NUM_THREADS={meta['threads']} per cell): {meta['cells_run']} cells in "
            f"{meta['seconds'] / 60:.1f} min. Written by scripts/map_doc.py: do not edit by "
            "hand.")  # fmt: skip
    return (f"{head}\n\n![loss vs LR]({figures}-loss_vs_lr.png)\n\n"
            f"![outcomes]({figures}-outcomes.png)\n\n{body}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--doc", type=Path, default=Path("docs/map.md"))
    p.add_argument("--command", default=None)
    a = p.parse_args()
    stem = a.doc.with_suffix("").name
    body = block(a.dir, a.command or f"stabilize-map --dir {a.dir}", stem)
    for fig in ("loss_vs_lr", "outcomes"):
        shutil.copyfile(a.dir / f"{fig}.png", a.doc.parent / f"{stem}-{fig}.png")
    return write_block(a.doc, "map", body, "map_doc.py")


if __name__ == "__main__":
    sys.exit(main())
