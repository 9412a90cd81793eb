"""Every command README.md and docs/*.md show, and the registry of the tests that run them
(issue 34 item 7: "every command in the README and in docs/ is run by a test as written").

A command is a line of a ```bash block (a ``\\`` continuation joined, a trailing ``# ...``
comment dropped) or a ``$ `` prompt line of a plain block. ``COMMANDS`` names each one
exactly as shown; a test fetches its text with ``doc_command(name)``, which fails when the
docs no longer show it, and runs that text (with only its size shrunk: steps, cells, arms;
or composed only, where it needs GPUs, a second node, the network, SLURM or docker:
``COMPOSED_ONLY``). ``tests/test_doc_commands.py`` checks that the registry and the docs
agree both ways and that every name is fetched by some test.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")

COMMANDS: dict[str, str] = {
    # README.md: the two commands, one run, the map
    "main-job": "python -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
    "PYTHON=.venv/bin/python scripts/repro_nan.sh",
    "tests": "python -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[dev]' && "
    ".venv/bin/python -m pytest -n 2 --dist loadfile",
    "one-run": "stabilize-train model=tiny norm=rmsnorm norm.placement=post norm.eps=1e-5 "
    "norm.reduction_dtype=fp16 precision=fp16-mixed trainer.max_steps=50",
    "report-main": "stabilize-report runs/main/*",
    "keys-loss-scale": "stabilize-train --keys monitor.loss_scale",
    "map": "stabilize-map",
    # docs/precision.md: the silent-gap drill (tests/test_silent_gap.py)
    "gap-refs": "for s in 1234 1235 1236; do stabilize-train experiment=main precision=fp32 "
    "trainer.max_steps=100 seed=$s run_dir=runs/fp32-$s; done",
    "gap-planted": "stabilize-train experiment=main precision=fp32 trainer.max_steps=100 "
    "fault=biased_round fault.site=lm_head fault.bits=1 run_dir=runs/silent",
    "gap-bf16": "stabilize-train experiment=main trainer.max_steps=100 precision=bf16-mixed "
    "norm.reduction_dtype=bf16 run_dir=runs/bf16",
    "gap-judge": "stabilize-gap runs/silent --reference runs/fp32-*",
    "gap-bisect": "stabilize-replay --gap runs/silent --reference runs/fp32-* --window 40",
    "gap-fixed": "stabilize-train experiment=main precision=fp32 trainer.max_steps=100 "
    'fault=biased_round fault.site=lm_head fault.bits=1 "++model.fp32_modules=[lm_head]" '
    "run_dir=runs/silent-fixed",
    "gap-bisect-bf16": "stabilize-replay --gap runs/bf16 --reference runs/fp32-*",
    "gap-tail": "stabilize-replay --tail 0 runs/silent --reference runs/fp32-*",
    "precision-table": "python scripts/precision_table.py",
    "hvp-check": "python scripts/hvp_check.py",
    # docs/design-spikes.md: the spike counterfactual's drill (tests/test_spike_counterfactual.py)
    "spike-refs": "for s in 1234 1235 1236; do stabilize-train experiment=main precision=fp32 "
    "trainer.max_steps=80 optim.grad_clip=0 optim.lr=1e-3 rollback.enabled=false seed=$s "
    "run_dir=runs/calm-$s; done",
    "spike-grad": "stabilize-train experiment=main precision=fp32 trainer.max_steps=80 "
    "optim.grad_clip=0 optim.lr=1e-3 rollback.enabled=false fault=grad_spike fault.step=30 "
    "fault.factor=1000 trainer.checkpoint_every_n_steps=20 run_dir=runs/grad-spike",
    "spike-loss": "stabilize-train experiment=main precision=fp32 trainer.max_steps=80 "
    "optim.grad_clip=0 optim.lr=1e-3 rollback.enabled=false fault=loss_spike fault.step=30 "
    "fault.factor=5 trainer.checkpoint_every_n_steps=20 run_dir=runs/loss-spike",
    "spike-cf-grad": "stabilize-replay --spike runs/grad-spike --reference runs/calm-*",
    "spike-cf-loss": "stabilize-replay --spike runs/loss-spike --reference runs/calm-*",
    "precision-table-pure": "python scripts/precision_table.py --runs pure-bf16 --set "
    "optim.lr=3e-5 --block precision-table-pure",
    # docs/data.md
    "bench-data": "python scripts/bench_data.py",
    "bench-data-reduced": "python scripts/bench_data.py --mb 40 --small-mb 4 --bpe-mb 4",
    # docs/guide.md
    "hub-8gpu": "scripts/launch.sh --nproc-per-node 8 experiment=nan_at_12000 data=hub "
    "data.name=Salesforce/wikitext data.config_name=wikitext-103-raw-v1 "
    "data.tokenizer=openai-community/gpt2",
    "launch-8gpu": "scripts/launch.sh --nproc-per-node 8 model=gpt-1.3b precision=fp16-mixed",
    "launch-2nodes": "scripts/launch.sh --nnodes 2 --nproc-per-node 8 --rdzv-endpoint "
    "node0:29500 --run-id exp1 model=gpt-1.3b trainer.strategy=fsdp",
    "launch-cpu": "scripts/launch.sh --nproc-per-node 2 trainer.accelerator=cpu",
    "launch-restarts": "scripts/launch.sh --nproc-per-node 8 --max-restarts 3 model=gpt-1.3b",
    "sweep-m": "stabilize-train -m norm=layernorm,rmsnorm norm.eps=1e-6,1e-3",
    "sweep-sh": "scripts/sweep.sh --group eps-sweep --nproc-per-node 2 -- "
    "norm=layernorm,rmsnorm 'norm.eps=choice(1e-6,1e-3)'",
    "report-sweep": "stabilize-report runs/eps-sweep/*",
    "map-mine": "stabilize-map --spec my_map.yaml --dir runs/map-mine --jobs 4 -- model.n_layer=4",
    "map-slurm": "stabilize-map --launcher submitit_slurm -- hydra.launcher.partition=gpu "
    "trainer.devices=8",
    "drift": "stabilize-train fault=activation_drift fault.step=100 fault.target=1e4 "
    "fault.target_step=150 norm=rmsnorm norm.reduction_dtype=fp16 precision=fp16-mixed",
    "repro": "PYTHON=.venv/bin/python scripts/repro_nan.sh",
    "repro-some-arms": "scripts/repro_nan.sh --arms reference,baseline,fp32_reduction "
    "--out runs/mine",
    "repro-seeds": "scripts/repro_nan.sh --seeds 3",
    "repro-natural": "scripts/repro_nan.sh --experiment nan_repro_natural",
    # docs/formats.md: the seed's question in 8 and 4 bits (tests/test_formats_scenario.py)
    "formats-scenario": "scripts/repro_nan.sh --experiment formats --arms reference,"
    "fp8_delayed16,fp8_delayed1024,fp8_current,mxfp8_floor,mxfp8_rceil,nvfp4 --cost-rounds 0",
    "one-arm": "stabilize-train experiment=nan_repro arm=large_eps",
    "nan12k-launch": "scripts/launch.sh --nproc-per-node 8 experiment=nan_at_12000 "
    "arm=baseline data=hub data.name=...",
    "nan12k-repro": "scripts/repro_nan.sh --experiment nan_at_12000 --nproc-per-node 8 -- "
    "data=hub data.name=...",
    "nan12k-2nodes": "scripts/launch.sh --nnodes 2 --nproc-per-node 8 --rdzv-endpoint "
    "node0:29500 --run-id nan12k experiment=nan_at_12000 optim.accumulate_grad_batches=8 "
    "data=hub data.name=...",
    "docker-build": "docker build -t stabilize .",
    "docker-run": "docker run --gpus all --ipc=host -v $PWD/runs:/workspace/stabilize/runs "
    "stabilize",
    "docker-run-8gpu": "docker run --gpus all --ipc=host -v "
    "$PWD/runs:/workspace/stabilize/runs stabilize scripts/launch.sh --nproc-per-node 8 "
    "experiment=nan_at_12000",
    # docs/memory.md
    "plan-1.3b": "stabilize-plan model=gpt-1.3b precision=fp16-mixed data.batch_size=16 "
    "plan.gpu=a100-80gb plan.gpus_per_node=8 rollback.keep=3",
    # docs/operations.md
    "soak": "python scripts/soak.py",
    # docs/rollback.md
    "poisoned-item": "stabilize-train fault=poisoned_item fault.item=117 data.max_chars=20000 "
    "data.batch_size=8 model.block_size=64 trainer.max_steps=8",
    "poisoned-item-replay": "stabilize-replay --data runs/main/*/bundles/step-000006-nonfinite",
    # docs/wandb.md
    "wandb-login": "wandb login",
    "wandb-sync-scenario": "wandb sync runs/nan_repro-*/*/wandb/offline-run-*",
    "wandb-sync-runs": "wandb sync runs/*/*/wandb/offline-run-*",
    "wandb-sync-multirun": "wandb sync multirun/*/*/*/wandb/offline-run-*",
    "wandb-sync-dry": "wandb sync --dry-run runs/*/*/wandb/offline-run-*",
    "report-arms": "stabilize-report runs/nan_repro-*/{baseline,fp32_reduction,bf16,large_eps,"
    "remedy}",
    "report-multirun": "stabilize-report multirun/main/*/*",
    "report-wandb": "stabilize-report --wandb ENTITY/PROJECT --group nan_repro",
    # docs/your-model.md (tests/test_your_model_doc.py)
    "hf-extra": ".venv/bin/pip install -q -e '.[hf]'",
    "replay-mylm": "stabilize-replay --trust-code runs/mylm/bundles/step-000006-nonfinite",
    "bisect-guard": "stabilize-replay --bisect --trust-code "
    "runs/guard/bundles/step-000005-activation",
    "replay-hf-trainer": "stabilize-replay runs/hf/bundles/step-000004-nonfinite",
    "train-hf": "stabilize-train model=hf norm.reduction_dtype=fp16 precision=fp16-mixed "
    "trainer.max_steps=20",
    "bench-your-model": "python scripts/bench_your_model.py --rounds 64",
    "bench-cost-wide": "python scripts/bench_cost.py --configs wide --rounds 24 --threads 1 "
    "--no-parts",
    "bench-cost-tiny": "python scripts/bench_cost.py --configs tiny --rounds 24 --threads 1",
    "bench-guard": "python scripts/bench_guard.py --configs tiny --threads 1 --quads 8 "
    "--set model.d_model=512 model.n_head=8",
    "bench-quant": "python scripts/bench_quant.py --configs tiny --threads 1 --rounds 4 "
    "--block 5 --set model.d_model=512 model.n_head=8",
    "scenario-hf": "scripts/repro_nan.sh --arms reference,baseline --reference-seeds 2 -- "
    "model=hf model.hf.arch=llama",
}

# What cannot run here, and why: these are composed (their Hydra overrides built into a
# RunConfig, their launcher flags checked against the script's), never run.
COMPOSED_ONLY: dict[str, str] = {
    "hub-8gpu": "8 GPUs and a hub download",
    "launch-8gpu": "8 GPUs and a 1.3B model",
    "launch-2nodes": "two nodes",
    "launch-restarts": "8 GPUs and a 1.3B model",
    "map-slurm": "SLURM (its plan is printed: --dry-run)",
    "nan12k-launch": "8 GPUs and a hub dataset",
    "nan12k-repro": "8 GPUs and a hub dataset",
    "nan12k-2nodes": "two nodes and a hub dataset",
    "docker-build": "docker and the NGC base image",
    "docker-run": "docker and GPUs",
    "docker-run-8gpu": "docker and 8 GPUs",
    "wandb-login": "a W&B account",
    "report-wandb": "the W&B API",
    "hf-extra": "an install (the extra's requirement is checked against the installed one)",
}

_BLOCK = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
_COMMENT = re.compile(r"\s+#(\s.*)?$")  # a trailing comment: whitespace, then '#'


def _joined(lines: list[str]) -> list[str]:
    """The block's lines with ``\\`` continuations joined by one space."""
    out: list[str] = []
    held = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1].strip() + " "
            continue
        out.append((held + line.strip()).strip())
        held = ""
    return out


