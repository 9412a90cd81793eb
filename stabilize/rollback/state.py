"""``TrainState``: the training state the harness owns beside Lightning's, in one object.

The LightningModule (``GPTLitModule.train_state``), the stability callback, the rollback
controller and the remedies all read and write this one object, and a checkpoint saves
exactly its ``state_dict()`` (``checkpoint["stabilize"]``, with the run's config beside it).
Lightning's own loop counters are not in it: they never rewind (a rollback moves
``model_step`` back, ``trainer.global_step`` goes on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(eq=False)
class TrainState:
    model: nn.Module = field(repr=False)
    """The model a remedy may change (norm dtypes, z-loss weight); not saved here."""
    model_step: int = 0
    """Optimizer steps applied to the weights (rewound by a rollback)."""
    data_step: int = 0
    """The next data position to train on (each position is one micro-batch per rank)."""
    lr_scale: float = 1.0
    """Multiplies the schedule's LR (``lower_lr`` lowers it)."""
    lr_since: int | None = None
    """Model step of the last rollback with the LR lowered (its warm-back starts there)."""
    remedies: list[str] = field(default_factory=list)
    """Every remedy applied, one entry per application, in order."""
    skipped: set[int] = field(default_factory=set)
    """Data positions never trained on. The train sampler holds this very set: change it in
    place."""
    skipped_items: dict[int, str] = field(default_factory=dict)
    """Training sequences never trained on: block index -> content hash (``data.skip_items``,
    ``skipped_items.json``, checkpoints). The train sampler holds this very dict."""
    fault_batches: list[int] = field(default_factory=list)
    """The data positions the fault being answered was found in (set before a remedy)."""
    fault_items: list[dict[str, Any]] = field(default_factory=list)
    """The sequences whose own loss was non-finite in the fault being answered (index,
    hash, rank, data position, row; set before a remedy; ``skip_rows`` skips them)."""
    fault_sites: list[str] = field(default_factory=list)
    """The norms whose reduction overflowed in the fault being answered (set before a
    remedy; ``fp32_sites`` switches them)."""
    fp32_sites: list[str] = field(default_factory=list)
    """The norms ``fp32_sites`` switched to fp32 (saved: a resume switches them again)."""
    high_precision: list[str] = field(default_factory=list)
    """The quantized Linears ``quant_bf16`` put back in high precision (saved likewise)."""
    skip_step: bool = False
    """Set by the stability callback: the step in flight is judged bad and is not applied."""

    def next_position(self, data_step: int) -> int:
        """The first data position at or after ``data_step`` that is not skipped."""
        while data_step in self.skipped:
            data_step += 1
        return data_step

    def state_dict(self) -> dict[str, Any]:
        return {
            "model_step": self.model_step,
            "data_step": self.data_step,
            "lr_scale": self.lr_scale,
            "lr_since": self.lr_since,
            "remedies": list(self.remedies),
            # the z_loss remedy may have switched it on (a model without one: 0)
            "z_loss": float(getattr(self.model, "z_loss", 0.0)),
            "skipped": sorted(self.skipped),
            "skipped_items": {str(i): h for i, h in sorted(self.skipped_items.items())},
            "fp32_sites": list(self.fp32_sites),
            "high_precision": list(self.high_precision),
        }

    def load_state_dict(self, state: dict[str, Any], z_loss: float) -> None:
        """``z_loss``: the configured weight, for a checkpoint written before it was saved.
        What the state dict cannot hold (a norm's reduction dtype) is the remedies' to
        re-apply (``rollback.reapply_remedies``)."""
        self.model_step = state["model_step"]
        self.lr_scale = state.get("lr_scale", 1.0)
        self.lr_since = state.get("lr_since")
        self.remedies = list(state.get("remedies", []))
        if hasattr(self.model, "z_loss"):
            self.model.z_loss = state.get("z_loss", z_loss)
        self.skipped |= set(state.get("skipped", []))  # in place (the sampler's set)
        self.skipped_items.update({int(i): h for i, h in state.get("skipped_items", {}).items()})
        self.fp32_sites = list(state.get("fp32_sites", []))
        self.high_precision = list(state.get("high_precision", []))
        self.data_step = self.next_position(state["data_step"])
