"""The data path: cache-pass throughput, decode memory, decode workers, startup with a full cache.

    python bench/bench_cache.py [--part all|throughput|memory|workers|startup|prefetch] [--clips 96]
        [--startup-clips 10000] [--repeats 2] [--cold-repeats 2] [--startup-dir DIR]
        [--prefetch-steps 200] [--read-latency-ms 0]

Every part builds its model and clips in a temporary folder and compares against a baseline measured
in the same run:
- throughput: `cache.py` on an empty cache, one clip per VAE/T5 call on one rank (CogVideo's way,
  the baseline) against --batch clips per call on one rank and on --nproc ranks; the pass's own
  rate.
- memory: the peak extra resident memory of decoding a 49-frame 1920x1080 H.264 clip to 49x480x720
  (data.decode_clip: seek, swscale resize per frame, uint8), in a fresh process; target < 200 MB.
- workers: the cache pass over 1280x720 clips (decoding dominates: the tiny VAE encodes 17x32x32)
  with data.decode_workers = 1 against 2 (this machine's cores); target >= 1.5x.
- startup: the wall time from launching `trainer.py` to its "step 1" line with a complete cache of
  --startup-clips small clips, with the manifest (warm) against without it (cold: every header read
  and hashed again), medians of --repeats and --cold-repeats runs; target warm < 10 s. With
  --startup-dir DIR the model, clips and cache stay in DIR and later runs reuse them (the fill takes
  minutes).
- prefetch: training's batch fetch in this process, one thread, the tiny CogVideoX with LoRA rank 4:
  --prefetch-steps micro-steps (fetch, loss, backward) with each batch read in the step's thread
  (Cache.load_batch, the baseline) against cache.Prefetch (read while the step before
  computes), interleaved --repeats times (each first in every other one); the step thread's wait for
  its batch and the whole micro-step, medians. --read-latency-ms sleeps before each file read, a
  stand-in for a network filesystem (an emulation, not a measurement of one).
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import free_port, write_toml  # noqa: E402
from tools.make_synthetic_dataset import make_synthetic_dataset  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402

RATE = re.compile(r"cache: (\d+)/(\d+) clips, ([\d.]+)/s")
# one thread per rank in every run: each rank stands for a device
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def settings(root: Path, data: str, resolution: list[int], cache: str) -> dict:
    return {
        "run.output_dir": str(root / "out"),
        "model.path": str(root / "model"),
        "model.dtype": "fp32",
        "data.data_root": str(root / data),
        "data.train_resolution": resolution,
        "data.cache_dir": str(root / cache),
        "train.mixed_precision": "no",
        "train.gradient_checkpointing": False,
        "train.batch_size": 1,
        "validation.do_validation": False,
    }


def cache_pass(root: Path, values: dict, nproc: int = 1) -> tuple[float, float]:
    """(clips per second in the encode loop, wall seconds of the command)."""
    config = write_toml(root / "bench.toml", values)
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
        ]
    )
    start = time.perf_counter()
    result = subprocess.run(
        [*launcher, str(REPO / "cache.py"), "--cfg", str(config)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the cache pass failed:\n{result.stderr[-3000:]}")
    done, total, rate = RATE.findall(result.stderr)[-1]
    assert done == total, f"the pass stopped at {done}/{total}"
    return float(rate), wall


def throughput(root: Path, args) -> None:
    make_synthetic_dataset(str(root / "clips"), args.clips, 17, 64, 64, seed=0)
    base = settings(root, "clips", [17, 64, 64], "unused")
    runs = {
        "one clip at a time, 1 rank": ({"data.cache_batch_size": 1, "data.cache_dir": str(root / "c1")}, 1),
        f"batch {args.batch}, 1 rank": (
            {"data.cache_batch_size": args.batch, "data.cache_dir": str(root / "c2")},
            1,
        ),
        f"batch {args.batch}, {args.nproc} ranks": (
            {"data.cache_batch_size": args.batch, "data.cache_dir": str(root / "c3")},
            args.nproc,
        ),
    }
    measured = {name: cache_pass(root, {**base, **extra}, nproc) for name, (extra, nproc) in runs.items()}
    baseline = next(iter(measured.values()))[0]
    print(f"throughput: {args.clips} clips of 17x64x64, tiny CogVideoX VAE + T5")
    for name, (rate, wall) in measured.items():
        print(f"  {name:28s} {rate:7.2f} clips/s  {rate / baseline:5.2f}x  (command wall {wall:5.1f} s)")


MEMORY_PROBE = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
import data, decode
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
path = Path({clip!r})
clip = data.Clip(path, "a clip", 1, "videos.txt")
item = data.plan_clip(clip, decode.probe(path), "content", [(49, 480, 720)], data.DataConfig(), 0)
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to what is resident now
before, start = status("VmRSS"), time.perf_counter()
video = data.decode_clip(item)
print(status("VmHWM") - before, time.perf_counter() - start, tuple(video.shape))
"""


