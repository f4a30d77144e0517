"""Loading a full-size transformer: its peak resident memory, in one process and per FSDP rank.

    python bench/bench_load.py [--folder /tmp/vidtrain-bench-load] [--nproc 2]

Writes once (reused when present) a model folder whose transformer is CogVideoX-2B's architecture at
its published sizes (30 blocks of 30 x 64 heads, text 4096 x 226, 1.69B parameters) with random bf16
weights in two safetensors shards and their index, as the published folder holds them; the VAE, text
encoder, tokenizer and scheduler are the tiny 2b model's (loading the transformer never reads them).
Then, each in a fresh process (one thread per process):
1. One process: adapter.load_transformer() in bf16 (model.dtype); its peak resident size against the
   weight files' tensor bytes (target <= 1.3x).
2. --nproc FSDP ranks (torchrun, gloo, CPU): model.build_model for sft (the trainable copy in fp32),
   fully_shard per block; each rank's peak resident size against the fp32 model's bytes (target
   <= 0.75x on 2 ranks).
3. For comparison, one process: diffusers' from_pretrained in bf16 (with accelerate, which peft
   installs; without it from_pretrained allocates every weight before reading it), right after it
   returns and after one read of every weight: on a CPU, its bf16 tensors from bf16 files are views
   of the files' memory maps, resident only as they are first read.
Peak resident size: /proc/self/status VmHWM after the load, less VmRSS just before it (after the
imports, the process group and the adapter): the memory loading itself adds."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# puts the repository on sys.path
from common import REPO, free_port, make_tiny_model, write_random_transformer
from diffusers import CogVideoXTransformer3DModel

import command  # noqa: E402
import memory  # noqa: E402
import ranks  # noqa: E402
from config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from model import build_model  # noqa: E402
from model_adapter import load_adapter  # noqa: E402
from weights import Weights  # noqa: E402

# CogVideoX-2b's transformer/config.json (the published values; the tiny model writes the same key
# set).
CONFIG_2B = {
    "_class_name": "CogVideoXTransformer3DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 16,
    "max_text_seq_length": 226,
    "norm_elementwise_affine": True,
    "norm_eps": 1e-05,
    "num_attention_heads": 30,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": 2,
    "sample_frames": 49,
    "sample_height": 60,
    "sample_width": 90,
    "spatial_interpolation_scale": 1.875,
    "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "timestep_activation_fn": "silu",
}
SHARD_BYTES = 2 * 10**9  # the published folder's two shards


def write_model(folder: Path) -> None:
    """The tiny 2b model's folder with CogVideoX-2B's transformer in place of its own, random bf16."""
    make_tiny_model(str(folder), "2b")
    shutil.rmtree(folder / "transformer")
    config = {k: v for k, v in CONFIG_2B.items() if k != "_class_name"}
    write_random_transformer(folder / "transformer", CogVideoXTransformer3DModel, config, SHARD_BYTES)


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(folder: Path, mode: str) -> None:
    """In this process: load, then print one JSON line of this rank's figures."""
    fsdp = mode == "fsdp"
    d = ranks.init(ParallelConfig(strategy="fsdp" if fsdp else "ddp"))
    adapter = load_adapter(ModelConfig(path=str(folder), dtype="bf16"), d.device)
    memory.reset_peak_memory(d.device, trim_heap=True)  # VmHWM back to the resident size now
    baseline = rss_kb("VmRSS")
    if mode == "pretrained":
        model = adapter.TRANSFORMER.from_pretrained(folder, subfolder="transformer", dtype=adapter.dtype)
    elif fsdp:
        model = build_model(
            adapter,
            TrainConfig(training_type="sft", mixed_precision="bf16", gradient_checkpointing=False),
            LoraConfig(),
            ParallelConfig(strategy="fsdp"),
            0,
            d,
        )
    else:
        model = adapter.load_transformer()
    peak = rss_kb("VmHWM")
    # its bf16 tensors are views of the files' memory maps: resident once read
    if mode == "pretrained":
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    touched = rss_kb("VmHWM")
    local = sum(memory._local_bytes(p) for p in model.parameters())
    print(
        json.dumps(
            {
                "rank": d.rank,
                "baseline_mb": baseline / 1024,
                "peak_mb": peak / 1024,
                "added_bytes": (peak - baseline) * 1024,
                "local_param_bytes": local,
                "touched_bytes": (touched - baseline) * 1024,
                "params": sum(p.numel() for p in model.parameters()),
            }
        ),
        flush=True,
    )
    del model
    command.shutdown()


def run(folder: Path, mode: str, nproc: int) -> list[dict]:
    launcher = (
        [sys.executable]
        if mode != "fsdp"
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
        ]
    )
    result = subprocess.run(
        [*launcher, __file__, "--folder", str(folder), "--measure", mode],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"{mode} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return sorted(
        (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default="/tmp/vidtrain-bench-load")
    parser.add_argument("--nproc", type=int, default=2)
    # The child processes' one measurement.
    parser.add_argument("--measure", choices=["one", "fsdp", "pretrained"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.folder)
    if args.measure:
        return measure(folder, args.measure)
    if not (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file():
        print(f"writing CogVideoX-2B's transformer (random bf16) to {folder} ...", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        write_model(folder)
    file_bytes = Weights(folder / "transformer").data_bytes
    (one,) = run(folder, "one", 1)
    params = one["params"]
    print(
        f"transformer: {params / 1e9:.3f}B parameters, {file_bytes / 2**30:.2f} GiB of bf16 tensor data "
        f"in the files, {4 * params / 2**30:.2f} GiB in fp32"
    )
    print(
        f"1 process, bf16: loading adds {one['added_bytes'] / 2**30:.2f} GiB to the resident size "
        f"(baseline {one['baseline_mb'] / 1024:.2f} GiB, peak {one['peak_mb'] / 1024:.2f} GiB): "
        f"{one['added_bytes'] / file_bytes:.2f}x the weight files (target <= 1.3x)"
    )
    for rank in run(folder, "fsdp", args.nproc):
        print(
            f"FSDP sft, rank {rank['rank']} of {args.nproc}: loading adds {rank['added_bytes'] / 2**30:.2f} GiB "
            f"(baseline {rank['baseline_mb'] / 1024:.2f} GiB, peak {rank['peak_mb'] / 1024:.2f} GiB; its fp32 "
            f"shard {rank['local_param_bytes'] / 2**30:.2f} GiB): {rank['added_bytes'] / (4 * params):.2f}x the "
            f"fp32 model (target <= 0.75x)"
        )
    (pretrained,) = run(folder, "pretrained", 1)
    print(
        f"1 process, bf16, diffusers' from_pretrained (with accelerate): adds {pretrained['added_bytes'] / 2**30:.2f}"
        f" GiB ({pretrained['added_bytes'] / file_bytes:.2f}x the weight files), {pretrained['touched_bytes'] / 2**30:.2f}"
        f" GiB ({pretrained['touched_bytes'] / file_bytes:.2f}x) once every weight has been read: its bf16 weights"
        " are views of the files' memory maps (page cache, faulted in as first read; copied on a GPU)"
    )


if __name__ == "__main__":
    main()
