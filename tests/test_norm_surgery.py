"""find_norms / swap_norms on tiny Hugging Face models built from configs (no download),
against references computed here: module names from the architectures, the models' own
logits, float64 counts of fp16-overflowing rows, and the original HF norm on the same input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabilize.norms import Norm, find_norms, swap_norms
from stabilize.validate import ConfigError

transformers = pytest.importorskip("transformers")

N_LAYER, D, V = 2, 64, 256
FP16_ELEMENT_LINE = 255.94  # |x| above it: x^2 > 65504 in fp16 (docs/norms.md)


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=N_LAYER, n_embd=D, n_head=4, vocab_size=V, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=N_LAYER,
        hidden_size=D,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=V,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


# The norms each architecture has, written from its layout (design note, section 4).
EXPECTED = {
    gpt2: (
        [f"transformer.h.{i}.{n}" for i in range(N_LAYER) for n in ("ln_1", "ln_2")]
        + ["transformer.ln_f"],
        "layernorm",
        1e-5,
        True,
    ),
    llama: (
        [
            f"model.layers.{i}.{n}"
            for i in range(N_LAYER)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        + ["model.norm"],
        "rmsnorm",
        1e-6,
        False,
    ),
}


def ids(seed=1, batch=2, t=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, t), generator=g)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_find_norms_lists_exactly_the_models_norms(build):
    model = build()
    names, kind, eps, bias = EXPECTED[build]
    found = find_norms(model)
    assert [f.name for f in found] == names
    # independently: the modules at those paths, and no other module of a norm class
    classes = {type(model.get_submodule(n)) for n in names}
    assert [n for n, m in model.named_modules() if type(m) in classes] == names
    for f in found:
        assert (f.kind, f.eps, f.bias, f.width, f.reduction_dtype) == (kind, eps, bias, D, "fp32")
        assert f.swappable and f.module is model.get_submodule(f.name)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_swap_at_fp32_keeps_logits_parameters_and_training(build):
    model = build()
    names = EXPECTED[build][0]
    x = ids()
    with torch.no_grad():
        before = model(x).logits
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    old_weights = [model.get_submodule(n).weight for n in names]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the swap

    assert swap_norms(model) == names
    for n, w in zip(names, old_weights, strict=True):
        m = model.get_submodule(n)
        assert isinstance(m, Norm) and m.weight is w
    assert {n: p for n, p in model.named_parameters()} == params  # same objects (`is`)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        after = model(x).logits
    if build is gpt2:  # zoo layernorm `auto` is F.layer_norm, as nn.LayerNorm
        assert torch.equal(after, before)
    else:
        # zoo rmsnorm `auto` on CPU is the fused kernel: measured 1.64e-7 max abs apart
        # (logits ~0.1-1; another summation order than LlamaRMSNorm's mean)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)

    model.train()
    start = [w.detach().clone() for w in old_weights]
    loss = F.cross_entropy(model(x).logits.flatten(0, 1), ids(seed=2).flatten())
    loss.backward()
    opt.step()
    for w, w0 in zip(old_weights, start, strict=True):
        assert w.grad is not None and not torch.equal(w.detach(), w0)


def test_swapped_llama_norms_bit_equal_with_the_explicit_backend():
    model = llama()
    x = ids()
    with torch.no_grad():
        before = model(x).logits
        swap_norms(model, backend="explicit")
        assert torch.equal(model(x).logits, before)


def _plant_and_capture(model, names, token=5, channel=7):
    """Plant |x| = 300 at one token of block 0's output (the residual stream); capture every
    norm's input and output."""
    seen = {}

    def plant(_m, _args, out):
        h = out[0] if isinstance(out, tuple) else out
        h[0, token, channel] = 300.0

    def capture(name):
        def hook(_m, args, out):  # returns None: the output is kept
            seen[name] = (args[0].detach(), out.detach())

        return hook

    handles = [model.model.layers[0].register_forward_hook(plant)]
    handles += [model.get_submodule(n).register_forward_hook(capture(n)) for n in names]
    with torch.no_grad():
        logits = model(ids()).logits
    for h in handles:
        h.remove()
    return seen, logits


def _overflow_rows64(seen):
    """float64 count of norm-input rows holding an element past the fp16 line; no other row
    comes near an overflowing sum of squares, so this is the exact count."""
    count = 0
    for x, _ in seen.values():
        x = x.double().flatten(0, -2)
        hot = (x.abs() > FP16_ELEMENT_LINE).any(-1)
        assert ((x * x).sum(-1)[~hot] < 65504 / 4).all()
        count += int(hot.sum())
    return count


