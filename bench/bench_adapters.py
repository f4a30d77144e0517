"""DoRA and LoKr against LoRA: a training step's time and memory, as ratios measured in one run.

    python bench/bench_adapters.py [--width 512] [--layers 2] [--latent 2 64 64] [--rank 16]
                                   [--targets default|all] [--no-checkpointing] [--iters 4]
                                   [--repeats 3] [--device cpu|cuda]

Writes a tiny CogVideoX-5B-layout model with --layers blocks of --width (64 per head), then, for
--repeats interleaved rounds, one child process per lora.variant ("lora", "dora", "lokr") at the
same rank (alpha = rank), targets and seed: the transformer with that adapter, activation
checkpointing as the trainer sets it (train.gradient_checkpointing, on unless --no-checkpointing),
fused AdamW as model.build_optimizer, and --iters timed steps (adapter.loss of a batch of 2 random
latents of --latent [frames, height, width] and prompt embeddings, backward, clip, step) after 2
untimed ones. On the CPU: one thread, fp32; with --device cuda: bf16 weights under bf16 autocast,
as train.mixed_precision = "bf16". Training memory = the peak during the steps less the memory the
loaded base model held before the adapter existed (the CPU's peak resident size, VmHWM, reset
through /proc/self/clear_refs; CUDA's max_memory_allocated): the adapter's weights, gradients,
AdamW state and every activation and transient of the steps. Prints each variant's trainable
parameters, its median step time and its training memory, and both as ratios against LoRA's.

DoRA's extra work per adapted layer does not grow with the tokens (the norm of W + s B A, a
weight-sized fp32 sum each forward), its extra activations do (the base output and the LoRA output
are kept for the magnitude's gradient): the ratio depends on tokens per layer width, printed with
the results."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# not bench/common.py, whose imports (the tests' helpers, the dataset tool) would slow each child
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import lora  # noqa: E402
from config import LoraConfig, ModelConfig  # noqa: E402
from model_adapter import load_adapter  # noqa: E402

VARIANTS = ("lora", "dora", "lokr")
BATCH, TEXT = 2, (16, 32)  # [L, D] of the tiny T5's prompt embeddings


def memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident size


def peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def child(args) -> None:
    """One variant's steps in this process; prints {trainable, step_s, memory} as JSON."""
    torch.set_num_threads(1)
    device = torch.device(args.device)
    bf16 = device.type == "cuda"
    adapter = load_adapter(ModelConfig(path=args.model, dtype="bf16" if bf16 else "fp32"), device)
    transformer = adapter.load_transformer().train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    base = memory_now(device)
    reset_peak(device)
    targets = (
        LoraConfig().target_modules
        if args.targets == "default"
        else ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    )
    lora.inject_lora(transformer, targets, args.rank, args.rank, 0.0, 0, variant=args.variant)
    if not args.no_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    generator = torch.Generator(device).manual_seed(0)
    latents = (args.latent[0], adapter.latent_channels, *args.latent[1:])
    times = []
    for _ in range(2 + args.iters):
        start = time.perf_counter()
        x0, noise = (torch.randn(BATCH, *latents, generator=generator, device=device) for _ in range(2))
        timesteps = torch.randint(
            0, len(adapter.alphas_cumprod), (BATCH,), generator=generator, device=device
        )
        embeds = torch.randn(BATCH, *TEXT, generator=generator, device=device)
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            loss = adapter.loss(transformer, x0, embeds, timesteps, noise).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = {
        "trainable": sum(p.numel() for p in params),
        "step_s": statistics.median(times[2:]),
        "memory": peak(device) - base,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=512, help="hidden size, 64 per attention head")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--latent", type=int, nargs=3, default=[2, 64, 64], metavar=("F", "H", "W"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=["default", "all"], default="default")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return child(args)
    from tools.make_tiny_model import make_tiny_model

    results = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            "num_attention_heads": args.width // 64,
            "attention_head_dim": 64,
            "num_layers": args.layers,
        }
        settings |= {"sample_frames": 4 * args.latent[0] - 3, "sample_height": args.latent[1]}
        settings |= {"sample_width": args.latent[2]}
        make_tiny_model(tmp, transformer_settings=settings)
        forwarded = sys.argv[1:] + ["--model", tmp]
        for _ in range(args.repeats):
            for variant in VARIANTS:
                out = subprocess.run(
                    [sys.executable, __file__, *forwarded, "--variant", variant],
                    cwd=REPO,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
                results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    tokens = args.latent[0] * args.latent[1] * args.latent[2] // 4 + TEXT[0]  # 2x2 patches
    print(
        f"CogVideoX blocks x{args.layers}, width {args.width}, {tokens} tokens per sample, batch {BATCH}, "
        f"rank {args.rank} on {args.targets} targets, checkpointing {'off' if args.no_checkpointing else 'on'}, "
        f"{args.device} ({'bf16' if args.device.startswith('cuda') else 'fp32, 1 thread'}), "
        f"{args.repeats} interleaved repetitions:"
    )
    lora_step = statistics.median(r["step_s"] for r in results["lora"])
    lora_memory = statistics.median(r["memory"] for r in results["lora"])
    for variant, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        memory = statistics.median(r["memory"] for r in runs)
        print(
            f"  {variant:5s} trainable {runs[0]['trainable']:>9,d}  step ms "
            + " ".join(f"{r['step_s'] * 1000:.0f}" for r in runs)
            + f"  (x{step / lora_step:.2f})  training memory MB "
            + " ".join(f"{r['memory'] / 2**20:.0f}" for r in runs)
            + f"  (x{memory / lora_memory:.2f})"
        )


if __name__ == "__main__":
    main()
