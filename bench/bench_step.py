"""Training step: the trainer's time per step against a bare step of the same model.

The bare step is the forward, backward and optimizer of the same model.

    python bench/bench_step.py [--size tiny|mid] [--short 20] [--long 1020] [--iters 200]
                               [--repeats 3]

Builds the tiny model (--size mid: 4 layers, 4 heads x 64, at 17x40x48, a bare step of ~100 ms or
more on one thread) and a synthetic dataset in a temporary folder, fills the cache with a first
trainer run, then, interleaved --repeats times:
- bare: in this process, one thread, the transformer with LoRA rank 4 (alpha 2, default targets,
  seed 0) and AdamW; per iteration random x0/noise/timesteps/prompt embeds of the trainer's shapes,
  adapter.loss, backward, clip_grad_norm_, step, zero_grad; --iters timed after 20 warm-up ones;
- trainer: `python trainer.py --cfg ...` (OMP_NUM_THREADS=1) with the same settings for --short and
  --long steps, saving only at the end; per step = (wall(long) - wall(short)) / (long - short),
  which cancels start-up, the cache check and the final save and export (a 200-step difference was
  too short: start-up jitter of a few tenths of a second moved the result by 1 ms per step); and the
  trainer's own time of each step after the first --short (its metrics.jsonl, logged every step: the
  log itself is counted), whose median a load spike from another job moves less.
Overhead = trainer step / bare step: from the fastest repetitions (the wall difference, the bare
mean), and from the median over repetitions of the per-step medians."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import median_step_s, timed_run, tiny_settings  # puts the repository on sys.path
from safetensors.torch import load_file

import lora  # noqa: E402
from config import LoraConfig, ModelConfig  # noqa: E402
from model_adapter import load_adapter  # noqa: E402

BATCH, EMBEDS = 2, (16, 32)  # [L, D] of the tiny T5
# Transformer settings over the tiny ones, and the training resolution (the clips are 17x40x48).
SIZES = {
    "tiny": ({}, [9, 32, 32]),
    "mid": ({"num_attention_heads": 4, "attention_head_dim": 64, "num_layers": 4}, [17, 40, 48]),
}


def latent_shape(resolution: list[int]) -> tuple[int, ...]:
    """[F', C, h, w] with the tiny VAE (4x in time and space, 4 channels)."""
    frames, height, width = resolution
    return (frames - 1) // 4 + 1, 4, height // 4, width // 4


def bare_step_s(
    model_path: Path, latents: tuple[int, ...], iters: int, warmup: int = 20
) -> tuple[float, float]:
    """Seconds per iteration of a bare training step: the mean and the median.

    A bare step is the loss, backward, clip, AdamW step, zero_grad; the median of the iterations is
    what a load spike from another job moves less."""
    adapter = load_adapter(ModelConfig(path=str(model_path), dtype="fp32"), torch.device("cpu"))
    transformer = adapter.load_transformer()
    lora.inject_lora(transformer, LoraConfig().target_modules, 4, 2, 0.0, 0)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, fused=True)  # as the trainer
    torch.manual_seed(0)
    times = []
    for _ in range(warmup + iters):
        start = time.perf_counter()
        x0, noise = torch.randn(BATCH, *latents), torch.randn(BATCH, *latents)
        timesteps = torch.randint(0, len(adapter.alphas_cumprod), (BATCH,))
        embeds = torch.randn(BATCH, *EMBEDS)
        adapter.loss(transformer, x0, embeds, timesteps, noise).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.mean(times[warmup:]), statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=1020)
    parser.add_argument("--iters", type=int, default=200, help="timed iterations of the bare step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        transformer_settings, resolution = SIZES[args.size]
        latents = latent_shape(resolution)
        base = {
            **tiny_settings(root, transformer_settings),
            "data.train_resolution": resolution,
            "lora.rank": 4,
            "lora.lora_alpha": 2,
        }
        timed_run(root, "warm-cache", {**base, "train.steps": 1})
        # The bare shapes are the trainer's: a video entry and a text entry of the cache.
        video, text = (
            load_file(next((root / "cache" / kind).rglob("*.safetensors"))) for kind in ("video", "text")
        )
        assert video["latent_mean"].permute(1, 0, 2, 3).shape == latents, video["latent_mean"].shape
        assert text["prompt_embeds"].shape == EMBEDS, text["prompt_embeds"].shape
        bare, own, walls = [], [], {args.short: [], args.long: []}
        for r in range(args.repeats):
            bare.append(bare_step_s(root / "model", latents, args.iters))
            for steps in walls:
                walls[steps].append(
                    timed_run(
                        root,
                        f"run-{r}-{steps}",
                        {**base, "train.steps": steps, "checkpoint.checkpointing_steps": steps + 1},
                    )
                )
            own.append(median_step_s(root / f"run-{r}-{args.long}", BATCH, args.short))
    spans = [
        (long - short) / (args.long - args.short) for short, long in zip(walls[args.short], walls[args.long])
    ]
    print(
        f"{args.size} CogVideoX, fp32, LoRA rank 4, batch 2 of {'x'.join(map(str, resolution))}, 1 thread, "
        f"{args.repeats} interleaved repetitions:"
    )
    print(
        "  bare step (loss, backward, clip, AdamW), mean ms    "
        + " ".join(f"{b[0] * 1000:.2f}" for b in bare)
    )
    print(
        "  bare step, median of the iterations, ms             "
        + " ".join(f"{b[1] * 1000:.2f}" for b in bare)
    )
    print(
        f"  trainer step, walls ({args.long} - {args.short} steps), ms    "
        + " ".join(f"{x * 1000:.2f}" for x in spans)
    )
    print("  trainer step, median of its own step times, ms      " + " ".join(f"{x * 1000:.2f}" for x in own))
    for steps, w in walls.items():
        print(f"    wall {steps:4d} steps  " + " ".join(f"{x:6.2f}" for x in w) + " s")
    # "fastest": the fastest long run less the fastest short one, as the earlier figures were
    # computed.
    step_fastest = (min(walls[args.long]) - min(walls[args.short])) / (args.long - args.short)
    for label, bare_s, step_s in (
        ("fastest", min(b[0] for b in bare), step_fastest),
        ("median", statistics.median(b[1] for b in bare), statistics.median(own)),
    ):
        print(
            f"  {label:7} bare {bare_s * 1000:7.2f} ms  trainer {step_s * 1000:7.2f} ms  trainer / bare "
            f"{step_s / bare_s:.3f}x ({100 * (step_s / bare_s - 1):.1f}% on top of the bare step)"
        )


if __name__ == "__main__":
    main()
