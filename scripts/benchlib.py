"""What the benchmark scripts share: an offline environment, Hydra composition of the real
configs, the bench model sizes, and muting the progress lines.

Imported first by each script (it sets the environment before wandb is imported).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

os.environ["WANDB_MODE"] = "offline"  # before wandb is imported; never the network
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a bare checkout

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import stabilize.train  # noqa: E402, F401  (registers the config's resolvers)
from stabilize.lit.callbacks import PlainProgress  # noqa: E402
from stabilize.lit.config import RunConfig  # noqa: E402

CONFIGS = {
    "tiny": ["model=tiny"],
    "small": ["model=tiny", "model.n_layer=4"],  # twice tiny's depth: ~2x its step time
}


def compose_cfg(run_dir: str, overrides: list[str]) -> RunConfig:
    """configs/train.yaml composed with Hydra as the CLI does, as a typed RunConfig."""
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"run_dir={run_dir}", *overrides])
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def mute_progress(trainer) -> None:
    """Silence the plain progress lines of a benchmarked run."""
    for cb in trainer.callbacks:
        if isinstance(cb, PlainProgress):
            cb.stream = io.StringIO()


def prepare(ap, args, configs: dict) -> list[str]:
    """After parsing: --quick, --threads, --configs checked, Lightning's chatter muted, and
    the load average recorded (over cores - threads, other jobs stall OpenMP threads)."""
    import logging
    import warnings

    import torch

    if args.quick:
        args.configs, args.repeats = "tiny", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    for n in names:
        if n not in configs:
            ap.error(f"--configs: {n!r} is not one of {sorted(configs)}")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning\..*")
    args.load = os.getloadavg()[0]
    return names


def run_overrides(config: list[str], precision: str, total: int, logger: str) -> list[str]:
    """The benchmarks' common run: a config, a precision, ``total`` steps, no validation, plain
    progress (muted by the benchmarks' callbacks), the given logger."""
    return [
        *config,
        f"precision={precision}",
        f"trainer.max_steps={total}",
        "trainer.limit_val_batches=0",
        "trainer.progress=plain",
        f"logger={logger}",
    ]
