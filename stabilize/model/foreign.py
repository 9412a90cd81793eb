"""What a model we did not build offers to watch (issue 36, docs/design-your-model.md
sections 3-4): ``inspect_model(model) -> ModelMap``, the discovery half of ``ForeignView``.

Found by structure, types and class names, never by importing ``transformers``:

- ``norms``: ``find_norms(model)``'s list (``stabilize/norms/surgery.py``);
- ``blocks``: the residual blocks, the longest ``nn.ModuleList`` whose items share one class
  (GPT-2 ``transformer.h``, Llama ``model.layers``, our GPT ``h``), or the modules a
  ``blocks=`` glob names (``*`` stays inside one dotted component);
- ``embedding`` / ``head``: the token embedding and the output projection, and whether they
  hold the same ``Parameter`` (``tied``);
- ``qk``: per block, the module(s) whose outputs are the attention queries and keys, with the
  columns of each output that hold them (a fused q|k|v projection is split by columns, never
  read from weights: GPT-2's ``Conv1D`` stores [in, out]).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from stabilize.norms.surgery import FoundNorm, find_norms

# Separate projections, by child name: (queries, keys) under one attention module.
QK_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"))
# Fused projections whose output is [q | k | v] in equal thirds (GPT-2 and our GPT). Others
# (GPT-NeoX's per-head interleaved ``query_key_value``, GQA-sized ``qkv_proj``) are not split
# by guess: their blocks get None.
QK_FUSED = ("c_attn",)

Site = tuple[str, nn.Module]


@dataclass(frozen=True)
class QKSource:
    """Where block i's queries and keys come from: the outputs of ``q`` and ``k`` (paths in
    the model; the same module when fused), columns ``[start, stop)`` of the last dimension
    (None: the whole output). Pre-RoPE where the model rotates them (Llama)."""

    q: str
    k: str
    q_cols: tuple[int, int] | None
    k_cols: tuple[int, int] | None
    q_module: nn.Module
    k_module: nn.Module

    @property
    def fused(self) -> bool:
        return self.q_module is self.k_module

    def select(self, q_out: torch.Tensor, k_out: torch.Tensor | None = None):
        """(q, k) from the modules' outputs (a fused module's one output serves both)."""
        k_out = q_out if k_out is None else k_out
        q = q_out if self.q_cols is None else q_out[..., self.q_cols[0] : self.q_cols[1]]
        k = k_out if self.k_cols is None else k_out[..., self.k_cols[0] : self.k_cols[1]]
        return q, k

    def describe(self) -> str:
        if self.fused:
            (a, b), (c, d) = self.q_cols, self.k_cols
            return f"{self.q} (fused: q [{a}:{b}], k [{c}:{d}])"
        return f"{self.q}, {self.k}"


@dataclass(frozen=True)
class ModelMap:
    """What ``ModelView`` watches on a foreign model (see the module doc)."""

    cls: str
    norms: tuple[FoundNorm, ...]
    blocks: tuple[Site, ...]
    embedding: Site | None
    head: Site | None
    tied: bool
    qk: tuple[QKSource | None, ...]
    blocks_from: str
    """``longest ModuleList`` | ``blocks='<pattern>'`` | ``none``."""

    def describe(self) -> list[str]:
        """A few human lines (counts and paths) for a console or a report."""
        lines = [f"{self.cls}: {len(self.blocks)} blocks, {len(self.norms)} norms"]
        if self.blocks:
            first, last = self.blocks[0][0], self.blocks[-1][0]
            span = first if len(self.blocks) == 1 else f"{first} .. {last}"
            kinds = sorted({type(m).__name__ for _, m in self.blocks})
            lines.append(f"blocks ({self.blocks_from}): {span} ({', '.join(kinds)})")
        if self.norms:
            kinds = sorted({f"{n.cls} ({n.kind})" for n in self.norms})
            lines.append(f"norms: {', '.join(kinds)}")
        emb = self.embedding[0] if self.embedding else "none found"
        head = self.head[0] if self.head else "none found"
        tie = ", tied" if self.tied else ", untied" if self.head and self.embedding else ""
        lines.append(f"embedding: {emb}; head: {head}{tie}")
        found = [s for s in self.qk if s is not None]
        if self.blocks:
            where = f": e.g. {found[0].describe()}" if found else ""
            lines.append(f"q/k: found in {len(found)} of {len(self.blocks)} blocks{where}")
        return lines


def _glob(pattern: str, name: str) -> bool:
    """``pattern`` matches ``name`` component by component (``*`` never crosses a dot)."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(
        fnmatchcase(h, w) for h, w in zip(have, want, strict=True)
    )


