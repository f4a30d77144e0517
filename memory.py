"""Memory measurements: each phase's peak and the state a rank holds, read on the host only.

The peak of each phase (training between log steps, a validation) and the state a rank holds;
host-side reads only, no device synchronisation."""

import contextlib
import ctypes
import resource
from pathlib import Path

import torch


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
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
