"""``optim.state_dtype=bf16``: AdamW's moments kept at bf16's precision, a precision site of
issue 37 (docs/precision.md).

Recipes that store the optimizer state in 16 bits (a pure-bf16 run's AdamW, memory-saving
optimizers) lose the small updates of the second moment first: a quiet gap, no NaN. This
emulates that storage on fp32 parameters: after each optimizer step every ``exp_avg`` and
``exp_avg_sq`` is rounded to bf16 (round to nearest even) in place. A real bf16 state is
rounded as it is written, before that step's update reads it; here that step's update
used the unrounded moments, and every later step starts from the rounded ones.
"""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def round_moments_to_bf16(opt: torch.optim.Optimizer, args=None, kwargs=None) -> None:
    """An optimizer step post-hook: each moment tensor rounded to bf16, kept in its dtype."""
    for state in opt.state.values():
        for key in MOMENTS:
            t = state.get(key)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(t.to(torch.bfloat16))
