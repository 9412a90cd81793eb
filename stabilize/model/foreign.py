"""What a model we did not build offers to watch (docs/design-your-model.md
sections 3-4): ``inspect_model(model) -> ModelMap``, the discovery half of ``ForeignView``.

Found by structure, types and class names, never by importing ``transformers``:

- ``norms``: ``find_norms(model)``'s list (``stabilize/norms/surgery.py``);
- ``blocks``: the residual blocks, the longest ``nn.ModuleList`` whose items share one class
  (GPT-2 ``transformer.h``, Llama ``model.layers``, our GPT ``h``), or the modules a
  ``blocks=`` glob names (``*`` stays inside one dotted component);
- ``embedding`` / ``head``: the token embedding and the output projection, and whether they
  hold the same ``Parameter`` (``tied``);
- ``qk``: per block, the module(s) whose outputs are the attention queries and keys as the
  scores are made from them: the projections' outputs, with the columns of each that hold
  them (a fused q|k|v projection is split by columns, never read from weights: GPT-2's
  ``Conv1D`` stores [in, out]), or where q and k are normalized after the projections
  (OLMo 2, Qwen3, Gemma 3: ``q_norm`` / ``k_norm``), those norms' outputs. A rotation (RoPE)
  after them keeps each head's norms, so the bound from them holds; a normalization does not,
  so a block whose attention normalizes q or k in a way not read here gets no source, and
  ``qk_notes`` says why, as it does for heads whose width cannot be found.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from stabilize.norms.measure import INLINE_NORM_CALLS
from stabilize.norms.surgery import FoundNorm, find_norms, unseen_norms_line

# Separate projections, by child name: (queries, keys) under one attention module.
QK_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"))
# Norms of q and k after their projections, by child name beside the projections (OLMo 2's
# over all heads, Qwen3's and Gemma 3's per head): the scores are made from their outputs.
QK_NORMS = (
    ("q_norm", "k_norm"),
    ("q_layernorm", "k_layernorm"),
    ("query_layernorm", "key_layernorm"),
    ("q_layer_norm", "k_layer_norm"),
    ("norm_q", "norm_k"),
)
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
    head_dim: int = 0
    """Width of one head (0: not found, and then no bound is measured)."""
    heads: tuple[int, int] = (0, 0)
    """(query heads, key heads) from the projections' widths (GQA: fewer key heads)."""
    scale: float | None = None
    """What the attention multiplies q.k by (its ``scaling``); None: 1/sqrt(head_dim)."""
    normed: bool = False
    """Read after q/k norms (the modules are the norms, not the projections)."""

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
        after = " (q and k after their norms)" if self.normed else ""
        return f"{self.q}, {self.k}{after}"


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
    qk_notes: tuple[str, ...] = ()
    """Per block, why its q/k were found but give no bound ('' where found, or where no
    attention was found at all)."""
    unseen_norms: str = ""
    """One line on the norms computed inline, which no module holds ('' when none)."""

    def describe(self) -> list[str]:
        """A few human lines (counts and paths) for a console or a report; what cannot be
        seen is said, never left out."""
        lines = [f"{self.cls}: {len(self.blocks)} blocks, {len(self.norms)} norms"]
        if self.blocks:
            first, last = self.blocks[0][0], self.blocks[-1][0]
            span = first if len(self.blocks) == 1 else f"{first} .. {last}"
            kinds = sorted({type(m).__name__ for _, m in self.blocks})
            lines.append(f"blocks ({self.blocks_from}): {span} ({', '.join(kinds)})")
        if self.norms:
            kinds = sorted({f"{n.cls} ({n.kind}{_eps_note(n)})" for n in self.norms})
            lines.append(f"norms: {', '.join(kinds)}")
        else:
            lines.append("norms: none found (no module normalizes its input's last dimension)")
        if self.unseen_norms:
            lines.append(self.unseen_norms)
        emb = self.embedding[0] if self.embedding else "none found"
        head = self.head[0] if self.head else "none found"
        tie = ", tied" if self.tied else ", untied" if self.head and self.embedding else ""
        lines.append(f"embedding: {emb}; head: {head}{tie}")
        found = [s for s in self.qk if s is not None]
        if self.blocks:
            where = f": e.g. {found[0].describe()}" if found else ""
            # a map built without notes (qk_notes ()) has none to give
            notes = [(b, n) for (b, _), n in zip(self.blocks, self.qk_notes, strict=False) if n]
            if notes:
                where += f"; no attention bound in {len(notes)} ({notes[0][0]}: {notes[0][1]})"
            lines.append(f"q/k: found in {len(found)} of {len(self.blocks)} blocks{where}")
        return lines


def _eps_note(n: FoundNorm) -> str:
    if n.eps_from == "measured":
        return f", eps {n.eps:g} measured"
    return ", eps unknown: 1e-05 assumed" if n.eps_from == "default" else ""


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


def _out_width(m: nn.Module | None) -> int | None:
    """Output features of a projection: ``nn.Linear`` [out, in]; ``Conv1D`` [in, out]."""
    if isinstance(m, nn.Linear):
        return m.out_features
    w = getattr(m, "weight", None)
    if type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[1])
    return None


