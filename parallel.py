"""Spreading the work over the ranks: DDP, FSDP2 (HSDP, streaming) and Ulysses sequence parallelism.

The model over the ranks: DDP, or FSDP2 per block (HSDP, streaming to host memory,
LoRA kept resident), gradient-sync control, resharding; and how the model computes there
(autocast, the attention kernel); then the sample over the ranks of a sequence-parallel group.
ranks.py holds the process group this runs on.
"""

import contextlib
import inspect
import warnings

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from config import ConfigError, ParallelConfig
from ranks import Dist

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


ATTENTION_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


class Compute:
    """Entered around every transformer call (training's forward, the held-out loss, sampling):
    autocast in train.mixed_precision, and SDPA held to train.attention_backend ("" leaves SDPA its
    choice)."""

    def __init__(self, device: torch.device, mixed_precision: str, attention_backend: str):
        self.autocast = torch.autocast(
            device.type, dtype=AUTOCAST_DTYPES[mixed_precision], enabled=mixed_precision != "no"
        )
        self.backend = attention_backend

    def attention(self):
        """The attention backend alone; training's backward runs inside it too, because activation
        checkpointing recomputes the forward there, and with another kernel the recompute would save
        other tensors than the forward did."""
        return sdpa_kernel(ATTENTION_BACKENDS[self.backend]) if self.backend else contextlib.nullcontext()

    def __enter__(self):
        self.entered = contextlib.ExitStack()
        self.entered.enter_context(self.autocast)
        self.entered.enter_context(self.attention())

    def __exit__(self, *exc_info):
        return self.entered.__exit__(*exc_info)


