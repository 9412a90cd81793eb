"""The Hugging Face arms of scripts/bench_cost.py: a ``transformers.Trainer`` stepped like the
other arms' generators, with and without ``HFStabilityCallback``.

``Trainer.train()`` is a loop that does not return until it is done, so it runs on a thread
of its own and hands a baton back at the end of every optimizer step (``on_step_end``):
``next()`` lets it take one step and waits for it. Only one arm runs at a time (the baton),
so the thread changes nothing but who drives; torch's kernels run on the same intra-op
threads. The model is transformers' ``LlamaForCausalLM`` at the run's width, depth, heads,
context and vocabulary (our GPT's own shape: a Trainer cannot train it), on the run's batch
size, learning rate and clipping, data from a seeded generator. Its bare twin is the same
Trainer without the callback: the adapter's cost is measured against its own loop.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch


class _Baton:
    """The thread's side: wait for a turn, take one step, hand the turn back."""

    def __init__(self):
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.error: BaseException | None = None
        self.finished = False


def _callback(baton: _Baton):
    from transformers import TrainerCallback

    class Handover(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            baton.go.acquire()  # the first step waits for its turn

        def on_step_end(self, args, state, control, **kwargs):
            baton.done.release()
            baton.go.acquire()

    return Handover()


def _rows(n: int, length: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n, length), generator=g)
    return [{"input_ids": s, "labels": s.clone()} for s in seq]


def hf_steps(cfg, run_dir: Path, with_callback: bool, steps: int):
    """An iterator: each ``next()`` is one optimizer step of a ``transformers.Trainer`` on a
    Llama of ``cfg.model``'s shape (``with_callback``: under ``HFStabilityCallback`` with
    the run's monitor and rollback settings); yields a 0-d tensor (the loss is the
    Trainer's)."""
    import transformers

    import stabilize

    m, o = cfg.model, cfg.optim
    torch.manual_seed(cfg.seed)
    llama = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=4 * m.d_model,
        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
        max_position_embeddings=m.block_size, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(llama)
    args = transformers.TrainingArguments(
        output_dir=str(run_dir / "hf"), max_steps=steps, learning_rate=o.lr,
        per_device_train_batch_size=cfg.data.batch_size, max_grad_norm=o.grad_clip,
        weight_decay=o.weight_decay, adam_beta1=o.beta1, adam_beta2=o.beta2, logging_steps=10,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=cfg.seed,
    )  # fmt: skip
    baton = _Baton()
    callbacks = [_callback(baton)]
    if with_callback:
        callbacks.insert(0, stabilize.HFStabilityCallback(
            run_dir=run_dir, monitor=cfg.monitor, rollback=cfg.rollback))  # fmt: skip
    data = _rows(steps * cfg.data.batch_size, m.block_size, m.vocab_size, cfg.seed)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=callbacks)  # fmt: skip

    def train():
        try:
            trainer.train()
        except BaseException as e:  # noqa: BLE001  (raised again by next(), on the driver)
            baton.error = e
        baton.finished = True
        baton.done.release()

    threading.Thread(target=train, name="bench-hf-trainer", daemon=True).start()
    zero = torch.zeros(())
    while True:
        baton.go.release()
        baton.done.acquire()
        if baton.error is not None:
            raise baton.error
        if baton.finished:
            return
        yield zero
