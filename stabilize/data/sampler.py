"""The step-indexed sample order: the batch of every micro-step is a pure function of
(seed, step).

Why: rollback rewinds to a snapshot and may skip the data that caused a fault, and a
restart must resume mid-epoch. Both are exact when the order needs no state, so no sampler
state has to be checkpointed. No Lightning or torch.distributed: rank and world_size are
passed in by the caller.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

from stabilize.data.config import check_int
from stabilize.validate import check_positive


def epoch_permutation(n_items: int, seed: int, epoch: int) -> torch.Tensor:
    """torch.randperm(n_items) from a generator seeded by (seed, epoch).

    SeedSequence mixes the pair, so (seed, epoch + 1) and (seed + 1, epoch) share nothing,
    unlike seed + epoch.
    """
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)
    g = torch.Generator().manual_seed(int(state[0]))
    return torch.randperm(n_items, generator=g)


class StepSampler(Sampler[list[int]]):
    """A batch sampler whose batch at each micro-step is a pure function of (seed, step).

    Slot j of rank r at micro-step s is the global position p = (s*W + r)*B + j, and the
    item is epoch_permutation(seed, p // n)[p % n]. The global sequence does not depend on
    how it is cut into ranks and batches; resuming (start_step), replaying or skipping ahead
    needs no state; ranks are disjoint within a global step, except in the one step per epoch
    that straddles the boundary, where an item may repeat across the two epochs' parts.
    """

    def __init__(
        self,
        n_items: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        *,
        num_steps: int | None,
        tagged: bool = False,
    ) -> None:
        check_positive("n_items", n_items, integer=True)
        check_positive("data.batch_size", batch_size, integer=True)
        check_int("data.seed", seed)
        check_positive("world_size", world_size, integer=True)
        check_int("rank", rank, 0, world_size - 1)
        if num_steps is not None:
            check_int("num_steps", num_steps)
        check_int("start_step", start_step, 0, num_steps)
        self.n_items, self.batch_size, self.seed = n_items, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.start_step, self.num_steps = start_step, num_steps
        self.position = start_step  # the next step to yield; seek() moves it
        self.tagged = tagged
        self.skip: set[int] = set()  # steps never yielded (a data-linked fault's batches)
        # items never yielded (a data-linked fault's sequences, by index -> content hash):
        # each is replaced by the next item in corpus order that is not skipped
        self.skip_items: dict[int, str] = {}
        self._perms: dict[int, torch.Tensor] = {}  # at most the two epochs a batch can span

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = epoch_permutation(self.n_items, self.seed, epoch)
        return self._perms[epoch]

    def batch_for_step(self, step: int, rank: int | None = None) -> list[int]:
        """The items of ``rank``'s batch (default: this sampler's rank) at ``step``."""
        check_int("step", step)
        rank = self.rank if rank is None else rank
        p = (step * self.world_size + rank) * self.batch_size
        end, out = p + self.batch_size, []
        while p < end:  # one slice per epoch the batch touches
            epoch, i = divmod(p, self.n_items)
            take = min(end - p, self.n_items - i)
            out.extend(self._perm(epoch)[i : i + take].tolist())
            p += take
        return [self.substitute(i) for i in out] if self.skip_items else out

    def substitute(self, item: int) -> int:
        """``item``, or the next item in corpus order (wrapping) that is not skipped: the
        batch keeps its size and the order stays a pure function of (seed, step)."""
        if len(self.skip_items) >= self.n_items:
            raise ValueError(f"every one of the {self.n_items} items is skipped")
        while item in self.skip_items:
            item = (item + 1) % self.n_items
        return item

    def seek(self, step: int) -> None:
        """Continue from ``step`` (a rollback rewinds here, a data skip jumps ahead)."""
        check_int("step", step)
        self.position = step

    def __iter__(self):
        # The position is re-read for every batch, so seek() takes effect mid-iteration.
        # Tagged batches carry their step: a batch fetched ahead before a seek is stale, and
        # the consumer can tell (Lightning prefetches one batch).
        while self.num_steps is None or self.position < self.num_steps:
            if self.position in self.skip:
                self.position += 1
                continue
            step = self.position
            self.position += 1
            batch = self.batch_for_step(step)
            yield [(step, i) for i in batch] if self.tagged else batch

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("an unbounded StepSampler (num_steps=None) has no length")
        return self.num_steps - self.start_step
