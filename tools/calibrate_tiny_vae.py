"""Give a tiny random VAE the latent statistics of a trained one, measured on a dataset's clips.

    python tools/calibrate_tiny_vae.py MODEL_DIR DATA_DIR [--frames 9] [--size 32 32]

A trained VAE's makers measure its latents_mean and latents_std on their data, so that the
normalised latents have unit variance, and its posterior's noise is small beside what tells clips
apart. A random VAE (make_tiny_model.py) has neither: its latents vary across the synthetic clips
by about 0.4% of the noise the model is trained against, and its posterior's standard deviation is
about 1, ten times that spread. The model then learns the average clip, and nothing a control
video carries shows in its held-out loss (bench/bench_control.py measured 1.001).

This tool encodes the clips listed in DATA_DIR/videos.txt (make_synthetic_dataset.py's layout),
resized to --size, their first --frames frames, and writes into MODEL_DIR/vae:
  - latents_mean and latents_std per channel: the encoded means' (the LTX-2 video VAE keeps them
    as buffers in its weights, Wan's AutoencoderKLWan in its config);
  - Wan only, whose trainer samples the posterior (LTX-2's uses its mean): the bias of the
    log-variance half of quant_conv, shifted so that the posterior's standard deviation is a tenth of
    each channel's spread.

Only the tiny models' VAE changes; the tests use uncalibrated ones.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLWan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decode  # noqa: E402

VAES = {"AutoencoderKLLTX2Video": AutoencoderKLLTX2Video, "AutoencoderKLWan": AutoencoderKLWan}
POSTERIOR_STD = 0.1  # of each channel's spread across the clips


def read_clip(path: Path, frames: int, size: tuple[int, int]) -> torch.Tensor:
    """The clip's first `frames` frames, resized to `size` by the trainer's reader, in [-1, 1]:
    [1, 3, F, H, W]."""
    media = decode.probe(path)
    times = [k / media.fps for k in range(frames)]
    try:
        pixels = decode.read_frames(path, media, times, size, (0, 0, *size), pad=False)
    except decode.MediaError as e:
        sys.exit(f"error: {path}: {e}")
    return (torch.from_numpy(pixels).permute(3, 0, 1, 2).float() / 127.5 - 1)[None]


def calibrate(model_dir: str, data_dir: str, frames: int = 9, size: tuple[int, int] = (32, 32)) -> None:
    vae_dir = Path(model_dir) / "vae"
    config = json.loads((vae_dir / "config.json").read_text())
    if config["_class_name"] not in VAES:
        sys.exit(f"error: {vae_dir} holds a {config['_class_name']}; this tool calibrates {', '.join(VAES)}")
    vae = VAES[config["_class_name"]].from_pretrained(vae_dir).eval()
    data = Path(data_dir)
    with torch.no_grad():
        posteriors = [
            vae.encode(read_clip(data / line, frames, size)).latent_dist
            for line in (data / "videos.txt").read_text().split()
        ]
    means = torch.cat([posterior.mean for posterior in posteriors])
    channels = (0, 2, 3, 4)
    mean, std = means.mean(dim=channels), means.std(dim=channels)
    if isinstance(vae, AutoencoderKLWan):
        logvar = torch.cat([posterior.logvar for posterior in posteriors]).mean(dim=channels)
        with torch.no_grad():
            vae.quant_conv.bias[len(std) :] += 2 * torch.log(POSTERIOR_STD * std) - logvar
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    else:
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    vae.save_pretrained(vae_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir")
    parser.add_argument("data_dir")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, nargs=2, default=[32, 32], metavar=("H", "W"))
    args = parser.parse_args()
    calibrate(args.model_dir, args.data_dir, args.frames, tuple(args.size))
    print(f"calibrated {args.model_dir}/vae on {args.data_dir}'s clips")


if __name__ == "__main__":
    main()
