"""Checkpoints: their payload, the training stall of saving, and a real-sized save's cost.

What one holds against the exported adapter, how long saving stalls training, and what one save of a
real-sized LoRA state costs against a plain torch.save of the same tensors.

    python bench/bench_ckpt.py [--parts payload stall save] [--steps 40] [--repeats 3] [--every 1]
                               [--sft] [--nproc 1] [--saves 3] [--rank 128]

Parts 1 and 2 build the tiny model and a synthetic dataset in a temporary folder:
1. Payload: trains 2 steps with LoRA rank 64 and reads the checkpoint's tensor bytes from DCP's own
   metadata, split into model / optimizer / other, against the exported adapter's tensor bytes; and
   the folder's size on disk against the adapter file and the frozen base (what finetrainers adds).
2. Stall: runs `trainer.py` for --steps steps saving every --every steps, synchronously and with
   checkpoint.async_save, and once saving only at the end (the baseline), interleaved, fastest of
   --repeats; a 1-step run gives the loop's own time per step. Overhead per save = (wall - baseline
   wall) / saves before the last step (the final save is synchronous in every mode). LoRA rank 64 on
   every linear layer, or full fine-tuning with --sft, so checkpoints are not trivial.
3. Save cost at a real size, in this process (one rank, one thread, in the system's temporary
   folder): CogVideoX-5B's LoRA at --rank on the default targets (132 M parameters at rank 128: the
   FQNs and shapes the trainer has, without the frozen base, which a LoRA checkpoint never holds),
   AdamW after one step, the sampler and train state (1.59 GB); a first save, then --saves
   synchronous `Checkpointer.save` calls (checkpointing_limit 2, so each one also rotates), each
   followed by `torch.save` of the same state dict (what the save hands to DCP) to a file, deleted
   again; medians, the ratio against the target (Checkpointer.save <= 1.25x torch.save), and pieces
   timed alone: a bare `dcp.save` (one thread, no hashing) with and without fsync, and the sha256 of
   the files read back from the page cache, the pass the commit made before it hashed while writing.
"""

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import timed_run, tiny_settings  # puts the repository on sys.path
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckpt  # noqa: E402
import ranks  # noqa: E402
from config import CheckpointConfig  # noqa: E402
from data import Sampler

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


class TrainState:
    """trainer.TrainState's tensors (nothing imports trainer.py)."""

    def state_dict(self) -> dict:
        return {
            "step": torch.tensor(1),
            "validation_pending": torch.tensor(False),
            "nonfinite_in_row": torch.tensor(0),
        }


def cogvideox_5b_lora(rank: int) -> nn.Module:
    """The trainable part of CogVideoX-5B with LoRA on the default targets.

    42 blocks, each with to_q, to_k, to_v and to_out.0 mapping its 3072 channels (48 heads x 64) to
    3072, each with lora_A [rank, 3072] and lora_B [3072, rank], under the transformer's own names.
    At rank 128: 42 x 4 x 2 x 128 x 3072 = 132,120,576 parameters."""

    def lora_pair():
        return nn.ModuleDict(
            {"lora_A": nn.Linear(3072, rank, bias=False), "lora_B": nn.Linear(rank, 3072, bias=False)}
        )

    def block():
        return nn.ModuleDict(
            {
                "attn1": nn.ModuleDict(
                    {
                        "to_q": lora_pair(),
                        "to_k": lora_pair(),
                        "to_v": lora_pair(),
                        "to_out": nn.ModuleList([lora_pair()]),
                    }
                )
            }
        )

    return nn.ModuleDict({"transformer_blocks": nn.ModuleList([block() for _ in range(42)])})


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def save_cost(root: Path, saves: int, rank: int) -> None:
    """Part 3: Checkpointer.save against torch.save of the same state, and where a save's time goes.

    Interleaved, in this process; then where a save's time goes, from its pieces timed alone."""
    torch.set_num_threads(1)  # as the trainer runs here (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    d = ranks.Dist(0, 1, 0, torch.device("cpu"))
    model = cogvideox_5b_lora(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step, so AdamW holds its moments as in training
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    objects = {
        "model": model,
        "optimizer": optimizer,
        "sampler": Sampler([0] * 24, 8, 0),
        "train": TrainState(),
    }
    identity = {"family": "cogvideox", "training_type": "lora", "lora": {"rank": rank}}
    checkpoints = ckpt.Checkpointer(
        CheckpointConfig(checkpointing_limit=2), str(root / "save-cost"), d, identity, {}
    )
    start = time.perf_counter()
    checkpoints.save(1, objects, final=False)
    first = time.perf_counter() - start
    state = checkpoints._state(objects, reuse=True)  # what each save hands to DCP
    tensors = [t for part in state.values() for t in part.values()]
    size = sum(t.numel() * t.element_size() for t in tensors)

    runs = {
        "Checkpointer.save": lambda i: checkpoints.save(i + 2, objects, final=False),
        "torch.save": lambda i: torch.save(state, root / "plain.pt"),
    }
    timed: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(saves):
        for name, run in runs.items():
            os.sync()  # untimed: each starts with nothing of the other's left to write back
            start = time.perf_counter()
            run(i)
            timed[name].append(time.perf_counter() - start)
        os.remove(root / "plain.pt")  # untimed: the disk holds one copy at a time
    newest = ckpt.complete_checkpoints(root / "save-cost")[-1]
    pieces = {}
    for name, sync in (("dcp.save, fsync", True), ("dcp.save, no fsync", False)):
        os.sync()
        start = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root / name, sync_files=sync))
        pieces[name] = time.perf_counter() - start
        shutil.rmtree(root / name)
    start = time.perf_counter()
    for path in sorted(newest.iterdir()):
        if path.is_file() and path.name != "meta.json":
            ckpt.sha256_of(path)
    pieces["sha256 of the files read back (the commit hashed so before hashing while writing)"] = (
        time.perf_counter() - start
    )
    dist.destroy_process_group()
    median = {k: statistics.median(v) for k, v in timed.items()}
    params = sum(p.numel() for p in model.parameters())
    print(
        f"save cost, CogVideoX-5B LoRA rank {rank} (default targets), 1 rank, 1 thread: {params:,} trainable "
        f"parameters, {len(tensors)} tensors, {size / 1e9:.2f} GB of state ({dir_bytes(newest) / 1e9:.2f} GB "
        f"on disk), {saves} saves after the first"
    )
    print(f"  first save (builds what later saves reuse)  {first:6.2f} s")
    for k, v in timed.items():
        print(f"  {k:18s} median {median[k]:6.2f} s   all " + " ".join(f"{x:.2f}" for x in v))
    ratio = median["Checkpointer.save"] / median["torch.save"]
    print(
        f"  Checkpointer.save / torch.save: {ratio:.2f}x median (target <= 1.25x: {'met' if ratio <= 1.25 else 'not met'})"
    )
    print("  pieces, each timed once alone: " + ", ".join(f"{k} {v:.2f} s" for k, v in pieces.items()))


