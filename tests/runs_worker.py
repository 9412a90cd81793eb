"""One rank of a torchrun that trains several runs in a row (torchrun on CPU, 2 ranks, gloo):
``runs_worker.py CASES.json OUT``, CASES mapping a name to its overrides; each run is
composed as tests/conftest.py's ``compose_run`` does and trained with ``stabilize.train.run``
into ``OUT/<name>``, every rank in the same dir, one after the other in one process group.
One Lightning import per rank serves every run (a launch per run costs ~10 s of imports);
what a launch through ``stabilize-train`` adds (exit codes, the run-dir claim) is
tests/test_launch.py's."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from stabilize.train import run

from conftest import compose_run  # tests/: this script's own folder


def main(cases_file: str, out: str) -> int:
    cases = json.loads(Path(cases_file).read_text())
    failed = []
    for name, overrides in cases.items():
        try:
            run(compose_run(Path(out) / name, overrides))
        except Exception:  # the next case still runs; the test reads crash.txt
            failed.append(name)
            (Path(out) / name).mkdir(parents=True, exist_ok=True)
            (Path(out) / name / "crash.txt").write_text(traceback.format_exc())
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
