"""Does a control run learn what its controls show? Held-out loss with the right and the wrong control.

    python bench/bench_control.py [--mode ic|vace] [--steps 300] [--clips 24] [--held-out 4] [--seed 0]

Writes the tiny model (LTX-2 2.0 for IC-LoRA, Wan 2.1 VACE for VACE) and --clips synthetic clips
with their edge maps (`make_synthetic_dataset --control`) in a temporary folder, gives the tiny VAE
a trained one's latent statistics measured on those clips (tools/calibrate_tiny_vae.py: without
them the clips' latents are nearly alike), trains a LoRA (rank 16 on the attention, feed-forward
and projection layers; --seed is run.seed) for --steps on one process, then measures the held-out
clips' val/loss with the base model and with the trained LoRA, each twice: with each clip's own edge map (matched) and with each held-out clip given
the next one's (rotated: the same clips, another shape's outline in another place). The baseline is
the base model, which was never taught to read the control: its two losses are about equal. A LoRA
that learned to fill the outline it is given ends with matched below rotated. Prints both ratios
rotated / matched, over all of validation.loss_timesteps and at t = 900 alone (where the noise
hides the clip and the control is what is left to go by); the training clips and their cache are
the same in both measurements.

Every clip gets the same prompt ("a shape moves on a black background"): the synthetic prompts name
the shape, its colour and its direction, which fix the clip to a pixel or two, so a control would
tell the model nothing they do not. With one prompt, the control is what tells the clips apart.
"""

import argparse
import contextlib
import tempfile
from pathlib import Path

from common import (
    make_synthetic_dataset,
    timed_run,
    write_toml,
)  # puts the repository on sys.path

import cache  # noqa: E402
import render  # noqa: E402
import validate  # noqa: E402
from config import load_config  # noqa: E402
from model import setup_adapter  # noqa: E402
from tests.conftest import one_rank_group  # noqa: E402
from tools.calibrate_tiny_vae import calibrate  # noqa: E402
from tools.make_tiny_model import make_tiny_ltx2, make_tiny_wan  # noqa: E402

ONE_PROMPT = "a shape moves on a black background"
# Each mode at the size that gives its tiny transformer 4x4 tokens a latent frame (LTX-2's VAE
# shrinks 8x and patches 1x1, Wan's 8x and 2x2): with 16x16, the IC-LoRA's held-out ratio at t = 900
# fell to 0.994; with 2x2, VACE's to 1.002.
MODES = {
    "ic": (
        lambda out: make_tiny_ltx2(out, "2.0"),
        32,
        {"model.family": "ltx2", "model.type": "ic", "data.audio": False},
    ),
    "vace": (
        lambda out: make_tiny_wan(out, "vace"),
        64,
        {"model.family": "wan", "model.type": "vace"},
    ),
}


def held_out_losses(config: Path, lora_file: str | None) -> dict[str, float]:
    """val/loss of the config's held-out clips (their controls encoded first, if new) under the base
    model or the LoRA file."""
    cfg = load_config(str(config))
    with one_rank_group() as d:
        adapter = setup_adapter(cfg, d)
        entries, _, held_out = cache.prepare(cfg, adapter, d)
        model = render.load_model(cfg, adapter, d, None, lora_file)
        losses = validate.held_out_loss(
            adapter, model, entries, held_out, cfg.validation, cfg.run.seed, d, contextlib.nullcontext()
        )
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=sorted(MODES), default="ic")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--held-out", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_model, size, mode_settings = MODES[args.mode]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_model(str(root / "model"))
        data = root / "data"
        make_synthetic_dataset(
            str(data), num_videos=args.clips, frames=17, height=size, width=size, seed=0, control=True
        )
        calibrate(str(root / "model"), str(data), frames=9, size=(size, size))
        lines = (data / "controls.txt").read_text().splitlines()
        first_held = len(lines) - args.held_out
        held = lines[first_held:]
        (data / "one_prompt.txt").write_text(f"{ONE_PROMPT}\n" * len(lines))
        (data / "rotated.txt").write_text("\n".join(lines[:first_held] + held[1:] + held[:1]) + "\n")
        settings = {
            "model.path": str(root / "model"),
            "model.dtype": "fp32",
            "data.data_root": str(data),
            "data.control_column": "controls.txt",
            "data.caption_column": "one_prompt.txt",
            "data.train_resolution": [9, size, size],
            "data.cache_dir": str(root / "cache"),
            "data.held_out": args.held_out,
            "train.steps": args.steps,
            "train.batch_size": 2,
            "train.learning_rate": 3e-3,
            "train.lr_warmup_steps": 10,
            "train.mixed_precision": "no",
            "train.gradient_checkpointing": False,
            "run.seed": args.seed,
            "lora.rank": 16,
            "lora.lora_alpha": 16,
            "lora.target_modules": [
                "to_q",
                "to_k",
                "to_v",
                "to_out.0",
                "net.0.proj",
                "net.2",
                "proj_in",
                "proj_out",
            ],
            "checkpoint.checkpointing_steps": args.steps,
            "validation.do_validation": False,
            **mode_settings,
        }
        wall = timed_run(root, "run", settings)
        lora_file = str(root / "run" / "lora" / "pytorch_lora_weights.safetensors")
        configs = {
            name: write_toml(
                root / f"{name}.toml",
                {**settings, "run.output_dir": str(root / name), "data.control_column": column},
            )
            for name, column in (("matched", "controls.txt"), ("rotated", "rotated.txt"))
        }
        losses = {
            (weights, name): held_out_losses(config, lora)
            for weights, lora in (("base", None), ("lora", lora_file))
            for name, config in configs.items()
        }
    print(
        f"mode {args.mode}, seed {args.seed}: {args.steps} steps on {args.clips - args.held_out} clips "
        f"in {wall:.0f} s"
    )
    for weights in ("base", "lora"):
        for key in ("val/loss", "val/loss_t900"):
            matched, rotated = losses[weights, "matched"][key], losses[weights, "rotated"][key]
            print(
                f"{weights:>5} {key:<13}: held-out matched {matched:.4f}, rotated {rotated:.4f}, "
                f"rotated / matched {rotated / matched:.3f}"
            )


if __name__ == "__main__":
    main()