def wrap(
    model: torch.nn.Module,
    blocks: list[torch.nn.Module],
    cfg: ParallelConfig,
    mixed_precision: str,
    accumulation: int,
    d: Dist,
    compute_dtype_params: frozenset[str] = frozenset(),
    resident: frozenset[str] = frozenset(),
    graph_varies: bool = False,
):
    """Spread the model over the ranks: DDP, or FSDP2 over each block and then the root.

    DDP (none for one process), or FSDP2: fully_shard each block, then the root; one process too
    (a 1-rank mesh), which is what streaming needs.

    FSDP gathers every parameter in its own dtype (the frozen base in model.dtype, LoRA and the
    family's fp32 modules in fp32), with no cast of the blocks' inputs, and reduces gradients in
    fp32: autocast then computes exactly what it computes under DDP. A policy's param_dtype, or its
    default input cast, would round the fp32 modules (Wan's scale_shift_table, time_embedder, norms)
    and the rotary tables to bf16: another model than DDP's and the pipeline's.
    `compute_dtype_params` (names) are gathered in the autocast dtype instead: sft's fp32 weights,
    which autocast casts anyway, at half the traffic; where a unit also holds fp32 modules, its
    largest submodules without any are sharded apart with that policy and the fp32 rest keeps the
    unit's own.

    Streaming (parallel.cpu_offload): the units of `streamed` keep their shards in pinned host
    memory; FSDP2 copies a unit's shards to the GPU on its all-gather streams just before the unit
    runs, and frees them after (reshard_after_forward), in the forward and again in the backward.
    Each unit prefetches the next one's (the root block 0's) as it starts, so a copy overlaps the
    compute before it; the backward prefetches in reverse by FSDP2's own order. `resident` (names:
    LoRA's weights) stay on the GPU in a unit of their own within their block's, with their
    gradients and AdamW state: sft passes none, and FSDP2 offloads its gradients and AdamW state
    with the weights (AdamW steps on the CPU)."""
    if cfg.strategy == "ddp" and d.world == 1:
        return model  # nothing to replicate: DDP's hooks would only cost time
    if cfg.strategy == "ddp":
        # static_graph lets DDP skip per-step graph checks, but with no_sync micro-steps it trips
        # the reducer's internal assertions on torch 2.13: only without accumulation, and only where
        # every step gives the same weights a gradient (graph_varies: DDP finds those without one).
        # No buffer changes in training (no batch norm), so re-broadcasting them every forward would
        # only cost time: 260 MiB for CogVideoX-2B's float64 positions.
        device_ids = [d.device.index] if d.device.type == "cuda" else None
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            gradient_as_bucket_view=True,
            static_graph=accumulation == 1 and not graph_varies,
            find_unused_parameters=graph_varies,
            broadcast_buffers=False,
        )
    if cfg.dp_replicate > 1:
        mesh = init_device_mesh(
            d.device.type,
            (cfg.dp_replicate, d.world // cfg.dp_replicate),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(d.device.type, (d.world,))
    own = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    compute = MixedPrecisionPolicy(
        param_dtype=AUTOCAST_DTYPES[mixed_precision], reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    # Pinned host memory lets the copies to and from the GPU overlap compute; a CPU-only torch has
    # none.
    host = CPUOffloadPolicy(pin_memory=d.device.type == "cuda")
    options = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    cast = {id(p) for name, p in model.named_parameters() if name in compute_dtype_params}
    kept = {id(p) for name, p in model.named_parameters() if name in resident}
    on_host = streamed(model, blocks, cfg)
    # fully_shard replaces a unit's parameters: each is read before its own
    for unit in [*blocks, model]:
        offload = host if any(unit is u for u in on_host) else OffloadPolicy()
        groups = _groups(unit, cast, blocks)
        if groups == [unit]:
            fully_shard(unit, mp_policy=compute, offload_policy=offload, **options)
            continue
        if groups:
            fully_shard(groups, mp_policy=compute, offload_policy=offload, **options)
        if offload is host and (on_device := _groups(unit, kept, blocks)):
            fully_shard(on_device, mp_policy=own, **options)
        fully_shard(unit, mp_policy=own, offload_policy=offload, **options)
    if cfg.cpu_offload:
        for unit, following in zip([model, *blocks], blocks):
            unit.set_modules_to_forward_prefetch([following])
    # diffusers' transformers return a view (the unpatchified output's reshape), and FSDP2 warns
    # that an in-place op on it would skip its pre-backward hook: every op on the output here is out
    # of place.
    warnings.filterwarnings(
        "ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning
    )
    return model


def streamed(
    model: torch.nn.Module, blocks: list[torch.nn.Module], cfg: ParallelConfig
) -> list[torch.nn.Module]:
    """The units whose weights parallel.cpu_offload keeps in host memory: with offload_blocks = N
    the first N blocks, else every block and the root. The first, not the last: the forward's first
    copy can hide behind the root's embeddings (the root prefetches block 0), and the backward,
    which starts from the last block the moment the forward ends, finds it resident; each later
    offloaded block's copy hides behind the block computed before it, in either direction."""
    if not cfg.cpu_offload:
        return []
    return blocks[: cfg.offload_blocks] if cfg.offload_blocks else [*blocks, model]


def check_offload_blocks(cfg: ParallelConfig, num_blocks: int) -> None:
    """parallel.offload_blocks against the model's blocks (Adapter.block_count: Wan VACE's context
    blocks count with the base blocks)."""
    if cfg.offload_blocks > num_blocks:
        raise ConfigError(
            f"parallel.offload_blocks = {cfg.offload_blocks}, but the model has {num_blocks} transformer "
            f"blocks: set at most {num_blocks} (0 streams every block and the rest of the model)"
        )


def offloaded(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that FSDP keeps in host memory (parallel.cpu_offload), read from
    FSDP2's own record of each unit's policy (FSDPParam.offload_to_cpu; torch 2.13 has no public
    accessor): the lean loader allocates their shards there, the others' on the device."""
    return {
        id(p.sharded_param)
        for module in model.modules()
        if isinstance(module, FSDPModule)
        if (group := module._get_fsdp_state()._fsdp_param_group) is not None
        for p in group.fsdp_params
        if p.offload_to_cpu
    }


def _groups(
    module: torch.nn.Module, chosen: set[int], blocks: list[torch.nn.Module]
) -> list[torch.nn.Module]:
    """The largest submodules of `module` (itself included) whose parameters outside the blocks are
    all `chosen` (ids): sharded apart with their own policy."""

    def outside_blocks(m):
        yield from m.parameters(recurse=False)
        for child in m.children():
            if not any(child is block for block in blocks):
                yield from outside_blocks(child)

    params = list(outside_blocks(module))
    if params and all(id(p) in chosen for p in params):
        return [module]
    return [
        group
        for child in module.children()
        if not any(child is block for block in blocks)
        for group in _groups(child, chosen, blocks)
    ]


def reshard(model: torch.nn.Module) -> None:
    """Free FSDP's gathered weights, so the next forward gathers the sharded ones afresh (a no-op
    without FSDP, or when they are already freed)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce on non-final micro-steps."""
    if isinstance(model, DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:  # one process without FSDP: there is nothing to synchronise
        yield


# --------------------------------------------------------------------------------------------------
# Sequence parallelism (Ulysses): the ranks of an sp group share one sample.
#
# The video tokens are split across the group's ranks at the first transformer block (in order, uneven
# lengths allowed: `torch.tensor_split`'s sizes); around self-attention an all-to-all swaps the
# sequence split for a head split, so each rank attends over the whole sequence with 1/sp of the
# heads, and back; the last block's output is gathered, so the rest of the model and the loss run on
# the whole sample on every rank. The families' attention processors call seq_to_heads / heads_to_seq
# / gather (families/cogvideox.py, families/wan.py, families/ltx2.py); the hooks here slice and gather
# around the blocks.
#
# Gradients: every collective is the functional all_to_all_single
# (torch.distributed._functional_collectives, which dynamo traces into the compiled block;
# torch.distributed.nn's raises under dynamo, so each block with an exchange would run eagerly), whose
# backward is the exact adjoint (the reverse all-to-all), so the ranks of a group together compute the
# gradient of the sum of their sp identical losses: sp times the one-process gradient of the sample.
# DDP and FSDP average over all dp x sp ranks, which divides the sp back out: the update is the one of
# dp processes, no loss rescaling needed (tests/test_sequence.py holds it to one process).


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
