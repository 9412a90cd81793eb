"""``quant``: which Linears train their GEMMs in 8 or 4 bits, and how (the config group
``configs/quant/``, ``stabilize-train quant=fp8_delayed``).

Who does the work, by recipe:

- ``fp8_tensor``, ``fp8_rowwise``: torchao's ``Float8Linear`` (``convert_to_float8_training``;
  emulated on a CPU, its real kernels on an fp8 GPU);
- ``fp8_delayed``, ``mxfp8``, ``nvfp4``: ``QuantLinear`` (linear.py), our own emulation
  (torchao removed delayed scaling, and trains MX and NVFP4 only on GPUs).

The head and the embeddings stay in high precision by default, as real recipes keep them.
Every knob is checked before anything is built: one line naming the key, the value and what
is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from stabilize.quant.quantize import RECIPES
from stabilize.quant.scaling import AMAX_ALGOS, SCALE_ROUNDINGS
from stabilize.validate import ConfigError, check_choice


@dataclass
class NVFP4Config:
    """``quant.nvfp4``: Transformer Engine's NVFP4 recipe beyond the format (quant=nvfp4)."""

    sr: bool = False
    """Round the gradients (each GEMM's grad-output) stochastically, unbiased, as the recipe
    does; the forward's operands stay round-to-nearest."""
    weights_2d: bool = False
    """One block scale per 16 x 16 tile of the weight instead of per 16 values of a row, as
    the recipe scales weights: the weight and its transpose (dgrad's) quantize alike."""
    rht: bool = False
    """The wgrad GEMM's own operands, as the recipe lays them out: the grad-output and the
    input mixed along the tokens by a random Hadamard transform (16 x 16) and quantized in
    blocks of 16 tokens (a micro-batch's tokens must split into 16s)."""


@dataclass
class QuantConfig:
    name: str = "none"
    """The recipe: none | fp8_tensor | fp8_rowwise | fp8_delayed | mxfp8 | nvfp4."""
    layers: list[str] = field(default_factory=lambda: ["*"])
    """Globs over nn.Linear module names to quantize (a glob matching none is an error)."""
    exclude: list[str] = field(default_factory=lambda: ["lm_head", "*.lm_head", "head"])
    """Globs over nn.Linear names kept in high precision (the head, by default)."""
    history: int = 1024
    """fp8_delayed: the amax history's length (Transformer Engine's amax_history_len)."""
    margin: int = 0
    """fp8_delayed: the scale is the format's max / (amax * 2**margin)."""
    amax_algo: str = "max"
    """fp8_delayed: the history's amax, max | most_recent."""
    scale_rounding: str = "rceil"
    """mxfp8: the E8M0 block scale's rounding, floor (OCP's) | rceil."""
    nvfp4: NVFP4Config = field(default_factory=NVFP4Config)
    """nvfp4: stochastic rounding of gradients and 16 x 16 weight tiles (``quant.nvfp4.*``)."""

    def __post_init__(self) -> None:
        check_choice("quant.name", self.name, RECIPES)
        for key in ("layers", "exclude"):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not all(isinstance(g, str) for g in value):
                raise ConfigError(f"quant.{key}={value!r} is not allowed; allowed: a list of "
                                  "globs over nn.Linear names")  # fmt: skip
        if self.name != "none" and not self.layers:
            raise ConfigError("quant.layers=[] is not allowed; allowed: at least one glob")
        for key in ("history", "margin"):
            value, low = getattr(self, key), 1 if key == "history" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"quant.{key}={value!r} is not allowed; allowed: an int >= {low}")
        check_choice("quant.amax_algo", self.amax_algo, AMAX_ALGOS)
        check_choice("quant.scale_rounding", self.scale_rounding, SCALE_ROUNDINGS)
        if isinstance(self.nvfp4, dict):
            known = set(NVFP4Config.__dataclass_fields__)
            bad = sorted(set(self.nvfp4) - known)
            if bad:
                raise ConfigError(f"quant.nvfp4.{bad[0]} is not allowed; allowed: "
                                  f"{sorted(known)}")  # fmt: skip
            self.nvfp4 = NVFP4Config(**self.nvfp4)
        for key in ("sr", "weights_2d", "rht"):
            value = getattr(self.nvfp4, key)
            if not isinstance(value, bool):
                raise ConfigError(f"quant.nvfp4.{key}={value!r} is not allowed; allowed: "
                                  "true or false")  # fmt: skip
            if value and self.name != "nvfp4":
                raise ConfigError(f"quant.nvfp4.{key}=true is not allowed with "
                                  f"quant={self.name}; allowed: quant=nvfp4")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.name != "none"


def check_with_norms(cfg: QuantConfig, reduction_dtype: str | None) -> None:
    """A quantized run asks about 8- and 4-bit GEMMs; fp16 norm reductions ask the 16-bit
    question at the same time, and each would hide the other's answer."""
    if cfg.enabled and reduction_dtype == "fp16":
        raise ConfigError(
            f"quant={cfg.name} with norm.reduction_dtype=fp16 is not allowed: two questions "
            "in one run hide each other's answers; allowed: norm.reduction_dtype=fp32 or bf16 "
            "with quant, or quant=none"
        )


def check_quant(model: nn.Module, cfg: QuantConfig) -> None:
    """Before anything is built or written (the preflight, on a meta-device model): the
    layer globs match, a block format's widths split, torchao is there where it is used."""
    if not cfg.enabled:
        return
    from stabilize.quant.ao import quiet_import, select_linears
    from stabilize.quant.linear import OWN_RECIPES, check_widths

    names = select_linears(model, cfg.layers, cfg.exclude)
    check_widths(model, names, cfg.name)
    if cfg.name not in OWN_RECIPES:
        quiet_import("torchao.float8", key="quant", value=cfg.name)


def apply_quant(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Quantize ``model``'s selected Linears in place; their names (none: ``quant=none``)."""
    if not cfg.enabled:
        return []
    from stabilize.quant.ao import convert_float8, select_linears
    from stabilize.quant.linear import OWN_RECIPES, swap_linears

    if cfg.name in OWN_RECIPES:
        names = select_linears(model, cfg.layers, cfg.exclude)
        knobs = {"scale_rounding": cfg.scale_rounding, "history": cfg.history,
                 "margin": cfg.margin, "amax_algo": cfg.amax_algo, "sr": cfg.nvfp4.sr,
                 "weights_2d": cfg.nvfp4.weights_2d, "rht": cfg.nvfp4.rht}  # fmt: skip
        return swap_linears(model, names, cfg.name, **knobs)
    recipe = cfg.name.removeprefix("fp8_").replace("tensor", "tensorwise")
    return convert_float8(model, recipe, layers=cfg.layers, exclude=cfg.exclude)
