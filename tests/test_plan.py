"""stabilize-plan (issue 13 item 6): model state against the real model on the meta device,
activations against what a real training step saves for backward on CPU, the snapshot size
against a real snapshot, and the CLI (tables and refusals) through Hydra composition."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import tomllib
import torch
import torch.nn.functional as F

from stabilize.model import GPT, PRESETS, GPTConfig
from stabilize.norms import NORM_TYPES
from stabilize.plan import (
    activations,
    main,
    matmul_weight_count,
    model_state,
    param_shapes,
    shard_count,
    snapshot_bytes,
)

from conftest import FAST, ROOT, compose_run

NORMS = [
    {},
    {"type": "rmsnorm", "qk_norm": True},
    {"type": "scalenorm", "placement": "sandwich", "final_norm": False},
    {"type": "layernorm", "bias": False, "embed_norm": True},
    {"affine": False},
]


def meta_model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


# ---- model state: exact ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("norm", NORMS, ids=str)
def test_model_state_is_the_meta_models_count_times_bytes(preset, norm):
    cfg = GPTConfig.preset(preset, norm=norm, bias=preset != "gpt-350m")
    model = meta_model(cfg)
    assert param_shapes(cfg) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    n = sum(p.numel() for p in model.parameters())  # the tied head counted once
    mixed = model_state(cfg, "fp16-mixed", "ddp", 8)
    assert (mixed.n_params, mixed.params, mixed.grads, mixed.optimizer) == (n, 4 * n, 4 * n, 8 * n)
    linears = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    assert mixed.autocast_copies == 2 * linears == 2 * matmul_weight_count(cfg)
    true16 = model_state(cfg, "bf16-true", "ddp", 8)
    assert (true16.params, true16.optimizer, true16.autocast_copies) == (2 * n, 4 * n, 0)
    assert model_state(cfg, "fp32", "ddp", 8).autocast_copies == 0
    # FSDP2 splits every parameter on dim 0, padded: the largest shard is rank 0's
    rows = sum(math.ceil(p.shape[0] / 8) * p[0].numel() for p in model.parameters() if p.dim())
    scalars = sum(1 for p in model.parameters() if not p.dim())
    fsdp = model_state(cfg, "bf16-mixed", "fsdp", 8)
    assert fsdp.params == 4 * shard_count(cfg, 8) == 4 * (rows + scalars)
    assert n / 8 <= shard_count(cfg, 8) < n / 8 * 1.01


def test_the_125m_and_1_3b_presets_have_their_published_sizes():
    assert (
        model_state(GPTConfig.preset("gpt-1.3b"), "fp16-mixed", "ddp", 8).n_params == 1_315_723_264
    )
    # GPT-2 small's 124,439,808 plus 1024 more learned positions of 768 (context 2048)
    gpt125 = model_state(GPTConfig.preset("gpt-125m"), "fp32", "ddp", 1).n_params
    assert gpt125 == 124_439_808 + 1024 * 768


def test_snapshot_size_is_a_real_snapshots_bytes(tmp_path):
    from stabilize.lit.module import param_groups
    from stabilize.rollback import to_cpu

    cfg = compose_run(tmp_path, ["norm=rmsnorm", "norm.qk_norm=true"])
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(param_groups(model, 0.1))
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    state = to_cpu({"model": model.state_dict(), "optimizer": opt.state_dict()})
    tensors, stack = {}, [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            tensors[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    assert snapshot_bytes(cfg) == sum(tensors.values())


# ---- activations: measured ------------------------------------------------------------------
class SavedBytes:
    """The bytes autograd saves for backward in a forward: activation memory by definition.

    Why this and not a peak-memory counter: PyTorch's CPU allocator keeps no statistics
    (torch.cuda.max_memory_allocated has no CPU twin), and the profiler's CPU memory events
    are per op, not a timeline. What a micro-batch costs in memory beyond the model's state
    is what the graph holds from forward to backward, which ``saved_tensors_hooks`` sees
    exactly: every saved tensor passes through ``pack``. Storages are counted once (q, k, v
    are views of one qkv buffer) and parameters not at all (they are model state); the 16-bit
    weight copies autocast saves are reported apart. The transient at the loss (logits
    before log_softmax, the backward's gradients) is not saved and is not checked here."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def saved_by_training_step(tmp_path, overrides) -> tuple[int, object]:
    """One real training step (Trainer, precision plugin, callbacks, loss) with the hook on
    from the batch's start to its backward."""
    import lightning as L

    from stabilize.train import run

    class Measure(L.Callback):
        bytes = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.meter = SavedBytes(module.parameters())
            self.meter.ctx.__enter__()

        def on_before_backward(self, trainer, module, loss):
            self.meter.ctx.__exit__(None, None, None)
            Measure.bytes = self.meter.total

    cfg = compose_run(
        tmp_path,
        [*FAST, "trainer.max_steps=1", "logger=none", "trainer.progress=none", *overrides],
    )
    run(cfg, callbacks=[Measure()])
    return Measure.bytes, cfg


# (n_layer, d_model, n_head, block, batch, precision, norm overrides). The per-block
# recompute line (trainer.activation_checkpointing) is not metered: only the "without" case.
STEPS = [
    (2, 128, 4, 64, 4, "fp32", []),
    (3, 192, 6, 96, 2, "bf16-mixed", []),
    (
        1,
        64,
        4,
        128,
        3,
        "fp16-mixed",
        ["norm=rmsnorm", "norm.backend=explicit", "norm.reduction_dtype=fp16"],
    ),
]


@pytest.mark.parametrize("shape", STEPS, ids=lambda s: f"L{s[0]}-D{s[1]}-T{s[3]}-B{s[4]}-{s[5]}")
def test_activations_agree_with_a_training_steps_saved_tensors(tmp_path, shape):
    n_layer, d, heads, block, batch, prec, norm = shape
    measured, cfg = saved_by_training_step(
        tmp_path,
        [
            f"model.n_layer={n_layer}",
            f"model.d_model={d}",
            f"model.n_head={heads}",
            f"model.block_size={block}",
            f"data.batch_size={batch}",
            f"precision={prec}",
            *norm,
        ],
    )
    plan = activations(cfg.model, prec, batch)
    planned = plan.saved + model_state(cfg.model, prec, "single", 1).autocast_copies
    assert plan.checked
    assert planned == pytest.approx(measured, rel=0.15), (planned, measured)


VARIANTS = [
    ("bf16-mixed", {"qk_norm": True}),
    ("fp32", {"embed_norm": True}),
    ("bf16-mixed", {"embed_norm": True, "final_norm": False}),
    ("fp32", {"type": "rmsnorm", "backend": "explicit", "qk_norm": True}),
    ("bf16-mixed", {"type": "layernorm", "backend": "explicit"}),
]


@pytest.mark.parametrize(("prec", "norm"), VARIANTS, ids=str)
def test_activation_formula_follows_the_norm_switches(prec, norm):
    """The same check on the bare model (forward + fp32 loss under CPU autocast), for the
    norm switches that change what is saved."""
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=32, norm=norm)
    model = GPT(cfg)
    meter = SavedBytes(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16}[prec]
    with meter.ctx:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
    planned = activations(cfg, prec, 2).saved + model_state(cfg, prec, "single", 1).autocast_copies
    assert planned == pytest.approx(meter.total, rel=0.15), (planned, meter.total)


