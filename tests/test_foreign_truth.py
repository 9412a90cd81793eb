"""What the probe says about a model we did not build is so, checked against references
computed here, on tiny models built from configs (no download):

- the attention-logit bound holds where q and k are normalized after their projections
  (OLMo 2 over all heads, Qwen3 and Gemma 3 per head) and where they are not (Llama): against
  the largest |q.k| x scale over the causal pairs, in float64, of the very q and k each
  attention call hands to its kernel (a registered ``AttentionInterface`` that records them,
  then runs SDPA);
- one tensor is one unit: a Llama's block output, which *is* the next norm's input (checked
  by identity here), is judged once, in a real ``Guard`` run;
- a value not measured is missing: no attention bound is written to a real run's CSV for
  blocks whose heads cannot be read, and ``describe()`` says so instead of claiming them.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stabilize
from stabilize.stability.probe import StabilityProbe
from stabilize.stability.view import view_of

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

V, D, H, KV, HD = 256, 64, 4, 2, 16
CAPTURE = "stabilize_test_scores"
SCORES: dict[int, float] = {}  # layer index -> largest |logit| seen


def _scores(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention as the model runs it (SDPA), after recording the largest |logit| it
    forms: q.k x scaling over the causal pairs, in float64, from the q [B, H, T, hd] and
    k [B, H_kv, T, hd] handed over (normalized and rotated, as the softmax sees them)."""
    q, k = query.detach().double(), key.detach().double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # grouped queries
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    t = s.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    worst = float(s.abs()[..., causal].max())
    SCORES[module.layer_idx] = max(SCORES.get(module.layer_idx, 0.0), worst)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)  # fmt: skip


AttentionInterface.register(CAPTURE, _scores)
AttentionMaskInterface.register(CAPTURE, sdpa_mask)  # the masks SDPA gets
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=64,
              attn_implementation=CAPTURE)  # fmt: skip


def olmo2():  # q_norm / k_norm over all heads: [B, T, H * hd]
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(eos_token_id=2, **COMMON))


def qwen3():  # per head, before the transpose: [B, T, H, hd]
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=HD, **COMMON))


def gemma3():  # per head, (1 + weight) gains, scale 1/sqrt(256) (query_pre_attn_scalar)
    cfg = transformers.Gemma3TextConfig(head_dim=HD, **COMMON)
    return transformers.Gemma3ForCausalLM(cfg)


def llama():  # no q/k norms: the projections are what the scores see, rotated
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _bound_and_truth(build):
    torch.manual_seed(0)
    model = build().train()
    probe = StabilityProbe(model)
    probe.reset(detailed=True, device="cpu")
    SCORES.clear()
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=idx)
    got = probe.unpack(*(t.tolist() for t in probe.vector("cpu")))["attn_logit"]
    probe.remove()
    return model, got, dict(SCORES)


@pytest.mark.parametrize("build", [olmo2, qwen3, gemma3, llama])
def test_the_attention_bound_bounds_the_real_logits(build):
    model, got, truth = _bound_and_truth(build)
    assert sorted(truth) == [0, 1]
    for i, real in truth.items():
        bound = got[f"model.layers.{i}.attn"]
        # Cauchy-Schwarz per head, from fp32 norms: never below the float64 truth
        assert bound >= real * (1 - 1e-5), (i, bound, real)
        assert bound <= 3.0 * real, (i, bound, real)  # and not a bound by being loose
    src = stabilize.inspect_model(model).qk[0]
    normed = build is not llama
    assert src.normed is normed
    assert src.q.endswith("self_attn.q_norm" if normed else "self_attn.q_proj")


def test_the_map_says_where_q_and_k_are_read():
    lines = stabilize.inspect_model(olmo2()).describe()
    line = next(x for x in lines if x.startswith("q/k"))
    assert line == ("q/k: found in 2 of 2 blocks: e.g. model.layers.0.self_attn.q_norm, "
                    "model.layers.0.self_attn.k_norm (q and k after their norms)")  # fmt: skip


# ---- what cannot be read is said, and never written as a number ------------------------------
class Attention(nn.Module):
    """q_proj / k_proj as Llama's, but the head count under a name no convention uses
    (``heads``), or a q/k norm under names no convention uses (``q_ln`` / ``k_ln``)."""

    def __init__(self, odd_norms: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.heads = H
        if odd_norms:
            self.head_dim = HD
            self.q_ln, self.k_ln = nn.LayerNorm(HD), nn.LayerNorm(HD)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        if hasattr(self, "q_ln"):
            q, k = self.q_ln(q), self.k_ln(k)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class Block(nn.Module):
    def __init__(self, odd_norms):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(D), Attention(odd_norms)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class Net(nn.Module):
    def __init__(self, odd_norms=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(odd_norms) for _ in range(2)])
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("odd_norms, why", [
    (False, "the head width is not found"),
    (True, "a norm in the attention not read as q/k (blocks.0.attn.q_ln)"),
])  # fmt: skip
def test_the_map_and_the_view_agree_on_what_is_not_measured(odd_norms, why):
    model = Net(odd_norms)
    m = stabilize.inspect_model(model)
    assert m.qk == (None, None) and view_of(model).attn == [None, None]
    line = next(x for x in m.describe() if x.startswith("q/k"))
    assert line.startswith(f"q/k: found in 0 of 2 blocks; no attention bound in 2 (blocks.0: {why}")


