"""What the trainer benchmarks share: the tiny model and clips in a folder, and a timed trainer run."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.conftest import free_port, write_toml  # noqa: E402
from tools.make_synthetic_dataset import make_synthetic_dataset  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def tiny_settings(root: Path, transformer_settings: dict | None = None) -> dict:
    """Write the tiny model and 24 clips under root; return the fp32 settings that train on them.

    The model's transformer_settings are overridden."""
    make_tiny_model(str(root / "model"), transformer_settings=transformer_settings)
    make_synthetic_dataset(str(root / "data"), num_videos=24, frames=17, height=40, width=48, seed=0)
    return {
        "model.path": str(root / "model"),
        "model.dtype": "fp32",
        "data.data_root": str(root / "data"),
        "data.train_resolution": [9, 32, 32],
        "data.cache_dir": str(root / "cache"),
        "train.batch_size": 2,
        "train.mixed_precision": "no",
        "train.gradient_checkpointing": False,
        "validation.do_validation": False,
    }


def median_step_s(output_dir: Path, global_batch: int, after: int) -> float:
    """The median of the trainer's own step times after step `after`.

    Its metrics.jsonl, logged every step: global batch / samples_per_s, which start-up and a load
    spike move less than a wall time."""
    logged = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").open()]
    return statistics.median(
        global_batch / m["train/samples_per_s"]
        for m in logged
        if m.get("step", 0) > after and "train/samples_per_s" in m
    )


def timed_run(root: Path, name: str, settings: dict, nproc: int = 1) -> float:
    """Run the trainer with this config on a fresh output folder; return its wall seconds.

    Write the config, run the trainer (one thread per rank) on a fresh output folder; its wall
    seconds."""
    config = write_toml(root / f"{name}.toml", {"run.output_dir": str(root / name), **settings})
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
        [*launcher, str(REPO / "trainer.py"), "--cfg", str(config)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    return wall


def write_random_transformer(folder: Path, cls, config: dict, shard_bytes: int, device: str = "cpu") -> None:
    """Write a transformer folder as the published ones hold it, with random bf16 weights.

    A transformer folder as the published ones hold it: config.json (with cls's name) and random
    bf16 weights (normal, std 0.02, drawn on `device` from seed 0) in safetensors shards of about
    shard_bytes, with their index."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **config}, indent=2) + "\n")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in cls.from_config(config).state_dict().items()}
    generator, shard, shards, weight_map = torch.Generator(device).manual_seed(0), {}, [], {}

    def flush():
        name = f"diffusion_pytorch_model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        shards.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key, shape in shapes.items():
        shard[key] = (torch.randn(shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
        if sum(t.nbytes for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    # Files named 00001-of-00002 by diffusers; the count is known only now.
    for name in shards:
        final = name.replace(".safetensors", f"-of-{len(shards):05d}.safetensors")
        (folder / name).rename(folder / final)
        weight_map = {k: final if v == name else v for k, v in weight_map.items()}
    total = sum((folder / n).stat().st_size for n in set(weight_map.values()))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