def memory(root: Path, args) -> None:
    import av
    import numpy as np

    clip = root / "hd49.mp4"
    with av.open(str(clip), "w") as out:
        stream = out.add_stream("libx264", rate=24, options={"preset": "ultrafast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        ys, xs = np.mgrid[0:1080, 0:1920]
        for k in range(49):
            pixels = np.stack([(xs + 8 * k) % 256, (ys + 4 * k) % 256, (xs ^ ys) % 256], -1).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE.format(repo=str(REPO), clip=str(clip))],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    extra, seconds, shape = result.stdout.split(maxsplit=2)
    print(
        f"memory: decoding 49 frames of 1920x1080 H.264 to {shape.strip()}: peak extra RSS "
        f"{int(extra) / 2**20:.0f} MiB (target < 200 MiB), {float(seconds):.2f} s; the frames alone are "
        f"{49 * 480 * 720 * 3 / 2**20:.0f} MiB (full-resolution float32 frames would be {49 * 1080 * 1920 * 12 / 2**20:.0f} MiB)"
    )


def workers(root: Path, args) -> None:
    make_synthetic_dataset(str(root / "hd"), args.worker_clips, 17, 720, 1280, seed=1)
    base = settings(root, "hd", [17, 32, 32], "unused")
    walls = {n: [] for n in (1, 2)}
    for r in range(args.repeats):
        for n in walls:
            rate, _ = cache_pass(
                root,
                {
                    **base,
                    "data.decode_workers": n,
                    "data.cache_batch_size": 4,
                    "data.cache_dir": str(root / f"w{n}-{r}"),
                },
            )
            walls[n].append(rate)
    best = {n: max(rates) for n, rates in walls.items()}
    print(
        f"workers: {args.worker_clips} clips of 17x720x1280 H.264 to 17x32x32, 1 rank, fastest of {args.repeats}"
    )
    for n, rate in best.items():
        print(
            f"  decode_workers = {n}: {rate:6.2f} clips/s  {rate / best[1]:4.2f}x   (runs {' '.join(f'{x:.2f}' for x in walls[n])})"
        )
    print("  target: >= 1.5x with 2 workers")


def time_to_step_one(config: Path, output_dir: Path) -> float:
    # a run that got to save its step 1 would only export next time
    shutil.rmtree(output_dir, ignore_errors=True)
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "trainer.py"), "--cfg", str(config)],
        cwd=REPO,
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for line in process.stderr:
        if " step 1/" in line:
            elapsed = time.perf_counter() - start
            process.kill()
            process.wait()
            return elapsed
    sys.exit(f"{config}: the trainer ended before step 1")


def startup(root: Path, args) -> None:
    n = args.startup_clips
    # clips, model and cache kept there: filled by the first run, reused by the next
    if args.startup_dir:
        root = Path(args.startup_dir)
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "model").is_dir():
            make_tiny_model(str(root / "model"))
    values = {
        **settings(root, "many", [9, 32, 32], "many-cache"),
        "data.cache_batch_size": 64,
        "train.steps": 1,
    }
    config = write_toml(root / "startup.toml", values)
    if (root / "many" / "videos.txt").is_file() and len(
        (root / "many" / "videos.txt").read_text().splitlines()
    ) == n:
        filled = "reused"
    else:
        print(f"startup: writing {n} clips of 9x32x32 ...", flush=True)
        make_synthetic_dataset(str(root / "many"), n, 9, 32, 32, seed=2)
        filled = f"filled in {cache_pass(root, values)[1]:.0f} s"
    warm = [time_to_step_one(config, root / "out") for _ in range(args.repeats)]
    manifest = root / "many-cache" / "manifest.json"
    cold = []
    for _ in range(args.cold_repeats):
        manifest.unlink()
        cold.append(time_to_step_one(config, root / "out"))
    print(f"startup: {n} clips, complete cache ({filled}), launch of trainer.py to its step 1 line; medians")
    print(
        f"  manifest warm  {statistics.median(warm):6.1f} s   (runs {' '.join(f'{x:.1f}' for x in warm)}; target < 10 s)"
    )
    if cold:
        print(
            f"  manifest cold  {statistics.median(cold):6.1f} s   (runs {' '.join(f'{x:.1f}' for x in cold)}): every "
            "header read and hashed"
        )
        print(f"  cold / warm    {statistics.median(cold) / statistics.median(warm):6.2f}x")


