"""Hugging Face architectures in ``stabilize-train`` (``model=hf``; docs/design-your-model.md
section 7).

``build_hf(cfg)`` makes a ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` from the run's own
``model`` keys (``vocab_size``, ``block_size``, ``n_layer``, ``d_model``, ``n_head``,
``mlp_ratio``, ``dropout``, ``init_std``; ``model.hf.config`` for the keys we do not have,
e.g. ``num_key_value_heads``), from a config: nothing is downloaded. Its norms are swapped
for ours (``swap_norms``: the same Parameters) with the ``norm`` group's eps, reduction
dtype and backend, each keeping its own kind (``model.hf.norm_type=arch``, the default) or
taking the group's (``group``); ``model.norm_sites`` then applies per norm. So the
scenario's question ("what if this model's norms reduced in fp16") is asked of a Llama.

The model is a subclass of the Hugging Face class whose ``forward(idx)`` returns the
logits (``use_cache=False``, SDPA attention), with what ``GPTLitModule`` reads of ours:
``cfg``, ``z_loss``, ``logit_softcap`` (a pass-through whose ``stats_sink`` the loss hands
each token's log Z), ``num_params``. Module paths stay Hugging Face's
(``model.layers.0.input_layernorm``). ``transformers`` is the ``hf`` extra.
"""

from __future__ import annotations

import torch
from torch import nn

from stabilize.model.config import GPTConfig, hf_config_values
from stabilize.model.logits import LogitSoftcap


def _classes(arch: str):
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "model=hf needs transformers: pip install -e '.[hf]' (docs/your-model.md)"
        ) from None
    if arch == "llama":
        return transformers.LlamaConfig, transformers.LlamaForCausalLM
    return transformers.GPT2Config, transformers.GPT2LMHeadModel


def build_hf(cfg: GPTConfig) -> nn.Module:
    """The run's Hugging Face model, norms swapped as the ``norm`` group says."""
    if cfg.hf.weights is not None:
        return _finish(_pretrained(cfg, _classes(cfg.hf.arch)[1]), cfg)
    return hf_skeleton(cfg)


def hf_skeleton(cfg: GPTConfig) -> nn.Module:
    """The run's Hugging Face model from the model keys alone, no weights read (on the meta
    device when built under it, as the start-up checks do: the module names and Linear
    widths are the same as with ``model.hf.weights``, whose config ``check_weights`` held
    to the keys)."""
    config_cls, model_cls = _classes(cfg.hf.arch)
    hf_cfg = config_cls(**hf_config_values(cfg), **cfg.hf.config, attn_implementation="sdpa")
    return _finish(_causal_lm(model_cls)(hf_cfg), cfg)


def _finish(model: nn.Module, cfg: GPTConfig) -> nn.Module:
    """The run's own pieces on a Hugging Face model: its config, the loss's log Z sink, the
    norms swapped and placed as the ``norm`` group says."""
    from stabilize.model.gpt import apply_norm_sites
    from stabilize.norms.surgery import swap_norms

    model.cfg = cfg
    model.z_loss = cfg.z_loss
    model.logit_softcap = LogitSoftcap(0.0)  # the loss's log Z sink (no cap: refused)
    kind = cfg.norm.type if cfg.hf.norm_type == "group" else None
    swap_norms(model, type=kind, eps=cfg.norm.eps, reduction_dtype=cfg.norm.reduction_dtype,
               backend=cfg.norm.backend)  # fmt: skip
    apply_norm_sites(model, cfg.norm_sites)
    return model


def check_weights(cfg: GPTConfig) -> None:
    """``model.hf.weights`` before anything is written: a local ``save_pretrained``
    directory whose config agrees with our model keys (and ``model.hf.config``); dropout
    is the run's and the init std unused, so those may differ."""
    from pathlib import Path

    config_cls, _ = _classes(cfg.hf.arch)
    path = Path(cfg.hf.weights).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.hf.weights={cfg.hf.weights!r} is not allowed: no config.json there; "
            "allowed: a directory written by save_pretrained"
        )
    saved = config_cls.from_pretrained(str(path), local_files_only=True)
    for key, value in {**hf_config_values(cfg), **cfg.hf.config}.items():
        have = getattr(saved, key, None)
        if have == value or key.endswith(("dropout", "pdrop")) or key == "initializer_range":
            continue
        raise ValueError(
            f"model.hf.weights={cfg.hf.weights!r} is not allowed with these model keys: its "
            f"{key} is {have!r}, ours says {value!r}; allowed: model keys that match the "
            "weights' config.json"
        )


def _pretrained(cfg: GPTConfig, model_cls) -> nn.Module:
    """The weights of ``model.hf.weights`` (checked by ``check_weights``), the run's dropout."""
    drop = {k: v for k, v in hf_config_values(cfg).items() if k.endswith(("dropout", "pdrop"))}
    return _causal_lm(model_cls).from_pretrained(
        str(cfg.hf.weights), local_files_only=True, attn_implementation="sdpa", **drop
    )


_SUBCLASSES: dict[type, type] = {}


def _causal_lm(base: type) -> type:
    """``base`` whose ``forward(idx)`` returns the logits tensor (one subclass per base)."""
    if base not in _SUBCLASSES:

        def forward(self, idx: torch.Tensor, **kw) -> torch.Tensor:
            return base.forward(self, input_ids=idx, use_cache=False, **kw).logits

        def num_params(self, non_embedding: bool = False) -> int:
            """Parameters (a tied head once); ``non_embedding`` drops a position table."""
            n = sum(p.numel() for p in self.parameters())
            wpe = getattr(getattr(self, "transformer", None), "wpe", None)
            return n - wpe.weight.numel() if non_embedding and wpe is not None else n

        _SUBCLASSES[base] = type(
            f"Stabilize{base.__name__}", (base,), {"forward": forward, "num_params": num_params}
        )
    return _SUBCLASSES[base]


def save_hf(model: nn.Module, path) -> None:
    """The run's Hugging Face model as ``save_pretrained`` writes it, for ``from_pretrained``
    of the plain Hugging Face class: our swapped norms hold the model's own Parameters under
    its own names, so the state dict is the architecture's, and the class written is the
    base (no harness subclass, nothing to import)."""
    base = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    with torch.device("meta"):  # no random init of weights replaced at once
        plain = base(model.config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    plain.save_pretrained(str(path))
