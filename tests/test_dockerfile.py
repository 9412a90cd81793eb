"""The Dockerfile, checked statically (no Docker engine here): it builds from NGC's PyTorch
image, copies what the package needs, installs it, and its commands exist in the repo."""

from __future__ import annotations

import os
import re
import shlex

from conftest import ROOT

TEXT = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [
    line.strip()
    for line in re.sub(r"\\\n", " ", TEXT).splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]
KNOWN = {"ARG", "FROM", "WORKDIR", "COPY", "RUN", "ENV", "CMD", "ENTRYPOINT", "LABEL"}


def _of(kind):
    return [i.split(None, 1)[1] for i in INSTRUCTIONS if i.split(None, 1)[0] == kind]


def test_dockerfile_lints_clean():
    assert INSTRUCTIONS[0].startswith("ARG NGC_TAG=") and INSTRUCTIONS[1].startswith("FROM ")
    for i in INSTRUCTIONS:
        assert i.split(None, 1)[0] in KNOWN, i
    base = _of("FROM")[0]
    assert base.startswith("nvcr.io/nvidia/pytorch:") and ":latest" not in base
    tag = re.search(r"ARG NGC_TAG=(\S+)", TEXT).group(1)
    assert re.fullmatch(r"\d\d\.\d\d-py3", tag), tag  # a pinned NGC release
    assert all("--no-cache-dir" in r for r in _of("RUN") if "pip install" in r)
    assert len(_of("CMD")) == 1 and _of("CMD")[0].startswith("[")  # exec form


def test_every_copied_path_exists_and_the_package_is_installed():
    for args in _of("COPY"):
        *sources, _dest = shlex.split(args)
        for s in sources:
            assert (ROOT / s).exists(), s
    copied = {s for args in _of("COPY") for s in shlex.split(args)[:-1]}
    assert {"pyproject.toml", "stabilize", "configs", "scripts"} <= copied
    assert any("pip install" in r and " -e ." in r for r in _of("RUN"))


def test_the_images_commands_exist():
    import json

    cmd = json.loads(_of("CMD")[0])
    entry = ROOT / cmd[0]
    assert entry.is_file() and os.access(entry, os.X_OK), cmd
    # the launch line the header documents uses scripts and experiments that exist
    assert os.access(ROOT / "scripts" / "launch.sh", os.X_OK)
    for exp in set(re.findall(r"experiment=(\w+)", TEXT)):
        assert (ROOT / "configs" / "experiment" / f"{exp}.yaml").exists(), exp
