"""Sequence parallelism: the trainer's step on 2 ranks with parallel.sp_size = 2 against 1 rank.

On a sequence long enough for attention to dominate.

    python bench/bench_sp.py [--resolution 49 128 128] [--steps 20] [--repeats 3]

The tiny CogVideoX-5b (rotary embeddings, 2 heads of 16) and 4 synthetic clips at --resolution
(49x128x128: 13 latent frames of 32x32, 3328 video tokens), fp32, LoRA rank 4, batch 1, no
checkpointing, one thread per rank, logging every step. A step's time is the trainer's own (its
metrics.jsonl: global batch / samples_per_s); per run the median over the steps after the first 5,
which start-up and a load spike from another job move less than a difference of wall times;
interleaved --repeats times, the median of the runs.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

# puts the repository on sys.path
from common import make_synthetic_dataset, make_tiny_model, median_step_s, timed_run

WARMUP = 5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--resolution", type=int, nargs=3, default=[49, 128, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    frames, height, width = args.resolution
    times = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_model(str(root / "model"), "5b")
        make_synthetic_dataset(
            str(root / "data"), num_videos=4, frames=frames, height=height, width=width, seed=0
        )
        base = {
            "model.path": str(root / "model"),
            "model.dtype": "fp32",
            "data.data_root": str(root / "data"),
            "data.train_resolution": args.resolution,
            "data.cache_dir": str(root / "cache"),
            "data.held_out": 0,
            "train.batch_size": 1,
            "train.mixed_precision": "no",
            "train.gradient_checkpointing": False,
            "lora.rank": 4,
            "lora.lora_alpha": 2,
            "validation.do_validation": False,
            "train.steps": args.steps,
            "checkpoint.checkpointing_steps": args.steps + 1,
        }
        timed_run(root, "warm-cache", {**base, "train.steps": 1})
        for r in range(args.repeats):
            for sp in times:
                timed_run(root, f"run-{r}-{sp}", {**base, "parallel.sp_size": sp}, nproc=sp)
                times[sp].append(median_step_s(root / f"run-{r}-{sp}", 1, WARMUP))
    print(
        f"tiny CogVideoX-5b, fp32, LoRA rank 4, batch 1 of {frames}x{height}x{width}, 1 thread per rank, "
        f"median step of steps {WARMUP + 1}-{args.steps}, {args.repeats} interleaved runs:"
    )
    for sp, runs in times.items():
        print(
            f"  sp {sp} ({sp} rank{'s' if sp > 1 else ''})  {statistics.median(runs) * 1000:8.1f} ms per step   "
            f"runs: {' '.join(f'{t * 1000:.1f}' for t in runs)}"
        )
    print(
        f"  2 ranks with sp_size 2 / 1 rank: {statistics.median(times[2]) / statistics.median(times[1]):.2f}x "
        "(target <= 0.65x)"
    )


if __name__ == "__main__":
    main()
