"""The processes of a run: its group, its settings, agreement across ranks, preemption.

The processes of a run: the process group and device, torch's allocator and determinism settings
(set before the first CUDA work), agreement across ranks on errors and values, and preemption.

Every run has a process group, one process included (a HashStore, so it needs no free port): the
code path is the same on one CPU and on many GPU nodes. command.py is the frame every command runs
in; parallel.py spreads the model over these ranks.
"""

import contextlib
import datetime
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config import ConfigError, ParallelConfig

log = logging.getLogger("vidtrain")

# Torch's caching allocators, set by init before the first CUDA allocation, under every launch
# (launch.sh, torchrun, python); a key the user's PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF)
# names keeps theirs. expandable_segments: segments that grow in place, as video shapes vary by
# bucket and fixed-size segments fragment. The pinned keys: torch 2.13's host allocator
# (aten/src/ATen/core/CachingHostAllocator.h, CachingHostAllocatorImpl::allocate) rounds a request
# up to a power of two unless it is above pinned_max_round_threshold_mb or pinned_max_cached_size_mb
# (default: never), and FSDP2 pins each streamed parameter on its own: a Wan 14B block took 1.53x
# its bytes. Both keys, at the same size: a block kept unrounded in the cache would sit in its power
# of two's free list, which hands out any block it holds (get_free_block checks no size). Above
# PINNED_EXACT_MB a request gets its exact size and, freed, goes back to the system; the smaller
# ones (a step's batch) keep the rounding and the cache.
PINNED_EXACT_MB = 16
ALLOCATOR_SETTINGS = {
    "expandable_segments": "True",
    "pinned_max_round_threshold_mb": str(PINNED_EXACT_MB),
    "pinned_max_cached_size_mb": str(PINNED_EXACT_MB),
}


def allocator_settings(user: str) -> str:
    """The user's allocator settings with those of ALLOCATOR_SETTINGS whose keys they do not name;
    the two pinned keys go together (one without the other would cache unrounded blocks, above)."""
    named = {item.split(":")[0].strip() for item in user.split(",")}
    if named & {"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}:
        named |= {"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}
    ours = [f"{key}:{value}" for key, value in ALLOCATOR_SETTINGS.items() if key not in named]
    return ",".join([user] * bool(user.strip()) + ours)


def pinned_bytes(nbytes: int) -> int:
    """The bytes torch's pinned allocator hands out for a request of nbytes under
    ALLOCATOR_SETTINGS."""
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
        """The data-parallel rank: which samples of the global batch this rank (and its sp group)
        takes."""
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
        # torch read PYTORCH_ALLOC_CONF at import
        torch._C._accelerator_setAllocatorSettings(settings)
        log.info("allocator settings: %s", settings)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if world % cfg.dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {cfg.dp_replicate} must divide the world size {world}")
    if world % cfg.sp_size:
        raise ConfigError(f"parallel.sp_size = {cfg.sp_size} must divide the world size {world}")
    return Dist(rank, world, local_rank, device, cfg.sp_size)


def make_deterministic() -> None:
    """Before any CUDA work: cuBLAS needs its workspace setting before its first handle.

    Attention keeps its fused kernels: under torch.use_deterministic_algorithms(True) (warn_only
    off) torch's own kernels switch to deterministic backward passes. FlashAttention-2's backward
    gets `deterministic = true` from globalContext().deterministicAlgorithms()
    (aten/src/ATen/native/ transformers/cuda/attention_backward.cu, _flash_attention_backward: dQ
    accumulated per split, no atomics), memory-efficient attention's backward forces num_splits_key
    = 1 (same file, _efficient_attention_backward), and SDPA never picks cuDNN attention
    (sdp_utils.cpp, check_cudnn_deterministic); pytorch/pytorch#182551 measured the three on CUDA.
    Turning flash off instead would leave the math backend, whose fp32 score matrix alone is 56.5
    GiB for CogVideoX-5B at 49x480x720 (48 heads x 17776^2 x 4 bytes): out of memory on any card."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


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
    """Run `work` on this rank and gather every rank's result: all_or_none for work whose results
    every rank needs. A failure on any rank travels inside the gathered payload."""
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
            raise ConfigError(
                f"rank {d.rank} cannot see {what} = {folder} written by rank 0: on several nodes "
                "it must be on a shared filesystem"
            )
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
    """Every rank agreed to stop because of a signal, with the work so far safe: the command exits
    0."""


class Preemption:
    """SIGTERM or SIGUSR1 (what SLURM and torchrun send before a kill) sets a flag; every rank
    learns whether any rank got it wherever `agreed` is called: between sampling steps of a render,
    between cache-pass rounds and before checkpoint verification; at step boundaries
    `agreed_a_step_late` learns it one step later without waiting. A save under way completes."""

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
        """Whether any rank had the stop flag at the previous call, read without waiting.

        Whether any rank had the flag at the previous call, from an all-reduce started then;
        starts the next one (unless `start_next` is False, or the answer is yes). The flag is a CPU
        tensor, reduced over gloo in the background (a process group with nccl sends CPU tensors to
        gloo too): reading it a step later neither waits for the other ranks nor synchronises the
        device, where reading an all-reduce started now would do both on every step. Every rank
        calls this at the same steps, so they all stop at the same one: a signal is acted on one
        step later than it would be otherwise."""
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