@cache
def shown_commands() -> tuple[tuple[str, int, str], ...]:
    """(file, line of its block, command) for every command the docs show."""
    found = []
    for pattern in DOCS:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text()
            for m in _BLOCK.finditer(text):
                lang, body = m.group(1), m.group(2)
                line = text[: m.start()].count("\n") + 1
                raw = body.splitlines()
                if lang in ("bash", "sh", "shell"):
                    cmds = _joined(raw)
                elif not lang:  # a plain block: only its "$ " prompt lines are commands
                    prompts = [i for i, x in enumerate(raw) if x.startswith("$ ")]
                    cmds = []
                    for i in prompts:
                        j, lines = i, [raw[i][2:]]
                        while lines[-1].rstrip().endswith("\\") and j + 1 < len(raw):
                            j += 1
                            lines.append(raw[j])
                        cmds += _joined(lines)
                else:
                    continue
                for c in cmds:
                    c = _COMMENT.sub("", c).strip() if not c.startswith("#") else ""
                    if c:
                        found.append((str(path.relative_to(ROOT)), line, c))
    return tuple(found)


def doc_command(name: str) -> str:
    """The command registered as ``name``, as the docs show it (fails if they no longer do)."""
    text = COMMANDS[name]
    where = [f"{f}:{n}" for f, n, c in shown_commands() if c == text]
    assert where, f"{name!r}: the docs no longer show {text!r} (update tests/doc_commands.py)"
    return text
