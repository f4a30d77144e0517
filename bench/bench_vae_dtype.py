"""Wan's VAE in bf16 against fp32: the cached latents' difference.

bf16 is model.dtype; diffusers' examples and the original code keep AutoencoderKLWan in fp32. The
difference is in the normalised units training sees.

    python bench/bench_vae_dtype.py [--frames 17] [--size 64]

Encodes synthetic clips (tools/make_synthetic_dataset.py's moving shapes) with the tiny Wan 2.1 VAE
(tools/make_tiny_model.py) in both dtypes; prints the relative L2 difference of the posterior means
and the largest difference after normalisation (latents_mean / latents_std), next to the noise's
unit scale."""

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diffusers import AutoencoderKLWan  # noqa: E402

from tools.make_synthetic_dataset import COLOURS, DIRECTIONS, SHAPES, render_clip  # noqa: E402
from tools.make_tiny_model import make_tiny_wan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--clips", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    videos = [
        torch.as_tensor(
            render_clip(
                rng.choice(SHAPES),
                rng.choice(list(COLOURS)),
                rng.choice(list(DIRECTIONS)),
                args.frames,
                args.size,
                args.size,
                rng,
            )[0]
        )
        for _ in range(args.clips)
    ]
    pixels = torch.stack(videos).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # [B, 3, F, H, W]
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_wan(f"{tmp}/wan", "t2v")
        means = {}
        for dtype in (torch.float32, torch.bfloat16):
            vae = AutoencoderKLWan.from_pretrained(f"{tmp}/wan", subfolder="vae", dtype=dtype).eval()
            with torch.no_grad():
                means[dtype] = vae.encode(pixels.to(dtype)).latent_dist.mean.float()
        config = vae.config
    z = config.z_dim
    mean = torch.tensor(config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, z, 1, 1, 1)
    reference, bf16 = means[torch.float32], means[torch.bfloat16]
    relative = ((bf16 - reference).norm() / reference.norm()).item()
    normalised = ((bf16 - mean) / std - (reference - mean) / std).abs()
    print(
        f"tiny Wan VAE, {args.clips} clips of {args.frames}x{args.size}x{args.size}: latent mean bf16 vs fp32: "
        f"relative L2 {relative:.2e}; normalised: max |diff| {normalised.max().item():.3e}, "
        f"mean |diff| {normalised.mean().item():.3e} (noise std 1)"
    )


if __name__ == "__main__":
    main()
