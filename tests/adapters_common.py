"""One model, one data set, three loops: the stability engine driven by its three adapters
(``StabilityCallback`` in a Lightning Trainer, ``Guard`` in a plain loop,
``HFStabilityCallback`` in a ``transformers.Trainer``), so that tests/test_adapters.py holds
them to one behaviour. The model is Hugging Face's LlamaForCausalLM from a config
(your_llama.py); a batch is ``{"input_ids", "labels"}`` and the loss is the model's own.
Importable by path (``adapters_common:LlamaLit``, ``adapters_common:hf_loss``,
``adapters_common:build``) for the replay in a fresh process."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from your_llama import build as _build

import stabilize

ADAPTERS = ("lightning", "guard", "hf")
BATCH, SEQ = 8, 32


def build(reduction: str = "fp32"):
    return _build(reduction)


def hf_loss(model, batch):
    return model(**batch).loss


def rows(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences a model can learn (arithmetic runs), one dict each."""
    g = torch.Generator().manual_seed(seed)
    seq = (torch.randint(0, 200, (n, 1), generator=g) + torch.arange(SEQ)) % 255
    return [{"input_ids": s, "labels": s.clone()} for s in seq]


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    r = rows(n * BATCH, seed)
    return [{k: torch.stack([x[k] for x in r[i : i + BATCH]]) for k in r[0]}
            for i in range(0, len(r), BATCH)]  # fmt: skip


class LlamaLit(L.LightningModule):
    def __init__(self, reduction: str = "fp32", lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = build(reduction)

    def training_step(self, batch, i):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


@dataclass
class Ran:
    run_dir: Path
    model: torch.nn.Module
    model_step: int
    loop_steps: int  # the loop's own count (Lightning's global_step, HF's global_step)
    console: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def run(kind: str, run_dir: Path, steps: int, *, accumulate: int = 1, reduction="fp32",
        hook=None, **settings) -> Ran:  # fmt: skip
    """``steps`` optimizer steps of the tiny Llama under adapter ``kind``; ``hook(model)``
    plants something on the model before training; ``settings``: monitor / rollback /
    fault groups. Lightning and the Guard go on to ``steps`` model steps; the Hugging Face
    Trainer counts its own (``steps``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ran = {"lightning": _lightning, "guard": _guard, "hf": _hf}[kind](
            run_dir, steps, accumulate, reduction, hook, settings
        )
    ran.console = out.getvalue()
    return ran


def _lightning(run_dir, steps, accumulate, reduction, hook, settings) -> Ran:
    torch.manual_seed(0)
    module = LlamaLit(reduction)
    if hook:
        hook(module.model)
    cb = stabilize.StabilityCallback(run_dir=run_dir, **settings)
    data = torch.utils.data.DataLoader(rows(BATCH * accumulate * (steps + 8)), batch_size=BATCH)
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[cb],
                        logger=L.pytorch.loggers.CSVLogger(run_dir, name="csv", version=0),
                        log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, data)
    return Ran(run_dir, module.model, cb.host.train_state.model_step, trainer.global_step)


def _guard(run_dir, steps, accumulate, reduction, hook, settings) -> Ran:
    torch.manual_seed(0)
    model = build(reduction)
    if hook:
        hook(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(model, opt, run_dir=run_dir, loss_fn=hf_loss,
                            factory="adapters_common:build", log_every=1, **settings)  # fmt: skip
    losses, taken = [], 0
    for batch in guard.batches(batches(accumulate * (steps + 8))):
        loss = hf_loss(model, batch)
        (loss / accumulate).backward()
        losses.append(loss)
        if len(losses) < accumulate:
            continue
        if guard.before_step(losses).apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses, taken = [], taken + 1
        if guard.model_step == steps:
            break
    guard.close()
    return Ran(run_dir, model, guard.model_step, taken)


def _hf(run_dir, steps, accumulate, reduction, hook, settings) -> Ran:
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build(reduction)
    if hook:
        hook(model)
    args = TrainingArguments(output_dir=str(run_dir / "hf"), max_steps=steps,
                             per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=accumulate, learning_rate=1e-3,
                             lr_scheduler_type="constant", max_grad_norm=0.0,
                             logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True,
                             seed=0)  # fmt: skip
    cb = stabilize.HFStabilityCallback(run_dir=run_dir, **settings)
    trainer = Trainer(model=model, args=args, train_dataset=rows(BATCH * accumulate * steps),
                      callbacks=[cb])  # fmt: skip
    trainer.train()
    return Ran(run_dir, model, cb.model_step, trainer.state.global_step)