def _head_dim(q_width: int, *modules: nn.Module) -> int | None:
    """The attention's per-head width, from the attributes Hugging Face and most
    implementations set: ``head_dim``, else the queries' width over the head count
    (``num_heads``, ``n_head`` or ``num_attention_heads``), searched in ``modules`` in order."""
    for top in modules:
        for m in top.modules():
            hd = getattr(m, "head_dim", None)
            if isinstance(hd, int) and hd > 0:
                return hd
            for heads in ("num_heads", "n_head", "num_attention_heads"):
                h = getattr(m, heads, None)
                if isinstance(h, int) and h > 0 and q_width % h == 0:
                    return q_width // h
    return None


def _calls_norm(m: nn.Module) -> bool:
    """``m``'s own forward computes a functional norm (``F.layer_norm``, ``F.rms_norm``) or
    ``F.normalize`` (cosine attention)."""
    code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
    names = code.co_names if code is not None else ()
    return any(n in names for n in (*INLINE_NORM_CALLS, "normalize"))


def _qk_norms(parent: nn.Module, prefix: str, norms: tuple[str, ...], block_path: str):
    """(q norm, k norm) sites, (None, None) where q and k go from the projections to the
    scores, or a reason why they cannot be read: a norm in the attention module that is not a
    known q/k pair (a normalization changes the bound; which side it is on is unknown)."""
    kids = dict(parent.named_children())
    for qn, kn in QK_NORMS:
        q, k = kids.get(qn), kids.get(kn)
        if q is not None and k is not None:
            if isinstance(q, nn.Identity) and isinstance(k, nn.Identity):
                return None, None  # no norm there: the projections are what the scores see
            return (f"{prefix}{qn}", q), (f"{prefix}{kn}", k)
    if prefix.rstrip(".") == block_path:  # the block itself: its norms come before
        return None, None
    inside = [n for n in norms if n.startswith(prefix)]
    if inside:
        return f"a norm in the attention not read as q/k ({inside[0]})", None
    if _calls_norm(parent):
        return f"{type(parent).__name__}.forward normalizes inline", None
    return None, None


def _source(block, prefix, parent, pair, cols, norms, block_path):
    """The ``QKSource`` of an attention module whose projections are ``pair`` (q and k sites;
    the same module when fused, split at ``cols``), or (None, why)."""
    (qp, q), (kp, k) = pair
    widths = (cols[0][1] - cols[0][0], cols[1][1] - cols[1][0]) if cols else (
        _out_width(q), _out_width(k))  # fmt: skip
    hd = _head_dim(widths[0], parent, block)
    if not hd:
        return None, "the head width is not found (no head_dim, num_heads or n_head)"
    qn, kn = _qk_norms(parent, prefix, norms, block_path)
    if isinstance(qn, str):
        return None, qn
    heads = (widths[0] // hd, widths[1] // hd)
    scale = getattr(parent, "scaling", None)
    scale = float(scale) if isinstance(scale, (int, float)) and scale > 0 else None
    if qn is not None:
        (qp, q), (kp, k), cols = qn, kn, None
    qc, kc = cols if cols else (None, None)
    return QKSource(qp, kp, qc, kc, q, k, hd, heads, scale, qn is not None), ""


def _qk(block_path: str, block: nn.Module, norms: tuple[str, ...]) -> tuple[QKSource | None, str]:
    """The first q/k projection pair (or fused q|k|v projection) under ``block``, read where
    the scores are made, and why not where that is not possible ('' when found, or when
    there is no attention)."""
    for name, parent in block.named_modules():
        prefix = f"{block_path}.{name}." if name else f"{block_path}."
        kids = dict(parent.named_children())
        for qn, kn in QK_PAIRS:
            q, k = kids.get(qn), kids.get(kn)
            if q is not None and k is not None and _out_width(q) and _out_width(k):
                pair = ((f"{prefix}{qn}", q), (f"{prefix}{kn}", k))
                return _source(block, prefix, parent, pair, None, norms, block_path)
        for fn in QK_FUSED:
            m = kids.get(fn)
            width = _out_width(m)
            if width and width % 3 == 0:
                split = getattr(parent, "split_size", width // 3)
                if split * 3 != width:
                    continue
                path = f"{prefix}{fn}"
                cols = ((0, split), (split, 2 * split))
                return _source(block, prefix, parent, ((path, m), (path, m)), cols, norms,
                               block_path)  # fmt: skip
    return None, ""


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
    norms = find_norms(model)
    names = tuple(n.name for n in norms)  # in module order
    qk = [_qk(p, b, names) for p, b in sites]
    return ModelMap(
        cls=type(model).__name__,
        norms=tuple(norms),
        blocks=tuple(sites),
        embedding=emb,
        head=head,
        tied=tied,
        qk=tuple(src for src, _ in qk),
        blocks_from=source,
        qk_notes=tuple(why for _, why in qk),
        unseen_norms=unseen_norms_line(model, norms),
    )
