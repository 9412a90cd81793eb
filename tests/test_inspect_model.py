"""inspect_model on tiny Hugging Face models built from configs (no download) and on our GPT,
against references computed here: block paths from the configs' layer counts, head and
embedding weights compared by identity, and the queries and keys the models' own attention
computes (captured at ``F.scaled_dot_product_attention``) against the modules the map names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabilize.model import GPT, GPTConfig, ModelMap, inspect_model
from stabilize.norms import find_norms

transformers = pytest.importorskip("transformers")
from test_norm_surgery import N_LAYER, D, V, gpt2, llama  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

H = 4  # heads of both tiny HF models (test_norm_surgery's configs)


def ours():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny")).eval()


def _layers(model) -> int:
    return model.cfg.n_layer if isinstance(model, GPT) else model.config.num_hidden_layers


# From each architecture's layout: (blocks, embedding, head, the norm feeding attention).
LAYOUT = {
    gpt2: ("transformer.h", "transformer.wte", "lm_head", "ln_1"),
    llama: ("model.layers", "model.embed_tokens", "lm_head", "input_layernorm"),
    ours: ("h", "wte", "lm_head", "ln_1"),
}


@pytest.mark.parametrize("build", [gpt2, llama, ours], ids=["gpt2", "llama", "ours"])
def test_blocks_embedding_head_and_tying_match_the_architecture(build):
    model = build()
    m = inspect_model(model)
    blocks, emb, head, _ = LAYOUT[build]
    want = [f"{blocks}.{i}" for i in range(_layers(model))]
    assert [p for p, _ in m.blocks] == want
    assert all(mod is model.get_submodule(p) for p, mod in m.blocks)
    assert m.blocks_from == "longest ModuleList"
    assert m.embedding[0] == emb and m.embedding[1] is model.get_submodule(emb)
    assert m.head[0] == head and m.head[1] is model.get_submodule(head)
    really_tied = model.get_submodule(head).weight is model.get_submodule(emb).weight
    # GPT-2 and our GPT tie; LlamaConfig's tie_word_embeddings defaults to False
    assert really_tied is (build is not llama)
    assert m.tied is really_tied
    if build is llama:
        assert model.config.tie_word_embeddings is False
    assert m.norms == tuple(find_norms(model))
    assert len(m.qk) == len(want) and all(s is not None for s in m.qk)
    lines = m.describe()
    assert lines[0] == f"{type(model).__name__}: {len(want)} blocks, {len(m.norms)} norms"
    assert any(want[0] in line and want[-1] in line for line in lines)
    assert any(emb in line and head in line for line in lines)


def _capture_attention(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (q, k) each attention call hands to SDPA, [B, H, T, hd], in call order."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.detach().clone(), k.detach().clone()))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def _block_inputs(m: ModelMap) -> tuple[list[torch.Tensor], list]:
    """Forward pre-hooks recording each block's input hidden states."""
    got = []

    def hook(_mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        got.append(x.detach().clone())

    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for _, b in m.blocks]
    return got, handles


def _heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    b, s, c = t.shape
    return t.view(b, s, n_head, c // n_head).transpose(1, 2)


@pytest.mark.parametrize("build", [gpt2, llama, ours], ids=["gpt2", "llama", "ours"])
@torch.no_grad()
def test_qk_sources_give_the_queries_and_keys_the_attention_computes(build, monkeypatch):
    model = build()
    m = inspect_model(model)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs, handles = _block_inputs(m)
    seen = _capture_attention(monkeypatch)
    model(idx)
    for h in handles:
        h.remove()
    assert len(seen) == len(inputs) == len(m.blocks)  # one SDPA call per block
    norm_name = LAYOUT[build][3]
    n_head = model.cfg.n_head if build is ours else H
    for (path, block), src, x, (q_ref, k_ref) in zip(m.blocks, m.qk, inputs, seen, strict=True):
        assert src.q.startswith(f"{path}.") and src.k.startswith(f"{path}.")
        assert src.q_module is model.get_submodule(src.q)
        assert src.k_module is model.get_submodule(src.k)
        h = block.get_submodule(norm_name)(x)  # the attention's input
        q, k = src.select(src.q_module(h), None if src.fused else src.k_module(h))
        q, k = _heads(q, n_head), _heads(k, n_head)
        if build is llama:  # the map's q/k are pre-RoPE; SDPA sees them rotated
            pos = torch.arange(idx.shape[1])[None]
            cos, sin = model.model.rotary_emb(h, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(q, q_ref)
        torch.testing.assert_close(k, k_ref)
        assert not torch.equal(q, k)  # q and k really are different columns
    if build is llama:
        assert not m.qk[0].fused and m.qk[0].q_cols is None
        assert m.qk[0].q.endswith("self_attn.q_proj") and m.qk[0].k.endswith("self_attn.k_proj")
    else:  # a fused q|k|v projection: GPT-2's Conv1D ([in, out] weight) or our nn.Linear
        width = D if build is gpt2 else model.cfg.d_model
        assert m.qk[0].fused and m.qk[0].q.endswith("attn.c_attn")
        assert (m.qk[0].q_cols, m.qk[0].k_cols) == ((0, width), (width, 2 * width))
        assert type(m.qk[0].q_module).__name__ == ("Conv1D" if build is gpt2 else "Linear")


def test_a_blocks_pattern_names_the_blocks():
    model = gpt2()
    m = inspect_model(model, blocks="transformer.h.*.mlp")
    assert [p for p, _ in m.blocks] == [f"transformer.h.{i}.mlp" for i in range(N_LAYER)]
    assert m.blocks_from == "blocks='transformer.h.*.mlp'"
    assert m.qk == (None,) * N_LAYER  # an MLP holds no attention
    assert "q/k: found in 0 of 2 blocks" in m.describe()
    # '*' stays inside one component: the blocks, not their children
    whole = inspect_model(model, blocks="transformer.h.*")
    assert [p for p, _ in whole.blocks] == [f"transformer.h.{i}" for i in range(N_LAYER)]


def test_a_pattern_that_matches_nothing_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        inspect_model(llama(), blocks="decoder.layers.*")
    msg = str(e.value)
    assert "\n" not in msg and "'decoder.layers.*'" in msg and "matches no module" in msg


def test_a_model_without_a_modulelist_maps_without_blocks():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    m = inspect_model(mlp)
    assert m.blocks == () and m.qk == () and m.blocks_from == "none"
    assert m.embedding is None and m.head is None and m.tied is False
    assert [n.name for n in m.norms] == ["1"]
    assert m.describe()[0] == "Sequential: 0 blocks, 1 norms"
