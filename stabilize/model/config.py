"""GPT configuration and the named sizes.

The GPT-3 sizes follow Brown et al. 2020, Table 2.1 (125M, 350M, 760M, 1.3B), with a
2048-token context and GPT-2's 50257-token vocabulary; parameter counts include the
(tied) token embedding and the learned position embedding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stabilize.norms import NormConfig
from stabilize.validate import build_dataclass, check_choice, check_positive, check_range

ACTIVATIONS = ("gelu_tanh", "gelu")  # gelu_tanh is GPT-2's "gelu_new"

PRESETS: dict[str, dict[str, Any]] = {
    # Byte-level, runs a training step in milliseconds on a CPU: the test and demo model.
    "tiny": dict(n_layer=2, n_head=4, d_model=128, block_size=128, vocab_size=256),
    "gpt-125m": dict(n_layer=12, n_head=12, d_model=768, block_size=2048, vocab_size=50257),
    "gpt-350m": dict(n_layer=24, n_head=16, d_model=1024, block_size=2048, vocab_size=50257),
    "gpt-760m": dict(n_layer=24, n_head=16, d_model=1536, block_size=2048, vocab_size=50257),
    "gpt-1.3b": dict(n_layer=24, n_head=16, d_model=2048, block_size=2048, vocab_size=50257),
}
# What each preset is published as, for the parameter-count check.
PUBLISHED_PARAMS = {
    "gpt-125m": 125e6,
    "gpt-350m": 350e6,
    "gpt-760m": 760e6,
    "gpt-1.3b": 1.3e9,
}


SITE_KEYS = ("reduction_dtype", "eps")  # what model.norm_sites may set per norm
HF_ARCHS = ("llama", "gpt2")
HF_NORM_TYPES = ("arch", "group")


@dataclass
class HFConfig:
    """``model.hf`` (``model=hf``): a Hugging Face architecture built from our ``model``
    keys (stabilize/model/hf_arch.py, docs/your-model.md)."""

    arch: str = "llama"
    """llama (RoPE, SwiGLU, RMSNorm, no biases) | gpt2."""
    config: dict[str, Any] = field(default_factory=dict)
    """Hugging Face config keys we do not have (``num_key_value_heads``,
    ``tie_word_embeddings``, ...); one our keys set is refused."""
    norm_type: str = "arch"
    """arch: each norm keeps its kind (Llama's RMSNorm, GPT-2's LayerNorm) with the ``norm``
    group's eps, reduction dtype and backend; group: the ``norm`` group's type too."""
    weights: str | None = None
    """A local directory of Hugging Face weights (``save_pretrained``'s: config.json and the
    weights), loaded with ``local_files_only``: nothing is downloaded. Its config must
    agree with our model keys (a key that differs is refused, naming both values)."""

    def __post_init__(self) -> None:
        check_choice("model.hf.arch", self.arch, HF_ARCHS)
        check_choice("model.hf.norm_type", self.norm_type, HF_NORM_TYPES)
        self.config = dict(self.config or {})


@dataclass
class GPTConfig:
    """``model`` (configs/model/, one file per preset); the norm is its own group
    (``norm``, configs/norm/)."""

    name: str = "custom"
    """The preset it came from (``PRESETS``), for logs and reports."""
    vocab_size: int = 256
    """Rows of the token embedding (and of the tied head). Left at its preset's value it
    follows ``data.tokenizer`` (except ``bytes``, whose 256 ids fit every preset); otherwise
    it must hold the tokenizer's ids."""
    block_size: int = 128
    """The context length."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (they split ``d_model``, which it must divide)."""
    d_model: int = 128
    """The residual stream's width."""
    mlp_ratio: int = 4
    """The MLP's hidden width, in multiples of ``d_model``."""
    dropout: float = 0.0
    """Dropout probability on the embeddings, the attention weights and each sublayer's
    output (0: off)."""
    bias: bool = True
    """Biases in the attention and MLP projections (the head has none; a norm's beta is
    ``norm.bias``)."""
    activation: str = "gelu_tanh"
    """gelu_tanh (GPT-2's "gelu_new") | gelu."""
    init_std: float = 0.02
    """The std of the normal init of linear and embedding weights (GPT-2's; its residual
    projections get std / sqrt(2 n_layer)); ``deepnorm`` uses DeepNet's init instead."""
    z_loss: float = 0.0
    """PaLM's z-loss coefficient: + z_loss * mean(log Z^2) on the loss; 0: off."""
    logit_softcap: float = 0.0
    """Gemma 2's soft cap: logits -> cap * tanh(logits / cap); 0: off."""
    norm: NormConfig = field(default_factory=NormConfig)
    hf: HFConfig | None = None
    """A Hugging Face architecture instead of our GPT (``model=hf``); None: our GPT."""
    norm_sites: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-norm settings over ``norm``'s: module name -> {reduction_dtype, eps}, e.g.
    {h.1.ln_2: {reduction_dtype: fp32}} (``stabilize-replay --bisect`` prints one)."""
    fp32_modules: list[str] = field(default_factory=list)
    """Module paths whose forward runs in fp32 with autocast off (a norm of ours reduces in
    fp32 too; model/fp32_sites.py), e.g. [lm_head, h.1.attn.c_attn]
    (``stabilize-replay --gap`` prints one)."""
    loss_dtype: str = "fp32"
    """fp32 | logits: the cross-entropy computed in fp32 (the logits upcast first), or in
    the logits' own dtype (bf16 under bf16-true: a loss that is not upcast); a precision
    site, ``loss`` (docs/precision.md)."""

    def __post_init__(self) -> None:
        self.norm = build_dataclass(NormConfig, self.norm, "norm")
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            check_positive(f"model.{key}", getattr(self, key), integer=True)
        if self.d_model % self.n_head:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            more = " ..." if len(divisors) > 12 else ""
            raise ValueError(
                f"model.n_head={self.n_head!r} is not allowed: model.d_model={self.d_model} is "
                f"not divisible by it; allowed: {divisors[:12]}{more}"
            )
        check_range("model.dropout", self.dropout, 0.0, 1.0)
        check_positive("model.init_std", self.init_std)
        check_range("model.z_loss", self.z_loss, 0.0, float("inf"))
        check_range("model.logit_softcap", self.logit_softcap, 0.0, float("inf"))
        check_choice("model.activation", self.activation, ACTIVATIONS)
        check_choice("model.loss_dtype", self.loss_dtype, ("fp32", "logits"))
        if self.hf is not None:
            self._check_hf()
        mods = self.fp32_modules
        if isinstance(mods, str) or not all(isinstance(p, str) for p in list(mods or [])):
            raise ValueError(f"model.fp32_modules={mods!r} is not allowed; expected a list of "
                             "module paths, e.g. [lm_head]")  # fmt: skip
        self.fp32_modules = list(mods or [])
        self.norm_sites = {str(k): dict(v or {}) for k, v in dict(self.norm_sites or {}).items()}
        for site, kv in self.norm_sites.items():
            for k in kv:
                check_choice(f"model.norm_sites.{site}", k, SITE_KEYS)

    def _check_hf(self) -> None:
        """``model.hf``: its keys, and what a Hugging Face architecture cannot honour."""
        self.hf = build_dataclass(HFConfig, self.hf, "model.hf")
        ours = set(hf_config_values(self))
        for key in self.hf.config:
            if key in ours:
                raise ValueError(
                    f"model.hf.config.{key} is not allowed: our model keys set it (model."
                    "vocab_size, block_size, n_layer, d_model, n_head, mlp_ratio, dropout, "
                    f"init_std, norm.eps); allowed: any other key of the {self.hf.arch} config"
                )
        n = self.norm
        if self.hf.arch == "gpt2" and self.hf.norm_type == "group":
            from stabilize.norms.registry import get_norm_type

            if not get_norm_type(n.type).has_bias:  # GPT-2's LayerNorms carry a bias
                raise ValueError(
                    f"norm.type={n.type!r} is not allowed with model.hf.arch=gpt2 "
                    "model.hf.norm_type=group: GPT-2's LayerNorms have a bias and "
                    f"{n.type} has none; allowed: a type with a bias, or model.hf.norm_type=arch"
                )
        for key, value, want in (("norm.placement", n.placement, "pre"),
                                 ("norm.embed_norm", n.embed_norm, False),
                                 ("norm.qk_norm", n.qk_norm, False),
                                 ("norm.final_norm", n.final_norm, True),
                                 ("model.logit_softcap", self.logit_softcap, 0.0)):  # fmt: skip
            if value != want:
                raise ValueError(
                    f"{key}={value!r} is not allowed with model=hf ({self.hf.arch} is built "
                    f"as Hugging Face does); allowed: {want!r}"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size, with any field overridden (``norm`` may be a dict or NormConfig)."""
        check_choice("model.preset", name, PRESETS)
        return cls(**{"name": name, **PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hf_config_values(cfg: GPTConfig) -> dict[str, Any]:
    """The Hugging Face config keys our ``model`` keys set, per arch, with their values
    (hf_arch.py builds the architecture from them; ``model.hf.config`` may not set them)."""
    if cfg.hf.arch == "llama":
        return {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "max_position_embeddings": cfg.block_size,
            # SwiGLU's three matrices at a 4x MLP's parameter count
            "intermediate_size": cfg.mlp_ratio * cfg.d_model * 2 // 3,
            "attention_dropout": cfg.dropout,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm.eps,
        }
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_positions": cfg.block_size,
        "n_inner": cfg.mlp_ratio * cfg.d_model,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": cfg.init_std,
        "layer_norm_epsilon": cfg.norm.eps,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
    }
