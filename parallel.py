"""Process group, device, DDP / FSDP2 wrapping, gradient-sync control, cross-rank agreement on errors,
preemption (command.py is the frame every command runs in).

Every run has a process group, one process included (a HashStore, so it needs no free port): the
code path is the same on one CPU and on many GPU nodes.
"""

import contextlib
import datetime
import logging
import os
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from config import ConfigError, ParallelConfig

log = logging.getLogger("vidtrain")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}
# Torch's caching allocators, set by init before the first CUDA allocation, under every launch (launch.sh,
# torchrun, python); a key the user's PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) names keeps theirs.
# expandable_segments: segments that grow in place, as video shapes vary by bucket and fixed-size segments
# fragment. The pinned keys: torch 2.13's host allocator (aten/src/ATen/core/CachingHostAllocator.h,
# CachingHostAllocatorImpl::allocate) rounds a request up to a power of two unless it is above
# pinned_max_round_threshold_mb or pinned_max_cached_size_mb (default: never), and FSDP2 pins each streamed
# parameter on its own: a Wan 14B block took 1.53x its bytes. Both keys, at the same size: a block kept
# unrounded in the cache would sit in its power of two's free list, which hands out any block it holds
# (get_free_block checks no size). Above PINNED_EXACT_MB a request gets its exact size and, freed, goes back
# to the system; the smaller ones (a step's batch) keep the rounding and the cache.
PINNED_EXACT_MB = 16
ALLOCATOR_SETTINGS = {"expandable_segments": "True", "pinned_max_round_threshold_mb": str(PINNED_EXACT_MB),
                      "pinned_max_cached_size_mb": str(PINNED_EXACT_MB)}


