"""A checkpoint folder's files: the hashing writer, meta.json, the checks before a load.

DCP's writer that hashes every file as it writes it, meta.json (the step, what was trained on what,
and each file's size and sha256), and the checks a checkpoint passes before it is loaded: its
meta.json, its model, base weights and data, and the bytes of the files this rank reads; the shapes
a config builds against a checkpoint's; the lock an export holds against rotation."""

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

import command
import lora
import ranks
from config import ConfigError
from weights import Weights

log = logging.getLogger("vidtrain")

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# in a checkpoint, flocked while `ckpt.py export` reads it; in no meta.json
EXPORT_LOCK = "export.lock"
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


class HashingWriter(dcp.FileSystemWriter):
    """DCP's file writer, hashing every file as it writes it, in several threads per rank.

    DCP's writer, hashing as it writes, in WRITE_THREADS threads (files) per rank: hashing and
    writing both release the GIL, so the threads hash and write in parallel where one torch.save
    cannot. No fsync here: the Checkpointer syncs a committed checkpoint in the background (see
    _commit)."""

    def __init__(self, path: Path):
        super().__init__(path, thread_count=WRITE_THREADS, sync_files=False)
        self.fs = HashingFileSystem()


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

    A resume (`resuming`) also refuses other base weights and warns of another precision; an export
    or a render of it may use any base. Checkpoints written before their base was recorded are not
    checked for it."""
    saved = meta["identity"]
    if resuming and "base" in saved and saved["base"]["weights"] != identity["base"]["weights"]:
        raise ConfigError(
            f"checkpoint {path} was trained on other base weights: {saved['base']['files']} "
            f"there, {identity['base']['files']} here (model.path, model.transformer_file): resume on "
            "the weights it was trained on, or start over in another run.output_dir (lora.init_from "
            "carries a LoRA over)"
        )
    if resuming and saved.get("precision", identity["precision"]) != identity["precision"]:
        log.warning(
            f"checkpoint {path} was trained with the base in {saved['precision']}, this run has "
            f"{identity['precision']}: training continues in this run's precision"
        )
    for key in sorted((set(saved) | set(identity)) - {"base", "precision"}):
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
    """Refuse a checkpoint trained on other clips.

    A checkpoint trained on other clips is refused: its sampler state would index clips that differ.
    A checkpoint accepted as it is (`ckpt.py rehash` of a damaged meta.json) has no record of them
    (None)."""
    saved = meta["data"]
    if saved is None or saved == data:
        return
    if saved["clips_per_bucket"] != data["clips_per_bucket"]:
        what = f"clips per bucket {saved['clips_per_bucket']} there, {data['clips_per_bucket']} here"
    else:
        what = "as many clips per bucket, but other ones (their contents, prompts or order differ)"
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


def other_shapes(cfg, adapter, metadata) -> str | None:
    """How the trained weights .metadata records differ from what cfg builds, or None.

    Names and shapes, from the config on the meta device: no weight is read."""
    with torch.device("meta"):
        skeleton = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    if cfg.train.training_type == "lora":
        lora.inject_lora(skeleton, cfg.lora.target_modules, cfg.lora.rank, cfg.lora.lora_alpha, 0.0, 0)
        built = {name: tuple(p.shape) for name, p in skeleton.named_parameters() if p.requires_grad}
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
