"""``optim.state_dtype=bf16``: AdamW's moments kept at bf16's precision, a precision site of
docs/precision.md.

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


SIXTEEN = (torch.bfloat16, torch.float16)


class MasterWeights:
    """``optim.master_dtype=fp32``: AdamW steps an fp32 master copy of each 16-bit parameter
    (``bf16-true``), and the parameter is set to the master rounded to its dtype after each
    step. Without it, an update smaller than half a bf16 unit in the last place is lost to
    rounding at every step; with it, such updates add up in the master until they move the
    16-bit weight.

    How: at ``before_step`` (Lightning's ``on_before_optimizer_step``: the step's gradients
    are final, before clipping) each 16-bit parameter's storage is swapped for its master
    and its gradient upcast, so clipping and AdamW see fp32 (AdamW's moments are created
    fp32); the optimizer's step post-hook rounds the result back into a 16-bit storage.
    Loading the optimizer's state (a resume, or a rollback's restore: the harness restores
    the weights first) drops the masters held and swaps fp32 copies in first, so its fp32
    moments are not cast to 16 bits on the way in; the masters then come from the checkpoint
    (``load``, by parameter name) where one holds them, else from the restored weights (a
    rollback's snapshot holds none: the sub-bf16 progress since it is not kept, nor any of
    the discarded steps'). Only then is each master checked against its parameter (it must
    round to it), not on every step. The masters travel in the checkpoint by parameter name
    (``state_dict``)."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module):
        self.opt = opt
        self.names = {p: n for n, p in model.named_parameters()}
        self.master: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}  # loaded by name, taken on first use
        self.swapped: list[tuple[torch.nn.Parameter, torch.dtype]] = []
        self.verify = True  # check the masters against the weights at the next swap
        opt.register_step_post_hook(self._after_step)
        opt.register_load_state_dict_pre_hook(self._before_load)
        opt.register_load_state_dict_post_hook(lambda o: self._swap_out())

    def _before_load(self, opt, state_dict) -> None:
        self.master, self.verify = {}, True  # the weights are being restored: see above
        self._swap_in(grads=False)

    def _low(self) -> list[torch.nn.Parameter]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.dtype in SIXTEEN]

    def _master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        m = self.master.get(p)
        if m is None:
            m = self.pending.pop(self.names.get(p, ""), None)
            if m is not None and (m.shape != p.shape or not torch.equal(m.to(p.dtype), p.data)):
                m = None  # a checkpoint's master that is not its weight's: not this run's
        elif self.verify and not torch.equal(m.to(p.dtype), p.data):
            m = None
        return m if m is not None else p.detach().float().clone()

    @torch.no_grad()
    def _swap_in(self, grads: bool = True) -> None:
        for p in self._low():
            g, dtype = p.grad, p.dtype
            p.data = self._master_of(p)
            if grads and g is not None:
                p.grad = g.float()
            self.swapped.append((p, dtype))

    @torch.no_grad()
    def _swap_out(self) -> None:
        for p, dtype in self.swapped:
            self.master[p] = p.data
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
        self.swapped = []

    def before_step(self) -> None:
        self._swap_in()
        self.verify = False

    def _after_step(self, opt, args, kwargs) -> None:
        self._swap_out()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.names[p]: m for p, m in self.master.items() if p in self.names}

    def load(self, saved: dict[str, torch.Tensor]) -> None:
        self.master, self.pending, self.verify = {}, dict(saved), True
