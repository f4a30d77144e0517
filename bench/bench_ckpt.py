"""Checkpoints: what one holds against the exported adapter, and how long saving stalls training.

    python bench/bench_ckpt.py [--steps 40] [--repeats 3] [--every 1] [--sft] [--nproc 1]

Builds the tiny model and a synthetic dataset in a temporary folder, then:
1. Payload: trains 2 steps with LoRA rank 64 and reads the checkpoint's tensor bytes from DCP's own
   metadata, split into model / optimizer / other, against the exported adapter's tensor bytes; and
   the folder's size on disk against the adapter file and the frozen base (what finetrainers adds).
2. Stall: runs `trainer.py` for --steps steps saving every --every steps, synchronously and with
   checkpoint.async_save, and once saving only at the end (the baseline), interleaved, fastest of
   --repeats; a 1-step run gives the loop's own time per step. Overhead per save =
   (wall - baseline wall) / saves before the last step (the final save is synchronous in every mode).
   LoRA rank 64 on every linear layer, or full fine-tuning with --sft, so checkpoints are not trivial.
"""

import argparse
import math
import tempfile
from pathlib import Path

from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from common import timed_run, tiny_settings

ALL_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_out"]


def safetensors_bytes(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def checkpoint_bytes(path: Path) -> dict[str, int]:
    """Tensor bytes per top-level key of DCP's metadata; the optimizer's step counters apart."""
    parts: dict[str, int] = {}
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        group = key.split(".")[0]
        if group == "optimizer" and key.endswith(".step"):
            group = "optimizer steps"
        parts[group] = parts.get(group, 0) + math.prod(meta.size) * meta.properties.dtype.itemsize
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=1, help="checkpointing_steps of the saving runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft", action="store_true", help="full fine-tuning in the stall runs")
    parser.add_argument("--nproc", type=int, default=1, help="ranks in the stall runs (>1: torchrun, FSDP)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = {**tiny_settings(root), "train.lr_warmup_steps": 1, "lora.rank": 64, "lora.lora_alpha": 32,
                "checkpoint.checkpointing_limit": 2}

        # 1. Payload (this run also fills the cache for the timed runs).
        timed_run(root, "payload", {**base, "train.steps": 2, "checkpoint.checkpointing_steps": 1}, 1)
        adapter_file = root / "payload" / "lora" / "pytorch_lora_weights.safetensors"
        adapter = safetensors_bytes(adapter_file)
        parts = checkpoint_bytes(root / "payload" / "checkpoint-2")
        on_disk = sum(p.stat().st_size for p in (root / "payload" / "checkpoint-2").iterdir())
        frozen = safetensors_bytes(root / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
        print(f"payload, LoRA rank 64 on to_q to_k to_v to_out.0 (fp32): adapter {adapter} B of tensors")
        for group, size in sorted(parts.items()):
            print(f"  {group:16s} {size:9d} B  {size / adapter:6.3f}x adapter")
        print(f"  {'all tensors':16s} {sum(parts.values()):9d} B  {sum(parts.values()) / adapter:6.3f}x adapter")
        print(f"  folder on disk   {on_disk:9d} B  {on_disk / adapter_file.stat().st_size:6.3f}x the adapter file "
              f"({adapter_file.stat().st_size} B); with the frozen base ({frozen} B) it would be "
              f"{(on_disk + frozen) / on_disk:.2f}x this")

        # 2. Stall.
        stall = {**base, "train.steps": args.steps, "train.log_every": args.steps}
        if args.nproc > 1:
            stall["parallel.strategy"] = "fsdp"
        stall |= {"train.training_type": "sft"} if args.sft else {"lora.target_modules": ALL_LINEAR}
        modes = {"one step": {"train.steps": 1},
                 "save at end only": {"checkpoint.checkpointing_steps": args.steps + 1},
                 "sync save every step": {"checkpoint.checkpointing_steps": args.every, "checkpoint.async_save": False},
                 "async save every step": {"checkpoint.checkpointing_steps": args.every, "checkpoint.async_save": True}}
        walls: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for i, (mode, extra) in enumerate(modes.items()):
                walls[mode].append(timed_run(root, f"stall-{r}-{i}", {**stall, **extra}, args.nproc))
        best = {m: min(w) for m, w in walls.items()}
    step_time = (best["save at end only"] - best["one step"]) / (args.steps - 1)
    saves = (args.steps - 1) // args.every
    what = "full fine-tuning" if args.sft else "LoRA rank 64 on every linear layer"
    print(f"stall, {what}, {args.nproc} rank(s), {args.steps} steps, {saves} saves before the last, fastest of {args.repeats}:")
    print(f"  loop time per step (no saves)  {step_time * 1000:7.1f} ms")
    overhead = {}
    for mode in ("sync save every step", "async save every step"):
        overhead[mode] = (best[mode] - best["save at end only"]) / saves
        print(f"  {mode:30s} +{overhead[mode] * 1000:7.1f} ms per save  ({overhead[mode] / step_time:5.2f}x a step)")
    sync, async_ = overhead.values()
    print(f"  sync / async overhead: {sync / async_:.2f}x" if async_ > 0 else
          f"  async overhead not measurable (<= 0); sync {sync * 1000:.1f} ms per save")
    for mode, w in walls.items():
        print(f"  wall {mode:24s} " + " ".join(f"{x:6.2f}" for x in w) + " s")


if __name__ == "__main__":
    main()
