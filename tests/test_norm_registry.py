"""Adding a norm type touches one place: a ``NormType`` registered from *this* file (outside
the package) is checked against a float64 reference written here, accepted by the config
(real Hydra composition), refused by the backends that cannot run it, and trains a tiny GPT
through the real ``run()``. The fixture unregisters it, so other tests see the built-ins."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from stabilize.norms import (
    NORM_TYPES,
    Norm,
    NormConfig,
    NormType,
    build_norm,
    get_norm_type,
    has_cpp_compiler,
    register_norm,
    unregister_norm,
)

from conftest import FAST, compose_run

BUILTIN = tuple(NORM_TYPES)  # before this file registers any: what the package registers
NAME = "test_prmsnorm"


class PartialRMSNorm(NormType):
    """pRMSNorm (Zhang & Sennrich 2019, section 4): the RMS is estimated from the first
    p = 1/4 of the features only, then the whole row is scaled by it; gamma [D]."""

    name = NAME
    P = 0.25

    def normalize(self, x, eps):
        k = math.ceil(self.P * x.shape[-1])
        ms = x[..., :k].square().sum(-1, keepdim=True) / k + eps  # [..., 1], in x's dtype
        return x * torch.rsqrt(ms), ms

    def reference64(self, x, eps):
        k = math.ceil(self.P * x.shape[-1])
        return x / torch.sqrt((x[..., :k] ** 2).mean(-1, keepdim=True) + eps)


def ref_prms(x, w, eps):
    """Written independently of the class: |x_:k| / sqrt(k) is the partial RMS."""
    x = x.double()
    k = math.ceil(x.shape[-1] / 4)
    rms = torch.linalg.vector_norm(x[..., :k], dim=-1, keepdim=True) / math.sqrt(k)
    return x / torch.sqrt(rms**2 + eps) * w.double()


@pytest.fixture
def prms():
    register_norm(PartialRMSNorm)
    try:
        yield NAME
    finally:
        unregister_norm(NAME)


def make(d, backend="explicit", reduction="fp32", seed=0):
    norm = build_norm(d, NormConfig(type=NAME, backend=backend, reduction_dtype=reduction))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        norm.weight.copy_(1 + 0.5 * torch.randn(d, generator=g))
    return norm


# ---- the new type's numerics ------------------------------------------------------------------
BACKENDS_HERE = ["explicit", "auto"] + (["compiled"] if has_cpp_compiler() else [])


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_registered_type_matches_its_float64_reference(prms, backend):
    norm = make(64, backend)
    assert norm.kind == NAME and norm.spec is get_norm_type(NAME)
    assert norm.weight.shape == (64,) and norm.bias is None  # no beta: has_bias is False
    x = 3 * torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(1))
    y = norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref_prms(x, norm.weight, norm.eps), rtol=1e-5, atol=1e-6)
    # The statistic is the type's own: only the first quarter of the features is reduced.
    y2 = norm(torch.cat([x[..., :16], 100 * x[..., 16:]], -1))
    torch.testing.assert_close(y2[..., :16], y[..., :16])


def test_auto_runs_the_explicit_form_when_the_type_has_no_kernel(prms):
    norm = make(64, "auto")
    x = torch.randn(2, 64)
    assert norm.resolve_backend(x) == ("compiled" if has_cpp_compiler() else "explicit")
    assert make(64, "auto", reduction="fp16").resolve_backend(x) == "explicit"


def test_fp16_reduction_overflows_only_where_the_type_reduces(prms):
    """A 300 in the reduced quarter overflows the fp16 statistic (300^2 > 65504): that row is
    zeroed, as for RMSNorm; the same 300 outside the quarter is not reduced, no overflow."""
    norm = make(64, "explicit", reduction="fp16")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).half()
    x[0, 3] = 300.0  # inside the first 16 features
    x[1, 40] = 300.0  # outside
    with torch.no_grad():
        y = norm(x)
    assert y.dtype == torch.float16
    assert torch.all(y[0] == 0)
    assert torch.isfinite(y[1:]).all() and y[1].abs().max() > 1
    torch.testing.assert_close(
        y[1].double(), ref_prms(x[1], norm.weight, norm.eps), rtol=2e-2, atol=2e-2
    )


# ---- config: accepted while registered, refused with the allowed list otherwise -----------
def test_config_accepts_the_registered_name_and_lists_it(prms, tmp_path):
    assert NAME in NORM_TYPES  # imported before the registration: read live
    cfg = compose_run(tmp_path, ["norm.type=" + NAME, "logger=none"])
    assert cfg.model.norm.type == NAME
    with pytest.raises(ValueError, match=r"norm.type='nope' is not allowed; allowed: \[") as e:
        compose_run(tmp_path, ["norm.type=nope", "logger=none"])
    assert f"'{NAME}'" in str(e.value) and "'scalenorm'" in str(e.value)


def test_backends_without_a_kernel_for_the_type_are_refused_with_the_allowed_list(prms):
    for backend in ("torch", "fused", "apex"):
        with pytest.raises(
            ValueError,
            match=rf"norm.backend='{backend}' cannot run norm.type='{NAME}'.*"
            r"Allowed for norm.type='test_prmsnorm': \['auto', 'explicit', 'compiled'\]",
        ):
            NormConfig(type=NAME, backend=backend)


def test_unregistering_restores_the_built_in_registry():
    assert tuple(NORM_TYPES) == BUILTIN
    register_norm(PartialRMSNorm)
    try:
        assert tuple(NORM_TYPES) == (*BUILTIN, NAME)
        with pytest.raises(ValueError, match=r"already registered by \S*PartialRMSNorm"):
            register_norm(PartialRMSNorm)
    finally:
        unregister_norm(NAME)
    assert tuple(NORM_TYPES) == BUILTIN
    with pytest.raises(ValueError, match=rf"norm.type='{NAME}' is not allowed"):
        NormConfig(type=NAME)
    with pytest.raises(TypeError, match="NormType subclass"):
        register_norm(object)


# ---- every registered type, built-in or not ---------------------------------------------------
@pytest.mark.parametrize("kind", [*BUILTIN, NAME])
def test_every_type_agrees_with_its_reference64_and_copies_keep_their_type(prms, kind):
    norm = build_norm(48, NormConfig(type=kind, backend="explicit", reduction_dtype="input"))
    x = 2 * torch.randn(5, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = norm.spec.reference64(x, norm.eps) * norm.weight.double()
    if norm.bias is not None:
        want = want + norm.bias.double()
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)
    clone = copy.deepcopy(norm)
    assert clone.spec is norm.spec and torch.equal(clone(x), norm(x))


@pytest.mark.parametrize("kind", BUILTIN)
def test_the_built_in_types_references_match_independent_definitions(kind):
    """Each built-in type's float64 reference (which the audit and this file's checks lean
    on) against a definition it does not share code with: torch's own F.layer_norm /
    F.rms_norm in float64, and ScaleNorm's x / sqrt(sum x^2 + eps) written out here."""
    import torch.nn.functional as F

    eps = 1e-5
    x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[0] *= 1e-3  # a small-norm row, where eps matters
    want = {
        "layernorm": lambda: F.layer_norm(x, (32,), eps=eps),
        "rmsnorm": lambda: F.rms_norm(x, (32,), eps=eps),
        "scalenorm": lambda: x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps),
    }[kind]()
    got = build_norm(32, NormConfig(type=kind, eps=eps)).spec.reference64(x, eps)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---- the new type trains through the real run() -------------------------------------------
class NormKinds(L.Callback):
    """Which norm types the trained model holds, and its final norm's gamma at the end."""

    def on_fit_start(self, trainer, pl_module):
        self.kinds = {m.kind for m in pl_module.model.modules() if isinstance(m, Norm)}

    def on_train_end(self, trainer, pl_module):
        self.gamma = pl_module.model.ln_f.weight.detach().clone()


def test_a_tiny_gpt_trains_two_steps_with_the_registered_type(prms, tmp_path):
    from stabilize.train import run

    over = [*FAST, "trainer.max_steps=2", "logger=none", f"norm.type={NAME}"]
    cfg = compose_run(tmp_path, [*over, "norm.backend=explicit", "norm.qk_norm=true"])
    seen = NormKinds()
    out = run(cfg, callbacks=[seen])
    assert out["model_step"] == 2 and math.isfinite(out["metrics"]["train/loss"])
    assert seen.kinds == {NAME}
    assert seen.gamma.shape == (cfg.model.d_model,) and not torch.all(seen.gamma == 1.0)
