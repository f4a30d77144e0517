"""Cache-pass throughput: batched and spread over ranks, against one clip at a time on one rank.

    python bench/bench_cache.py [--clips 48] [--frames 17] [--size 64] [--batch 8] [--nproc 2]

Builds the tiny model and a synthetic dataset in a temporary folder, then runs `cache.py` three times
on an empty cache: one process encoding one clip per VAE/T5 call (CogVideo's way, the baseline),
one process with --batch clips per call, and --nproc ranks with --batch clips per call. The rate is
the pass's own progress line (clips encoded / seconds in the encode loop, model loading excluded);
the wall time of each command (process start and model loading included) is printed beside it.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.make_synthetic_dataset import make_synthetic_dataset  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402

RATE = re.compile(r"cache: (\d+)/(\d+) clips, ([\d.]+) clips/s")


def cache_pass(config: Path, cache_dir: Path, batch: int, nproc: int) -> tuple[float, float]:
    """(clips per second in the encode loop, wall seconds of the command)."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    f"--nproc_per_node={nproc}", "--master_port=29533"]
    command = [*launcher, str(REPO / "cache.py"), "--cfg", str(config), "--data.cache_dir", str(cache_dir),
               "--data.cache_batch_size", str(batch)]
    start = time.perf_counter()
    # One thread per rank in every run, as torchrun sets it: each rank stands for one device.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    done, total, rate = RATE.findall(result.stderr)[-1]
    assert done == total, f"the pass stopped at {done}/{total}"
    return float(rate), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=48)
    parser.add_argument("--frames", type=int, default=17, help="frames per clip and per cached sample (8k+1)")
    parser.add_argument("--size", type=int, default=64, help="height and width of clips and samples")
    parser.add_argument("--batch", type=int, default=8, help="clips per VAE/T5 call in the batched runs")
    parser.add_argument("--nproc", type=int, default=2, help="ranks in the spread run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_model(str(root / "model"))
        make_synthetic_dataset(str(root / "data"), args.clips, args.frames, args.size, args.size, seed=0)
        config = root / "bench.toml"
        config.write_text(
            f'[run]\noutput_dir = "{root / "out"}"\n[model]\npath = "{root / "model"}"\ndtype = "fp32"\n'
            f'[data]\ndata_root = "{root / "data"}"\ntrain_resolution = [{args.frames}, {args.size}, {args.size}]\n'
        )
        runs = {
            "one clip at a time, 1 rank": cache_pass(config, root / "c1", 1, 1),
            f"batch {args.batch}, 1 rank": cache_pass(config, root / "c2", args.batch, 1),
            f"batch {args.batch}, {args.nproc} ranks": cache_pass(config, root / "c3", args.batch, args.nproc),
        }
    baseline = next(iter(runs.values()))[0]
    print(f"{args.clips} clips of {args.frames}x{args.size}x{args.size}, tiny CogVideoX VAE + T5")
    for name, (rate, wall) in runs.items():
        print(f"{name:28s} {rate:7.2f} clips/s  {rate / baseline:5.2f}x  (command wall {wall:5.1f} s)")


if __name__ == "__main__":
    main()
