"""The LightningModule's data side (``GPTLitModule`` mixes it in): the train and validation
loaders, built once per data position (the corpus is tokenized once) and rebuilt only when a
rollback or a data skip moves the position, the seek after one, the micro-batch at any
position, which a replay's other batches and the held-out checks read, and validation
(``val/loss`` and ``val/bpb``, bits per byte for any tokenizer).

The order of batches is a pure function of (seed, data position) (``StepSampler``), so a
position names its batch; the trainer's own loaders are used wherever they exist (a rebuild
would leave the trainer's train iterator behind).
"""

from __future__ import annotations

import torch

from stabilize.data import bits_per_byte, build_dataloaders, share_skips


class LoaderMixin:
    """Reads ``cfg``, ``train_state``, ``trainer``, ``device``, ``loss`` and ``log`` of the
    LightningModule it is mixed into; holds ``_loader_cache``: (data step, (train loader, val
    loader)) or None, and ``_val_sums`` (nats, bytes) over a validation epoch."""

    _loader_cache = None

    def _loaders(self):
        """Both loaders, built once per data position (the corpus is tokenized once)."""
        if self._loader_cache is not None and self._loader_cache[0] == self.train_state.data_step:
            return self._loader_cache[1]
        t = self.trainer
        loaders = build_dataloaders(
            self.cfg.data,
            self.cfg.model.block_size,
            rank=t.global_rank,
            world_size=t.world_size,
            start_step=self.train_state.data_step,
            num_steps=None,  # unbounded: rollbacks and data skips need more than max_steps
            val_batches=self.cfg.trainer.limit_val_batches,
            tagged=True,
        )
        ts = self.train_state
        share_skips(loaders[0], ts.skipped, ts.skipped_items)  # the same sets: later skips too
        self._loader_cache = (self.train_state.data_step, loaders)
        return loaders

    def train_dataloader(self):
        return self._loaders()[0]

    def seek_data(self, data_step: int) -> None:
        """Make the train loader continue from ``data_step`` (after a rollback or skip)."""
        self.train_state.data_step = self.train_state.next_position(data_step)
        self._loader_cache[1][0].batch_sampler.seek(self.train_state.data_step)

    def train_sampler(self):
        """The trainer's own train batch sampler (``StepSampler``: positions -> items)."""
        return self._loader_cache[1][0].batch_sampler

    def other_batches(self, positions: list[int]) -> tuple[list, list[int]]:
        """The micro-batches at the data positions after ``positions`` (as many, skipped
        ones passed over), and those positions: a re-run's other batches (host.py)."""
        nxt, p = [], positions[-1] + 1
        while len(nxt) < len(positions):
            p = self.train_state.next_position(p)
            nxt.append(p)
            p += 1
        return [self.batch_at(q) for q in nxt], nxt

    def train_dataset(self):
        """The training blocks, untagged (a fault on content reads them)."""
        data = self.train_dataloader().dataset  # the trainer's (cached) loader's
        return getattr(data, "dataset", data)

    def batch_at(self, data_step: int):
        """This rank's (x, y) micro-batch at data position ``data_step``, on the device (a
        replay's other batch: the order is a pure function of the position)."""
        loader = self._loader_cache[1][0]  # the trainer's (a rebuild would leave it behind)
        sampler = loader.batch_sampler  # tagged items: (step, index)
        items = [loader.dataset[(data_step, i)] for i in sampler.batch_for_step(data_step)]
        x, y, _ = loader.collate_fn(items)
        return x.to(self.device), y.to(self.device)

    def val_dataloader(self):
        return self._loaders()[1]

    def held_out_batches(self, n: int) -> list:
        """The first ``n`` validation batches, from the loaders the trainer already iterates
        (never rebuilt here: a rebuild would leave the trainer's train iterator behind)."""
        loaders = self._loader_cache[1] if self._loader_cache is not None else self._loaders()
        out = []
        for batch in loaders[1]:
            if len(out) >= n:
                break
            out.append(batch)
        return out

    # ---- validation ----------------------------------------------------------------------
    def on_validation_epoch_start(self):
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch, z_loss=False)
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        # Bits per byte for any tokenizer: nats summed over the targets, over the UTF-8 bytes
        # of text behind them, both summed over batches and ranks before dividing.
        y = batch[1]
        nbytes = self._loader_cache[1][1].dataset.token_bytes
        nbytes = y.numel() if nbytes is None else nbytes.to(y.device)[y].sum()
        self._val_sums += torch.stack(
            [
                loss.detach().double() * y.numel(),
                torch.as_tensor(nbytes, dtype=torch.float64, device=self.device),
            ]
        )

    def on_validation_epoch_end(self):
        nats, nbytes = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum").tolist()
        if nbytes > 0:
            self.log("val/bpb", bits_per_byte(nats, nbytes), on_step=False, on_epoch=True)