def prefetch(root: Path, args) -> None:
    import torch
    import torch.distributed as dist

    import cache
    import data
    import lora
    import ranks
    from config import load_config
    from data import Sampler
    from model import setup_adapter

    torch.set_num_threads(1)
    make_synthetic_dataset(str(root / "pf"), 24, 17, 40, 48, seed=0)
    cfg = load_config(
        str(
            write_toml(
                root / "prefetch.toml",
                {**settings(root, "pf", [9, 32, 32], "pf-cache"), "train.batch_size": 2, "data.held_out": 4},
            )
        )
    )
    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    d = ranks.Dist(0, 1, 0, cpu)
    adapter = setup_adapter(cfg, d)
    entries, clips, _ = cache.prepare(cfg, adapter, d)
    # a stand-in for a network filesystem's latency per file (it sleeps, as I/O waits)
    if args.read_latency_ms:
        read = entries.read
        entries.read = lambda item, kind: time.sleep(args.read_latency_ms / 1000) or read(item, kind)
    model = adapter.load_transformer()
    lora.inject_lora(model, cfg.lora.target_modules, 4, 2, 0.0, 0)
    sampler = Sampler([clip.bucket for clip in clips], 2, 0)
    batches = [[clips[i] for i in sampler.next_batch()] for _ in range(args.prefetch_steps)]

    def micro_steps(fetch) -> tuple[float, float]:
        """Median seconds of the step thread's wait for its batch, and of the whole micro-step."""
        waits, steps = [], []
        for k in range(len(batches)):
            start = time.perf_counter()
            batch = fetch(k)
            fetched = time.perf_counter()
            adapter.train_loss(
                model, batch, [data.keyed_generator(0, k, p) for p in range(2)]
            ).mean().backward()
            model.zero_grad(set_to_none=True)
            waits.append(fetched - start)
            steps.append(time.perf_counter() - start)
        return statistics.median(waits), statistics.median(steps)

    def inline(k):
        return {
            key: value.to(cpu, non_blocking=True) for key, value in entries.load_batch(batches[k]).items()
        }

    def prefetched(k):
        return ahead.batch(batches[k], batches[k + 1] if k + 1 < len(batches) else None)

    measured = {"in the step's thread": [], "cache.Prefetch": []}
    for r in range(args.repeats):
        ahead = cache.Prefetch(entries, cpu)
        for name, fetch in sorted(
            {"in the step's thread": inline, "cache.Prefetch": prefetched}.items(), reverse=r % 2 == 1
        ):  # each first in every other repetition
            measured[name].append(micro_steps(fetch))
        ahead.close()
    dist.destroy_process_group()
    latency = f", {args.read_latency_ms} ms slept per file read" if args.read_latency_ms else ""
    print(
        f"prefetch: {args.prefetch_steps} micro-steps of batch 2 (9x32x32, 2 cache files per clip{latency}), tiny "
        f"CogVideoX LoRA rank 4, loss + backward, 1 thread, {args.repeats} interleaved repetitions; medians in ms"
    )
    base_wait, base_step = (
        statistics.median(run[i] for run in measured["in the step's thread"]) for i in (0, 1)
    )
    for name, runs in measured.items():
        wait, step = (statistics.median(run[i] for run in runs) for i in (0, 1))
        print(
            f"  {name:22s} wait for the batch {wait * 1000:6.3f} ({wait / base_wait:5.2f}x)   micro-step "
            f"{step * 1000:6.2f} ({step / base_step:5.3f}x)   runs: "
            + " ".join(f"{w * 1000:.3f}/{s * 1000:.2f}" for w, s in runs)
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part", choices=["all", "throughput", "memory", "workers", "startup", "prefetch"], default="all"
    )
    parser.add_argument("--clips", type=int, default=48, help="clips in the throughput part")
    parser.add_argument("--batch", type=int, default=8, help="clips per VAE/T5 call in the batched runs")
    parser.add_argument("--nproc", type=int, default=2, help="ranks in the spread run")
    parser.add_argument("--worker-clips", type=int, default=16, help="720p clips in the workers part")
    parser.add_argument("--startup-clips", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold-repeats", type=int, default=2, help="startup runs without the manifest")
    parser.add_argument(
        "--startup-dir", default="", help="keep the startup part's clips and cache here, and reuse them"
    )
    parser.add_argument(
        "--prefetch-steps", type=int, default=200, help="micro-steps per run of the prefetch part"
    )
    parser.add_argument(
        "--read-latency-ms",
        type=float,
        default=0.0,
        help="prefetch part: sleep this long before each cache file read (a slow filesystem's stand-in)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_model(str(root / "model"))
        for part in (throughput, memory, workers, startup, prefetch):
            if args.part in ("all", part.__name__):
                part(root, args)


if __name__ == "__main__":
    main()
