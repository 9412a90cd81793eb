"""The run's model, as every place that builds one from a ``RunConfig`` must build it: our
GPT or ``model.hf``'s architecture (``stabilize.model.build_model``), then the Linears that
``quant`` names quantized (``stabilize.quant.config.apply_quant``). The Lightning module,
the replay and the replay's checkpoint reader all build it here, so a quantized run's
bundle replays on the same modules (and state-dict keys) it trained with."""

from __future__ import annotations

from typing import Any

from torch import nn


def build_run_model(cfg: Any) -> nn.Module:
    """``cfg``: a ``RunConfig`` (its ``model`` and ``quant`` sections)."""
    from stabilize.model import build_model
    from stabilize.quant.config import apply_quant

    model = build_model(cfg.model)
    apply_quant(model, cfg.quant)
    return model