def _blocks(model: nn.Module, pattern: str | None) -> tuple[list[Site], str]:
    if pattern is not None:
        sites = [(n, m) for n, m in model.named_modules() if n and _glob(pattern, n)]
        if not sites:
            raise ValueError(
                f"inspect_model: blocks={pattern!r} matches no module of {type(model).__name__}"
            )
        return sites, f"blocks={pattern!r}"
    best: list[Site] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(b) for b in m}) == 1:
            prefix = f"{name}." if name else ""
            best = [(f"{prefix}{i}", b) for i, b in enumerate(m)]
    return best, "longest ModuleList" if best else "none"


def _out_width(m: nn.Module) -> int | None:
    """Output features of a projection: ``nn.Linear`` [out, in]; ``Conv1D`` [in, out]."""
    if isinstance(m, nn.Linear):
        return m.out_features
    w = getattr(m, "weight", None)
    if type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[1])
    return None


def _qk(block_path: str, block: nn.Module) -> QKSource | None:
    """The first q/k projection pair (or fused q|k|v projection) under ``block``."""
    for name, parent in block.named_modules():
        prefix = f"{block_path}.{name}." if name else f"{block_path}."
        kids = dict(parent.named_children())
        for qn, kn in QK_PAIRS:
            q, k = kids.get(qn), kids.get(kn)
            if q is not None and k is not None and _out_width(q) and _out_width(k):
                return QKSource(f"{prefix}{qn}", f"{prefix}{kn}", None, None, q, k)
        for fn in QK_FUSED:
            m = kids.get(fn)
            width = _out_width(m)
            if width and width % 3 == 0:
                split = getattr(parent, "split_size", width // 3)
                if split * 3 != width:
                    continue
                path = f"{prefix}{fn}"
                return QKSource(path, path, (0, split), (split, 2 * split), m, m)
    return None


def _embedding_head(model: nn.Module) -> tuple[Site | None, Site | None, bool]:
    mods = list(model.named_modules())
    embs = [(n, m) for n, m in mods if isinstance(m, nn.Embedding)]
    linears = [(n, m) for n, m in mods if isinstance(m, nn.Linear)]
    for head in reversed(linears):  # a tied head: the last Linear sharing an embedding's weight
        for emb in embs:
            if head[1].weight is emb[1].weight:
                return emb, head, True
    if not embs:
        return None, None, False
    emb = max(embs, key=lambda e: e[1].num_embeddings)  # max keeps the first of equals
    heads = [h for h in linears if h[1].out_features == emb[1].num_embeddings]
    return emb, (heads[-1] if heads else None), False


def inspect_model(model: nn.Module, blocks: str | None = None) -> ModelMap:
    """A ``ModelMap`` of ``model`` (see the module doc). ``blocks``: a glob over module paths
    (``"transformer.h.*"``) naming the residual blocks, instead of the longest ModuleList; one
    that matches nothing is refused in one line."""
    sites, source = _blocks(model, blocks)
    emb, head, tied = _embedding_head(model)
    return ModelMap(
        cls=type(model).__name__,
        norms=tuple(find_norms(model)),
        blocks=tuple(sites),
        embedding=emb,
        head=head,
        tied=tied,
        qk=tuple(_qk(p, b) for p, b in sites),
        blocks_from=source,
    )
