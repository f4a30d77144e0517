"""Sequence parallelism (Ulysses): the ranks of an sp group share one sample.

The video tokens are split across the group's ranks at the first transformer block (in order, uneven
lengths allowed: `torch.tensor_split`'s sizes); around self-attention an all-to-all swaps the
sequence split for a head split, so each rank attends over the whole sequence with 1/sp of the
heads, and back; the last block's output is gathered, so the rest of the model and the loss run on
the whole sample on every rank. The families' attention processors call seq_to_heads / heads_to_seq
/ gather (families/cogvideox.py, families/wan.py, families/ltx2.py); the hooks here slice and gather
around the blocks.

Gradients: every collective is the functional all_to_all_single
(torch.distributed._functional_collectives, which dynamo traces into the compiled block;
torch.distributed.nn's raises under dynamo, so each block with an exchange would run eagerly), whose
backward is the exact adjoint (the reverse all-to-all), so the ranks of a group together compute the
gradient of the sum of their sp identical losses: sp times the one-process gradient of the sample.
DDP and FSDP average over all dp x sp ranks, which divides the sp back out: the update is the one of
dp processes, no loss rescaling needed (tests/test_sequence.py holds it to one process).
"""

import inspect

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from config import ConfigError


class SequenceSplit:
    """One rank's place in its sp group: ranks rank // size * size ...

    + size - 1, adjacent so that a group stays inside a node."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a whole sequence, remembering every rank's length.

        The lengths, of the sample now in the blocks, serve the exchanges that follow."""
        slices = x.tensor_split(self.size, dim)
        self.lengths = [s.shape[dim] for s in slices]
        return slices[self.rank]

    def _exchange(self, chunks: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Send chunks[r] to rank r; return what each rank r sent this one, in shapes[r]."""
        sent = torch.cat([c.reshape(-1) for c in chunks])
        sizes = [s.numel() for s in shapes]
        received = all_to_all_single_autograd(sent, sizes, [c.numel() for c in chunks], self.group)
        return [r.view(s) for r, s in zip(received.split(sizes), shapes)]

    def seq_to_heads(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """Exchange a sequence slice with every head for the whole sequence with 1/sp of the heads."""
        chunks = list(x.chunk(self.size, head_dim))
        shapes = [_with(chunks[0].shape, seq_dim, n) for n in self.lengths]
        return torch.cat(self._exchange(chunks, shapes), dim=seq_dim)

    def heads_to_seq(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """The inverse of seq_to_heads."""
        chunks = list(x.split(self.lengths, seq_dim))
        return torch.cat(self._exchange(chunks, [chunks[self.rank].shape] * self.size), dim=head_dim)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Gather every rank's slice of the sequence along dim, on every rank.

        Every rank's slice of the sequence, concatenated along dim, on every rank: an all-gather
        whose backward sums each slice's gradients over the group."""
        return torch.cat(
            self._exchange([x] * self.size, [_with(x.shape, dim, n) for n in self.lengths]), dim=dim
        )

    def heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's 1/sp of the heads of a tensor every rank holds whole.

        CogVideoX's text tokens are such a tensor."""
        return x.chunk(self.size, head_dim)[self.rank]

    def gather_heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The inverse of heads: every rank's heads, on every rank."""
        return torch.cat(self._exchange([x] * self.size, [x.shape] * self.size), dim=head_dim)


def stack_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[3, ...]: Q, K and V for one exchange, in V's dtype.

    Under CUDA's autocast the Q and K norms return fp32 (layer_norm is on its fp32 list) beside a
    bf16 V, and stacking would promote all three to fp32, doubling the exchange's bytes; SDPA casts
    Q and K to bf16 anyway (it is on the lower-precision list), so casting first changes no result.
    """
    return torch.stack([query.to(value.dtype), key.to(value.dtype), value])


def new_split(size: int, rank: int) -> SequenceSplit:
    """This rank's sp group, of adjacent ranks (every rank calls it: it creates every group)."""
    group, _ = dist.new_subgroups(group_size=size)
    return SequenceSplit(group, size, rank % size)


def split_blocks(
    blocks: list[torch.nn.Module],
    split: SequenceSplit,
    per_token_inputs,
    first: tuple[str, ...] = ("hidden_states",),
    gather: bool = True,
) -> None:
    """Hook the blocks so that they run on this rank's slice of the sequence.

    Hooks: the first block's `first` inputs (hidden_states) are sliced along dim 1, and every
    block's other per-token inputs (the model computes them once, whole, and hands them to each
    block) by per_token_inputs(arguments) -> {argument: dim} (a tuple argument: each element); the
    last block's output (its first element if a tuple) is gathered along dim 1, unless `gather` is
    False (the caller gathers where the sequence leaves the blocks: Wan VACE adds a split hint after
    the last block). They stay through activation checkpointing's recomputation, which calls the
    block as a module too; every rank of a group recomputes alike."""
    signature = inspect.signature(blocks[0].forward)

    def before(module, args, kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        if module is blocks[0]:
            for name in first:
                arguments[name] = split.local(arguments[name], 1)
        for name, dim in per_token_inputs(arguments).items():
            value = arguments[name]
            arguments[name] = (
                tuple(split.local(v, dim) for v in value)
                if isinstance(value, tuple)
                else split.local(value, dim)
            )
        return (), arguments

    def after(module, args, output):
        if isinstance(output, tuple):
            return (split.gather(output[0], 1), *output[1:])
        return split.gather(output, 1)

    for block in blocks:
        block.register_forward_pre_hook(before, with_kwargs=True)
    if gather:
        blocks[-1].register_forward_hook(after)


def check_heads(sp_size: int, heads: int, world: int) -> None:
    """parallel.sp_size must divide the head count (each rank attends with 1/sp of the heads)."""
    if heads % sp_size:
        valid = [n for n in range(1, world + 1) if heads % n == 0 and world % n == 0]
        raise ConfigError(
            f"parallel.sp_size = {sp_size} does not divide this model's {heads} attention heads: "
            f"use one of {valid} (the sizes that divide both the heads and the world size {world})"
        )


def _with(shape: torch.Size, dim: int, length: int) -> torch.Size:
    return torch.Size([*shape[:dim], length, *shape[dim + 1 :]])
