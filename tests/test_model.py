"""The GPT: sizes, placements wired as published, causality, GPT-2 compatibility."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stabilize.model import GPT, GPTConfig
from stabilize.model.config import PRESETS, PUBLISHED_PARAMS
from stabilize.model.hf import from_hf_gpt2, gpt2_config_kwargs, to_hf_gpt2
from stabilize.norms import PLACEMENTS, Norm

SMALL = dict(vocab_size=97, block_size=16, n_layer=3, n_head=4, d_model=32)


def small(**norm):
    # explicit backend: these tests check wiring, not kernels, and need no compile
    return GPTConfig(**SMALL, norm={"backend": "explicit", **norm})


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_presets_match_published_sizes_on_meta_without_memory(name):
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(name))
    assert all(p.is_meta for p in model.parameters())
    n = model.num_params()
    assert abs(n / PUBLISHED_PARAMS[name] - 1) < 0.03, (name, n)


def test_gpt_1_3b_shape_is_the_one_users_run():
    cfg = GPTConfig.preset("gpt-1.3b")
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.block_size, cfg.vocab_size) == (
        24,
        2048,
        16,
        2048,
        50257,
    )


def test_tiny_preset_trains_a_step_on_cpu():
    cfg = GPTConfig.preset("tiny", norm={"backend": "explicit"})
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    logits = model(idx)
    assert logits.shape == (4, cfg.block_size, cfg.vocab_size)
    targets = torch.randint(0, cfg.vocab_size, idx.shape)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    # untrained, random targets: close to uniform over the byte vocabulary
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_module_tree_has_one_shape_across_placements_and_switches():
    names = set()
    for placement in PLACEMENTS:
        for extra in ({}, {"qk_norm": True, "embed_norm": True, "final_norm": False}):
            model = GPT(small(placement=placement, **extra))
            names.add(tuple(n for n, _ in model.named_modules()))
    assert len(names) == 1


def test_absent_norms_are_identity_and_present_ones_are_norms():
    m = GPT(small(placement="pre"))
    assert isinstance(m.h[0].ln_1_out, torch.nn.Identity)
    assert isinstance(m.h[0].attn.q_norm, torch.nn.Identity)
    assert isinstance(m.ln_emb, torch.nn.Identity) and isinstance(m.ln_f, Norm)
    m = GPT(small(placement="sandwich", qk_norm=True, embed_norm=True, final_norm=False))
    assert isinstance(m.h[0].ln_1_out, Norm) and isinstance(m.h[0].attn.q_norm, Norm)
    assert m.h[0].attn.q_norm.dim == 8  # per head
    assert isinstance(m.ln_emb, Norm) and isinstance(m.ln_f, torch.nn.Identity)


def _ln(x):  # F.layer_norm with the fresh norms' gamma = 1, beta = 0, eps = 1e-5
    return F.layer_norm(x, x.shape[-1:], eps=1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_block_wiring_matches_the_published_formula(placement):
    torch.manual_seed(0)
    block = GPT(small(placement=placement)).h[1]
    x = 2 * torch.randn(2, 16, 32)
    attn, mlp = block.attn, block.mlp
    with torch.no_grad():
        if placement == "pre":  # GPT-2
            h = x + attn(_ln(x))
            want = h + mlp(_ln(h))
        elif placement == "post":  # Vaswani et al. 2017
            h = _ln(x + attn(x))
            want = _ln(h + mlp(h))
        elif placement == "sandwich":
            h = x + _ln(attn(_ln(x)))
            want = h + _ln(mlp(_ln(h)))
        else:  # DeepNet: alpha = (2N)^(1/4), N = 3 layers -> 6^(1/4)
            a = 6**0.25
            h = _ln(a * x + attn(x))
            want = _ln(a * h + mlp(h))
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_deepnorm_init_uses_beta_gain():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64,
        block_size=8,
        n_layer=6,
        n_head=8,
        d_model=256,
        norm={"placement": "deepnorm", "backend": "explicit"},
    )
    block = GPT(cfg).h[0]
    beta = (8 * 6) ** -0.25  # hand-computed: 0.3799
    xavier = math.sqrt(2 / (256 + 256))
    w = block.attn.c_attn.weight
    assert abs(w[:512].std().item() / xavier - 1) < 0.05  # q, k: gain 1
    assert abs(w[512:].std().item() / (beta * xavier) - 1) < 0.05  # v: gain beta
    assert abs(block.attn.c_proj.weight.std().item() / (beta * xavier) - 1) < 0.05
    fc_xavier = math.sqrt(2 / (256 + 1024))
    assert abs(block.mlp.c_fc.weight.std().item() / (beta * fc_xavier) - 1) < 0.05


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64, block_size=8, n_layer=8, n_head=8, d_model=256, norm={"backend": "explicit"}
    )
    m = GPT(cfg)
    assert abs(m.h[0].attn.c_proj.weight.std().item() / (0.02 / math.sqrt(16)) - 1) < 0.05
    assert abs(m.h[0].mlp.c_fc.weight.std().item() / 0.02 - 1) < 0.05


def test_attention_is_causal_and_matches_hand_written_softmax():
    torch.manual_seed(0)
    m = GPT(small()).eval()
    idx = torch.randint(0, 97, (1, 16))
    idx2 = idx.clone()
    idx2[0, 10] = (idx[0, 10] + 1) % 97
    with torch.no_grad():
        a, b = m(idx), m(idx2)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # the past ignores the future
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4

    attn = m.h[0].attn.double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(32, dim=-1)
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32)
    want = y @ attn.c_proj.weight.T + attn.c_proj.bias
    with torch.no_grad():
        torch.testing.assert_close(attn(x), want)


def test_tied_head_dropout_and_length_check():
    m = GPT(GPTConfig(**{**SMALL, "dropout": 0.5}, norm={"backend": "explicit"}))
    assert m.lm_head.weight is m.wte.weight
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert not torch.equal(m.train()(idx), m(idx))  # dropout active
        m.eval()
        assert torch.equal(m(idx), m(idx))
    with pytest.raises(ValueError, match="exceeds model.block_size=16"):
        m(torch.randint(0, 97, (1, 17)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(d_model=30, n_head=4),
            r"model.n_head=4 is not allowed: model.d_model=30 .*allowed: \[1, 2, 3, 5",
        ),
        (dict(n_layer=0), r"model.n_layer=0 is not allowed; must be a positive integer"),
        (dict(dropout=1.0), r"model.dropout=1.0 is not allowed; must be in \[0.0, 1.0\)"),
        (
            dict(activation="relu"),
            r"model.activation='relu' is not allowed; allowed: \['gelu_tanh', 'gelu'\]",
        ),
        (
            dict(norm={"placement": "middle"}),
            r"norm.placement='middle' is not allowed; allowed: \['pre'",
        ),
        (dict(norm={"typo": 1}), r"norm.typo is not a known setting; allowed: \['type'"),
    ],
)
def test_invalid_model_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**SMALL, **kwargs})


def test_unknown_preset():
    with pytest.raises(
        ValueError, match=r"model.preset='gpt-7b' is not allowed; allowed: \['tiny'"
    ):
        GPTConfig.preset("gpt-7b")
    assert set(PRESETS) == {"tiny", *PUBLISHED_PARAMS}


# ---- Hugging Face GPT-2 -------------------------------------------------------------------
GPT2_CFG = dict(vocab_size=300, block_size=32, n_layer=2, n_head=4, d_model=64)


def _hf_model(cfg):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(**gpt2_config_kwargs(cfg), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(hf_cfg).eval()


def test_loads_hugging_face_gpt2_weights_and_gives_its_logits():
    cfg = GPTConfig(**GPT2_CFG)
    hf = _hf_model(cfg)
    ours = GPT(cfg).eval()
    missing = ours.load_state_dict(from_hf_gpt2(hf.state_dict(), cfg))
    assert not missing.missing_keys and not missing.unexpected_keys
    idx = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_exports_to_hugging_face_gpt2_layout():
    cfg = GPTConfig(**GPT2_CFG)
    hf = _hf_model(cfg)
    torch.manual_seed(2)
    ours = GPT(cfg).eval()
    hf.load_state_dict(to_hf_gpt2(ours.state_dict(), cfg))
    idx = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
    back = from_hf_gpt2(to_hf_gpt2(ours.state_dict(), cfg), cfg)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_gpt2_conversion_refuses_other_architectures():
    with pytest.raises(ValueError, match=r"norm.type='rmsnorm' \(GPT-2 needs 'layernorm'\)"):
        gpt2_config_kwargs(GPTConfig(**GPT2_CFG, norm={"type": "rmsnorm"}))
