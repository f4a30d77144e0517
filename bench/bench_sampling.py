"""Our sampling loop (validate.py) against CogVideoXPipeline: same model, prompts, seed, steps.

The scheduler is the same too.

    python bench/bench_sampling.py [--model DIR] [--prompts N] [--steps S] [--resolution F H W]
                                   [--repeats R]

Prints the fastest wall time of each over R interleaved repetitions (the minimum: other jobs on a
shared machine only ever add time), their ratio, and the largest pixel difference between their
frames. Without --model it renders with a fresh tiny CogVideoX (tools/make_tiny_model.py) in fp32.
"""

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import data  # noqa: E402
import ranks  # noqa: E402
import validate  # noqa: E402
from config import DataConfig, ModelConfig, ValidationConfig  # noqa: E402
from model_adapter import load_adapter  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402

PROMPTS = [
    "a red ball moves left",
    "a blue square drifts up slowly",
    "a small green circle bounces",
    "a white triangle moves right quickly",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="diffusers CogVideoX folder (default: a fresh tiny model)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--scheduler", default="dpm", choices=["dpm", "ddim"])
    parser.add_argument("--resolution", type=int, nargs=3, default=[9, 32, 32], metavar=("F", "H", "W"))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    from diffusers import CogVideoXPipeline

    model_dir = args.model or tempfile.mkdtemp()
    if not args.model:
        make_tiny_model(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    adapter = load_adapter(ModelConfig(path=model_dir, dtype=args.dtype), device)
    cfg = ValidationConfig(
        prompts=(PROMPTS * args.prompts)[: args.prompts],
        num_inference_steps=args.steps,
        scheduler=args.scheduler,
    )
    renderer = validate.ClipRenderer(
        adapter, cfg, DataConfig(train_resolution=args.resolution), model_dir, ranks.Dist(0, 1, 0, device)
    )
    transformer = adapter.load_transformer().eval()
    pipe = CogVideoXPipeline.from_pretrained(model_dir, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = adapter.sampler(args.scheduler)
    frames, height, width = args.resolution

    def ours():
        scheduler = adapter.sampler(args.scheduler)
        with adapter.sampling_attention(transformer):
            return [
                renderer.frames(transformer, i, scheduler, contextlib.nullcontext())
                for i in range(len(cfg.prompts))
            ]

    def theirs():
        return [
            pipe(
                p,
                num_frames=frames,
                height=height,
                width=width,
                num_inference_steps=args.steps,
                guidance_scale=cfg.guidance_scale,
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                max_sequence_length=adapter.text_length,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
            .float()
            .cpu()
            for i, p in enumerate(cfg.prompts)
        ]

    times = {ours: [], theirs: []}
    for _ in range(args.repeats + 1):  # the first round warms up both and is not counted
        for fn in (ours, theirs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[fn].append(time.perf_counter() - start)
            if fn is ours:
                our_frames = outputs
            else:
                their_frames = outputs
    ours_s, theirs_s = min(times[ours][1:]), min(times[theirs][1:])
    diff = max((a - b).abs().max().item() for a, b in zip(our_frames, their_frames))
    print(
        f"device {device}, {args.dtype}, {len(cfg.prompts)} prompts x {args.steps} {args.scheduler} steps at "
        f"{frames}x{height}x{width}, guidance {cfg.guidance_scale}, fastest of {args.repeats}"
    )
    print(f"ours     {ours_s:.3f} s")
    print(f"pipeline {theirs_s:.3f} s")
    print(
        f"pipeline / ours wall time: {theirs_s / ours_s:.2f}x; largest pixel difference (0..1 scale): {diff:.2e}"
    )


if __name__ == "__main__":
    main()
