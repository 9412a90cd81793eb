"""Where the Hydra configs are, for every entry point that composes them (stabilize-train,
stabilize-plan): one rule, so an installed wheel and a checkout find the same files."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """The directory of Hydra's primary config (train.yaml).

    ``$STABILIZE_CONFIG_DIR`` if set; else the copy an installed wheel carries inside the
    package (setup.py ships the repo's ``configs/`` as ``stabilize/configs/``); else the
    checkout's ``configs/`` beside the package (a repo on PYTHONPATH, or ``pip install -e``).
    """
    if env := os.environ.get("STABILIZE_CONFIG_DIR"):
        return Path(env)
    package = Path(__file__).resolve().parent
    bundled = package / "configs"
    return bundled if (bundled / "train.yaml").is_file() else package.parent / "configs"


def default_cache_dir() -> Path:
    """$STABILIZE_CACHE_DIR, else $XDG_CACHE_HOME/stabilize, else ~/.cache/stabilize."""
    if os.environ.get("STABILIZE_CACHE_DIR"):
        return Path(os.environ["STABILIZE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stabilize"
