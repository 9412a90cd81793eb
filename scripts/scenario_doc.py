"""Write the measured part of docs/scenario.md from a scenario's output dir.

    python scripts/scenario_doc.py DIR [--doc docs/scenario.md] [--command "..."]

DIR is what ``scripts/repro_nan.sh --out DIR`` wrote (its ``report.md`` and run dirs). The
tables and conclusions between the doc's ``<!-- measured:begin -->`` and
``<!-- measured:end -->`` markers are replaced by the report's, headed by what produced them:
the command, the commit, the threads per run, the CPU and the wall time the script printed.
Nothing is copied by hand, so the doc cannot drift from a run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.docblock import commit, cpu, write_block

SECTIONS = ("## Per arm", "## Against the reference", "## Conclusions", "## Forecast warnings")


def _section(report: str, title: str) -> str:
    """The report's section ``title`` up to the next ``## `` heading."""
    start = report.index(title)
    nxt = report.find("\n## ", start + len(title))
    return report[start : nxt if nxt >= 0 else len(report)].strip()


def measured_block(out: Path, command: str) -> str:
    report = (out / "report.md").read_text()
    logs = sorted(out.glob("*.log"))
    plan = wall = ""
    for log in [out / "scenario.log", *logs]:
        if log.exists():
            text = log.read_text()
            plan = plan or next(iter(re.findall(r"^plan: .*$", text, re.M)), "")
            wall = wall or next(iter(re.findall(r"^scenario done in .*$", text, re.M)), "")
    threads = re.search(r"(\d+) thread\(s\) each", plan)
    head = [
        f"Measured by `{command}` at commit {commit()}, on {cpu()} "
        f"({threads.group(1) if threads else '?'} thread(s) per run); "
        + (wall.split(";")[0] if wall else "wall time not recorded")
        + ".",
        "Written by `scripts/scenario_doc.py` from that run's `report.md`: do not edit by hand.",
    ]
    body = [_section(report, t).replace("## ", "### ", 1) for t in SECTIONS if t in report]
    return "\n\n".join([*head, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scenario_doc.py", description=__doc__.split("\n")[0])
    p.add_argument("out", help="the scenario's output dir (scripts/repro_nan.sh --out DIR)")
    p.add_argument("--doc", default="docs/scenario.md")
    p.add_argument("--command", default="bash scripts/repro_nan.sh --out DIR")
    a = p.parse_args(argv)
    out, doc = Path(a.out), Path(a.doc)
    if not (out / "report.md").is_file():
        print(
            f"scenario_doc.py: {out}/report.md does not exist (run repro_nan.sh)", file=sys.stderr
        )
        return 2
    return write_block(doc, "measured", measured_block(out, a.command), "scenario_doc.py")


if __name__ == "__main__":
    sys.exit(main())
