"""The sampler: which clips each optimizer step trains on, the same for any number of ranks.

Global batches of clips from one bucket each, in an order keyed by (run.seed, epoch), and each rank's
positions in a global batch per micro-step (docs/training.md, Steps and batches). Its state is two
counters, so a resume continues the same sequence bitwise.
"""

import torch

from config import ConfigError
from data import keyed_generator


class Sampler:
    """Global batches of G clip indices, each from one bucket. For each (seed, epoch): one keyed
    permutation within each bucket, cut into global batches of G with the tails dropped, then the
    batches of all buckets in one keyed order. State: (epoch, global batches consumed in this
    epoch)."""

    def __init__(self, buckets: list[int], global_batch: int, seed: int):
        self.members: dict[int, list[int]] = {}
        for index, bucket in enumerate(buckets):
            self.members.setdefault(bucket, []).append(index)
        if all(len(m) < global_batch for m in self.members.values()):
            sizes = {b: len(m) for b, m in sorted(self.members.items())}
            raise ConfigError(
                f"no bucket holds a full global batch of {global_batch} (train.batch_size x "
                f"train.gradient_accumulation_steps x world size); clips per bucket: {sizes}: lower it or add clips"
            )
        self.global_batch, self.seed = global_batch, seed
        self.epoch, self.consumed = 0, 0
        self._batches: tuple[int, list[list[int]]] = (-1, [])

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._batches[0] != epoch:
            batches, g = [], self.global_batch
            for bucket, members in sorted(self.members.items()):
                order = torch.randperm(
                    len(members), generator=keyed_generator(self.seed, "epoch", epoch, bucket)
                )
                shuffled = [members[i] for i in order.tolist()]
                batches += [shuffled[i * g : (i + 1) * g] for i in range(len(shuffled) // g)]
            order = torch.randperm(
                len(batches), generator=keyed_generator(self.seed, "epoch", epoch, "batches")
            )
            self._batches = (epoch, [batches[i] for i in order.tolist()])
        return self._batches[1]

    def next_batch(self) -> list[int]:
        self.epoch, self.consumed = self._after()
        return self._epoch_batches(self.epoch)[self.consumed - 1]

    def peek(self) -> list[int]:
        """The batch next_batch returns next, not taken: the state a checkpoint holds stays as it
        is."""
        epoch, consumed = self._after()
        return self._epoch_batches(epoch)[consumed - 1]

    def _after(self) -> tuple[int, int]:
        """(epoch, consumed) once the next batch is taken."""
        if self.consumed == len(self._epoch_batches(self.epoch)):
            return self.epoch + 1, 1
        return self.epoch, self.consumed + 1

    def state_dict(self) -> dict:
        return {
            "epoch": torch.tensor(self.epoch),
            "consumed": torch.tensor(self.consumed),
            "global_batch": torch.tensor(self.global_batch),
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ConfigError(
                f"the checkpoint was trained with global batch {int(state['global_batch'])}, this run has "
                f"{self.global_batch}: keep train.batch_size x train.gradient_accumulation_steps x world size equal"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def micro_slice(micro: int, rank: int, world: int, batch_size: int) -> range:
    """Positions in the global batch that this rank uses in this micro-step (docs/training.md, Steps
    and batches)."""
    start = (micro * world + rank) * batch_size
    return range(start, start + batch_size)
