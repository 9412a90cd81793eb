"""A user's own LightningModule around Hugging Face's GPT2LMHeadModel (issue 36, "Done when"
1): no stabilize import, nothing of ours to define. Importable by path (``your_lm:GPT2LM``),
so that ``stabilize-replay`` can rebuild it in another process.

``poison_token`` >= 0 plants a deterministic fault by content: a hook made in ``__init__``
(so a rebuilt module has it too) turns the embedding's output NaN for any sequence holding
that token.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class GPT2LM(L.LightningModule):
    def __init__(self, n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                 lr=3e-3, poison_token=-1):  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                         n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0)  # fmt: skip
        self.model = GPT2LMHeadModel(cfg)
        if poison_token >= 0:
            self.model.transformer.wte.register_forward_hook(self._poison)

    def _poison(self, module, args, out):
        hit = (args[0] == self.hparams.poison_token).any(-1)  # [B]
        return out.masked_fill(hit[:, None, None], float("nan")) if bool(hit.any()) else out

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def patterned(n: int = 128, t: int = 32, vocab: int = 256, seed: int = 0, poison_at=()):
    """``n`` learnable sequences (each an arithmetic progression mod ``vocab - 1``, so token
    ``vocab - 1`` never occurs), as (inputs, next tokens); sequences ``poison_at`` get one
    token ``vocab - 1``."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - 1, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(t + 1)) % (vocab - 1)
    for i in poison_at:
        seq[i, t // 2] = vocab - 1
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def loader(**kw) -> DataLoader:
    return DataLoader(patterned(**kw), batch_size=8, shuffle=False)


def nan_once(at: int, where: tuple[int, int, int] = (0, 0, 0)):
    """A forward hook for a residual block: one NaN in its output at its ``at``-th training
    forward (the step of that number, with no accumulation), never again (a transient
    fault: a re-run does not meet it). A tuple output (transformers 4) keeps its tail."""
    forwards = []

    def hook(block, args, out):
        if not block.training:
            return None
        forwards.append(1)
        if len(forwards) != at:
            return None
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[where] = float("nan")
        return (h, *out[1:]) if isinstance(out, tuple) else h

    return hook
