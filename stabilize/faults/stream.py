"""Stream drift: the whole residual stream grows, and the model's function does not change.

This is the seed's "the residual stream drifts to ~1e4" as it happens in a pre-norm model:
weights grow, the stream's scale grows with them, and every norm that reads the stream
divides the scale away, so the loss does not notice, until a 16-bit reduction of the
stream's squares overflows (at D = 128 once a row's RMS passes 255.94 / sqrt(128) = 22.6).

From ``fault.step`` on, block ``fault.layer``'s output is multiplied by a factor f and
every later block's residual update by the same f, so the stream after block ``layer`` is
f times the natural one. Every reader of the stream (``ln_1``, ``ln_2``, ``ln_f``, all
scale-invariant in the pre placement) sees the same normalized rows, up to eps: with the
norms reduced in fp32 the run trains as the healthy reference does, which is what lets a
remedy be judged by how it trains (an ``activation_drift`` scales one block's update, which
drowns every later block's update and degrades any arm, remedied or not).

f follows the same planned path as ``activation_drift`` (``target`` / ``target_step`` or
``cross`` / ``cross_step``, holding at ``target`` unless ``keep_growing``): block
``layer``'s output |x| max is pinned to it exactly, in closed form (f = planned / natural
|x| max). The gradients reaching every weight are unchanged in exact arithmetic (the
stream's gradient shrinks by 1/f, every path into it is scaled by f).
"""

from __future__ import annotations

import torch
from torch import nn

from stabilize.faults.base import first_tensor, register_fault, residual_blocks, with_first
from stabilize.faults.drift import ActivationDrift


@register_fault
class StreamDrift(ActivationDrift):
    """Scales the residual stream from block ``fault.layer`` on by the drift's factor."""

    kind = "stream_drift"

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        if cfg.channels is not None:
            raise ValueError(
                f"fault.channels={cfg.channels} is not allowed with fault.kind='stream_drift' "
                "(the whole stream scales); allowed: null (use activation_drift for an "
                "outlier feature)"
            )

    def attach(self, model: nn.Module) -> None:
        blocks = residual_blocks(model, self.cfg.layer)
        blocks[self.cfg.layer].register_forward_hook(self._scale_output)
        for block in blocks[self.cfg.layer + 1 :]:
            block.register_forward_hook(self._scale_update, with_kwargs=True)

    def _active(self) -> bool:
        return not (self.disabled or not self.mine() or self.step < self.cfg.step)

    def _scale_output(self, module, args, out):
        if not self._active():
            self.drift_factor = 1.0
            return out
        h = first_tensor(out)
        with torch.no_grad():
            natural = float(h.detach().abs().max())
            if self.drift_start is None:  # the first drift step: the natural level
                self.drift_start = natural
            f = self.planned(self.step) / natural if natural > 0 else 1.0
        self.drift_factor = f
        return with_first(out, h * f)

    def _scale_update(self, module, args, kwargs, out):
        if not self._active() or self.drift_factor == 1.0:
            return out
        # the block's input, already f times the natural stream (Hugging Face passes it by
        # keyword in some versions)
        x = args[0] if args else kwargs["hidden_states"]
        h = first_tensor(out)
        return with_first(out, x + (h - x) * self.drift_factor)
