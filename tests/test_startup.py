"""``stabilize-train --help`` and config errors load no training stack.

Each case runs the console script's ``main`` in a fresh interpreter and lists the modules it
had imported when it exited: Hydra's app must not pull in Lightning (nor, for ``--help`` and
Hydra's own errors, torch). The time it saves is measured by scripts/bench_startup.py, not
here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = """
import json, sys
sys.argv = ["stabilize-train", *json.loads(sys.argv[1])]
from stabilize.train import main
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"lightning", "pytorch_lightning",
               "torch", "wandb", "datasets"})
print(json.dumps({"code": code, "heavy": heavy, "dist": "torch.distributed" in sys.modules,
                  "lightning": any(m.startswith("lightning") for m in sys.modules)}))
"""


def probe(args: list[str], cwd) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


@pytest.mark.parametrize(
    "args, code, allowed",
    [
        (["--help"], 0, []),
        (["model.typo=3"], 2, []),  # Hydra's own error: before the app runs
        # our config check (RunConfig): the config needs torch and the data stack, not
        # Lightning nor W&B
        (["norm.type=groupnorm"], 2, ["datasets", "torch"]),
    ],
)
def test_help_and_config_errors_import_no_training_stack(args, code, allowed, tmp_path):
    out = probe([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out["code"] == code, out["stderr"][-2000:]
    assert out["heavy"] == allowed, out
    assert not out["lightning"]
    if code == 2:
        assert out["stderr"].strip().startswith("stabilize-train: "), out["stderr"]
    if not allowed:
        assert not out["dist"]
