"""What the probe's numbers are called (``StabilityProbe``):

- ``Units``: one tensor, one unit. A block whose output *is* the next norm's input (pre-norm)
  is the same tensor under two names: it is read once, by the norm, and ``act_alias`` tells
  the monitors (monitors/activations.py judges it once, as the norm), though both series
  are logged. Our GPT's view names the pairs from its placement; on any other model they
  are found at the first training forward, by identity (``x is h``: a copy, a dropout or a
  residual add in between makes another tensor, and two units), and the block's own hook
  is then dropped.
- ``unpack``: the step vector read back by name, host lists after the step's one host sync
  into the dicts of ``StepStats``. A value not measured is missing, never 0: the maxima
  start at -inf (|x| max, the attention bound, entropy, log Z, curvature) or -1 (norms,
  ratios), and a slot still there is left out (a block whose heads were not found has no
  ``attn_logit``; a norm that did not run this step has no |x| max and no counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stabilize.stability.quant_sites import PER_SITE, unpack_sites


class Units:
    """Which block outputs are a norm's input (``alias``: block -> norm), and the block
    hooks of the others (``handles``), until the first training step has settled it."""

    def __init__(self, aliases: dict[str, str], norms: list[str]):
        self.alias = dict(aliases)
        self.norms = norms
        self.norm_index = {name: j for j, name in enumerate(norms)}
        self.handles: dict[str, Any] = {}  # block -> its probe hook, while it has one
        # (block, its output) last seen while the pairs are found; None once settled
        self.last: tuple[str, torch.Tensor] | None = None
        self.finding = False
        self._seen = False  # a training forward ran while finding

    def hook_blocks(self, blocks: list[tuple[str, nn.Module]], make: Callable) -> None:
        """A forward hook (``make(i)``) on every block no norm is known to read."""
        for i, (name, block) in enumerate(blocks):
            if name not in self.alias:
                self.handles[name] = block.register_forward_hook(make(i))
        self.finding = bool(self.handles)

    def block_out(self, name: str, h: torch.Tensor) -> None:
        self.last, self._seen = (name, h), True

    def norm_in(self, j: int, x: torch.Tensor) -> None:
        """Norm j's input is the last block's output itself: one tensor, one unit, and the
        block's hook goes."""
        name, h = self.last
        if x is h and name not in self.alias:
            self.alias[name] = self.norms[j]
            self.handles.pop(name).remove()
            self.last = None

    def step(self) -> None:
        """A step starts: once a whole step has been seen, the pairs are settled."""
        if self.finding and self._seen:
            self.finding, self.last = False, None

    def remove(self) -> None:
        for h in self.handles.values():
            h.remove()
        self.handles.clear()


def unpack(p, maxima: list[float], counts: list[float]) -> dict[str, dict[str, Any]]:
    """Host lists -> named dicts for StepStats: a value not measured this step (a slot
    still at its -inf / -1 start) is left out, never reported as 0."""
    nb, na, nn_ = len(p.blocks), len(p.attn), len(p.norms)
    at = {
        k: getattr(p, f"_o_{k}") - p.lead
        for k in ("norm", "rms", "ent", "lz", "gn", "upd", "g2v", "opt")
    }
    norm_max = maxima[at["norm"] : at["rms"]]
    blocks = maxima[:nb]
    for i, name in enumerate(p.blocks):
        if name in p.units.alias:  # measured by the next norm (its input |x| max)
            blocks[i] = norm_max[p.units.norm_index[p.units.alias[name]]]
    ninf = -math.inf
    attn = zip(p.attn, maxima[nb : nb + na], strict=True)
    out = {
        "act_max": {k: v for k, v in zip(p.blocks, blocks, strict=True) if v != ninf},
        "attn_logit": {k: v for k, v in attn if v != ninf},
    }
    ran = {k for k, v in zip(p.norms, norm_max, strict=True) if v != ninf}
    out["act_max"].update((k, v) for k, v in zip(p.norms, norm_max, strict=True) if k in ran)
    out["norm_rms_max"] = {
        k: v for k, v in zip(p.norms, maxima[at["rms"] : at["ent"]], strict=True) if v >= 0
    }
    for k, field in enumerate(p.COUNTS):
        vals = zip(p.norms, counts[k * nn_ : (k + 1) * nn_], strict=True)
        out[field] = {n: v for n, v in vals if n in ran}  # a norm that did not run: none
    ent = maxima[at["ent"] : at["lz"]]
    out["attn_entropy"] = {k: -v for k, v in zip(p.attn, ent, strict=True) if v != -math.inf}
    lz_max, (lz_sum, n) = maxima[at["lz"]], counts[3 * nn_ :]
    out["log_z"] = {"mean": lz_sum / n, "max": lz_max} if n > 0 else {}
    groups = list(p.param_groups)
    for field, o in (("layer_grad_norm", "gn"), ("update_ratio", "upd"), ("g2_v", "g2v")):
        vals = maxima[at[o] : at[o] + len(groups)]
        out[field] = {g: v for g, v in zip(groups, vals, strict=True) if not v < 0}
    opt = zip(p.OPT, maxima[at["opt"] : at["opt"] + len(p.OPT)], strict=True)
    out["opt"] = {k: v for k, v in opt if v != -math.inf and not (k[:4] != "curv" and v < 0)}
    o = p._o_q - p.lead
    out.update(unpack_sites(p.quant, maxima[o : o + len(p.quant) * PER_SITE]))
    out["norm_dim"] = p.dims  # constant: the RMS line 255.94 / sqrt(D) needs D
    out["act_alias"] = dict(p.units.alias)
    return out
