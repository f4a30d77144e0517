"""The render command: validation clips of a checkpoint, a LoRA file or the base model.

The render command: validation clips of a checkpoint, an exported LoRA or the base model, without
training. `python render.py ...` runs it too (its documented name).

    python render.py --cfg FILE.toml [--checkpoint DIR [--online] | --lora FILE] --prompt TEXT
                     [--image FILE] [--last-image FILE] [--control FILE [--mask FILE]] [--reference FILE]
                     [--prompt TEXT ...]
    torchrun --nproc_per_node N render.py ...       # the same, prompts spread over the ranks

The model is built as the trainer builds it, with the checkpoint's weights (its EMA weights unless
--online) or the LoRA file's; validate.py's ClipRenderer samples and writes the clips.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from safetensors import safe_open

import ckpt
import command
import data
import parallel
import ranks
import validate
from config import Config, ConfigError, check_validation_files, check_validation_images, check_values
from model import EMA, build_frozen, build_model
from model_adapter import RunSettings, load_adapter

log = logging.getLogger("vidtrain")


def load_model(
    cfg: Config, adapter, d: ranks.Dist, checkpoint: str | None, lora_file: str | None, online: bool = False
):
    """The transformer as the trainer builds it (LoRA injected, DDP or FSDP), holding the weights of
    a checkpoint (its EMA weights when it has them, as in-training validation, unless `online`), of
    an exported LoRA file, or the base model's."""
    # a checkpoint or --lora decides the weights
    if lora_file:
        check_lora_metadata(lora_file, adapter.lora_metadata())
    lora_cfg = dataclasses.replace(cfg.lora, init_from="")
    model = build_model(adapter, cfg.train, lora_cfg, cfg.parallel, cfg.run.seed, d, lora_file or "")
    if checkpoint:
        ema = EMA(model, cfg.train.ema_decay) if ckpt.has_ema(checkpoint) and not online else None
        ckpt.load_weights(
            model,
            checkpoint,
            ckpt.run_identity(adapter, cfg.model, cfg.train, cfg.lora),
            d,
            ema,
        )
        if ema is not None:
            ema.swap_in()
            log.info("rendering with the checkpoint's EMA weights (--online renders the others)")
    return model


def check_lora_metadata(path: str, expected: dict[str, str]) -> None:
    """A LoRA file whose metadata gives one of the family's settings (Adapter.lora_metadata: an
    IC-LoRA's reference_downscale_factor) another value than this run's model.<key>: named before
    anything renders."""
    file = Path(path) / "pytorch_lora_weights.safetensors" if Path(path).is_dir() else Path(path)
    if not expected or not file.is_file():
        return
    with safe_open(str(file), framework="pt") as f:
        header = f.metadata() or {}
    for key, value in expected.items():
        if header.get(key, value) != value:
            raise ConfigError(
                f"--lora {path} was trained with {key} = {header[key]} (its metadata), and "
                f"model.{key} is {value}: set model.{key} = {header[key]}"
            )


def render_names(cfg: Config, checkpoint: str | None, lora_file: str | None, online: bool) -> list[str]:
    """render_{checkpoint or LoRA file}[_online]_prompt_{i}_{hash}: the hash covers what makes clip
    i (the weights' path and the LoRA file's date, its prompt and image, the model and sampling
    settings), so a render never replaces one of other weights, prompts or settings."""
    weights = checkpoint or lora_file
    source = Path(checkpoint).name if checkpoint else Path(lora_file).stem if lora_file else "base"
    common = {
        "weights": str(Path(weights).resolve()) if weights else "",
        "online": online,
        "lora_mtime": os.stat(lora_file).st_mtime_ns if lora_file else 0,
        "model": dataclasses.asdict(cfg.model),
        "mixed_precision": cfg.train.mixed_precision,
        "validation": {
            k: v
            for k, v in dataclasses.asdict(cfg.validation).items()
            if k not in ("prompts", "images", "last_images", "control_videos", "masks", "reference_images")
        },
    }
    names = []
    for i, prompt in enumerate(cfg.validation.prompts):
        image = (
            hashlib.sha256(Path(cfg.validation.images[i]).read_bytes()).hexdigest()
            if cfg.validation.images
            else ""
        )
        # hashed only when given: the names of other renders stay as they were
        last = cfg.validation.last_images
        last = {"last_image": hashlib.sha256(Path(last[i]).read_bytes()).hexdigest()} if last else {}
        controls = cfg.validation.control_videos  # the same: hashed only when given
        last |= {"control": hashlib.sha256(Path(controls[i]).read_bytes()).hexdigest()} if controls else {}
        masks = cfg.validation.masks  # the same
        last |= {"mask": hashlib.sha256(Path(masks[i]).read_bytes()).hexdigest()} if masks else {}
        references = cfg.validation.reference_images  # the same (one reference: its hash)
        if references:
            paths = [references[i]] if isinstance(references[i], str) else references[i]
            hashes = [hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in paths]
            last["reference"] = hashes[0] if len(hashes) == 1 else hashes
        digest = hashlib.sha256(
            json.dumps({**common, "prompt": prompt, "image": image, **last}, sort_keys=True).encode()
        )
        names.append(f"render_{source}{'_online' if online else ''}_prompt_{i}_{digest.hexdigest()[:8]}")
    return names