def payload(root: Path, base: dict) -> None:
    """Part 1 (its run also fills the cache for the stall runs)."""
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
    print(
        f"  folder on disk   {on_disk:9d} B  {on_disk / adapter_file.stat().st_size:6.3f}x the adapter file "
        f"({adapter_file.stat().st_size} B); with the frozen base ({frozen} B) it would be "
        f"{(on_disk + frozen) / on_disk:.2f}x this"
    )


def stall(root: Path, stall_settings: dict, args) -> None:
    """Part 2."""
    modes = {
        "one step": {"train.steps": 1},
        "save at end only": {"checkpoint.checkpointing_steps": args.steps + 1},
        "sync save every step": {
            "checkpoint.checkpointing_steps": args.every,
            "checkpoint.async_save": False,
        },
        "async save every step": {
            "checkpoint.checkpointing_steps": args.every,
            "checkpoint.async_save": True,
        },
    }
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for i, (mode, extra) in enumerate(modes.items()):
            walls[mode].append(timed_run(root, f"stall-{r}-{i}", {**stall_settings, **extra}, args.nproc))
    best = {m: min(w) for m, w in walls.items()}
    step_time = (best["save at end only"] - best["one step"]) / (args.steps - 1)
    saves = (args.steps - 1) // args.every
    what = "full fine-tuning" if args.sft else "LoRA rank 64 on every linear layer"
    print(
        f"stall, {what}, {args.nproc} rank(s), {args.steps} steps, {saves} saves before the last, fastest of {args.repeats}:"
    )
    print(f"  loop time per step (no saves)  {step_time * 1000:7.1f} ms")
    overhead = {}
    for mode in ("sync save every step", "async save every step"):
        overhead[mode] = (best[mode] - best["save at end only"]) / saves
        print(
            f"  {mode:30s} +{overhead[mode] * 1000:7.1f} ms per save  ({overhead[mode] / step_time:5.2f}x a step)"
        )
    sync, async_ = overhead.values()
    print(
        f"  sync / async overhead: {sync / async_:.2f}x"
        if async_ > 0
        else f"  async overhead not measurable (<= 0); sync {sync * 1000:.1f} ms per save"
    )
    for mode, w in walls.items():
        print(f"  wall {mode:24s} " + " ".join(f"{x:6.2f}" for x in w) + " s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parts = ["payload", "stall", "save"]
    parser.add_argument("--parts", nargs="+", choices=parts, default=parts)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=1, help="checkpointing_steps of the saving runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft", action="store_true", help="full fine-tuning in the stall part")
    parser.add_argument("--nproc", type=int, default=1, help="ranks in the stall runs (>1: torchrun, FSDP)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves of the save-cost part")
    parser.add_argument("--rank", type=int, default=128, help="LoRA rank of the save-cost part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "save" in args.parts:
            save_cost(root, args.saves, args.rank)
        if "payload" not in args.parts and "stall" not in args.parts:
            return
        base = {
            **tiny_settings(root),
            "train.lr_warmup_steps": 1,
            "lora.rank": 64,
            "lora.lora_alpha": 32,
            "checkpoint.checkpointing_limit": 2,
        }
        if "payload" in args.parts:
            payload(root, base)
        if "stall" in args.parts:
            if "payload" not in args.parts:  # fill the cache outside the timed runs
                timed_run(root, "warm-cache", {**base, "train.steps": 1})
            # LoRA rank 64 on every linear layer, or full fine-tuning: checkpoints that are not
            # trivial.
            heavy = {"train.training_type": "sft"} if args.sft else {"lora.target_modules": ALL_LINEAR}
            stall_settings = {**base, **heavy, "train.steps": args.steps, "train.log_every": args.steps}
            if args.nproc > 1:
                stall_settings["parallel.strategy"] = "fsdp"
            stall(root, stall_settings, args)


if __name__ == "__main__":
    main()