@pytest.mark.parametrize("prec", ["fp32", "bf16-mixed"])
def test_the_math_attention_line_is_what_sdpas_math_path_saves(prec):
    """The plan assumes a fused SDPA kernel and prints what the math path adds: the same
    meter, on the bare model with the math path forced, against the plan plus its extra."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = GPTConfig(n_layer=3, d_model=96, n_head=6, block_size=40)
    model = GPT(cfg)
    meter = SavedBytes(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (3, 40))
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16}[prec]
    with meter.ctx, sdpa_kernel(SDPBackend.MATH):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
    act = activations(cfg, prec, 3)
    planned = act.saved + cfg.n_layer * act.math_attention
    planned += model_state(cfg, prec, "single", 1).autocast_copies
    assert planned == pytest.approx(meter.total, rel=0.02), (planned, meter.total)
    # the T x T weights are what dominates it: 4 bytes x heads x T per token, per block
    assert act.math_attention >= 4 * cfg.n_head * 40 * 3 * 40 - 4 * cfg.n_head * 3 * 40


# ---- the command ----------------------------------------------------------------------------
def test_cli_prints_the_1_3b_plan(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stabilize.plan",
            "model=gpt-1.3b",
            "precision=fp16-mixed",
            "data.batch_size=16",
            "plan.gpu=a100-80gb",
            "plan.gpus_per_node=8",
            "rollback.keep=3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "1,315,723,264 parameters" in out and "A100-SXM4-80GB" in out
    assert "total, no checkpointing" in out and "does NOT fit" in out
    assert "total, per-block recompute" in out and "fits: " in out
    # its attention assumption, and what the math path would add: 4 H T + 6 D - 4 H bytes a
    # token and block at 16 x 2048 tokens (by hand: 143,296 x 32,768 = 4.696 GB)
    assert "attention: planned as a fused SDPA kernel (flash or memory-efficient" in out
    assert "SDPA's math path saves 4.696 GB more a block" in out
    base = float(re.search(r"total, no checkpointing +([\d.]+)", out)[1])
    no_fused = float(re.search(r"no fused attn, no checkpointing +([\d.]+)", out)[1])
    assert no_fused - base == pytest.approx(24 * 4.696, abs=0.02)
    assert "378.93" in out  # 3 x 15.79 GB x 8 ranks: the issue's ~379 GB per node
    assert not any(tmp_path.iterdir())  # a plan writes nothing


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "norm.type=groupnorm",
            f"norm.type='groupnorm' is not allowed; allowed: {list(NORM_TYPES)}",
        ),
        ("norm=groupnorm", "Available options in 'norm'"),
        ("model.typo=3", "typo"),
        ("plan.gpu=v100", "plan.gpu='v100' is not allowed; allowed: ['a100-40gb', 'a100-80gb'"),
        ("plan.disks=2", "plan.disks is not a known setting"),
    ],
)
def test_bad_overrides_fail_with_the_training_message(override, message, capsys):
    assert main([override]) == 2  # a config error (stabilize/exits.py)
    err = capsys.readouterr().err
    assert message in err and err.startswith("stabilize-plan: ")


def test_fsdp_divides_the_state_and_the_1_3b_state_fits_on_40gb(tmp_path, capsys):
    assert main(["model=gpt-1.3b", "trainer.strategy=fsdp", "plan.gpu=a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert "parameters (fp32 / 8 (FSDP shard))" in out and "FSDP unsharded working set" in out


def test_the_console_script_points_at_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stabilize-plan"] == "stabilize.plan:main"
