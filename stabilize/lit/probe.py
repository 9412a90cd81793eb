"""Per-layer statistics gathered on device during the training forward, no host sync.

Series, in a fixed order (so every rank stacks the same vector):
- ``h.{i}``: the residual stream after block i, |x| max;
- every norm by module name (``h.{i}.ln_1``, ``ln_f``, ...): its input's |x| max, rows
  whose reduction overflowed, rows that collapsed to zeros, largest row RMS (read from the
  norm's own ``last_stats``, see stabilize.norms.norm_stats);
- ``h.{i}.attn``: an upper bound on the attention logit, max|q| max|k| / sqrt(d_head)
  (Cauchy-Schwarz; the exact max would cost a second attention).
Maxima accumulate with ``torch.maximum`` and counts with ``+`` across the micro-batches of
one optimizer step; ``reset()`` starts the next step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stabilize.norms import Norm


class StabilityProbe:
    def __init__(self, model: nn.Module):
        self.blocks = [f"h.{i}" for i in range(len(model.h))]
        self.norms = [n for n, m in model.named_modules() if isinstance(m, Norm)]
        self.attn = [f"h.{i}.attn" for i in range(len(model.h))]
        self._handles = []
        # The attention bound is logged, not judged: the callback asks for it only on the
        # steps it logs (two passes over q and k otherwise spent every step).
        self.detailed = True
        self._block_max: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._norm: list[torch.Tensor | None] = [None] * len(self.norms)
        self._attn: list[torch.Tensor | None] = [None] * len(self.attn)
        self._q: list[torch.Tensor | None] = [None] * len(self.attn)
        # Pre-norm and sandwich: block i's output is exactly the input of the next norm
        # (h.{i+1}.ln_1, or ln_f after the last block), which the norm already measures;
        # reading the same tensor twice would only cost another pass.
        self._alias: dict[str, str] = {}
        if model.cfg.norm.placement in ("pre", "sandwich"):
            for i in range(len(self.blocks)):
                nxt = f"h.{i + 1}.ln_1" if i + 1 < len(self.blocks) else "ln_f"
                if nxt in self.norms:
                    self._alias[self.blocks[i]] = nxt
        self._norm_index = {name: j for j, name in enumerate(self.norms)}
        for i, block in enumerate(model.h):
            if self.blocks[i] not in self._alias:
                self._handles.append(block.register_forward_hook(self._block_hook(i)))
            self._handles.append(block.attn.q_norm.register_forward_hook(self._q_hook(i)))
            self._handles.append(block.attn.k_norm.register_forward_hook(self._k_hook(i)))
        modules = dict(model.named_modules())
        self.dims = {name: modules[name].dim for name in self.norms}
        for j, name in enumerate(self.norms):
            modules[name].collect_stats = True
            self._handles.append(modules[name].register_forward_hook(self._norm_hook(j)))

    # ---- hooks (training forwards only) -------------------------------------------------
    def _block_hook(self, i):
        def hook(module, args, out):
            if module.training:
                with torch.no_grad():
                    # max(max x, -min x): on CPU ~10x faster than an ord=inf norm
                    v = torch.maximum(out.amax(), -out.amin()).float()
                    prev = self._block_max[i]
                    self._block_max[i] = v if prev is None else torch.maximum(prev, v)

        return hook

    def _q_hook(self, i):
        def hook(module, args, out):  # out: [B, H, T, hd]
            if module.training and self.detailed:
                with torch.no_grad():
                    self._q[i] = torch.linalg.vector_norm(out.float(), dim=-1).amax(dim=(0, 2))

        return hook

    def _k_hook(self, i):
        def hook(module, args, out):
            if module.training and self.detailed and self._q[i] is not None:
                with torch.no_grad():
                    kn = torch.linalg.vector_norm(out.float(), dim=-1).amax(dim=(0, 2))  # [H]
                    v = (self._q[i] * kn).amax() / math.sqrt(out.shape[-1])
                    prev = self._attn[i]
                    self._attn[i] = v if prev is None else torch.maximum(prev, v)

        return hook

    def _norm_hook(self, j):
        def hook(module, args, out):
            s = module.last_stats
            if module.training and s is not None:
                prev = self._norm[j]
                if prev is None:
                    self._norm[j] = s
                else:  # max, sum, sum, max
                    self._norm[j] = torch.stack(
                        [
                            torch.maximum(prev[0], s[0]),
                            prev[1] + s[1],
                            prev[2] + s[2],
                            torch.maximum(prev[3], s[3]),
                        ]
                    )

        return hook

    # ---- the step's vector ------------------------------------------------------------------
    def reset(self) -> None:
        self._q = [None] * len(self.attn)
        self._block_max = [None] * len(self.blocks)
        self._norm = [None] * len(self.norms)
        self._attn = [None] * len(self.attn)

    @property
    def size(self) -> int:
        return len(self.blocks) + len(self.attn) + 4 * len(self.norms)

    def vector(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(maxima, counts): maxima are reduced across ranks with max, counts with sum.

        maxima = [block |x| max..., attn bound..., norm |x| max..., norm RMS max...]
        counts = [norm overflow rows..., norm collapsed rows...]
        """
        zero = torch.zeros((), device=device)
        blocks = []
        for i, name in enumerate(self.blocks):
            if name in self._alias:  # measured by the next norm (its input |x| max)
                v = self._norm[self._norm_index[self._alias[name]]]
                blocks.append(v[0] if v is not None else zero)
            else:
                v = self._block_max[i]
                blocks.append(v if v is not None else zero)
        attn = [v if v is not None else zero for v in self._attn]
        norms = [v if v is not None else torch.zeros(4, device=device) for v in self._norm]
        n = torch.stack(norms) if norms else torch.zeros(0, 4, device=device)  # [N, 4]
        maxima = torch.cat(
            [torch.stack(blocks + attn) if blocks else zero[None][:0], n[:, 0], n[:, 3]]
        )
        counts = torch.cat([n[:, 1], n[:, 2]])
        return maxima, counts

    def unpack(self, maxima: list[float], counts: list[float]) -> dict[str, dict[str, float]]:
        """Host lists -> named dicts for StepStats."""
        nb, na, nn_ = len(self.blocks), len(self.attn), len(self.norms)
        out = {
            "act_max": dict(zip(self.blocks, maxima[:nb], strict=True)),
            "attn_logit": dict(zip(self.attn, maxima[nb : nb + na], strict=True)),
        }
        out["act_max"].update(zip(self.norms, maxima[nb + na : nb + na + nn_], strict=True))
        out["norm_rms_max"] = {
            k: v for k, v in zip(self.norms, maxima[nb + na + nn_ :], strict=True) if v >= 0
        }
        out["norm_overflow"] = dict(zip(self.norms, counts[:nn_], strict=True))
        out["norm_collapsed"] = dict(zip(self.norms, counts[nn_:], strict=True))
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
