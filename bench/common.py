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

from tests.conftest import free_port, write_toml  # noqa: E402
from tools.make_synthetic_dataset import make_synthetic_dataset  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def tiny_settings(root: Path, transformer_settings: dict | None = None) -> dict:
    """Write the tiny model (its transformer_settings overridden) and 24 clips under root; the fp32
    settings that train on them."""
    make_tiny_model(str(root / "model"), transformer_settings=transformer_settings)
    make_synthetic_dataset(str(root / "data"), num_videos=24, frames=17, height=40, width=48, seed=0)
    return {"model.path": str(root / "model"), "model.dtype": "fp32", "data.data_root": str(root / "data"),
            "data.train_resolution": [9, 32, 32], "data.cache_dir": str(root / "cache"),
            "train.batch_size": 2, "train.mixed_precision": "no", "train.gradient_checkpointing": False,
            "validation.do_validation": False}


def median_step_s(output_dir: Path, global_batch: int, after: int) -> float:
    """The median of the trainer's own step times after step `after` (its metrics.jsonl, logged every
    step: global batch / samples_per_s), which start-up and a load spike move less than a wall time."""
    logged = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").open()]
    return statistics.median(global_batch / m["train/samples_per_s"] for m in logged
                             if m.get("step", 0) > after and "train/samples_per_s" in m)


def timed_run(root: Path, name: str, settings: dict, nproc: int = 1) -> float:
    """Write the config, run the trainer (one thread per rank) on a fresh output folder; its wall seconds."""
    config = write_toml(root / f"{name}.toml", {"run.output_dir": str(root / name), **settings})
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    start = time.perf_counter()
    result = subprocess.run([*launcher, str(REPO / "trainer.py"), "--cfg", str(config)], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    return wall
