"""The planner's own settings (``plan.*`` on the command line) and the GPUs it knows.

The ``plan.*`` keys are written like every other Hydra override (``plan.gpu=h200``), so a
plan is asked for with the very argument list a launch uses, but they never reach Hydra:
the training config has no ``plan`` group (``RunConfig`` refuses unknown top-level keys), so
the planner takes them out of the list before composing ``configs/train.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stabilize.validate import build_dataclass, check_choice, check_positive

GB = 1e9  # decimal gigabytes, as the issues and docs quote sizes (15.8 GB per snapshot)
MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator: its name and the memory ``nvidia-smi`` reports as total."""

    label: str
    memory_bytes: int


# Totals as nvidia-smi reports them (MiB): the allocator can never hand out more.
GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("A100-SXM4-40GB", 40_960 * MIB),
    "a100-80gb": GPU("A100-SXM4-80GB", 81_920 * MIB),
    "h100-80gb": GPU("H100-SXM5-80GB", 81_559 * MIB),
    "h200": GPU("H200-SXM-141GB", 143_771 * MIB),
}


@dataclass
class PlanConfig:
    """What the planner needs besides the run's config."""

    gpu: str = "a100-80gb"
    """A key of ``GPUS``: a100-40gb | a100-80gb | h100-80gb | h200."""
    gpus_per_node: int | None = None
    """Ranks per node; None: ``trainer.devices`` when it is a number, else 8 (a DGX node)."""
    nodes: int | None = None
    """Nodes; None: ``trainer.num_nodes``."""
    disk_gbps: float = 2.0
    """Sustained durable-write bandwidth of the run directory's disk, GB/s (1e9 bytes)."""
    reserve_gb: float = 2.0
    """Per GPU, never available to tensors: CUDA context (~0.5 GB), cuBLAS/cuDNN
    workspaces and allocator fragmentation. A rule of thumb, not a measurement."""

    def __post_init__(self) -> None:
        check_choice("plan.gpu", self.gpu, GPUS)
        for key in ("gpus_per_node", "nodes"):
            if getattr(self, key) is not None:
                check_positive(f"plan.{key}", getattr(self, key), integer=True)
        check_positive("plan.disk_gbps", self.disk_gbps)
        check_positive("plan.reserve_gb", self.reserve_gb + 1.0)  # 0 allowed

    @property
    def device(self) -> GPU:
        return GPUS[self.gpu]


def parse_plan_overrides(args: list[str]) -> tuple[PlanConfig, list[str]]:
    """Split ``plan.key=value`` items off an override list: (PlanConfig, the rest for Hydra).

    Values are read as YAML scalars would be (ints, floats, null), so ``plan.nodes=2`` is
    the integer 2 as it would be in a config file."""
    plan: dict[str, object] = {}
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not key.startswith("plan."):
            rest.append(arg)
            continue
        name = key[len("plan.") :]
        if not sep:
            raise ValueError(f"{arg!r} is not an override; write plan.{name}=VALUE")
        if name not in {f.name for f in fields(PlanConfig)}:
            allowed = [f.name for f in fields(PlanConfig)]
            raise ValueError(f"plan.{name} is not a known setting; allowed: {allowed}")
        plan[name] = _scalar(value)
    return build_dataclass(PlanConfig, plan, "plan"), rest


def _scalar(text: str) -> object:
    if text.lower() in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
