"""What a measured block in a doc is headed by, and how it replaces the last one: the
commit, the CPU, and the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
(scripts/scenario_doc.py, scripts/eval_forecast.py --doc). Nothing is copied by hand."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "stabilize", "configs"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return (r.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(doc: Path, name: str, body: str) -> str | None:
    """Put ``body`` between the doc's markers; the error line when it has none."""
    begin, end = markers(name)
    text = doc.read_text()
    if begin not in text or end not in text:
        return f"{doc} has no {begin} ... {end} markers"
    doc.write_text(text[: text.index(begin)] + f"{begin}\n\n{body.strip()}\n\n{end}"
                   + text[text.index(end) + len(end):])  # fmt: skip
    return None


def write_block(doc: Path, name: str, body: str, script: str) -> int:
    """``replace_block``, said in one line: 0 and where it wrote, or 2 and why not (on
    stderr); ``script``: the script's name, which starts the line."""
    err = replace_block(doc, name, body)
    if err:
        print(f"{script}: {err}", file=sys.stderr)
        return 2
    print(f"{script}: wrote the {name} block of {doc}")
    return 0


def write_measured(doc: Path, name: str, script: str, argv: list[str] | None, text: str) -> int:
    """``text`` into the doc's ``name`` block under the line every eval's block starts with:
    the command as run (``python scripts/<script> <argv>``), the commit and the CPU."""
    args = argv if argv is not None else sys.argv[1:]
    cmd = f"python scripts/{script} " + " ".join(args)
    body = (f"Measured by `{cmd.strip()}` at commit {commit()}, on {cpu()}. Written by the "
            "script: do not edit by hand.\n\n" + text)  # fmt: skip
    return write_block(doc, name, body, script)
