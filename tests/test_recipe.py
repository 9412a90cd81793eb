"""The seed's recipe: nan_at_12000's 4M-token step, composed with Hydra
and run shrunk on CPU, and the activation checkpointing it relies on."""

from __future__ import annotations

import torch

from stabilize.model import GPT, GPTConfig, set_activation_checkpointing
from stabilize.norms import Norm
from stabilize.stability.probe import StabilityProbe
from stabilize.train import run

from conftest import compose_run


def tokens_per_step(cfg, world_size: int) -> int:
    """Tokens of one optimizer step: micro-batch x block x ranks x accumulation."""
    return (
        cfg.data.batch_size * cfg.model.block_size * world_size * cfg.optim.accumulate_grad_batches
    )


def test_nan_at_12000_is_the_seeds_4m_token_step_on_one_node_and_on_two(tmp_path):
    cfg = compose_run(tmp_path, ["experiment=nan_at_12000"])
    assert (cfg.data.batch_size, cfg.model.block_size) == (16, 2048)  # per GPU
    assert cfg.optim.accumulate_grad_batches == 16
    assert tokens_per_step(cfg, world_size=8) == 4_194_304
    assert cfg.trainer.activation_checkpointing
    two = compose_run(tmp_path, ["experiment=nan_at_12000", "optim.accumulate_grad_batches=8"])
    assert tokens_per_step(two, world_size=16) == 4_194_304  # docs/guide.md's 2-node line


def test_nan_at_12000_runs_shrunk_with_accumulation_checkpointing_and_rollback(tmp_path):
    """The recipe's groups and settings (fp16-mixed, RMSNorm reduced in fp16, accumulation
    16, activation checkpointing), with rollback on (arm=remedy), on the tiny model."""
    cfg = compose_run(
        tmp_path,
        [
            "experiment=nan_at_12000",
            "arm=remedy",
            "model=tiny",
            "model.block_size=32",
            "data.batch_size=1",
            "fault.layer=1",
            "fault.step=2",  # inside the shortened run (one that never fires is refused)
            "logger=none",
            "trainer.max_steps=2",
            "trainer.progress=none",
            "trainer.limit_val_batches=1",
            "optim.warmup_steps=1",
        ],
    )
    assert cfg.rollback.enabled and cfg.optim.accumulate_grad_batches == 16
    out = run(cfg)
    assert out["model_step"] == out["global_step"] == 2
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["data_step"] == 2 * 16
    assert ckpt["stabilize"]["config"]["trainer"]["activation_checkpointing"]


def _step(model: GPT, idx: torch.Tensor, probe: StabilityProbe, seed: int):
    probe.reset(detailed=True, device="cpu")
    torch.manual_seed(seed)  # dropout: the recompute must redraw the same masks
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, probe.buf.clone()


def test_activation_checkpointing_changes_no_number_the_monitors_or_the_optimizer_see():
    """fp16 reductions with overflowing rows (so the probe counts rows), dropout on: with
    each Block recomputed in the backward, the norms run twice per micro-batch, yet the
    probe's maxima and counts, the loss and every gradient equal those without."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset(
        "tiny",
        dropout=0.1,
        norm={"type": "rmsnorm", "backend": "explicit", "reduction_dtype": "fp16"},
    )
    model = GPT(cfg).train()
    with torch.no_grad():
        model.wte.weight[:128] *= 2000  # those tokens' rows overflow h.0.ln_1's fp16 sum
    probe = StabilityProbe(model)
    calls = [0]
    for m in model.modules():
        if isinstance(m, Norm):
            m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    plain = _step(model, idx, probe, seed=5)
    plain_calls, calls[0] = calls[0], 0
    model.zero_grad(set_to_none=True)
    assert set_activation_checkpointing(model, True) == cfg.n_layer
    ckpt = _step(model, idx, probe, seed=5)
    in_blocks = sum(isinstance(m, Norm) for m in model.h.modules())
    assert calls[0] == plain_calls + in_blocks  # every norm in a Block ran twice

    assert torch.equal(plain[0], ckpt[0])
    for name, g in plain[1].items():
        torch.testing.assert_close(ckpt[1][name], g, rtol=0, atol=0, equal_nan=True)
    counts = probe.vector("cpu")[1]
    assert counts.sum() > 0  # rows overflowed: the counts are there to be doubled
    torch.testing.assert_close(ckpt[2], plain[2], rtol=0, atol=0, equal_nan=True)
    probe.remove()


def test_the_attention_hooks_run_once_per_micro_batch_under_checkpointing(monkeypatch):
    """The q/k hooks inside a Block (attention bound, head entropy) are not run again by the
    recompute: as many measurements with checkpointing as without, the same numbers."""
    import stabilize.stability.probe as probe_mod

    calls = [0]
    real = probe_mod.sampled_queries

    def counted(q):
        calls[0] += 1
        return real(q)

    monkeypatch.setattr(probe_mod, "sampled_queries", counted)
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", dropout=0.0)
    model = GPT(cfg).train()
    probe = StabilityProbe(model)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = _step(model, idx, probe, seed=5)
    plain_calls, calls[0] = calls[0], 0
    model.zero_grad(set_to_none=True)
    set_activation_checkpointing(model, True)
    ckpt = _step(model, idx, probe, seed=5)
    assert plain_calls == cfg.n_layer and calls[0] == plain_calls
    torch.testing.assert_close(ckpt[2], plain[2], rtol=0, atol=0, equal_nan=True)
    probe.remove()