def allocator_settings(user: str) -> str:
    """The user's allocator settings with those of ALLOCATOR_SETTINGS whose keys they do not name; the two
    pinned keys go together (one without the other would cache unrounded blocks, above)."""
    named = {item.split(":")[0].strip() for item in user.split(",")}
    if named & {"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}:
        named |= {"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}
    ours = [f"{key}:{value}" for key, value in ALLOCATOR_SETTINGS.items() if key not in named]
    return ",".join([user] * bool(user.strip()) + ours)


def pinned_bytes(nbytes: int) -> int:
    """The bytes torch's pinned allocator hands out for a request of nbytes under ALLOCATOR_SETTINGS."""
    if nbytes == 0 or nbytes > PINNED_EXACT_MB * 2**20:
        return nbytes
    return 1 << (nbytes - 1).bit_length()  # c10::llvm::PowerOf2Ceil


class StopRun(Exception):
    """Raised on every rank when any rank failed; the message is the failing rank's."""


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    sp: int = 1  # parallel.sp_size: adjacent ranks rank // sp * sp ... share one sample

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: which samples of the global batch this rank (and its sp group) takes."""
        return self.rank // self.sp

    @property
    def dp_world(self) -> int:
        return self.world // self.sp


def init(cfg: ParallelConfig) -> Dist:
    """Device from LOCAL_RANK before the process group; nccl for CUDA tensors, gloo for CPU ones."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if torch.cuda.is_available():
        settings = allocator_settings(torch._C._accelerator_getAllocatorSettings())
        torch._C._accelerator_setAllocatorSettings(settings)  # torch read PYTORCH_ALLOC_CONF at import
        log.info("allocator settings: %s", settings)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if world % cfg.dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {cfg.dp_replicate} must divide the world size {world}")
    if world % cfg.sp_size:
        raise ConfigError(f"parallel.sp_size = {cfg.sp_size} must divide the world size {world}")
    return Dist(rank, world, local_rank, device, cfg.sp_size)


def make_deterministic() -> None:
    """Before any CUDA work: cuBLAS needs its workspace setting before its first handle.

    Attention keeps its fused kernels: under torch.use_deterministic_algorithms(True) (warn_only off)
    torch's own kernels switch to deterministic backward passes. FlashAttention-2's backward gets
    `deterministic = true` from globalContext().deterministicAlgorithms() (aten/src/ATen/native/
    transformers/cuda/attention_backward.cu, _flash_attention_backward: dQ accumulated per split, no
    atomics), memory-efficient attention's backward forces num_splits_key = 1 (same file,
    _efficient_attention_backward), and SDPA never picks cuDNN attention (sdp_utils.cpp,
    check_cudnn_deterministic); pytorch/pytorch#182551 measured the three on CUDA.
    Turning flash off instead would leave the math backend, whose fp32 score matrix alone is 56.5 GiB for
    CogVideoX-5B at 49x480x720 (48 heads x 17776^2 x 4 bytes): out of memory on any card."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


ATTENTION_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                      "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


class Compute:
    """Entered around every transformer call (training's forward, the held-out loss, sampling): autocast
    in train.mixed_precision, and SDPA held to train.attention_backend ("" leaves SDPA its choice)."""

    def __init__(self, device: torch.device, mixed_precision: str, attention_backend: str):
        self.autocast = torch.autocast(device.type, dtype=AUTOCAST_DTYPES[mixed_precision],
                                       enabled=mixed_precision != "no")
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


@contextlib.contextmanager
def all_or_none():
    """Run a block on every rank; if it raised on any rank, raise StopRun on all of them with the
    lowest failing rank's message, so no rank waits for a collective that will never come."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{error}")
    failed = [m for m in messages if m is not None]
    if failed:
        raise StopRun(failed[0]) from error


def broadcast(value, d: Dist):
    """Rank 0's value on every rank (a picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(work, d: Dist) -> list:
    """Run `work` on this rank and gather every rank's result: all_or_none for work whose results every
    rank needs. A failure on any rank travels inside the gathered payload."""
    try:
        result, failure = work(), None
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        result, failure = None, f"rank {d.rank}: {type(e).__name__}: {e}"
    gathered = [None] * d.world
    dist.all_gather_object(gathered, (result, failure))
    failures = [f for _, f in gathered if f is not None]
    if failures:
        raise StopRun(failures[0])
    return [r for r, _ in gathered]


def wrap(model: torch.nn.Module, blocks: list[torch.nn.Module], cfg: ParallelConfig, mixed_precision: str,
         accumulation: int, d: Dist, compute_dtype_params: frozenset[str] = frozenset(),
         resident: frozenset[str] = frozenset(), graph_varies: bool = False):
    """DDP (none for one process), or FSDP2: fully_shard each block, then the root; one process too (a
    1-rank mesh), which is what streaming needs.

    FSDP gathers every parameter in its own dtype (the frozen base in model.dtype, LoRA and the family's
    fp32 modules in fp32), with no cast of the blocks' inputs, and reduces gradients in fp32: autocast
    then computes exactly what it computes under DDP. A policy's param_dtype, or its default input
    cast, would round the fp32 modules (Wan's scale_shift_table, time_embedder, norms) and the rotary
    tables to bf16: another model than DDP's and the pipeline's. `compute_dtype_params` (names) are
    gathered in the autocast dtype instead: sft's fp32 weights, which autocast casts anyway, at half the
    traffic; where a unit also holds fp32 modules, its largest submodules without any are sharded apart
    with that policy and the fp32 rest keeps the unit's own.

    Streaming (parallel.cpu_offload): the units of `streamed` keep their shards in pinned host memory;
    FSDP2 copies a unit's shards to the GPU on its all-gather streams just before the unit runs, and
    frees them after (reshard_after_forward), in the forward and again in the backward. Each unit
    prefetches the next one's (the root block 0's) as it starts, so a copy overlaps the compute before
    it; the backward prefetches in reverse by FSDP2's own order. `resident` (names: LoRA's weights) stay
    on the GPU in a unit of their own within their block's, with their gradients and AdamW state: sft
    passes none, and FSDP2 offloads its gradients and AdamW state with the weights (AdamW steps on the CPU)."""
    if cfg.strategy == "ddp" and d.world == 1:
        return model  # nothing to replicate: DDP's hooks would only cost time
    if cfg.strategy == "ddp":
        # static_graph lets DDP skip per-step graph checks, but with no_sync micro-steps it trips the
        # reducer's internal assertions on torch 2.13: only without accumulation, and only where every step
        # gives the same weights a gradient (graph_varies: DDP finds those without one). No buffer changes in
        # training (no batch norm), so re-broadcasting them every forward would only cost time: 260 MiB
        # for CogVideoX-2B's float64 positions.
        device_ids = [d.device.index] if d.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                       static_graph=accumulation == 1 and not graph_varies,
                                       find_unused_parameters=graph_varies, broadcast_buffers=False)
    if cfg.dp_replicate > 1:
        mesh = init_device_mesh(d.device.type, (cfg.dp_replicate, d.world // cfg.dp_replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(d.device.type, (d.world,))
    own = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    compute = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[mixed_precision], reduce_dtype=torch.float32,
                                   cast_forward_inputs=False)
    # Pinned host memory lets the copies to and from the GPU overlap compute; a CPU-only torch has none.
    host = CPUOffloadPolicy(pin_memory=d.device.type == "cuda")
    options = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    cast = {id(p) for name, p in model.named_parameters() if name in compute_dtype_params}
    kept = {id(p) for name, p in model.named_parameters() if name in resident}
    on_host = streamed(model, blocks, cfg)
    for unit in [*blocks, model]:  # fully_shard replaces a unit's parameters: each is read before its own
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
    # diffusers' transformers return a view (the unpatchified output's reshape), and FSDP2 warns that an
    # in-place op on it would skip its pre-backward hook: every op on the output here is out of place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    return model


def streamed(model: torch.nn.Module, blocks: list[torch.nn.Module], cfg: ParallelConfig) -> list[torch.nn.Module]:
    """The units whose weights parallel.cpu_offload keeps in host memory: with offload_blocks = N the first
    N blocks, else every block and the root. The first, not the last: the forward's first copy can hide
    behind the root's embeddings (the root prefetches block 0), and the backward, which starts from the
    last block the moment the forward ends, finds it resident; each later offloaded block's copy hides
    behind the block computed before it, in either direction."""
    if not cfg.cpu_offload:
        return []
    return blocks[:cfg.offload_blocks] if cfg.offload_blocks else [*blocks, model]


def check_offload_blocks(cfg: ParallelConfig, num_blocks: int) -> None:
    """parallel.offload_blocks against the model's blocks (its config's num_layers)."""
    if cfg.offload_blocks > num_blocks:
        raise ConfigError(f"parallel.offload_blocks = {cfg.offload_blocks}, but the model has {num_blocks} transformer "
                          f"blocks: set at most {num_blocks} (0 streams every block and the rest of the model)")


def offloaded(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that FSDP keeps in host memory (parallel.cpu_offload), read from FSDP2's own
    record of each unit's policy (FSDPParam.offload_to_cpu; torch 2.13 has no public accessor): the lean
    loader allocates their shards there, the others' on the device."""
    return {id(p.sharded_param) for module in model.modules() if isinstance(module, FSDPModule)
            if (group := module._get_fsdp_state()._fsdp_param_group) is not None
            for p in group.fsdp_params if p.offload_to_cpu}


def _groups(module: torch.nn.Module, chosen: set[int], blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The largest submodules of `module` (itself included) whose parameters outside the blocks are all
    `chosen` (ids): sharded apart with their own policy."""
    def outside_blocks(m):
        yield from m.parameters(recurse=False)
        for child in m.children():
            if not any(child is block for block in blocks):
                yield from outside_blocks(child)

    params = list(outside_blocks(module))
    if params and all(id(p) in chosen for p in params):
        return [module]
    return [group for child in module.children() if not any(child is block for block in blocks)
            for group in _groups(child, chosen, blocks)]


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


def check_shared(folder: str, what: str, d: Dist) -> None:
    """Every rank must see the same folder (a shared filesystem on multi-node runs): rank 0 writes a
    token that every other rank then reads back."""
    path = Path(folder)
    token = [os.urandom(8).hex() if d.is_main else None]
    dist.broadcast_object_list(token, src=0)
    probe = path / f".vidtrain-shared-{token[0]}"
    with all_or_none():
        if d.is_main:
            path.mkdir(parents=True, exist_ok=True)
            probe.write_text(token[0])
    with all_or_none():
        if not probe.is_file():
            raise ConfigError(f"rank {d.rank} cannot see {what} = {folder} written by rank 0: on several nodes "
                              "it must be on a shared filesystem")
    if d.is_main:
        probe.unlink()


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    values = values.detach().clone()
    dist.all_reduce(values)
    return values / dist.get_world_size()


def max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    values = values.detach().clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


class Preempted(Exception):
    """Every rank agreed to stop because of a signal, with the work so far safe: the command exits 0."""


class Preemption:
    """SIGTERM or SIGUSR1 (what SLURM and torchrun send before a kill) sets a flag; every rank learns
    whether any rank got it wherever `agreed` is called: between sampling steps of a render, between
    cache-pass rounds and before checkpoint verification; at step boundaries `agreed_a_step_late` learns
    it one step later without waiting. A save under way completes."""

    def __init__(self):
        self.requested = False
        self.pending = None  # (work, flag) of the all-reduce started at the previous step boundary

    def install(self) -> dict:
        """Set the handlers; return the previous ones."""
        return {sig: signal.signal(sig, self._request) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def _request(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        return bool(max_over_ranks(torch.tensor(float(self.requested), device=device)))

    def agreed_a_step_late(self, start_next: bool) -> bool:
        """Whether any rank had the flag at the previous call, from an all-reduce started then; starts the
        next one (unless `start_next` is False, or the answer is yes). The flag is a CPU tensor, reduced
        over gloo in the background (a process group with nccl sends CPU tensors to gloo too): reading it
        a step later neither waits for the other ranks nor synchronises the device, where reading an
        all-reduce started now would do both on every step. Every rank calls this at the same steps, so
        they all stop at the same one: a signal is acted on one step later than it would be otherwise."""
        stop = False
        if self.pending is not None:
            work, flag = self.pending
            work.wait()  # done a step ago: this returns at once
            stop = bool(flag)  # a host tensor: no device synchronisation
        self.pending = None
        if start_next and not stop:
            flag = torch.tensor(float(self.requested))
            self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return stop


PREEMPTION = Preemption()


def stop_if_preempted(d: Dist, what: str) -> None:
    """A collective: raise Preempted on every rank when any rank got a stop signal."""
    if PREEMPTION.agreed(d.device):
        raise Preempted(what)