def test_fp16_reduction_zeroes_exactly_the_overflowing_rows():
    names = EXPECTED[llama][0]
    model = llama().half()
    assert swap_norms(model, reduction_dtype="fp16") == names
    assert all(f.reduction_dtype == "fp16" for f in find_norms(model))
    seen, _ = _plant_and_capture(model, names)
    zero_rows = sum(int((y.flatten(0, -2) == 0).all(-1).sum()) for _, y in seen.values())
    expected = _overflow_rows64(seen)
    # block 1's two norms and the final norm each see the planted token
    assert zero_rows == expected == 3

    # the original HF LlamaRMSNorm upcasts: the same input stays finite and alive
    model = llama().half()
    seen, logits = _plant_and_capture(model, names)
    assert _overflow_rows64(seen) == 3
    assert torch.isfinite(logits).all()
    for _, y in seen.values():
        assert torch.isfinite(y).all() and not (y.flatten(0, -2) == 0).all(-1).any()


# ---- duck typing ---------------------------------------------------------------------------
class InputDtypeRMSNorm(nn.Module):  # reduces in its input's dtype
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class UpcastLayerNorm(nn.Module):  # upcasts, with a bias and HF's attribute name
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.full((d,), 0.5))
        self.bias = nn.Parameter(torch.full((d,), 0.1))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        y = F.layer_norm(x.float(), x.shape[-1:], eps=self.variance_epsilon)
        return (y * self.weight + self.bias).to(x.dtype)


class OffsetRMSNorm(nn.Module):  # Gemma's (1 + weight) gain, weight starting at 0
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Net(nn.Module):
    def __init__(self, offset=True):
        super().__init__()
        self.a = InputDtypeRMSNorm(D)
        self.b = UpcastLayerNorm(D)
        self.proj = nn.Linear(D, D)
        if offset:
            self.c = OffsetRMSNorm(D)


def test_duck_typed_norms_are_found_and_measured():
    found = {f.name: f for f in find_norms(Net())}
    assert list(found) == ["a", "b", "c"]
    a, b, c = found["a"], found["b"], found["c"]
    assert (a.kind, a.eps, a.bias, a.reduction_dtype, a.swappable) == (
        "rmsnorm",
        1e-5,
        False,
        "fp16",
        True,
    )
    assert (b.kind, b.eps, b.bias, b.reduction_dtype, b.swappable) == (
        "layernorm",
        1e-6,
        True,
        "fp32",
        True,
    )
    assert (c.kind, c.unit_offset, c.swappable) == ("rmsnorm", True, False)


def test_unit_offset_norm_is_refused_in_one_line_and_nothing_is_swapped():
    net = Net()
    for sites in (None, ["c"]):
        with pytest.raises(ValueError, match=r"swap_norms: c \(OffsetRMSNorm\).*1 \+ weight") as e:
            swap_norms(net, sites=sites)
        assert "\n" not in str(e.value)
        assert not any(isinstance(m, Norm) for m in net.modules())
    # the others can still be asked for by name, each with its own settings
    assert swap_norms(net, sites={"a": {"reduction_dtype": "fp16"}, "b": {}}) == ["a", "b"]
    assert (net.a.reduction_dtype, net.b.reduction_dtype, net.b.eps) == ("fp16", "fp32", 1e-6)


def test_swapped_duck_norms_match_the_originals():
    net = Net(offset=False)
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(3))
    want = [net.a(x), net.b(x)]
    swap_norms(net)
    torch.testing.assert_close([net.a(x), net.b(x)], want)


class HandLayerNorm(nn.LayerNorm):  # a torch subclass with its own forward, in x's dtype
    def forward(self, x):
        xc = x - x.mean(-1, keepdim=True)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * self.weight + self.bias


class PlainSubclass(nn.LayerNorm):  # torch's forward
    pass


def test_a_torch_norm_subclass_with_its_own_forward_is_measured():
    hand = HandLayerNorm(D)
    nn.init.constant_(hand.bias, 0.1)  # an overflowed row is then the bias, not zero
    net = nn.Sequential(hand, PlainSubclass(D))
    got = [(f.name, f.kind, f.reduction_dtype, f.swappable) for f in find_norms(net)]
    assert got == [("0", "layernorm", "fp16", True), ("1", "layernorm", "fp32", True)]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"type": "groupnorm"}, "swap_norms.type='groupnorm'"),
        ({"reduction_dtype": "fp8"}, "swap_norms.reduction_dtype='fp8'"),
        ({"sites": ["transformer.h.9.ln_1"]}, "swap_norms.sites='transformer.h.9.ln_1'"),
        ({"sites": {"transformer.ln_f": {"bias": 0}}}, "swap_norms.sites.transformer.ln_f='bias'"),
    ],
)
def test_bad_settings_are_one_config_error_line(kwargs, key):
    model = gpt2()
    with pytest.raises(ConfigError) as e:
        swap_norms(model, **kwargs)
    msg = str(e.value)
    assert msg.startswith(key) and "allowed: [" in msg and "\n" not in msg
    assert not any(isinstance(m, Norm) for m in model.modules())


def test_a_type_that_would_drop_a_parameter_is_refused():
    model = gpt2()
    with pytest.raises(ValueError, match="transformer.h.0.ln_1 .*has a bias and rmsnorm has none"):
        swap_norms(model, type="rmsnorm")
    assert not any(isinstance(m, Norm) for m in model.modules())
