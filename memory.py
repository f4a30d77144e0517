"""Fitting one card: fp8 storage of the frozen base, activation offload, the memory measurements.

The measurements: the peak of each phase (training between log steps, a validation) and the state a rank holds;
host-side reads only, no device synchronisation. Then fp8 storage of the frozen base's linear weights,
and the activation offload.
"""

import contextlib
import ctypes
import resource
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(local, "__tensor_flatten__"):  # a tensor subclass (torchao's 8-bit moments): its parts
        return sum(_local_bytes(getattr(local, name)) for name in local.__tensor_flatten__()[0])
    return local.numel() * local.element_size()


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of parameters and optimizer state (its shard under FSDP)."""
    params = sum(_local_bytes(p) for p in model.parameters())
    states = sum(
        _local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return params + states


def reset_peak_memory(device: torch.device, trim_heap: bool = False) -> None:
    """Start a new memory peak, so each phase reports its own.

    A phase is training between log steps, or a validation. The peak is the allocator's on GPUs; on
    Linux CPUs the kernel's VmHWM, which writing 5 to /proc/self/clear_refs resets to the current
    resident size (ru_maxrss cannot be reset: without /proc the CPU peak spans the process).
    `trim_heap`, after a validation: glibc keeps large freed blocks resident, which would carry the
    validation's buffers into training's peak; malloc_trim returns them first (CPU only; once per
    validation, as memory given back costs page faults when it is taken again). Host-side only: no
    device synchronisation."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    if trim_heap:
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL(None).malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory, or the process's peak resident size on CPU, since the last reset.

    Peak allocated accelerator memory, or the process's peak resident size on CPU, since the last
    reset_peak_memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --------------------------------------------------------------------------------------------------
# fp8 storage of the frozen base: linear weights in float8_e4m3fn, upcast per layer as they run.
#
# How the frozen base is stored: model.storage_dtype = "fp8" keeps the transformer blocks' frozen
# linear weights as float8_e4m3fn with one scale per output row, upcast to the compute dtype per layer
# as it runs.
#
# Half the bytes of bf16 for the weights that dominate a LoRA run's memory (and a streamed block's
# transfer); LoRA, norms, embeddings, biases and everything outside the blocks keep model.dtype. The
# scale is per row, not per tensor: a row's scale needs only that row, so each rank quantizes the rows
# it reads under FSDP (and a row of small weights keeps its precision beside a row of large ones);
# BENCHMARKS.md compares the two. The weight and its scale are ordinary frozen parameters that FSDP2
# shards on dim 0 alike and all-gathers (as bytes: a unit whose parameters differ in dtype is gathered
# as uint8). The scales are fp32, as ComfyUI's files keep theirs (model.dtype's fp16 would turn a row
# of small weights to NaN). A single file's weights that are already float8_e4m3fn with one scale per
# tensor (ComfyUI's scaled fp8, or a plain cast: scale 1) are kept as the file stores them, the scale
# spread to every row: quantizing them again would round them twice. diffusers' layerwise casting
# (diffusers.hooks) casts without a scale and casts a module's every parameter, LoRA's included, back
# and forth around its forward: neither fits.


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row still divides by something, and quantizes to zeros.
MIN_SCALE = 1e-12
# Rows quantized at a time: the fp32 temporaries are a block's (20 MB at Wan 14B's width), not the
# tensor's.
ROWS = 1024


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-d weight to fp8 with one fp32 scale per row.

    (fp8 weight, fp32 scale [rows, 1]) of a 2-d weight (bf16, fp16 or fp32), its largest magnitude
    per row mapped to fp8's largest value. The scale stays fp32, as ComfyUI's files keep theirs: in
    fp16 a row of weights below 2.7e-5 would have a scale under fp16's smallest value (6e-8), 0, and
    its weights would divide into NaN."""
    low, high = torch.aminmax(weight, dim=1, keepdim=True)
    scale = (torch.maximum(-low, high).float() / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    for start in range(0, weight.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        quantized[rows] = (weight[rows].float() / scale[rows]).clamp_(-FP8_MAX, FP8_MAX)
    return quantized, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 weight times its fp32 scale, rounded once to `dtype` (the compute dtype).

    Every fp8 value is exact in bf16 and fp16, so the upcast copy is the only temporary: the product
    is taken in fp32."""
    return weight.to(dtype).mul_(scale)


