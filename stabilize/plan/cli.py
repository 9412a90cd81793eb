"""``stabilize-plan``: the memory plan of a run, from the same overrides as ``stabilize-train``.

    stabilize-plan model=gpt-1.3b precision=fp16-mixed data.batch_size=16 plan.gpu=a100-80gb

Composes configs/train.yaml with Hydra's compose API (no run directory, no logs, no
Lightning import) into the same typed ``RunConfig`` training builds, so a bad override fails
with the same message, then prints per-GPU memory, per-node host memory and disk.
"""

from __future__ import annotations

import sys

from stabilize.exits import EXIT_CONFIG, one_line
from stabilize.paths import config_dir
from stabilize.plan.hardware import GB, PlanConfig, parse_plan_overrides
from stabilize.plan.memory import PARAM_BYTES, activations, model_state
from stabilize.plan.storage import storage
from stabilize.run.config import RunConfig

USAGE = """usage: stabilize-plan [OVERRIDE ...]

Every override stabilize-train takes (model=gpt-1.3b precision=fp16-mixed data.batch_size=16
trainer.strategy=fsdp rollback.keep=3 ...), plus the planner's own:
  plan.gpu=a100-80gb       a100-40gb | a100-80gb | h100-80gb | h200
  plan.gpus_per_node=8     default: trainer.devices when a number, else 8
  plan.nodes=1             default: trainer.num_nodes
  plan.disk_gbps=2.0       durable-write bandwidth of the run directory, GB/s
  plan.reserve_gb=2.0      per GPU: CUDA context, workspaces, fragmentation
Sizes are decimal GB (1e9 bytes). docs/memory.md explains every line."""


def compose_run(overrides: list[str]) -> RunConfig:
    """configs/train.yaml + ``overrides`` -> RunConfig, as train.py builds it. The run
    directory is only named (``${hydra:...}`` has no value outside a Hydra app)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from stabilize.config_store import store

    store()  # the dataclasses' defaults, which every option file starts from
    args = list(overrides)
    if not any(a.partition("=")[0].lstrip("+~") == "run_dir" for a in args):
        args.insert(0, "run_dir=plan")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=args)
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def _gb(n: float) -> str:
    return f"{n / GB:9.2f}"


def render(cfg: RunConfig, plan: PlanConfig) -> str:
    """The plan as a table (the text stabilize-plan prints)."""
    m, t, p = cfg.model, cfg.trainer, cfg.precision.name
    per_node = plan.gpus_per_node or (t.devices if isinstance(t.devices, int) else 8)
    nodes = plan.nodes or t.num_nodes
    world = per_node * nodes
    strategy = t.strategy if t.strategy != "auto" else ("ddp" if world > 1 else "single")
    b, seq = cfg.data.batch_size, m.block_size
    gpu = plan.device
    ms = model_state(m, p, strategy, world)
    act = activations(m, p, b, seq)
    st = storage(cfg, per_node, nodes, plan.disk_gbps)
    pdt = "fp32" if PARAM_BYTES[p] == 4 else "bf16"
    shard = f" / {world} (FSDP shard)" if strategy == "fsdp" else ""
    fixed = ms.params + ms.grads + ms.optimizer + ms.autocast_copies + ms.fsdp_gather
    reserve = plan.reserve_gb * GB

    def verdict(total: float) -> str:
        need = total + reserve
        word = "fits" if need <= gpu.memory_bytes else "does NOT fit"
        return f"{word}: {need / gpu.memory_bytes:.0%} of {gpu.memory_bytes / GB:.1f} GB"

    def row(label: str, value: float, note: str = "") -> str:
        return f"  {label:<34}{_gb(value)}  {note}".rstrip()

    rows = [
        f"stabilize-plan: {m.name} ({ms.n_params:,} parameters), {p}, {strategy}, "
        f"{nodes} node(s) x {per_node} x {gpu.label} ({gpu.memory_bytes / GB:.1f} GB)",
        f"micro-batch {b} x {seq} tokens per GPU, accumulation {cfg.optim.accumulate_grad_batches}"
        " (adds no activation memory); GB = 1e9 bytes",
        "",
        f"per GPU{'GB':>38}",
        row(f"parameters ({pdt}{shard})", ms.params),
        row(f"gradients ({pdt}{shard})", ms.grads),
        row(f"AdamW moments (2 x {pdt}{shard})", ms.optimizer),
    ]
    if ms.autocast_copies:
        rows.append(row("autocast 16-bit weight copies", ms.autocast_copies, "forward to backward"))
    if ms.fsdp_gather:
        rows.append(row("FSDP unsharded working set", ms.fsdp_gather, "2 blocks + 1 of grads"))
    layers = f"{m.n_layer} x {act.per_layer / GB:.3f} + {(act.head + act.embedding) / GB:.3f}"
    rows += [
        row("activations, no checkpointing", act.saved, layers),
        row("activations, per-block recompute", act.checkpointed, "block inputs + one block"),
        row("loss peak (logits, transient)", act.loss_peak, "8 B x vocab per token"),
        row("reserve (context, workspaces)", reserve, "plan.reserve_gb"),
        row("total, no checkpointing", fixed + act.peak + reserve, verdict(fixed + act.peak)),
        row(
            "total, per-block recompute",
            fixed + act.peak_checkpointed + reserve,
            verdict(fixed + act.peak_checkpointed),
        ),
    ]
    math, math_ckpt = act.without_fused_attention(m.n_layer)
    rows += [
        "  attention: planned as a fused SDPA kernel (flash or memory-efficient; it saves no",
        f"  T x T weights); SDPA's math path saves {act.math_attention / GB:.3f} GB more a block:",
        row("no fused attn, no checkpointing", fixed + math + reserve, verdict(fixed + math)),
        row(
            "no fused attn, per-block recompute",
            fixed + math_ckpt + reserve,
            verdict(fixed + math_ckpt),
        ),
    ]
    rows += [f"  note: {n}" for n in act.notes]
    keep = cfg.rollback.keep if cfg.rollback.enabled else 0
    bound = "unbounded" if st.disk_bound is None else f"at most {st.disk_bound / GB:.1f} GB"
    durable = cfg.rollback.durable_every if cfg.rollback.enabled else 0
    rows += [
        "",
        f"host memory, snapshot ring (rollback.keep={keep}){'per rank':>14}{'per node':>12}",
        f"  {'full copy on every rank (unsharded ring)':<47}{_gb(st.ring_per_rank)}   "
        f"{_gb(st.ring_per_node)}",
        f"  {f'1/{world} slice per rank (DDP and FSDP now)':<47}{_gb(st.sharded_per_rank)}   "
        f"{_gb(st.sharded_per_node)}",
        "",
        f"disk{'GB':>41}",
        row(
            "durable snapshot (= a checkpoint)",
            st.snapshot,
            f"{st.write_seconds:.1f} s at {plan.disk_gbps:g} GB/s, every {durable} steps",
        ),
        row(
            "written per 100 steps",
            st.disk_per_100_steps,
            f"checkpoints every {t.checkpoint_every_n_steps}; retention: {bound}",
        ),
        row(
            f"on disk after {t.max_steps} steps",
            st.disk_at_end,
            f"keep_checkpoints={t.keep_checkpoints}, keep_durable={cfg.rollback.keep_durable}",
        ),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        plan, rest = parse_plan_overrides(args)
        cfg = compose_run(rest)
    except (ValueError, HydraException, OmegaConfBaseException) as e:
        print(f"stabilize-plan: {one_line(str(e))}", file=sys.stderr)
        return EXIT_CONFIG
    print(render(cfg, plan))
    return 0
