"""Checkpoints: the training state in DCP, a checkpoint's files and checks, the exports, their commands.

A checkpoint is written by every rank into checkpoint-N.tmp/, then renamed to checkpoint-N/ once all
ranks are done, then `latest` is replaced. It holds the trainable weights (never the frozen base),
the optimizer's tensors (FQN-keyed, flattened, so they reshard), the sampler and the step, and a
meta.json with the sizes and sha256 of every file. No RNG state: every draw is keyed by the step.
Nothing of ours is pickled: non-tensor values are rebuilt from the config. Loading only the trained
weights (load_weights) serves rendering and export.

In this order: a checkpoint folder's files (the hashing writer, meta.json, the checks before a
load); the training state's save, commit, rotation and resume; the exported files (the LoRA in the
layouts diffusers, PEFT and ComfyUI load, or the transformer); the commands on a checkpoint
(`python ckpt.py export` and `python ckpt.py rehash`, this module's `__main__` block).
"""

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import traceback
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import command
import faults
import lora
import ranks
from config import CheckpointConfig, ConfigError, LoraConfig, ModelConfig, TrainConfig
from model import EMA, build_model, model_state, trains_part
from model_adapter import load_adapter
from weights import Weights

# --------------------------------------------------------------------------------------------------
# A checkpoint folder's files: the hashing writer, meta.json, the checks before a load.
#
# DCP's writer that hashes every file as it writes it, meta.json (the step, what was trained on what,
# and each file's size and sha256), and the checks a checkpoint passes before it is loaded: its
# meta.json, its model, base weights and data, and the bytes of the files this rank reads; the shapes
# a config builds against a checkpoint's; the lock an export holds against rotation.


log = logging.getLogger("vidtrain")
# The kinds of condition a clip may carry (the key that gives them): the data.Item field holding
# their contents.
CONDITIONS = {
    "control videos (data.control_column)": "control_content",
    "masks (data.mask_column)": "mask_content",
    "reference images (data.reference_column)": "reference_content",
    "last images (data.last_image_column)": "last_image_content",
}

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# in a checkpoint, flocked while `ckpt.py export` reads it; in no meta.json
EXPORT_LOCK = "export.lock"
# The warning of a checkpoint that `ckpt.py rehash` accepted without a readable record of its data,
# at the rehash and at every resume from it.
NO_DATA_RECORD = (
    "checkpoint {path} has no record of the data it was trained on (ckpt.py rehash accepted its "
    "files as they are): {what} cannot check that the clips, their conditions and data.target_fps "
    "and data.audio are the ones it was trained on; resume with its run's data and config.toml"
)
BASE_SAMPLES = 64  # pieces of 64 KiB read from each base weight file for its identity
# files per rank, each written and hashed by its own thread
WRITE_THREADS = min(4, os.cpu_count() or 1)


@contextlib.contextmanager
def write_failures_named(tmp: Path):
    """Turn DCP's every-rank write failure into one message with the first cause and the fix.

    DCP reports a failed write on every rank as a CheckpointException (a BaseException) holding
    every rank's traceback: turn it into one message naming the first failing rank's cause and the
    fix."""
    try:
        yield
    except CheckpointException as e:
        raise ranks.StopRun(
            f"writing {tmp} failed on {command.first_failure(e)}; earlier checkpoints are "
            "intact, free space or move run.output_dir and resume"
        ) from None


class HashingStream:
    """A file being written, hashed as it is written.

    Read back afterwards instead, a checkpoint of GBs would cost a second pass over every byte."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        written = self.file.write(data)
        self.size += written
        return written

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.file, name)


class HashingFileSystem(FileSystem):
    """DCP's file system, recording the size and sha256 of every file it writes (by final name)."""

    def __init__(self):
        super().__init__()
        self.written = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as file:
            stream = HashingStream(file)
            yield stream
        self.written[Path(path).name] = {"size": stream.size, "sha256": stream.sha256.hexdigest()}

    def rename(self, path, new_path) -> None:  # DCP writes .metadata under a temporary name
        super().rename(path, new_path)
        self.written[Path(new_path).name] = self.written.pop(Path(path).name)


# What DCP's writer threads raised (a full disk), kept from threading.excepthook, which would print
# each one's chained traceback (about 30 lines a thread) before the save's one-line error.
WRITER_FAILURES: list[BaseException] = []


def writer_thread_failed(args) -> None:
    """threading.excepthook: a DCP writer thread's exception is kept for HashingWriter.write_data to
    raise, any other thread's goes to the hook that was there before."""
    if any(frame.name == "_write_files_from_queue" for frame in traceback.extract_tb(args.exc_traceback)):
        WRITER_FAILURES.append(args.exc_value)
    else:
        writer_thread_failed.previous(args)


class HashingWriter(dcp.FileSystemWriter):
    """DCP's file writer, hashing every file as it writes it, in several threads per rank.

    DCP's writer, hashing as it writes, in WRITE_THREADS threads (files) per rank: hashing and
    writing both release the GIL, so the threads hash and write in parallel where one torch.save
    cannot. No fsync here: the Checkpointer syncs a committed checkpoint in the background (see
    _commit)."""

    def __init__(self, path: Path):
        super().__init__(path, thread_count=WRITE_THREADS, sync_files=False)
        self.fs = HashingFileSystem()

    def write_data(self, plan, planner):
        """DCP's write, its other threads' failures raised here, where DCP reports them once per
        rank (write_failures_named), instead of printed by each thread; a failure of those threads
        alone would otherwise go unreported."""
        if threading.excepthook is not writer_thread_failed:
            writer_thread_failed.previous, threading.excepthook = threading.excepthook, writer_thread_failed
        WRITER_FAILURES.clear()
        written = super().write_data(plan, planner)  # its threads joined, unless this thread failed
        if WRITER_FAILURES:
            raise WRITER_FAILURES[0]
        return written