class _Fp8Linear(torch.autograd.Function):
    """F.linear with an fp8 weight that keeps the fp8 weight, not its upcast copy, for the backward.

    Otherwise every layer between a forward and its backward would hold its weight in bf16 again."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, dtype):
        ctx.save_for_backward(weight, scale)
        ctx.dtype = dtype
        return F.linear(x, dequantize(weight, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        return grad @ dequantize(weight, scale, ctx.dtype).to(grad.dtype), None, None, None, None


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) of a linear layer.

    Its weight is upcast from fp8 storage where it has one."""
    if module.weight.dtype != FP8:
        return F.linear(x, module.weight, module.bias)
    return _Fp8Linear.apply(x, module.weight, module.weight_scale, module.bias, module.compute_dtype)


def weight(module: nn.Linear) -> torch.Tensor:
    """The weight a linear layer computes with: its own, or its fp8 storage upcast."""
    if module.weight.dtype != FP8:
        return module.weight
    return dequantize(module.weight, module.weight_scale, module.compute_dtype)


class Fp8Linear(nn.Linear):
    """A frozen nn.Linear stored in fp8 with one fp32 scale per output row.

    `weight` (float8_e4m3fn, [out, in]), `weight_scale` ([out, 1], fp32) and `bias` (in `dtype`, the
    compute dtype, or None). Built from an already-quantized weight and its scale, per row ([out, 1]
    or [out]) or per tensor (one value, as ComfyUI's scaled fp8 files keep it, spread to every row).
    """

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate and fill a weight of its own
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"Fp8Linear takes a 2-d {FP8} weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        scale = scale.float().reshape(-1, 1).expand(self.out_features, 1).contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def on_meta(cls, base: nn.Linear) -> "Fp8Linear":
        """The Fp8Linear that will hold `base`'s weight, its parameters still on the meta device.

        The layer that will hold `base`'s weight in fp8, its parameters still on the meta device
        (the loader fills them: with `quantize`, or one rank's rows at a time under FSDP:
        `load_rows`)."""
        out_features, in_features = base.weight.shape
        return cls(
            torch.empty(out_features, in_features, dtype=FP8, device="meta"),
            torch.empty(out_features, 1, device="meta"),
            base.bias,
            base.weight.dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def store_fp8(model: nn.Module, blocks: list[nn.Module], keep) -> list[str]:
    """Replace the blocks' nn.Linear layers by Fp8Linear; return the fp8 weights' names.

    Replace every nn.Linear inside the blocks (on the meta device, before loading) by an Fp8Linear,
    but those whose weight name `keep(name)` keeps in its own dtype (a family's fp32 modules);
    return the names of the fp8 weights."""
    inside = {id(module) for block in blocks for module in block.modules()}
    names = []
    for name, module in list(model.named_modules()):
        if id(module) in inside and type(module) is nn.Linear and not keep(f"{name}.weight"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.on_meta(module))
            names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_rows(
    weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, stored_scale: float | None = None
) -> None:
    """Fill an fp8 weight's rows and their scales from rows of a weight.

    The scales are tensors of the same rows (e.g. one rank's shard). The rows are quantized, or,
    with `stored_scale`, rows a file already stores in fp8 with that one scale are kept as they are
    (quantizing them again would round them twice)."""
    if stored_scale is None:
        quantized, row_scale = quantize(rows.to(weight.device))
        weight.copy_(quantized)
        scale.copy_(row_scale)
    else:
        weight.copy_(rows)
        scale.fill_(stored_scale)


# --------------------------------------------------------------------------------------------------
# Activation offload (train.activation_offload): checkpointed block inputs wait in host memory.
#
# The block inputs that activation checkpointing keeps for the backward wait there instead of on the
# device.
#
# Non-reentrant checkpointing (torch.utils.checkpoint with use_reentrant=False, what diffusers' blocks
# use) keeps a block's tensor inputs through one autograd node whose saved tensors go through the
# saved-tensors hooks set around the checkpoint call; what the block computes inside is dropped and
# recomputed under checkpointing's own hooks, which take precedence there. Hooks set around each
# checkpoint call therefore see exactly what checkpointing keeps: the video tokens entering each block
# (the dominant activation term at 81 frames), with the text and timestep embeddings beside them.
# Those are the same tensors for every block of a Wan or LTX-2 model (LTX-2's I2V timestep embedding
# has a row per token): the first block call copies them out, and the later ones keep the device
# tensor itself, which the forward holds anyway, instead of one more host copy each (a tensor counts
# as seen while its storage lives and its version is unchanged); it stays on the device until the
# backward reaches the first block.
#
# On CUDA every copy runs on a side stream into pinned memory, so neither direction makes the host
# wait. Forward: each block's inputs are copied out after the compute that made them, and the caching
# allocator keeps their device memory until the copy has run (record_stream). Backward: the first of a
# block's inputs that the recompute asks for sends that block's inputs back, and the block's before
# it, the next the backward needs, so that copy runs beside this block's backward; the compute waits
# only for its own. On a CPU the copies are plain ones: the same code path, which the tests run.
#
# The host buffers are this object's own, reused from step to step (a block's come back once its
# backward has run; the smallest free one that is large enough serves): torch's pinned allocator hands
# out exact sizes above ranks.PINNED_EXACT_MB and caches none of them
# (ranks.ALLOCATOR_SETTINGS), so pinning them anew each step would page-lock every block's inputs
# again at every step (docs/memory.md gives their size for Wan 14B). Both directions of a buffer's
# copies run on the side stream, in order, so a buffer handed out again is written after its last
# read.


class _Kept:
    """One checkpointed block call's inputs, on the host or back on the device.

    Host copies (or, for a tensor an earlier call copied, the device tensor itself), the pooled
    buffers under them, and once sent back, their device copies."""

    def __init__(self, previous: "_Kept | None"):
        self.host: list[torch.Tensor] = []
        # per input: a host copy (True) or the device tensor kept (False)
        self.copied: list[bool] = []
        self.buffers: list[torch.Tensor] = []
        self.on_device: list[torch.Tensor] | None = None
        self.ready = None  # CUDA: the event after the copies back
        # Weak: the block before stays alive through its own autograd node, as long as the backward
        # needs it.
        self.previous = None if previous is None else weakref.ref(previous)


class HostActivations:
    """Offloads the inputs that checkpointing keeps to host memory.

    `checkpoint` is diffusers' gradient_checkpointing_func (enable_gradient_checkpointing's
    argument)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last = None  # a weak reference to the latest block call's _Kept
        # the tensors copied out, while their storage lives
        self.seen: dict[tuple, StorageWeakRef] = {}
        self.free: list[torch.Tensor] = []  # pooled host buffers (bytes) no block call holds
        self.pinned: list[int] = []  # the size of every host buffer made, in bytes

    def checkpoint(self, block, *args):
        kept = _Kept(self.last and self.last())
        self.last = weakref.ref(kept)
        # the list object, filled as inputs are packed
        weakref.finalize(kept, self.free.extend, kept.buffers)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: self.pack(kept, tensor), self.unpack):
            return checkpoint(block, *args, use_reentrant=False)

    def pack(self, kept: _Kept, tensor: torch.Tensor):
        self.seen = {k: ref for k, ref in self.seen.items() if not ref.expired()}
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        if key in self.seen:
            kept.host.append(tensor)
            kept.copied.append(False)
            return kept, len(kept.host) - 1
        self.seen[key] = StorageWeakRef(tensor.untyped_storage())
        host = self.host_like(kept, tensor)
        if self.stream is None:
            host.copy_(tensor)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        kept.host.append(host)
        kept.copied.append(True)
        return kept, len(kept.host) - 1

    def host_like(self, kept: _Kept, tensor: torch.Tensor) -> torch.Tensor:
        """A pooled host buffer viewed as a tensor shaped like `tensor`.

        A host tensor with tensor's shape, dtype and strides (as empty_like picks them) in a pooled
        buffer."""
        strides = torch.empty_like(tensor, device="meta").stride()
        nbytes = tensor.numel() * tensor.element_size()
        fitting = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fitting:
            buffer = self.free.pop(min(fitting, key=lambda i: self.free[i].numel()))
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.stream is not None)
            self.pinned.append(nbytes)
        kept.buffers.append(buffer)
        return buffer[:nbytes].view(tensor.dtype).as_strided(tensor.shape, strides)

    def unpack(self, packed) -> torch.Tensor:
        kept, index = packed
        self.send_back(kept)
        if (previous := kept.previous and kept.previous()) is not None:
            self.send_back(previous)
        if kept.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(kept.ready)
        return kept.on_device[index]

    def send_back(self, kept: _Kept) -> None:
        if kept.on_device is not None:
            return
        if self.stream is None:
            kept.on_device = kept.host
            return
        with torch.cuda.stream(self.stream):
            kept.on_device = [
                host.to(self.device, non_blocking=True) if copied else host
                for host, copied in zip(kept.host, kept.copied)
            ]
            kept.ready = self.stream.record_event()
        # made on the side stream, used on the compute one
        for tensor, copied in zip(kept.on_device, kept.copied):
            if copied:
                tensor.record_stream(torch.cuda.current_stream(self.device))
