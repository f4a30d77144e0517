"""Sequence parallelism: the trainer's step on 2 ranks with parallel.sp_size = 2 against 1 rank, on a
sequence long enough for attention to dominate.

    python bench/bench_sp.py [--resolution 49 128 128] [--short 3] [--long 13] [--repeats 3]

The tiny CogVideoX-5b (rotary embeddings, 2 heads of 16) and 4 synthetic clips at --resolution
(49x128x128: 13 latent frames of 32x32, 3328 video tokens), fp32, LoRA rank 4, batch 1, no
checkpointing, one thread per rank. Per step = (wall(long) - wall(short)) / (long - short), which
cancels start-up, the cache check and the final save; interleaved --repeats times, fastest of each.
"""

import argparse
import tempfile
from pathlib import Path

from common import make_synthetic_dataset, make_tiny_model, timed_run  # puts the repository on sys.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolution", type=int, nargs=3, default=[49, 128, 128])
    parser.add_argument("--short", type=int, default=3)
    parser.add_argument("--long", type=int, default=13)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    frames, height, width = args.resolution
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_model(str(root / "model"), "5b")
        make_synthetic_dataset(str(root / "data"), num_videos=4, frames=frames, height=height, width=width, seed=0)
        base = {"model.path": str(root / "model"), "model.dtype": "fp32", "data.data_root": str(root / "data"),
                "data.train_resolution": args.resolution, "data.cache_dir": str(root / "cache"), "data.held_out": 0,
                "train.batch_size": 1, "train.mixed_precision": "no", "train.gradient_checkpointing": False,
                "lora.rank": 4, "lora.lora_alpha": 2, "validation.do_validation": False}
        timed_run(root, "warm-cache", {**base, "train.steps": 1})
        walls = {(sp, steps): [] for sp in (1, 2) for steps in (args.short, args.long)}
        for r in range(args.repeats):
            for sp, steps in walls:
                walls[sp, steps].append(timed_run(root, f"run-{r}-{sp}-{steps}", {
                    **base, "train.steps": steps, "checkpoint.checkpointing_steps": steps + 1, "parallel.sp_size": sp},
                    nproc=sp))
    step_s = {sp: (min(walls[sp, args.long]) - min(walls[sp, args.short])) / (args.long - args.short) for sp in (1, 2)}
    print(f"tiny CogVideoX-5b, fp32, LoRA rank 4, batch 1 of {frames}x{height}x{width}, 1 thread per rank, "
          f"fastest of {args.repeats}:")
    for (sp, steps), w in walls.items():
        print(f"  sp {sp}  wall {steps:3d} steps  " + " ".join(f"{x:6.2f}" for x in w) + " s")
    for sp, s in step_s.items():
        print(f"  sp {sp} ({sp} rank{'s' if sp > 1 else ''})  {s * 1000:8.1f} ms per step")
    print(f"  2 ranks with sp_size 2 / 1 rank: {step_s[2] / step_s[1]:.2f}x")


if __name__ == "__main__":
    main()
