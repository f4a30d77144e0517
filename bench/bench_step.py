"""Training step: the trainer's time per step against the bare forward+backward+optimizer of the same model.

    python bench/bench_step.py [--short 20] [--long 1020] [--iters 200] [--repeats 3]

Builds the tiny model and a synthetic dataset in a temporary folder, fills the cache with a first
trainer run, then, interleaved --repeats times (fastest of each):
- bare: in this process, one thread, the transformer with LoRA rank 4 (alpha 2, default targets,
  seed 0) and AdamW; per iteration random x0/noise/timesteps/prompt embeds of the trainer's shapes,
  adapter.loss, backward, clip_grad_norm_, step, zero_grad; --iters timed after 20 warm-up ones;
- trainer: `python trainer.py --cfg ...` (OMP_NUM_THREADS=1) with the same settings for --short and
  --long steps, saving only at the end; per step = (wall(long) - wall(short)) / (long - short), which
  cancels start-up, the cache check and the final save and export (a 200-step difference was
  too short: start-up jitter of a few tenths of a second moved the result by 1 ms per step).
Overhead = trainer step / bare step.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from common import timed_run, tiny_settings  # puts the repository on sys.path

import lora  # noqa: E402
from config import LoraConfig, ModelConfig  # noqa: E402
from model import load_adapter  # noqa: E402

BATCH, LATENTS, EMBEDS = 2, (3, 4, 8, 8), (16, 32)  # [F', C, h, w] of 9x32x32 with the tiny VAE; [L, D] of T5


def bare_step_s(model_path: Path, iters: int, warmup: int = 20) -> float:
    """Seconds per iteration of the bare loss, backward, clip, AdamW step, zero_grad."""
    adapter = load_adapter(ModelConfig(path=str(model_path), dtype="fp32"), torch.device("cpu"))
    transformer = adapter.load_transformer()
    lora.inject_lora(transformer, LoraConfig().target_modules, 4, 2, 0.0, 0)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, fused=True)  # as the trainer
    torch.manual_seed(0)
    for i in range(warmup + iters):
        if i == warmup:
            start = time.perf_counter()
        x0, noise = torch.randn(BATCH, *LATENTS), torch.randn(BATCH, *LATENTS)
        timesteps = torch.randint(0, len(adapter.alphas_cumprod), (BATCH,))
        embeds = torch.randn(BATCH, *EMBEDS)
        adapter.loss(transformer, x0, embeds, timesteps, noise).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=1020)
    parser.add_argument("--iters", type=int, default=200, help="timed iterations of the bare step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = {**tiny_settings(root), "lora.rank": 4, "lora.lora_alpha": 2}
        timed_run(root, "warm-cache", {**base, "train.steps": 1})
        # The bare shapes are the trainer's: a video entry and a text entry of the cache.
        video, text = (load_file(next((root / "cache" / kind).rglob("*.safetensors"))) for kind in ("video", "text"))
        assert video["latent_mean"].permute(1, 0, 2, 3).shape == LATENTS, video["latent_mean"].shape
        assert text["prompt_embeds"].shape == EMBEDS, text["prompt_embeds"].shape
        bare, walls = [], {args.short: [], args.long: []}
        for r in range(args.repeats):
            bare.append(bare_step_s(root / "model", args.iters))
            for steps in walls:
                walls[steps].append(timed_run(root, f"run-{r}-{steps}", {
                    **base, "train.steps": steps, "checkpoint.checkpointing_steps": steps + 1}))
    bare_s = min(bare)
    step_s = (min(walls[args.long]) - min(walls[args.short])) / (args.long - args.short)
    print(f"tiny CogVideoX, fp32, LoRA rank 4, batch 2 of 9x32x32, 1 thread, fastest of {args.repeats}:")
    print(f"  bare step (loss, backward, clip, AdamW)  {bare_s * 1000:7.2f} ms   "
          f"runs: {' '.join(f'{b * 1000:.2f}' for b in bare)}")
    print(f"  trainer step ({args.long} - {args.short} steps)        {step_s * 1000:7.2f} ms")
    for steps, w in walls.items():
        print(f"    wall {steps:4d} steps  " + " ".join(f"{x:6.2f}" for x in w) + " s")
    print(f"  trainer / bare {step_s / bare_s:.2f}x: {100 * (step_s - bare_s) / step_s:.0f}% of a trainer step "
          f"is outside the model ({100 * (step_s / bare_s - 1):.0f}% on top of the bare step)")


if __name__ == "__main__":
    main()
