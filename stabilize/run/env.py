"""Where this process sits in a launch, read from torchrun's environment (no Lightning:
the config checks read it too)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class LaunchEnv:
    """Where this process sits: under torchrun, Lightning spawns nothing and reads these."""

    world_size: int
    rank: int
    local_world_size: int

    @classmethod
    def detect(cls) -> LaunchEnv:
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(world, int(env.get("RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", world)))

    @property
    def torchrun(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or self.world_size > 1
