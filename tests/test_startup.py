"""``stabilize-train --help``, ``--keys`` and config errors load no training stack.

Each case runs the console script's ``main`` in a fresh interpreter and lists the modules it
had imported when it exited: Hydra's app must not pull in Lightning (nor, for ``--help`` and
Hydra's own errors, torch), once the config nodes of this source are cached (the first launch
after an install or an edit builds them: stabilize/config_store.py). The time it saves is
measured by scripts/bench_startup.py, not here.
"""

from __future__ import annotations

import json
import os
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


def probe(args: list[str], cwd, cache) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "STABILIZE_CACHE_DIR": str(cache)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache dir holding this source's config nodes and key table, made by a first launch
    (which builds them: the dataclasses load torch; ``datasets`` only where a corpus is
    loaded)."""
    d = tmp_path_factory.mktemp("cache")
    first = probe(["--keys", "norm"], d, d)  # the key table of --keys is cached the same way
    assert first["code"] == 0 and first["heavy"] == ["torch"], first
    assert len(list((d / "config-nodes").glob("*.json"))) == 1
    assert len(list((d / "config-keys").glob("*.json"))) == 1  # stabilize/run/keys.py
    return d


def test_the_cached_nodes_are_the_dataclasses_and_follow_the_source(monkeypatch, tmp_path):
    from stabilize import config_store

    monkeypatch.setenv("STABILIZE_CACHE_DIR", str(tmp_path))
    live = config_store.nodes()
    assert config_store.cached_nodes() == live  # built and written
    (written,) = (tmp_path / "config-nodes").glob("*.json")
    assert written.stem == config_store.source_hash()
    assert json.loads(written.read_text()) == live
    written.write_text(json.dumps({"base_run": {"seed": -1}}))  # read back as it is
    assert config_store.cached_nodes() == {"base_run": {"seed": -1}}
    monkeypatch.setattr(config_store, "source_hash", lambda: "edited")  # another source
    assert config_store.cached_nodes() == live
    assert (tmp_path / "config-nodes" / "edited.json").is_file()
    for i in range(config_store.KEEP + 3):  # many edits: only the newest files are kept
        monkeypatch.setattr(config_store, "source_hash", lambda i=i: f"edit{i}")
        config_store.cached_nodes()
    kept = sorted(f.stem for f in (tmp_path / "config-nodes").glob("*.json"))
    assert len(kept) == config_store.KEEP and f"edit{config_store.KEEP + 2}" in kept


@pytest.mark.parametrize(
    "args, code, allowed",
    [
        (["--help"], 0, []),
        (["model.typo=3"], 2, []),  # Hydra's own error: before the app runs
        # our config check (RunConfig): the config needs torch, not Lightning, W&B nor
        # datasets (loaded only where a corpus is: not for a cached one)
        (["norm.type=groupnorm"], 2, ["torch"]),
    ],
)
def test_help_and_config_errors_import_no_training_stack(args, code, allowed, cache, tmp_path):
    out = probe([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, cache)
    assert out["code"] == code, out["stderr"][-2000:]
    assert out["heavy"] == allowed, out
    assert not out["lightning"]
    if code == 2:
        assert out["stderr"].strip().startswith("stabilize-train: "), out["stderr"]
    if not allowed:
        assert not out["dist"]


@pytest.mark.parametrize(
    "args, code", [(["--keys", "monitor.loss_scale"], 0), (["--keys", "monitor.loss_scal"], 2)]
)
def test_keys_imports_no_training_stack(args, code, cache, tmp_path):
    """``--keys`` answers from the cached table and the composed config, as ``--help`` does
    (Hydra's parser never sees the flag)."""
    out = probe(args, tmp_path, cache)
    assert out["code"] == code, out["stderr"][-2000:]
    assert out["heavy"] == [] and not out["lightning"] and not out["dist"], out
