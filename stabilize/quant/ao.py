"""torchao, imported only here and only on demand: its quiet import and its quantizers.

``import stabilize`` and every 16-bit path never import torchao: each function below imports
it inside its body. What torchao provides and the harness uses:

- ``torchao.float8``: ``convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear``;
  with ``emulate=True`` it trains on CPU (tensorwise and rowwise recipes).
- ``torchao.prototype.mx_formats``: ``MXTensor.to_mx`` (MXFP8, FLOOR and RCEIL scales) and
  ``NVFP4Tensor.to_nvfp4`` (two-level scaling), both running on CPU.

torchao 0.18's import is loud on a CPU machine: it logs a warning for each CUDA extension it
fails to load (``_C_mxfp8``, ``_C_cutlass_90a``) and torch logs a deprecation for one of its
Enum registrations. Both go through ``logging``; ``quiet_import`` raises those two loggers to
ERROR for the import only, and sets them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib
import logging
from collections.abc import Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version

import torch

from stabilize.validate import ConfigError, check_choice

MIN_TORCHAO = (0, 18)
INSTALL_HINT = "pip install 'stabilize[fp8]' (torchao>=0.18)"
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_version() -> str | None:
    """torchao's installed version, or None (read from metadata: nothing is imported)."""
    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def quiet_import(module: str = "torchao", *, key: str = "quant", value: str = "") -> object:
    """Import ``module`` (torchao or one of its submodules) without its import-time noise.

    A missing or too old torchao is a ConfigError naming the key and value that asked for it.
    """
    found = torchao_version()
    wanted = ".".join(map(str, MIN_TORCHAO))
    if found is None or _version_tuple(found) < MIN_TORCHAO:
        what = "not installed" if found is None else f"found {found}"
        raise ConfigError(
            f"{key}={value!r} needs torchao>={wanted} ({what}); allowed: {INSTALL_HINT}"
        )
    with _quiet():
        return importlib.import_module(module)


# ---- torchao's own quantizers, as dequantized fp32 tensors (reference and cross-check) ----


def fp8_roundtrip(
    x: torch.Tensor, dtype: torch.dtype, *, rowwise: bool = False, pow2: bool = False
) -> torch.Tensor:
    """torchao's dynamic fp8 cast of ``x`` and back (tensorwise, or rowwise along dim -1)."""
    f8 = quiet_import("torchao.float8", value="fp8_rowwise" if rowwise else "fp8_tensor")
    utils = quiet_import("torchao.float8.float8_scaling_utils")
    gran = f8.ScalingGranularity.AXISWISE if rowwise else f8.ScalingGranularity.TENSORWISE
    t = utils.hp_tensor_to_float8_dynamic(
        x.float(),
        dtype,
        f8.LinearMMConfig(),
        scaling_granularity=gran,
        axiswise_dim=-1 if rowwise else None,
        round_scales_to_power_of_2=pow2,
    )
    return t.to_original_precision().float()


def mx_roundtrip(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """torchao's ``MXTensor.to_mx`` (32-element blocks) and back; ``rounding`` floor|rceil."""
    mx = quiet_import("torchao.prototype.mx_formats.mx_tensor", value="mxfp8")
    cfg = quiet_import("torchao.prototype.mx_formats.config", value="mxfp8")
    mode = {"floor": cfg.ScaleCalculationMode.FLOOR, "rceil": cfg.ScaleCalculationMode.RCEIL}
    if rounding not in mode:
        raise ConfigError(
            f"quant.scale_rounding={rounding!r} is not allowed; allowed: {sorted(mode)}"
        )
    t = mx.MXTensor.to_mx(x.float().contiguous(), dtype, block_size=32, scaling_mode=mode[rounding])
    return t.dequantize(torch.float32)


def nvfp4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """torchao's two-level ``NVFP4Tensor.to_nvfp4`` (fp32 tensor scale amax / 2688) and back.

    torchao does not guard the tensor scale: an all-zero tensor gives 0 / 0 = NaN here (0.18),
    where ``stabilize.quant.scaling.nvfp4_tensor_scale`` floors it.
    """
    nv = quiet_import("torchao.prototype.mx_formats.nvfp4_tensor", value="nvfp4")
    x = x.float().contiguous()
    pts = nv.per_tensor_amax_to_scale(x.abs().amax())
    return nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)


# ---- converting a model's Linears: the quant.layers globs --------------------------------

# Real recipes keep the head and the embeddings in high precision; torchao converts only
# nn.Linear, so an embedding never matches, and a head is named here.
DEFAULT_EXCLUDE = ("lm_head", "*.lm_head", "head", "*.head")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's recipe names


def select_linears(
    model: torch.nn.Module, layers: Iterable[str] = ("*",), exclude: Iterable[str] = DEFAULT_EXCLUDE
) -> list[str]:
    """Names of the ``nn.Linear`` modules matching a ``layers`` glob and no ``exclude`` glob.

    A glob in ``layers`` that matches no Linear is a ConfigError: a typo would otherwise run
    the whole model in high precision and call it quantized.
    """
    layers, exclude = list(layers), list(exclude)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for glob in layers:
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise ConfigError(
                f"quant.layers={glob!r} matches no nn.Linear; allowed: globs over "
                f"{names[:6]}{' ...' if len(names) > 6 else ''}"
            )
    return [
        n
        for n in names
        if any(fnmatch.fnmatchcase(n, g) for g in layers)
        and not any(fnmatch.fnmatchcase(n, g) for g in exclude)
    ]


def convert_float8(
    model: torch.nn.Module,
    recipe: str = "tensorwise",
    *,
    layers: Iterable[str] = ("*",),
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    emulate: bool | None = None,
) -> list[str]:
    """Swap the selected Linears for torchao's ``Float8Linear`` in place; return their names.

    ``emulate`` defaults to True unless CUDA with fp8 matmuls (SM 8.9+) is present: on CPU
    torchao's emulation runs the same scaling with the matmul in high precision.
    """
    check_choice("quant.float8_recipe", recipe, FLOAT8_RECIPES)
    f8 = quiet_import("torchao.float8", value=f"fp8_{recipe}")
    chosen = set(select_linears(model, layers, exclude))
    if emulate is None:
        emulate = not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    f8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _mod, fqn: fqn in chosen
    )
    return sorted(chosen)
