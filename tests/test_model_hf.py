"""``model=hf`` (issue 36, design section 7): Hugging Face's Llama and GPT-2 built from the
run's own model keys by real Hydra composition, their parameter counts against a hand
count, their norms swapped for ours as the norm group says, the refusals in one line, a
short run of the main job's baseline on a Llama through stabilize-train, and (slow) the
scenario's reference and baseline arms telling the chain on a Llama."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from doc_commands import doc_command

from conftest import FAST, ROOT, cli, compose_run, train_cli

pytest.importorskip("transformers")


def _llama_params(v, d, layers, f, heads, kv_heads):
    hd = d // heads
    attn = d * d + 2 * d * kv_heads * hd + d * d  # q, k, v, o: no biases
    per_layer = attn + 3 * d * f + 2 * d  # SwiGLU's three matrices, two RMSNorm gains
    return v * d + layers * per_layer + d + d * v  # embedding, final norm, untied head


def _gpt2_params(v, t, d, layers):
    per_layer = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d)
    per_layer += 4 * d * d + d  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj
    return v * d + t * d + layers * per_layer + 2 * d  # tied head: counted once


def test_a_llama_from_our_keys_counts_its_parameters_and_takes_our_norms(tmp_path):
    from stabilize.model import build_model
    from stabilize.norms import Norm

    over = ["model=hf", "norm=rmsnorm", "norm.reduction_dtype=fp16", "norm.eps=1e-6",
            "+model.hf.config.num_key_value_heads=2"]  # fmt: skip
    cfg = compose_run(tmp_path, over)
    m = cfg.model
    model = build_model(m)
    assert type(model).__mro__[1].__name__ == "LlamaForCausalLM"
    f = m.mlp_ratio * m.d_model * 2 // 3
    want = _llama_params(m.vocab_size, m.d_model, m.n_layer, f, m.n_head, 2)
    assert sum(p.numel() for p in model.parameters()) == want
    norms = {n: x for n, x in model.named_modules() if isinstance(x, Norm)}
    assert sorted(norms) == sorted([f"model.layers.{i}.{k}" for i in range(m.n_layer)
                                    for k in ("input_layernorm", "post_attention_layernorm")]
                                   + ["model.norm"])  # fmt: skip
    assert {(x.reduction_dtype, x.eps) for x in norms.values()} == {("fp16", 1e-6)}
    x = torch.randint(0, m.vocab_size, (2, 16))
    assert model(x).shape == (2, 16, m.vocab_size)  # forward(idx) -> logits, as our GPT


def test_a_gpt2_counts_its_parameters_and_keeps_its_layernorms(tmp_path):
    from stabilize.model import build_model
    from stabilize.norms import Norm

    cfg = compose_run(tmp_path, ["model=hf", "model.hf.arch=gpt2", "norm=rmsnorm"])
    m = cfg.model
    model = build_model(m)
    assert sum(p.numel() for p in model.parameters()) == _gpt2_params(
        m.vocab_size, m.block_size, m.d_model, m.n_layer
    )
    kinds = {x.kind for x in model.modules() if isinstance(x, Norm)}
    assert kinds == {"layernorm"}  # norm_type=arch: the norm group's type is not applied
    # norm_type=group: the group's type too (a Llama's RMSNorms become LayerNorms)
    cfg = compose_run(tmp_path, ["model=hf", "norm=layernorm", "model.hf.norm_type=group"])
    kinds = {x.kind for x in build_model(cfg.model).modules() if isinstance(x, Norm)}
    assert kinds == {"layernorm"}


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("+model.hf.config.hidden_size=64", "model.hf.config.hidden_size is not allowed"),
        ("norm.placement=post", "norm.placement='post' is not allowed with model=hf"),
        ("model.hf.arch=mistral", "model.hf.arch='mistral' is not allowed"),
        (
            "model.hf.arch=gpt2 norm=rmsnorm model.hf.norm_type=group",
            "norm.type='rmsnorm' is not allowed with model.hf.arch=gpt2",
        ),
    ],
)
def test_what_model_hf_cannot_honour_is_refused_in_one_line(
    tmp_path, monkeypatch, capsys, override, words
):
    args = ["model=hf", *override.split(), f"hydra.run.dir={tmp_path / 'run'}"]
    rc, err = cli(args, tmp_path, monkeypatch, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "run").exists()


def test_the_main_jobs_baseline_on_a_llama_counts_its_overflow_by_its_own_names(tmp_path):
    """A short baseline (the drift reaches the fp16 line within its steps) through the
    real stabilize-train: the per-layer series carry Hugging Face's module paths, and the
    fp16 reductions overflow where the drifted stream enters them."""
    from stabilize.train import run

    over = ["experiment=nan_repro", "arm=baseline", "model=hf", *FAST,
            "trainer.max_steps=12", "fault.step=2", "fault.target_step=8"]  # fmt: skip
    out = run(compose_run(tmp_path / "b", over))
    assert out["model_step"] == 12
    with open(next((tmp_path / "b" / "csv").glob("*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    cols = set(rows[0])
    assert "act/model.layers.0" in cols and "overflow/model.norm" in cols
    overflowed = [float(r["overflow/model.norm"]) for r in rows
                  if r.get("overflow/model.norm")]  # fmt: skip
    assert overflowed and max(overflowed) > 0
    events = [json.loads(x) for x in (tmp_path / "b" / "events.jsonl").read_text().splitlines()]
    assert any(e["monitor"] == "overflow" and e["layer"].startswith("model.") for e in events)


@pytest.mark.slow
def test_the_scenario_tells_the_chain_on_a_llama(tmp_path):
    """Done when 3: scripts/repro_nan.sh's reference (2 seeds) and baseline arms with
    model=hf model.hf.arch=llama; the report tells the forward overflow, the dead rows, the
    flat loss and the verdict against the reference."""
    out = tmp_path / "scen"
    env = {**os.environ, "PYTHON": str(Path(os.sys.executable))}
    script, *args = shlex.split(doc_command("scenario-hf"))  # as docs/your-model.md shows it
    i = args.index("--")  # with the output dir, no cost rounds and no W&B added
    args = [*args[:i], "--cost-rounds", "0", "--out", str(out), *args[i:], "logger=none"]
    r = subprocess.run(["bash", str(ROOT / script), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (out / "report.md").read_text()
    chain = next(x for x in report.splitlines() if x.startswith("- Baseline chain"))
    assert "the first fp16 reduction overflowed (model." in chain
    assert "came out of the norm as zeros" in chain
    assert "went flat at 5.545 = ln 256" in chain
    verdict = next(x for x in report.splitlines() if x.startswith("| baseline | no |"))
    assert verdict.rstrip().endswith("| dies (predicts uniformly) |")


def test_the_docs_model_hf_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/your-model.md's stabilize-train line, as written (20 steps, fp16 reductions),
    in this process with W&B off, a run dir of the test's and only the size shrunk (4
    sequences a batch, 2 validation batches, 2 held-out batches after training)."""
    args = [*shlex.split(doc_command("train-hf"))[1:], "logger=none", "data.batch_size=4",
            "trainer.limit_val_batches=2", "trainer.final_eval_batches=2",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    r = train_cli(args, tmp_path, monkeypatch, capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stabilize-train: hf Llama (459,136 parameters, 2 layers x 128), rmsnorm pre" in r.stdout
    # what the doc says it does: at Hugging Face's init std 0.02 the fp16 reductions'
    # backward overflows from step 1 (every step a scaler skip), and the ladder's rollbacks
    # end with the norms reducing in fp32, the run trained to its 20 steps
    assert "done: 20 steps (20 asked; " in r.stdout
    assert "remedy fp32_reduction" in r.stdout
    assert "norm.reduction_dtype fp16 -> fp32 (the remedies')" in r.stdout
    lines = r.stdout.splitlines()
    first = next(x for x in lines if x.startswith("first non-finite gradient, at step "))
    assert first.startswith("first non-finite gradient, at step 1: model.layers.")


def _saved_llama(path, **over):
    """A Llama of the default model keys, by hand, written with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, intermediate_size=341, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**{**keys, **over})).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_model_hf_run_ends_with_a_save_pretrained_dir_of_its_final_weights(tmp_path, arch):
    """The run's final weights as ``save_pretrained`` wrote them (``RUN_DIR/hf``): the plain
    Hugging Face class loads them with ``from_pretrained``, equal, tensor by tensor, to the
    run's own last checkpoint; nothing of ours is needed to read them."""
    import transformers

    from stabilize.train import run

    d = tmp_path / "r"
    out = run(compose_run(d, ["model=hf", f"model.hf.arch={arch}", *FAST]))
    assert out["hf_dir"] == str(d / "hf")
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel}[arch]
    loaded = cls.from_pretrained(out["hf_dir"], local_files_only=True)
    assert type(loaded) is cls
    ckpt = torch.load(d / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    want = {k.removeprefix("model."): v for k, v in ckpt.items() if k.startswith("model.")}
    got = loaded.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_local_weights_load_with_nothing_downloaded_and_give_the_same_logits(tmp_path):
    from stabilize.model import build_model

    theirs = _saved_llama(tmp_path / "w")
    cfg = compose_run(tmp_path, ["model=hf", f"model.hf.weights={tmp_path / 'w'}"])
    ours = build_model(cfg.model).eval()  # norms swapped for ours, reducing in fp32
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(input_ids=x).logits
        got = ours(x)
    torch.testing.assert_close(got, want)  # fp32 defaults: the swap changed no number


def test_local_weights_whose_config_differs_from_the_model_keys_are_refused(
    tmp_path, monkeypatch, capsys
):
    _saved_llama(tmp_path / "w", num_hidden_layers=3)
    args = ["model=hf", f"model.hf.weights={tmp_path / 'w'}", f"hydra.run.dir={tmp_path / 'r'}"]
    rc, err = cli(args, tmp_path, monkeypatch, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "its num_hidden_layers is 3, ours says 2" in err
    assert not (tmp_path / "r").exists()