class FailingWriter(HashingWriter):
    """A storage writer that fails like a full disk, for the save_fail fault point.

    DCP itself then reports the failure on every rank."""

    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device (injected save_fail)")


@functools.cache  # once per process: each version() parses a package's METADATA file
def library_versions() -> dict[str, str]:
    return {p: version(p) for p in ("torch", "diffusers", "transformers")}


def fsync_files(paths: list[Path]) -> None:
    for path in paths:
        with path.open("rb") as f:
            os.fsync(f.fileno())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """Every checkpoint-<int>/ folder, oldest first, complete or not.

    Anything else in the folder (foreign files, .tmp, best.pt) is ignored."""
    found = []
    for path in output_dir.glob("checkpoint-*"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first.

    A committed one is a checkpoint-<int>/ with DCP's .metadata and our meta.json."""
    return [
        p
        for p in checkpoint_folders(output_dir)
        if (p / ".metadata").is_file() and (p / "meta.json").is_file()
    ]


def meta_problem(path: Path) -> str | None:
    """What makes a checkpoint's meta.json unusable (missing, empty, garbled), or None."""
    if not (path / "meta.json").is_file():
        return f"checkpoint {path} has no meta.json"
    try:
        meta = json.loads((path / "meta.json").read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        return f"checkpoint {path}: meta.json is damaged ({e})"
    missing = sorted({"step", "identity", "data", "files"} - set(meta if isinstance(meta, dict) else ()))
    return f"checkpoint {path}: meta.json is damaged (it lacks {missing})" if missing else None


def check_identity(path: Path, meta: dict, identity: dict, resuming: bool = False) -> None:
    """A checkpoint of another model, LoRA shape or training type is refused naming the difference.

    So is another value of a family's setting that the weights are trained for (model.<key>: an
    IC-LoRA's reference_downscale_factor), for an export, a resume or a render alike. A resume
    (`resuming`) also refuses other base weights and warns of another precision; an export or a
    render of it may use any base. Checkpoints written before their base or settings were recorded
    are not checked for them."""
    saved = meta["identity"]
    if resuming and "base" in saved and saved["base"]["weights"] != identity["base"]["weights"]:
        raise ConfigError(
            f"checkpoint {path} was trained on other base weights: {saved['base']['files']} "
            f"there, {identity['base']['files']} here (model.path, model.transformer_file): resume on "
            "the weights it was trained on, or start over in another run.output_dir (lora.init_from "
            "carries a LoRA over)"
        )
    # written since train.optimizer had choices; AdamW's before. Another optimizer's state has other
    # names, which DCP would report as missing keys: an export or a render reads none of it
    saved_optimizer = saved.get("optimizer", "adamw")
    if resuming and saved_optimizer != identity["optimizer"]:
        raise ConfigError(
            f"checkpoint {path} was trained with train.optimizer = {saved_optimizer!r}, this run has "
            f"{identity['optimizer']!r}: its state does not carry over; resume with "
            f'train.optimizer = "{saved_optimizer}", or start over in another run.output_dir '
            "(lora.init_from carries a LoRA over)"
        )
    if resuming and saved.get("precision", identity["precision"]) != identity["precision"]:
        log.warning(
            f"checkpoint {path} was trained with the base in {saved['precision']}, this run has "
            f"{identity['precision']}: training continues in this run's precision"
        )
    for key, value in saved.get("model", {}).items():  # recorded since IC-LoRA's factor was
        here = identity.get("model", {}).get(key)
        if here != value:
            raise ConfigError(
                f"checkpoint {path} was trained with {key} = {value}, and this config has "
                f"{'none' if here is None else here}: set {key} = {value} (its run's config.toml)"
            )
    for key in sorted((set(saved) | set(identity)) - {"base", "precision", "model", "optimizer"}):
        if saved.get(key) != identity.get(key):
            raise ConfigError(
                f"checkpoint {path} was trained with {key} = {saved.get(key)}, this run has {identity.get(key)}: "
                "use the same model and training settings (the run's config.toml), or another run.output_dir"
            )


def base_identity(adapter) -> dict:
    """The transformer's weight files by content, cheaply: sizes, headers and sampled pieces.

    The files are model.transformer_file's, or model.path's transformer folder's, known as the
    manifest knows clips: per file its size, its safetensors header (names, dtypes, shapes, offsets)
    and BASE_SAMPLES pieces spread over its data. A whole-file hash of a 14B model would cost
    minutes per launch; fine-tuned weights differ in every sampled piece. The key holds no paths: a
    model moved elsewhere still resumes."""
    if adapter.single_file is not None:
        files = adapter.single_file.files
    else:
        files = sorted(
            {entry[0] for entry in Weights(adapter.path / adapter.transformer_folder).entries.values()}
        )
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            digest.update(f"{size} {length}".encode() + f.read(length))
            start = 8 + length
            for i in range(BASE_SAMPLES):
                f.seek(start + (size - start) * i // BASE_SAMPLES)
                digest.update(f.read(1 << 16))
    return {"weights": digest.hexdigest(), "files": [str(p) for p in files]}


def check_data(path: Path, meta: dict, data: dict) -> None:
    """Refuse a checkpoint trained on other clips, conditions or data settings.

    Its sampler state would index clips that differ, or the same clips would train on other
    conditions, frames or sound. A checkpoint accepted as it is (`ckpt.py rehash` of a damaged
    meta.json) has no record of them (None): a warning says the check is off. Checkpoints written
    before their conditions and settings were recorded are checked for their clips alone."""
    saved = meta["data"]
    if saved is None:
        log.warning(NO_DATA_RECORD.format(path=path, what="this resume"))
        return
    if saved == data:
        return
    if saved["clips_per_bucket"] != data["clips_per_bucket"]:
        what = f"clips per bucket {saved['clips_per_bucket']} there, {data['clips_per_bucket']} here"
    elif saved["clips_sha256"] != data["clips_sha256"]:
        what = "as many clips per bucket, but other ones (their contents, prompts or order differ)"
    else:
        conditions = saved.get("conditions_sha256", data["conditions_sha256"])
        settings = saved.get("settings", data["settings"])
        changed = [
            f"other {kind}" for kind in conditions if conditions[kind] != data["conditions_sha256"].get(kind)
        ]
        changed += [
            f"{key} = {json.dumps(value)} there, {json.dumps(data['settings'].get(key))} here"
            for key, value in settings.items()
            if value != data["settings"].get(key)
        ]
        if changed:
            raise ConfigError(
                f"checkpoint {path} was trained on the same clips with {'; '.join(changed)}: resume with "
                "the conditions and data settings it was trained on (its run's config.toml), or start "
                "over in another run.output_dir"
            )
        return
    raise ConfigError(
        f"checkpoint {path} was trained on other data: {what}; resume with the clips it was trained on "
        "(data.data_root, its list files, data.held_out, data.buckets), or start over in another "
        "run.output_dir"
    )


def check_files(path: Path, names: list[str]) -> str | None:
    """Check a checkpoint's files against its meta.json; return what is wrong, or None.

    Check files of a checkpoint against its meta.json, every size before any sha256; return what is
    wrong, or None."""
    expected = json.loads((path / "meta.json").read_text())["files"]
    for name in names:
        if name not in expected or not (path / name).is_file():
            return (
                f"checkpoint {path} is missing {name}"
                if name in expected
                else f"checkpoint {path}: {name} is not in meta.json"
            )
        if (path / name).stat().st_size != expected[name]["size"]:
            return f"checkpoint {path}: {name} does not match its size or sha256 in meta.json"
    for name in names:
        if sha256_of(path / name) != expected[name]["sha256"]:
            return f"checkpoint {path}: {name} does not match its size or sha256 in meta.json"
    return None


def check_reads(path: Path, state: dict, planner) -> str | None:
    """Check the files this rank's DCP load will read, and only those.

    DCP's .metadata (it is unpickled to plan the reads), then the shards named by this rank's own
    load plan of `state`, made locally. Every rank checks its share at the same time, outside any
    collective, so a checkpoint of tens of GB is hashed in the time of one rank's share and no rank
    waits inside a collective's timeout meanwhile."""
    problem = check_files(path, [".metadata"])
    if problem:
        return problem
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    reads = {
        metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items
    }
    return check_files(path, sorted(reads))


def reads_problem(path: Path, state: dict, d: ranks.Dist, **planner_options) -> str | None:
    """Check on every rank what it will read of `path`; return the first problem found, or None.

    A collective."""
    problems = ranks.agree(lambda: check_reads(path, state, dcp.DefaultLoadPlanner(**planner_options)), d)
    return next((p for p in problems if p), None)


def other_shapes(adapter, train: TrainConfig, lora_cfg: LoraConfig, metadata) -> str | None:
    """How the trained weights .metadata records differ from what cfg builds, or None.

    Names and shapes, from the config on the meta device: no weight is read."""
    with torch.device("meta"):
        skeleton = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    if train.training_type == "lora":
        lora.inject_lora(
            skeleton,
            lora_cfg.target_modules,
            lora_cfg.rank,
            lora_cfg.lora_alpha,
            0.0,
            0,
            variant=lora_cfg.variant,
            factor=lora_cfg.lokr_factor,
        )
        built = {name: tuple(p.shape) for name, p in skeleton.named_parameters() if p.requires_grad}
    elif train.trainable_modules:
        built = {
            name: tuple(p.shape)
            for name, p in skeleton.named_parameters()
            if lora.trainable(name, train.trainable_modules)
        }
    else:
        built = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    saved = {
        key.removeprefix("model."): tuple(m.size)
        for key, m in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    for name in sorted(set(saved) | set(built)):
        if saved.get(name) != built.get(name):
            return (
                f"{name}: {list(saved[name]) if name in saved else 'absent'} there, "
                f"{list(built[name]) if name in built else 'absent'} here"
            )
    return None


def write_meta(folder: Path, step: int, world_size: int, identity: dict, data: dict, files: dict) -> None:
    meta = {
        "step": step,
        "world_size": world_size,
        "identity": identity,
        "data": data,
        "versions": library_versions(),
        "files": files,
    }
    (folder / "meta.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(folder / "meta.json.tmp", folder / "meta.json")


def read_meta(path: Path) -> dict:
    problem = meta_problem(path)
    if problem:
        raise ConfigError(problem)
    return json.loads((path / "meta.json").read_text())


@contextlib.contextmanager
def exporting(path: Path):
    """Hold a checkpoint against rotation while `ckpt.py export` reads it.

    Held while `ckpt.py export` reads a checkpoint: a shared flock on its EXPORT_LOCK, which
    rotation in a running training tries to take exclusively before it deletes the checkpoint (it
    keeps the checkpoint while an export holds it). A read-only checkpoint is not locked: nothing
    deletes it."""
    try:
        lock = (path / EXPORT_LOCK).open("a")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        lock = None
    if lock is None:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # waits while rotation is deleting it
        if not (path / ".metadata").is_file():
            raise ConfigError(
                f"{path} was deleted by rotation (checkpoint.checkpointing_limit) as the export "
                "started: export a newer checkpoint"
            )
        yield


def deletable(path: Path):
    """A checkpoint's EXPORT_LOCK, locked for deletion; None while an export holds it.

    The open EXPORT_LOCK of a checkpoint, flocked exclusively for its deletion; None while an export
    holds it."""
    lock = (path / EXPORT_LOCK).open("a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def has_ema(path: str) -> bool:
    """Whether a checkpoint holds EMA weights, from DCP's metadata.

    Its run had train.ema_decay > 0."""
    read_meta(Path(path))
    return any(
        key.startswith("ema.") for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    )


def run_identity(adapter, model: ModelConfig, train: TrainConfig, lora_cfg: LoraConfig) -> dict:
    """What a checkpoint must match to be resumed.

    The model's architecture, its base weights (a resume on others is refused), their precision (a
    change is named), the family's settings the weights are trained for, and what is trained."""
    config = {k: v for k, v in adapter.transformer_config.items() if not k.startswith("_")}
    identity = {
        "family": adapter.FAMILY,  # model.family as resolved: "" names the folder's
        "transformer_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "training_type": train.training_type,
        "base": base_identity(adapter),
        "precision": {"model.dtype": model.dtype, "model.storage_dtype": model.storage_dtype},
        "optimizer": train.optimizer,
    }
    # the family's settings its trained weights hold and its exports record (an IC-LoRA's
    # reference_downscale_factor): an export, resume or render from another value is refused
    settings = adapter.lora_metadata()
    if settings:
        identity["model"] = {f"model.{key}": value for key, value in settings.items()}
    if train.trainable_modules:
        identity["trainable_modules"] = train.trainable_modules
    if train.training_type == "lora":
        identity["lora"] = {
            "rank": lora_cfg.rank,
            "lora_alpha": lora_cfg.lora_alpha,
            "target_modules": lora_cfg.target_modules,
        }
        if lora_cfg.variant != "lora":  # the identity of runs from before lora.variant stays theirs
            identity["lora"] |= {"variant": lora_cfg.variant, "lokr_factor": lora_cfg.lokr_factor}
    return identity


def data_identity(clips: list, target_fps: float, sound: bool) -> dict:
    """The training clips a checkpoint's sampler state indexes, known by content, and their conditions.

    The clips per bucket and in order, by their contents and prompts (not their paths: a dataset
    moved elsewhere still resumes); each kind of condition they carry (control videos, masks,
    reference images, last images) by content, per clip and in order; and the data settings that
    change what a clip trains on (data.target_fps picks its frames, data.audio adds its sound:
    `sound` is whether this run trains it)."""
    per_bucket = collections.Counter(str(list(item.resolution)) for item in clips)
    keys = [[item.content, item.image_content, item.clip.prompt, item.bucket] for item in clips]
    conditions = {kind: [getattr(item, field) for item in clips] for kind, field in CONDITIONS.items()}
    return {
        "clips_per_bucket": dict(sorted(per_bucket.items())),
        "clips_sha256": hashlib.sha256(json.dumps(keys).encode()).hexdigest(),
        "conditions_sha256": {
            kind: hashlib.sha256(json.dumps(values).encode()).hexdigest()
            for kind, values in conditions.items()
        },
        "settings": {"data.target_fps": target_fps, "data.audio": sound},
    }


@torch.no_grad()
def _identity(tensor: torch.Tensor) -> tuple:
    """What a view of `tensor` depends on.

    The object, its local data (a DTensor's shard), requires_grad."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return id(tensor), local.data_ptr(), local.shape, tensor.requires_grad


def cached_planner() -> dcp.DefaultSavePlanner:
    """DCP's planner with a plan cache, reused by every save of one layout.

    Every save of a run has the same layout, so after the first one each rank sends an empty plan
    when its local plan matches the cached one and the coordinator reuses the global plan and
    metadata (the data still comes from this save's tensors; another layout is planned afresh). The
    cache is per process: sync and async saves of one layout share it safely."""
    return dcp.DefaultSavePlanner(enable_plan_caching=True)


def staging_copy() -> DefaultStager:
    """The CPU copy of this rank's state that an async save stages into, kept from save to save.

    What an async save copies this rank's state into before training continues: DCP's stager keeps
    one CPU copy per source tensor (storage) and refills it at every save, where a fresh stager
    would allocate the whole state again each time (docs/checkpoints.md gives its size for Wan 14B
    sft with EMA); pinned on GPUs, so the device-to-host copy runs at full speed. Refilling is safe:
    each save waits for the previous write before it stages."""
    on_gpu = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=on_gpu,
        )
    )


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, output_dir: str, d: ranks.Dist, identity: dict, data: dict):
        """identity: run_identity's; data: data_identity's, of the training clips."""
        self.cfg, self.dir, self.d, self.identity, self.data = cfg, Path(output_dir), d, identity, data
        self.frozen_excluded = trains_part(identity)
        self.async_group, self.pending, self.saved_step, self.views = None, None, None, None
        # async saves' CPU copy of this rank's state, made once and refilled by every save
        self.stager = None
        self.syncer = concurrent.futures.ThreadPoolExecutor(1)
        # this rank's fsync of the newest checkpoint's files, running in the background
        self.syncing = None
        self.dir.mkdir(parents=True, exist_ok=True)

    def _state(self, objects: dict, reuse: bool = False) -> dict:
        """The tensors to save or fill, kept between saves while they still alias the live ones.

        Model and optimizer come through DCP's FQN-keyed helpers, the rest through state_dict().
        Saves (`reuse`) keep the helpers' output, which aliases the live tensors (parameters, FSDP
        shards, AdamW's state: all updated in place), rather than map every module's names again at
        every save (BENCHMARKS.md, "Checkpoints", has the cost); a replaced tensor (the optimizer's
        first step, a resume), swapped storage (.data, FSDP's reset_sharded_param) or changed
        requires_grad rebuilds it. The kept tensors stay alive, so no other tensor can take one of
        their ids."""
        model, optimizer = objects["model"], objects["optimizer"]
        tensors = [
            *model.parameters(),
            *model.buffers(),
            *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        ]
        key = tuple(_identity(t) for t in tensors)
        if reuse and self.views and self.views[1] == key:
            views = self.views[2]
        else:
            options = StateDictOptions(
                ignore_frozen_params=self.frozen_excluded, flatten_optimizer_state_dict=True
            )
            optim_state = get_optimizer_state_dict(model, optimizer, options=options)
            views = {
                "model": model_state(model, self.frozen_excluded, flatten_optimizer_state_dict=True),
                # param_groups (lr, betas) are plain numbers rebuilt from the config: only tensors
                # are saved.
                "optimizer": {k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)},
            }
            # a resume's build is not kept: it must not pin optimizer state the load replaces
            if reuse:
                self.views = (tensors, key, views)
        return {**views, **{k: v.state_dict() for k, v in objects.items() if k not in ("model", "optimizer")}}

    def save(self, step: int, objects: dict, final: bool) -> None:
        """Every rank writes its shards.

        With async_save the write runs in the background and commits at the next save; the final
        save is synchronous so the run ends committed."""
        self.wait_and_commit()
        if step == self.saved_step:  # a stop right after this step's save: it is committed already
            return
        self.saved_step = step
        final_dir, tmp = self.dir / f"checkpoint-{step}", self.dir / f"checkpoint-{step}.tmp"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        failing = faults.active("save_fail", step)
        writer = (FailingWriter if failing else HashingWriter)(tmp)
        with ranks.all_or_none():
            state = self._state(objects, reuse=True)
            if self.cfg.async_save and not final:
                if self.async_group is None:
                    # Background writes on the default group collide with training's collectives.
                    self.async_group = dist.new_group(backend="gloo")
                    self.stager = staging_copy()
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=cached_planner(),
                    process_group=self.async_group,
                    async_stager=self.stager,
                )
                self.pending = (step, tmp, final_dir, future, writer)
                return
            with write_failures_named(tmp):
                dcp.save(state, storage_writer=writer, planner=cached_planner())
        faults.fault("save", step)
        self._commit(step, tmp, final_dir, writer.fs.written, last=final)

    def wait_and_commit(self) -> None:
        """Finish the background save, if one is running, and commit it on every rank."""
        if self.pending is None:
            return
        step, tmp, final_dir, future, writer = self.pending
        self.pending = None
        with ranks.all_or_none(), write_failures_named(tmp):
            future.result()
        faults.fault("save", step)
        self._commit(step, tmp, final_dir, writer.fs.written, last=False)

    def _commit(self, step: int, tmp: Path, final: Path, mine: dict, last: bool) -> None:
        """Commit a written checkpoint: meta.json, rename, `latest`, rotation.

        Gather the sizes and sha256 of the files every rank wrote (`mine`: this rank's), then rank 0
        writes meta.json, renames, updates latest, rotates. A checkpoint reaches the disk in the
        background (each rank fsyncs its files; until then a crash of the machine, not of the
        process, could damage it, which its check on resume finds): rotation counts only checkpoints
        every rank has synced, so between saves one more than checkpointing_limit is kept; the last
        save of a launch waits for its own."""
        if self.syncing is not None:  # the previous checkpoint's, started a save interval ago
            self.syncing.result()
        shares = [None] * self.d.world
        dist.all_gather_object(shares, mine)
        if self.d.is_main:
            files = {k: v for share in shares for k, v in sorted(share.items())}
            write_meta(tmp, step, self.d.world, self.identity, self.data, files)
            # one that failed its check on resume, recomputed since: move it aside first
            if final.exists():
                stale = final.with_name(f"{final.name}.stale.tmp")
                os.replace(final, stale)
                os.replace(tmp, final)
                shutil.rmtree(stale)
            else:
                os.replace(tmp, final)
            latest_tmp = self.dir / "latest.tmp"
            latest_tmp.write_text(f"{final.name}\n")
            os.replace(latest_tmp, self.dir / "latest")
            log.info("saved %s", final)
        dist.barrier()
        written = [*mine, "meta.json"] if self.d.is_main else list(mine)
        self.syncing = self.syncer.submit(fsync_files, [final / name for name in written])
        if last:
            self.syncing.result()
            dist.barrier()
        if self.d.is_main:
            self._rotate([p for p in complete_checkpoints(self.dir) if last or p != final])

    def _rotate(self, synced: list[Path]) -> None:
        if self.cfg.checkpointing_limit == 0:
            return
        for path in synced[: -self.cfg.checkpointing_limit]:
            lock = deletable(path)
            if lock is None:
                log.info("keeping %s while `ckpt.py export` reads it: a later rotation deletes it", path)
                continue
            with lock:
                shutil.rmtree(path)

    def _candidates(self) -> list[Path]:
        """The checkpoints to try, newest first, as rank 0 sees them.

        Leftover .tmp folders are removed."""
        found = None
        with ranks.all_or_none():
            if self.d.is_main:
                for tmp in self.dir.glob("checkpoint-*.tmp"):
                    shutil.rmtree(tmp)
                found = [str(p) for p in reversed(checkpoint_folders(self.dir))]
        found = ranks.broadcast(found, self.d)
        if self.cfg.resume == "none" and found:
            raise ConfigError(
                f'{self.dir} already holds {Path(found[0]).name}: set checkpoint.resume = "auto" '
                "to continue it, or choose another run.output_dir"
            )
        if self.cfg.resume not in ("auto", "none"):
            read_meta(Path(self.cfg.resume))
            return [Path(self.cfg.resume)]
        return [Path(p) for p in found] if self.cfg.resume == "auto" else []

    def _none_passes(self, candidates: list[Path], skipped: list[str]) -> str:
        """The message when every checkpoint fails its check: both ways on, spelled out."""
        message = (
            f"no checkpoint in {self.dir} passes its check ({'; '.join(skipped)}): to start over, choose "
            "another run.output_dir"
        )
        loadable = [p for p in candidates if (p / ".metadata").is_file()]
        if loadable:
            message += (
                f"; to resume from {loadable[0].name} anyway, accept its files as they are with `python "
                f"ckpt.py rehash --cfg {self.dir / 'config.toml'} --checkpoint {loadable[0]}` and launch again"
            )
        return message

    def resume(self, objects: dict) -> Path | None:
        """Load the newest checkpoint that checks out, falling back to older ones; return its path.

        The checkpoint is loaded into the live objects on every rank; resharding is DCP's. A stop
        signal before the check ends the run here."""
        ranks.stop_if_preempted(self.d, "before resuming, with nothing new to save")
        candidates = self._candidates()
        state, skipped = self._state(objects), []
        for path in candidates:
            problem = next((p for p in ranks.agree(lambda: meta_problem(path), self.d) if p), None)
            if problem is None:
                # another model, LoRA or dataset: stop, do not fall back
                with ranks.all_or_none():
                    meta = read_meta(path)
                    check_identity(path, meta, self.identity, resuming=True)
                    check_data(path, meta, self.data)
                problem = reads_problem(path, state, self.d)
            if problem is None:
                break
            if self.cfg.resume != "auto":
                raise ConfigError(problem)
            skipped.append(problem)
            log.warning("%s; falling back to the previous checkpoint", problem)
        else:
            # starting over would overwrite the damaged ones: leave that decision to the user
            if candidates:
                raise ConfigError(self._none_passes(candidates, skipped))
            return None
        with ranks.all_or_none():
            meta = read_meta(path)
            dcp.load(state, checkpoint_id=str(path))
            options = StateDictOptions(strict=not self.frozen_excluded, flatten_optimizer_state_dict=True)
            set_model_state_dict(objects["model"], state["model"], options=options)
            optim_state = get_optimizer_state_dict(objects["model"], objects["optimizer"], options=options)
            set_optimizer_state_dict(
                objects["model"], objects["optimizer"], {**optim_state, **state["optimizer"]}, options=options
            )
            for name, obj in objects.items():
                if name not in ("model", "optimizer"):
                    obj.load_state_dict(state[name])
        self.saved_step = meta["step"]
        log.info("resumed from step %d (%s)", meta["step"], path)
        return path


def load_weights(model, path: str, identity: dict, d: ranks.Dist, ema=None) -> None:
    """Load only a checkpoint's trained weights (and EMA) into a built model.

    Only the trained weights (and the EMA, when given) of a checkpoint into an already built model:
    for rendering and export, without the optimizer. Every rank calls it."""
    check_identity(Path(path), read_meta(Path(path)), identity)
    part = trains_part(identity)
    options = StateDictOptions(ignore_frozen_params=part, strict=not part)
    state = {"model": model_state(model, part)}
    if ema is not None:
        state["ema"] = ema.state_dict()
    problem = reads_problem(Path(path), state, d, allow_partial_load=True)
    if problem:
        raise ConfigError(problem)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, state["model"], options=options)


# --------------------------------------------------------------------------------------------------
# The final export: the trained weights in the layouts diffusers, PEFT and ComfyUI load.
#
# The trained weights (and EMA's beside them) as diffusers and PEFT load them, a LoRA also in
# ComfyUI's layout where the family has one, or the whole transformer for sft. Written at the end of
# training (trainer.py) and by `python ckpt.py export` (ckpt.py) for any checkpoint.


def export(
    model,
    training_type: str,
    lora_cfg: LoraConfig,
    adapter,
    out_dir: str,
    d: ranks.Dist,
    ema=None,
    name: str = "",
):
    """Export the final weights, and the EMA weights beside them when EMA is on.

    The final weights, and the EMA weights beside them (lora_ema/, transformer_ema/) when EMA is on.
    `name` names the ComfyUI file (default: out_dir's name, the run's)."""
    name = name or Path(out_dir).resolve().name
    _export_weights(model, training_type, lora_cfg, adapter, Path(out_dir), "", d, name)
    if ema is not None:
        with ema.swapped_in():
            _export_weights(model, training_type, lora_cfg, adapter, Path(out_dir), "_ema", d, name)


def _export_weights(
    model, training_type, lora_cfg: LoraConfig, adapter, out: Path, suffix: str, d, name: str
):
    """Gather only the exported weights to rank 0 and write them.

    The LoRA in diffusers' and PEFT's layouts, or the full transformer with save_pretrained."""
    # sft writes the whole transformer, the frozen weights of train.trainable_modules' runs too: a
    # folder diffusers loads (their checkpoints hold only what trains)
    state = model_state(model, training_type == "lora", full_state_dict=True, cpu_offload=True)
    if not d.is_main:
        return
    # A diverged run's weights (train.learning_rate too high: NaN within a step, in a checkpoint
    # before the non-finite guard stops the run) would load everywhere and render noise.
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        folder = out / f"{'lora' if training_type == 'lora' else 'transformer'}{suffix}"
        raise ranks.StopRun(
            f"{len(bad)} of the {len(state)} weights for {folder} hold NaN or inf (first: {bad[0]}): "
            "the training diverged, and they were not written; export an earlier checkpoint "
            "(python ckpt.py export --checkpoint DIR), or train again with a lower "
            "train.learning_rate"
        )
    if training_type == "lora":
        folder = out / f"lora{suffix}"
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.float() for k, v in state.items()}
        modules = {key.rsplit(".lora_", 1)[0] for key in weights}
        targets = lora.exported_targets(lora_cfg.target_modules, modules)
        args = (weights, lora_cfg.rank, lora_cfg.lora_alpha, targets)
        lora.save_lora(
            str(folder / "pytorch_lora_weights.safetensors"),
            *args,
            metadata=({"expert": adapter.expert} if adapter.expert else {}) | adapter.lora_metadata(),
            variant=lora_cfg.variant,
            factor=lora_cfg.lokr_factor,
        )
        if lora_cfg.variant != "lokr":  # PEFT's LoKr scales a full w2 by alpha / r, LyCORIS' by 1
            lora.save_peft_adapter(str(folder), *args, variant=lora_cfg.variant)
        log.info(
            "LoRA written to %s%s",
            folder / "pytorch_lora_weights.safetensors",
            f" (the {adapter.expert} expert, {adapter.transformer_folder}/)" if adapter.expert else "",
        )
        _export_comfy(weights, lora_cfg.lora_alpha, adapter, folder, name)
    else:
        with faults.written(out / f"transformer{suffix}", lora.EXPORT_FIX) as tmp:
            adapter.transformer_from_state_dict(state).save_pretrained(tmp)
        log.info("transformer written to %s", out / f"transformer{suffix}")


def _export_comfy(weights: dict, alpha: float, adapter, folder: Path, name: str) -> None:
    """Write the LoRA in the key layout ComfyUI's native loader reads.

    lora/comfy/<name>[_<expert>].safetensors in the key layout ComfyUI's native loader reads: Wan's
    original checkpoint's, CogVideoX's ComfyUI model's (comfy/ldm/cogvideo/model.py)."""
    if not adapter.COMFY:
        return
    modules = {lora.module_of(key) for key in weights}
    unmapped = sorted(m for m in modules if adapter.comfy_key(m) is None)
    if unmapped:
        log.warning(
            "no ComfyUI file: %s lie outside the blocks, where the layout carries no alpha", unmapped[:3]
        )
        return
    if any(isinstance(adapter.comfy_key(m), tuple) for m in modules) and any(".lokr_" in k for k in weights):
        log.warning("no ComfyUI file: a LoKr's factors do not fuse into the original's fused modules (qkv)")
        return
    name += f"_{adapter.expert}" if adapter.expert else ""
    lora.save_comfy(
        str(folder / "comfy" / f"{name}.safetensors"),
        weights,
        alpha,
        adapter.comfy_key,
        adapter.COMFY_ALPHA,
        adapter.lora_metadata(),
    )
    log.info("ComfyUI LoRA written to %s", folder / "comfy" / f"{name}.safetensors")


# --------------------------------------------------------------------------------------------------
# The checkpoint commands: export any checkpoint's weights, or accept a failing one's files.
#
#     python ckpt.py export --cfg FILE.toml --checkpoint DIR [--out DIR]
#     python ckpt.py rehash --cfg FILE.toml --checkpoint DIR
#
# `python ckpt.py` stays their entry point (its `__main__` block runs main here). Export builds the
# model as training does, loads the checkpoint's trained weights (ckpt.load_weights) and writes them
# with ckpt.py, by default into RUN/exports/checkpoint-N/; rehash rewrites a checkpoint's meta.json
# from the files now there (ckpt.py holds the files and their checks).


def export_checkpoint(cfg, checkpoint: str, out: str | None, d: ranks.Dist) -> None:
    """Export a checkpoint's trained weights (and EMA).

    Builds the model as training does and loads the checkpoint's trained weights into it first."""
    # By default into the run's exports/checkpoint-N/ (its ComfyUI file named <run>_checkpoint-N):
    # never inside the checkpoint, which rotation deletes, nor over the run's own lora/, which holds
    # its final weights.
    where = Path(checkpoint).resolve()
    target = Path(out) if out else where.parent / "exports" / where.name
    with ranks.all_or_none():  # before any compute
        if not where.is_dir():
            raise ConfigError(not_there(where))
        read_meta(where)  # a checkpoint (a mistyped path makes no exports/ folder)
        problem = command.write_problem(target) if d.is_main else None
        if problem:
            raise ConfigError(
                f"the export cannot be written to {target} ({problem}): "
                f"{'choose another --out' if out else 'pass --out DIR, a folder you can write'}"
            )
        adapter = load_adapter(cfg.model, d.device)
    lora_cfg = dataclasses.replace(cfg.lora, init_from="")  # the checkpoint holds the weights
    model = build_model(adapter, cfg.train, lora_cfg, cfg.parallel, cfg.run.seed, d)
    ema = EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    # a training still running keeps this checkpoint until the export is written
    with exporting(where):
        with ranks.all_or_none():
            load_weights(
                model,
                checkpoint,
                run_identity(adapter, cfg.model, cfg.train, cfg.lora),
                d,
                ema,
            )
        export(
            model,
            cfg.train.training_type,
            cfg.lora,
            adapter,
            str(target),
            d,
            ema,
            "" if out else f"{where.parent.name}_{where.name}",
        )


def not_there(path: Path) -> str:
    """What to say of a --checkpoint that does not exist: rotation took it (an older step than every
    complete checkpoint beside it), or which checkpoints are there."""
    there = complete_checkpoints(path.parent)
    steps = [int(CHECKPOINT_NAME.fullmatch(p.name).group(1)) for p in there]
    match = CHECKPOINT_NAME.fullmatch(path.name)
    names = ", ".join(p.name for p in there)
    if match and steps and int(match.group(1)) < steps[0]:
        return (
            f"checkpoint {path} does not exist: rotation (checkpoint.checkpointing_limit) deleted it, "
            f"{path.parent} keeps {names}; export one of those"
        )
    if steps:
        return f"checkpoint {path} does not exist: {path.parent} holds {names}; export one of those"
    return f"checkpoint {path} does not exist: give --checkpoint a run's checkpoint-N folder"


def rehash(cfg, checkpoint: str, d: ranks.Dist) -> None:
    """Accept a checkpoint's files as they are by rewriting its meta.json.

    For a checkpoint that fails its check and is wanted anyway: its meta.json is rewritten from the
    files now there (sizes, sha256) and the step its name holds. Refused when a shard its .metadata
    names is missing, when this config builds other shapes than .metadata records, or when a
    readable meta.json names another model or training (each would fail the resume). A readable
    identity is kept, else this config's is written; the record of its training clips is kept where
    the old meta.json still has one, else left out (None: not checked on resume). Loading it then
    reads whatever its shards hold."""
    path = Path(checkpoint)
    match = CHECKPOINT_NAME.fullmatch(path.name)
    if not match or not (path / ".metadata").is_file():
        raise ConfigError(
            f"{path} is not a checkpoint-N folder holding DCP's .metadata, so nothing can load it: "
            "resume from another checkpoint, or start over in another run.output_dir"
        )
    with ranks.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
    if not d.is_main:
        return
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name not in ("meta.json", EXPORT_LOCK))
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(names))
    if missing:
        raise ConfigError(
            f"{path} lacks {len(missing)} shard(s) its .metadata names (first: {missing[0]}), so no "
            "resume can read it: resume from another checkpoint, or start over in another run.output_dir"
        )
    shapes_differ = other_shapes(adapter, cfg.train, cfg.lora, metadata)
    if shapes_differ:
        raise ConfigError(
            f"{path} holds other shapes than {cfg.model.path} with this config builds ({shapes_differ}): "
            "rehash it with the config it was trained with (its run's config.toml)"
        )
    identity, data = run_identity(adapter, cfg.model, cfg.train, cfg.lora), None
    if meta_problem(path) is None:
        meta = read_meta(path)
        check_identity(path, meta, identity)
        identity, data = meta["identity"], meta.get("data")
    # ranks that wrote shards
    writers = {name.split("_")[2] for name in names if name.endswith(".distcp")}
    files = {name: {"size": (path / name).stat().st_size, "sha256": sha256_of(path / name)} for name in names}
    write_meta(path, int(match.group(1)), len(writers), identity, data, files)
    log.info("rewrote %s: its %d files are accepted as they are", path / "meta.json", len(files))
    if data is None:
        log.warning(NO_DATA_RECORD.format(path=path, what="a resume from it"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="ckpt.py",
        description="Export the weights of any checkpoint, or accept "
        "the files of a checkpoint that fails its check (rehash).",
    )
    parser.add_argument("command", choices=["export", "rehash"])
    parser.add_argument("--cfg", required=True, help="the run's TOML config")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-N folder")
    parser.add_argument(
        "--out", help="where lora/ or transformer/ go (default: the run's exports/checkpoint-N/)"
    )
    args, overrides = parser.parse_known_args(argv)
    commands = {
        "export": lambda cfg, d: export_checkpoint(cfg, args.checkpoint, args.out, d),
        "rehash": lambda cfg, d: rehash(cfg, args.checkpoint, d),
    }
    command.run_command(commands[args.command], args.cfg, overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
