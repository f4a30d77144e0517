"""Spreading the model over the ranks: DDP, or FSDP2 per block (HSDP, streaming to host memory,
LoRA kept resident), gradient-sync control, resharding; and how the model computes there
(autocast, the attention kernel). ranks.py holds the process group this runs on.
"""

import contextlib
import warnings

import torch
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