class EncoderLM(nn.Module):
    """A causal LM from torch's own pre-norm encoder layers: its attention is an
    ``nn.MultiheadAttention`` (one packed ``in_proj_weight``, no q/k modules to read)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.norm(self.encoder(self.embed(idx), mask=mask, is_causal=True)))


def _data(n=48, t=16):
    g = torch.Generator().manual_seed(0)
    seq = (torch.randint(0, 200, (n, 1), generator=g) + torch.arange(t + 1)) % 255
    return [(seq[i : i + 8, :-1], seq[i : i + 8, 1:]) for i in range(0, n, 8)]


def _loss(model, batch):
    x, y = batch
    out = model(x)
    logits = getattr(out, "logits", out)  # a Hugging Face model's output, or the logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _train(guard, model, opt):
    """The plain loop of docs/your-model.md, fp32, over the test's data."""
    for batch in guard.batches(_data()):
        loss = _loss(model, batch)
        loss.backward()
        if guard.before_step(loss).apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()


def _rows(run) -> list[dict[str, str]]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_a_bound_not_measured_is_absent_from_a_real_runs_csv(tmp_path):
    torch.manual_seed(0)
    model = EncoderLM()
    assert "q/k: found in 0 of 2 blocks" in stabilize.inspect_model(model).describe()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(model, opt, None, run_dir=tmp_path / "run", loss_fn=_loss, log_every=1)
    _train(guard, model, opt)
    rows = _rows(tmp_path / "run")
    logged = [r for r in rows if r.get("act/encoder.layers.0.norm1")]
    assert len(logged) == 6  # the probe ran and its measured series were written
    written = [(k, r[k]) for r in rows for k in r if k.startswith("attn_logit/") and r[k] != ""]
    assert written == []


# ---- one tensor, one unit --------------------------------------------------------------------
@pytest.mark.parametrize("reduction", [None, "fp16"], ids=["hf-norms", "swapped-fp16"])
def test_a_llamas_block_output_is_one_unit(tmp_path, reduction):
    from your_llama import build

    model = build(reduction) if reduction else _plain_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = {"kind": "stream_drift", "layer": 0, "step": 3, "target": 300.0, "target_step": 5}
    run = tmp_path / "run"
    guard = stabilize.Guard(model, opt, None, run_dir=run, loss_fn=_loss, fault=fault,
                            rollback={"enabled": False}, log_every=1)  # fmt: skip
    # the reference: which names are one tensor, by identity, on the forward itself
    layers, same = model.model.layers, set()
    nxt = [(layers[1], "model.layers.1.input_layernorm"), (model.model.norm, "model.norm")]
    for i, (norm, norm_name) in enumerate(nxt):
        out = {}
        layers[i].register_forward_hook(lambda m, a, o, out=out: out.__setitem__("h", o))
        norm.register_forward_pre_hook(
            lambda m, a, i=i, out=out, n=norm_name: (
                same.add((f"model.layers.{i}", n)) if a[0] is out.get("h") else None
            )
        )
    _train(guard, model, opt)
    assert same == {("model.layers.0", "model.layers.1.input_layernorm"),
                    ("model.layers.1", "model.norm")}  # fmt: skip
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    judged = [(e["step"], e["monitor"], e["layer"]) for e in events
              if e["monitor"] in ("activation", "forecast")]  # fmt: skip
    # it crossed 256: judged under the norm that reads it, where its reduction overflows
    assert any(layer == "model.layers.1.input_layernorm" for _, _, layer in judged)
    merged = {block for block, _ in same}  # one tensor: never judged under its second name
    assert [j for j in judged if j[2] in merged] == []
    assert guard.last.act_alias == dict(same)
    for r in _rows(run):  # both names still logged, one value
        if r.get("act/model.layers.0"):
            assert r["act/model.layers.0"] == r["act/model.layers.1.input_layernorm"]


def _plain_llama():
    cfg = transformers.LlamaConfig(**{**COMMON, "attn_implementation": "sdpa",
                                      "initializer_range": 0.04})  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)
