"""What the probe watches on a model: the ``ModelView`` (docs/design-your-model.md section 3).

The probe (probe.py), the gradient scan (grad_scan.py) and the per-block parameter groups
(param_stats.py) ask a view, never the model's own attribute names:

- ``blocks``: the residual blocks, ``(name, module)`` in order (the series ``act_max/<name>``);
- ``norms``: every normalization module, ``NormSite`` (name, module, width, whether it
  reports its own statistic: our zoo ``Norm`` calls ``record_norm`` from its forward; any
  other norm is read by a forward pre-hook on its input);
- ``attn``: per block, where its queries and keys come out as the scores see them, up to a
  rotation (``AttnSite``; None: not found, or not measurable there: ``inspect_model``'s
  ``qk_notes`` says why);
- ``aliases``: block -> the norm whose input *is* that block's output (read once, by the norm;
  our GPT's from its placement, any other model's found by the probe at its first forward);
- ``log_z``: ``"sink"`` (our loss hands the probe its log Z), ``"head"`` (a hook on the output
  projection's logits, on detailed steps) or None.

``GPTView`` answers for our GPT from its names (``h.{i}``, ``h.{i}.ln_1``, ``ln_f``,
``h.{i}.attn``: the series keep the names they always had); ``ForeignView`` for any other
model from ``inspect_model`` (its module paths: ``transformer.h.0``,
``model.layers.0.input_layernorm``). ``view_of(model)`` picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stabilize.model.foreign import QKSource, inspect_model
from stabilize.norms import Norm


@dataclass(frozen=True)
class NormSite:
    name: str
    module: nn.Module
    width: int
    reports: bool
    """A zoo ``Norm``: it hands its input and statistic to the probe itself."""
    reduction: str | None = None
    """A norm that is not ours: the dtype its statistic is computed in (``find_norms``;
    fp16 / bf16: its rows are counted as its own reduction would overflow them)."""
    kind: str = "rmsnorm"
    """layernorm (its statistic is of the centred row) | rmsnorm | unknown."""


@dataclass(frozen=True)
class AttnSite:
    """Block i's attention: ``q_module`` / ``k_module`` outputs, made [B, H, T, hd] by
    ``heads`` (None: they already are)."""

    name: str
    q_module: nn.Module
    k_module: nn.Module
    heads: Callable[[torch.Tensor, bool], torch.Tensor] | None = None
    """(a module's output, is it q) -> [B, H, T, hd]."""
    entropy: bool = True
    """The lowest head entropy is measured: q and k are the ones the softmax sees. Off on a
    model we did not build: its q / k may be rotated (RoPE) after these modules."""
    scale: float | None = None
    """What the attention multiplies q.k by; None: 1/sqrt(head width)."""


@dataclass
class ModelView:
    module: nn.Module
    blocks: list[tuple[str, nn.Module]]
    norms: list[NormSite]
    attn: list[AttnSite | None]
    aliases: dict[str, str] = field(default_factory=dict)
    log_z: str | None = None
    head: nn.Module | None = None
    """The output projection (``log_z == "head"``: its logits are read)."""
    lines: list[str] = field(default_factory=list)
    """What is seen and what is not, for the console at start-up (a foreign model's)."""

    def block_of(self, param_name: str) -> str:
        """The block a parameter (or module) path belongs to, else ``other``."""
        for name, _ in self.blocks:
            if param_name == name or param_name.startswith(name + "."):
                return name
        return "other"

    # the log-Z sink of our GPT's loss (model.logits.lm_loss)
    def attach_sink(self, probe) -> None:
        if self.log_z == "sink":
            self.module.logit_softcap.stats_sink = probe

    def detach_sink(self, probe) -> None:
        if self.log_z == "sink" and self.module.logit_softcap.stats_sink is probe:
            self.module.logit_softcap.stats_sink = None


def _is_gpt(model: nn.Module) -> bool:
    from stabilize.model import GPT

    return isinstance(model, GPT)


def gpt_view(model: nn.Module) -> ModelView:
    """Our GPT, by its own names (the series and the report keep them)."""
    n = len(model.h)
    blocks = [(f"h.{i}", b) for i, b in enumerate(model.h)]
    norms = [
        NormSite(name, m, m.dim, True) for name, m in model.named_modules() if isinstance(m, Norm)
    ]
    attn = [AttnSite(f"h.{i}.attn", b.attn.q_norm, b.attn.k_norm) for i, b in enumerate(model.h)]
    # Pre-norm and sandwich: block i's output is exactly the input of the next norm
    # (h.{i+1}.ln_1, or ln_f after the last block), which the norm already measures.
    aliases: dict[str, str] = {}
    names = {s.name for s in norms}
    if model.cfg.norm.placement in ("pre", "sandwich"):
        for i in range(n):
            nxt = f"h.{i + 1}.ln_1" if i + 1 < n else "ln_f"
            if nxt in names:
                aliases[f"h.{i}"] = nxt
    return ModelView(model, blocks, norms, attn, aliases, log_z="sink")


def _heads(src: QKSource):
    """(a q or k module's output, is it q) -> [B, H, T, hd], a strided view. A projection's
    output is [B, T, H * hd] (a fused one's columns cut first); a per-head norm's is 4-D,
    [B, T, H, hd] as Hugging Face applies it before the transpose, or [B, H, T, hd]: told
    apart by the head count, and where T equals it the heads are pooled into one (the max
    over every head of q times that of k still bounds each head's logits)."""
    hd = src.head_dim

    def split(out: torch.Tensor, is_q: bool) -> torch.Tensor:
        h = src.heads[0] if is_q else src.heads[1]
        if out.dim() == 4:
            b, t1, t2, _ = out.shape
            if t2 == h and t1 != h:
                return out.transpose(1, 2)  # [B, T, H, hd] -> [B, H, T, hd]
            if t1 == h and t2 != h:
                return out
            return out.reshape(b, 1, -1, hd)  # [B, 1, H * T, hd]: one pooled head
        cols = src.q_cols if is_q else src.k_cols
        if cols is not None:
            out = out[..., cols[0] : cols[1]]
        b, t, c = out.shape
        return out.view(b, t, c // hd, hd).transpose(1, 2)  # [B, H, T, hd], a strided view

    return split


def foreign_view(model: nn.Module, blocks: str | None = None) -> ModelView:
    """Any other model, by discovery (``inspect_model``; ``blocks``: a glob over paths)."""
    found = inspect_model(model, blocks=blocks)
    norms = [
        NormSite(n.name, n.module, n.width, isinstance(n.module, Norm), n.reduction_dtype, n.kind)
        for n in found.norms
    ]
    attn: list[AttnSite | None] = []
    for (name, _), src in zip(found.blocks, found.qk, strict=True):
        if src is None:  # not found, or not measurable there (found.qk_notes says why)
            attn.append(None)
            continue
        site = AttnSite(f"{name}.attn", src.q_module, src.k_module, _heads(src), False, src.scale)
        attn.append(site)
    head = found.head[1] if found.head else None
    # model=hf's model hands its loss's log Z over as ours does (model/hf_arch.py)
    sink = getattr(getattr(model, "logit_softcap", None), "stats_sink", False) is not False
    log_z = "sink" if sink else "head" if head is not None else None
    return ModelView(
        model, list(found.blocks), norms, attn, log_z=log_z, head=head, lines=found.describe()
    )


def view_of(model: nn.Module, blocks: str | None = None) -> ModelView:
    """``GPTView`` for our GPT, ``ForeignView`` for any other model."""
    return gpt_view(model) if _is_gpt(model) and blocks is None else foreign_view(model, blocks)


def norm_summary(model: nn.Module) -> dict[str, Any]:
    """The norms' ``reduction_dtype`` and ``eps`` as one value each where they agree
    (``mixed`` where they do not; ``eps`` None), ``type`` likewise: the report's columns."""
    from stabilize.norms.surgery import find_norms

    found = find_norms(model)

    def one(values: set) -> Any:
        return next(iter(values)) if len(values) == 1 else "mixed" if values else None

    eps = {n.eps for n in found}
    return {
        "type": one({n.kind for n in found}),
        "reduction_dtype": one({n.reduction_dtype or "?" for n in found}),
        "eps": next(iter(eps)) if len(eps) == 1 else None,
    }
