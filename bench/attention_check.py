"""Attention at the shipped configs' sequence lengths: SDPA's kernel and run.deterministic.

For bench/gpu_check.sh, at the real sequence lengths: which SDPA kernel runs, and
run.deterministic's forward and backward. Prints one PASS or FAIL line per check.

    python bench/attention_check.py kernels
    python bench/attention_check.py deterministic
    --cpu

kernels: SDPA's own choice, bf16 forward + backward, per model. deterministic: CogVideoX-5B at
49x480x720 under run.deterministic: two backward passes bitwise equal, a fused kernel, the peak.
--cpu: the same code at 256 tokens and 2 heads (what SDPA picks on a CPU; the figures mean nothing).

Sequence lengths (text + video tokens after the VAE and the patches), heads and head size, from the
published configs: one sample per rank, no sequence parallelism."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import memory  # noqa: E402
import ranks  # noqa: E402

SHAPES = {  # name: (tokens, heads, head size)
    "CogVideoX-2B 49x480x720": (226 + 13 * 30 * 45, 30, 64),
    "CogVideoX-5B 49x480x720": (226 + 13 * 30 * 45, 48, 64),
    # 21 latent frames padded to 22, patch_t 2
    "CogVideoX1.5-5B 81x768x1360": (226 + 11 * 48 * 85, 48, 64),
    "Wan 1.3B 81x480x832": (21 * 30 * 52, 12, 128),
    "Wan 14B 81x480x832": (21 * 30 * 52, 40, 128),
    "Wan2.2-TI2V-5B 121x704x1280": (31 * 22 * 40, 24, 128),
}
KERNELS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "math": "_scaled_dot_product_attention_math",
}


def attend(tokens: int, heads: int, head_dim: int, device: torch.device, seed: int = 0):
    """One bf16 forward and backward; returns the kernel that ran and the three input gradients."""
    generator = torch.Generator(device).manual_seed(seed)
    q, k, v = (
        torch.randn(
            1, heads, tokens, head_dim, device=device, generator=generator, dtype=torch.bfloat16
        ).requires_grad_()
        for _ in range(3)
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(torch.ones_like(out))
    names = {event.name for event in profile.events()}
    ran = [kernel for kernel, op in KERNELS.items() if any(name.startswith(f"aten::{op}") for name in names)]
    return ran, (q.grad, k.grad, v.grad)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", choices=["kernels", "deterministic"])
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    shapes = {"a CPU shape": (256, 2, 64)} if args.cpu else SHAPES
    failed = False
    if args.check == "kernels":
        for name, shape in shapes.items():
            ran, _ = attend(*shape, device)
            # the unfused kernel at these lengths runs out of memory or crawls
            ok = ran and "math" not in ran
            failed |= not ok
            print(
                f"{'PASS' if ok else 'FAIL'} attention kernel at {name} ({shape[0]} tokens, {shape[1]} heads x "
                f"{shape[2]}): {', '.join(ran) or 'none recognised'}",
                flush=True,
            )
        return int(failed)
    ranks.make_deterministic()
    name, shape = (
        next(iter(shapes.items()))
        if args.cpu
        else ("CogVideoX-5B 49x480x720", SHAPES["CogVideoX-5B 49x480x720"])
    )
    memory.reset_peak_memory(device)
    ran, first = attend(*shape, device)
    _, second = attend(*shape, device)
    equal = all(torch.equal(a, b) for a, b in zip(first, second))
    peak = memory.peak_memory_gb(device)
    ok = equal and ran and "math" not in ran
    print(
        f"{'PASS' if ok else 'FAIL'} run.deterministic attention at {name}: {', '.join(ran)}; two backward "
        f"passes {'bitwise equal' if equal else 'DIFFER'}; peak {peak:.1f} GB",
        flush=True,
    )
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
