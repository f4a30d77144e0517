"""Activation offload (train.activation_offload): checkpointed block inputs wait in host memory.

The block inputs that activation checkpointing keeps for the backward wait there instead of on the
device.

Non-reentrant checkpointing (torch.utils.checkpoint with use_reentrant=False, what diffusers' blocks
use) keeps a block's tensor inputs through one autograd node whose saved tensors go through the
saved-tensors hooks set around the checkpoint call; what the block computes inside is dropped and
recomputed under checkpointing's own hooks, which take precedence there. Hooks set around each
checkpoint call therefore see exactly what checkpointing keeps: the video tokens entering each block
(the dominant activation term at 81 frames), with the text and timestep embeddings beside them.
Those are the same tensors for every block of a Wan or LTX-2 model (LTX-2's I2V timestep embedding
has a row per token): the first block call copies them out, and the later ones keep the device
tensor itself, which the forward holds anyway, instead of one more host copy each (a tensor counts
as seen while its storage lives and its version is unchanged); it stays on the device until the
backward reaches the first block.

On CUDA every copy runs on a side stream into pinned memory, so neither direction makes the host
wait. Forward: each block's inputs are copied out after the compute that made them, and the caching
allocator keeps their device memory until the copy has run (record_stream). Backward: the first of a
block's inputs that the recompute asks for sends that block's inputs back, and the block's before
it, the next the backward needs, so that copy runs beside this block's backward; the compute waits
only for its own. On a CPU the copies are plain ones: the same code path, which the tests run.

The host buffers are this object's own, reused from step to step (a block's come back once its
backward has run; the smallest free one that is large enough serves): torch's pinned allocator hands
out exact sizes above ranks.PINNED_EXACT_MB and caches none of them
(ranks.ALLOCATOR_SETTINGS), so pinning them anew each step would page-lock every block's inputs
again at every step (docs/memory.md gives their size for Wan 14B). Both directions of a buffer's
copies run on the side stream, in order, so a buffer handed out again is written after its last
read.
"""

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint


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