def check_lora_file(lora_file: str) -> None:
    """A part of a DCP checkpoint passed as --lora is named, with what to pass instead."""
    path = Path(lora_file)
    folder = path if path.is_dir() else path.parent
    if path.suffix == ".distcp" or (folder / ".metadata").is_file():
        raise ConfigError(
            f"--lora {lora_file} is part of the checkpoint {folder}, not a LoRA file: render it with "
            f"--checkpoint {folder}, or export it (python ckpt.py export --cfg FILE.toml --checkpoint "
            f"{folder}) and pass --lora {folder / 'export' / 'lora' / 'pytorch_lora_weights.safetensors'}"
        )


def render_command(
    cfg: Config,
    prompts: list[str],
    images: list[str],
    checkpoint: str | None,
    lora_file: str | None,
    online: bool,
    d: ranks.Dist,
    last_images: list[str] = (),
    controls: list[str] = (),
    references: list[str] = (),
    masks: list[str] = (),
) -> None:
    # the command line's prompts (and images, last images, controls, references) replace the
    # config's
    if prompts:
        cfg.validation.prompts, cfg.validation.images = prompts, images
        cfg.validation.last_images, cfg.validation.control_videos = list(last_images), list(controls)
        # several references of one prompt: separated by data.REFERENCES
        cfg.validation.reference_images = [
            r.split(data.REFERENCES) if data.REFERENCES in r else r for r in references
        ]
        cfg.validation.masks = list(masks)
        check_values(cfg)
    if not cfg.validation.prompts:
        raise ConfigError("nothing to render: pass --prompt TEXT or set validation.prompts in the config")
    check_validation_images(cfg)
    check_validation_files(cfg.validation)
    if lora_file:
        check_lora_file(lora_file)
    with ranks.all_or_none():
        # LTX-2's positions in seconds at the rate the clips trained at; the other settings are
        # training's
        adapter = load_adapter(cfg.model, d.device, RunSettings(frame_rate=cfg.data.target_fps))
        renderer = validate.ClipRenderer(
            adapter,
            cfg.validation,
            cfg.data,
            cfg.run.output_dir,
            d,
            lambda folder: build_frozen(adapter, folder, cfg.train, cfg.parallel, d),
        )
        model = load_model(cfg, adapter, d, checkpoint, lora_file, online)
    compute = parallel.Compute(d.device, cfg.train.mixed_precision, cfg.train.attention_backend)
    names = render_names(cfg, checkpoint, lora_file, online)
    try:
        with validate.eager():
            clips = renderer.render(model, compute)
    except ranks.Preempted:  # nothing is kept for a relaunch to continue: not a clean stop
        raise ranks.StopRun(
            "stopped by a signal before the clips were written; run the command again"
        ) from None
    for path in renderer.save(clips, names, renderer.sounds):
        log.info("wrote %s", path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cfg", required=True, help="TOML config file (a run's config.toml for its checkpoints)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a checkpoint-N folder of a run trained with --cfg")
    source.add_argument("--lora", help="an exported LoRA: ours, diffusers' or PEFT's layout")
    parser.add_argument(
        "--online", action="store_true", help="with --checkpoint: the online weights, not the EMA"
    )
    parser.add_argument(
        "--prompt", action="append", default=[], help="a prompt (repeatable); default: validation.prompts"
    )
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        help="i2v (IC-LoRA: its first frame): the image of each --prompt, in order",
    )
    parser.add_argument(
        "--last-image",
        action="append",
        default=[],
        help="first-last-frame (Wan FLF2V): the last image of each --prompt, in order",
    )
    parser.add_argument(
        "--control",
        action="append",
        default=[],
        help="control models (LTX-2 IC-LoRA): the control video of each --prompt, in order",
    )
    parser.add_argument(
        "--reference",
        action="append",
        default=[],
        help="Wan VACE: the reference image of each --prompt, in order (several: A.png|B.png)",
    )
    parser.add_argument(
        "--mask",
        action="append",
        default=[],
        help="Wan VACE: the mask (video or image) of each --control, in order",
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.online and not args.checkpoint:
        parser.error("--online chooses between a checkpoint's weights: it needs --checkpoint")
    if (args.image or args.last_image or args.control or args.reference or args.mask) and not args.prompt:
        parser.error(
            "--image, --last-image, --control, --mask and --reference go with --prompt: one of each per prompt"
        )
    command.run_command(
        lambda cfg, d: render_command(
            cfg,
            args.prompt,
            args.image,
            args.checkpoint,
            args.lora,
            args.online,
            d,
            args.last_image,
            args.control,
            args.reference,
            args.mask,
        ),
        args.cfg,
        overrides,
    )


if __name__ == "__main__":
    main()
