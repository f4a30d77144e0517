"""Each train.optimizer's step time and state memory, as ratios against AdamW in the same run.

    python bench/bench_optimizers.py [--blocks 30] [--rank 128] [--dim 1920] [--steps 10]

The trainable weights of a CogVideoX-2B LoRA (rank 128 on to_q, to_k, to_v and to_out.0 of its 30
blocks at width 1920: 240 fp32 matrices, 59M values; --blocks, --rank, --dim shrink it), each
optimizer built by model.build_optimizer as the trainer builds it (its defaults, train.* defaults,
prodigy at learning rate 1.0), then per step fresh random gradients (seeded) and Optimizers.step as
clip_and_step calls it: the median of --steps after 3 warm-up steps (AdamW8bit's first ones compile
its step with inductor), one process, all threads. State: the bytes of each optimizer's tensors once
it has stepped (memory.local_state_bytes less the weights; torchao's 8-bit moments by their codes and
scales)."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import memory  # noqa: E402
import model  # noqa: E402
from config import TrainConfig  # noqa: E402

OPTIMIZERS = ("adamw", "adafactor", "muon", "prodigy", "adamw8bit")
TARGETS = ("to_q", "to_k", "to_v", "to_out")


def lora_weights(blocks: int, rank: int, dim: int) -> torch.nn.Module:
    """A module whose parameters are the LoRA matrices' shapes and names (lora_A, lora_B)."""
    root = torch.nn.Module()
    for b in range(blocks):
        for target in TARGETS:
            layer = torch.nn.Module()
            layer.lora_A = torch.nn.Linear(dim, rank, bias=False)
            layer.lora_B = torch.nn.Linear(rank, dim, bias=False)
            root.add_module(f"block{b}_{target}", layer)
    return root


def measure(name: str, args) -> tuple[float, int]:
    """(median seconds per step, state bytes) of one optimizer."""
    torch.manual_seed(0)
    weights = lora_weights(args.blocks, args.rank, args.dim)
    t = TrainConfig(optimizer=name, learning_rate=1.0 if name == "prodigy" else 1e-4)
    params, optimizer = model.build_optimizer(weights, t)
    generator, times = torch.Generator().manual_seed(0), []
    skipped = torch.tensor(False)
    for _ in range(3 + args.steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        start = time.perf_counter()
        optimizer.step(skipped)
        times.append(time.perf_counter() - start)
        optimizer.zero_grad()
    state = memory.local_state_bytes(weights, optimizer) - sum(p.numel() * p.element_size() for p in params)
    return statistics.median(times[3:]), state


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--dim", type=int, default=1920)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    values = args.blocks * len(TARGETS) * 2 * args.rank * args.dim
    print(
        f"LoRA r{args.rank} on {len(TARGETS)} linears of {args.blocks} blocks at width {args.dim}: "
        f"{values / 1e6:.1f}M fp32 values; {torch.get_num_threads()} threads"
    )
    results = {name: measure(name, args) for name in OPTIMIZERS}
    base_time, base_state = results["adamw"]
    print(f"  {'optimizer':12}{'ms/step':>10}{'x AdamW':>10}{'state MiB':>12}{'x AdamW':>10}")
    for name, (seconds, state) in results.items():
        print(
            f"  {name:12}{seconds * 1e3:10.1f}{seconds / base_time:10.2f}"
            f"{state / 2**20:12.1f}{state / base_state:10.3f}"
        )


if __name__ == "__main__":
    main()
