"""What the stability core asks of the training loop it watches: the ``Host`` protocol.

The core (gather, classify, localize, bundle, controller) reads and drives a run only
through these names (docs/design-your-model.md section 3). Two hosts answer them:

- ``GPTLitModule`` (``stabilize/lit/module.py``), our own LightningModule: it owns the
  loop's facts (the data position, the stale prefetched batch, the LR schedule) and answers
  from them;
- ``LightningHost`` (``stabilize/lit/host.py``), any other LightningModule: it learns the
  same facts from Lightning's hooks, the optimizer and the scheduler Lightning holds, and
  falls back where the user's loop cannot tell it (no data seek: the data goes on after a
  rollback; no sampler: bundles carry no item indices).

No Lightning here: the protocol is structural (``typing.Protocol``), so a plain loop's host
(``Guard``) can answer it too.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from stabilize.rollback.state import TrainState


class Host(Protocol):
    model: nn.Module
    """The network watched, snapshotted and replayed (the probe's and the faults' model)."""
    train_state: TrainState
    """Model and data steps, LR scale, remedies, skipped positions: the core writes here."""
    step_loss: torch.Tensor | None
    """The step's loss summed over its micro-batches (a device tensor, no sync)."""
    injector: Any
    """The fault injector (the core's own; ``FaultInjector``), or None."""

    @property
    def device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def window_start(self) -> bool:
        """Is the incoming micro-batch the first of an optimizer step?"""

    @property
    def stale_batch(self) -> bool:
        """Was the incoming batch fetched before a rollback moved the data (not trained on)?"""

    @property
    def clip_norm(self) -> float:
        """The gradient clipping norm (0: none), for the update/weight ratios."""

    @property
    def precision_name(self) -> str:
        """``fp32`` | ``fp16-mixed`` | ``bf16-mixed`` (a bundle's autocast)."""

    def parameters(self): ...

    def grad_total_norm(self) -> torch.Tensor:
        """The step's pre-clip global gradient norm (a device tensor; computed once)."""

    def seed_dropout(self, data_step: int) -> None:
        """Put the random generators where they were for that micro-batch (a re-run draws
        the same dropout masks)."""

    def loss(self, batch) -> torch.Tensor:
        """The training loss of ``batch`` (a re-run of the user's own step)."""

    def other_batches(self, positions: list[int]) -> tuple[list, list[int]]:
        """Micro-batches other than the step's, as many as ``positions``, and their data
        positions: the re-run classification asks whether they fail too."""

    def train_sampler(self) -> Any:
        """The train batch sampler (``batch_for_step(pos, rank)``: item indices), or None."""

    def train_dataset(self) -> Any:
        """The training dataset (a fault on content reads it), or None."""

    def apply_lr(self) -> None:
        """Impose the LR the schedule and the remedies' scale give at the model's step."""

    def seek_data(self, data_step: int) -> None:
        """Continue from data position ``data_step`` (as far as the loader can)."""

    def run_config(self) -> dict[str, Any]:
        """The run's resolved settings (a bundle's ``config``)."""

    def host_info(self) -> dict[str, Any]:
        """How another process rebuilds the module (a bundle's ``host``)."""
