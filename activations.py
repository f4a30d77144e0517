"""Activation offload (train.activation_offload): the block inputs that activation checkpointing keeps for
the backward wait in host memory instead of on the device.

Non-reentrant checkpointing (torch.utils.checkpoint with use_reentrant=False, what diffusers' blocks use)
keeps a block's tensor inputs through one autograd node whose saved tensors go through the saved-tensors
hooks set around the checkpoint call; what the block computes inside is dropped and recomputed under
checkpointing's own hooks, which take precedence there. Hooks set around each checkpoint call therefore
see exactly what checkpointing keeps: the video tokens entering each block (the dominant activation term
at 81 frames), with the text and timestep embeddings beside them (the same tensors for every block of a
Wan model, copied once per block: about 2% of the tokens' bytes at Wan 14B 81x480x832).

On CUDA every copy runs on a side stream into pinned memory, so neither direction makes the host wait.
Forward: each block's inputs are copied out after the compute that made them, and the caching allocator
keeps their device memory until the copy has run (record_stream). Backward: the first of a block's inputs
that the recompute asks for sends that block's inputs back, and the block's before it, the next the
backward needs, so that copy runs beside this block's backward; the compute waits only for its own. On a
CPU the copies are plain ones: the same code path, which the tests run.
"""

import weakref

import torch
from torch.utils.checkpoint import checkpoint


class _Kept:
    """One checkpointed block call's inputs: their host copies, and once sent back, their device copies."""

    def __init__(self, previous: "_Kept | None"):
        self.host: list[torch.Tensor] = []
        self.on_device: list[torch.Tensor] | None = None
        self.ready = None  # CUDA: the event after the copies back
        # Weak: the block before stays alive through its own autograd node, as long as the backward needs it.
        self.previous = None if previous is None else weakref.ref(previous)


class HostActivations:
    """`checkpoint` is diffusers' gradient_checkpointing_func (enable_gradient_checkpointing's argument)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last = None  # a weak reference to the latest block call's _Kept

    def checkpoint(self, block, *args):
        kept = _Kept(self.last and self.last())
        self.last = weakref.ref(kept)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: self.pack(kept, tensor), self.unpack):
            return checkpoint(block, *args, use_reentrant=False)

    def pack(self, kept: _Kept, tensor: torch.Tensor):
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.stream is not None)
        if self.stream is None:
            host.copy_(tensor)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        kept.host.append(host)
        return kept, len(kept.host) - 1

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
            kept.on_device = [host.to(self.device, non_blocking=True) for host in kept.host]
            kept.ready = self.stream.record_event()
        for tensor in kept.on_device:  # made on the side stream, used on the compute stream
            tensor.record_stream(torch.cuda.current_stream(self.device))
