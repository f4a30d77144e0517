"""The cache of latents, text embeddings and sound: its files, its manifest, and the pass that fills it.

The pass is batched, spread over ranks and resumable.

    python cache.py --cfg FILE.toml [overrides]     # this pass only (torchrun works too)

Six kinds of entry (video, image, text, audio, control, loss_mask), one safetensors file each, named by a hash
of what produced it (Cache.path says what): an interrupted pass resumes where it was, and a
fine-tuned VAE or T5 never reuses stale entries. The manifest keeps the headers and hashes.

In this order: the entries on disk (Cache) and their read-ahead (Prefetch); the manifest; the
encoding rounds; the pass (prepare) and its command.

Ranks agree after every round (a header chunk, or one encode batch per rank), so no collective waits
longer than one round, far below parallel.timeout_s, and an error on one rank stops them all.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import command
import data
import decode
import faults
import model_adapter
import ranks
from config import Config, ConfigError, DataConfig
from model import setup_adapter

# --------------------------------------------------------------------------------------------------
# The cache's entries on disk: names, atomic writes, reads and the read-ahead.
#
# Where each entry lives (named by a hash of what produced it), writing one atomically, reading a
# micro-batch's entries, and the read-ahead that brings the next micro-batch in while the current one
# computes. cache.py runs the pass that writes them; the trainer only reads.
#
# Six kinds of entry, one safetensors file each, named by a hash of what produced it:
# - video: the VAE posterior (mean, log-variance) of a clip, keyed by the clip's content, its
#   preprocessing (bucket, rate, first frame, crop, resize) and the VAE's content;
# - image (image-to-video): the conditioning image's posterior, keyed by the same plus the image's
#   content and the seed of its noise augmentation;
# - text: the T5 embedding of a prompt, keyed by the prompt, the text encoder's and tokenizer's
#   content and the text length;
# - audio (families with sound, data.audio): the audio VAE posterior (audio_latent_mean,
#   audio_latent_logvar) of the sound of a clip's window (data.decode_audio), keyed by the clip's
#   content, the window, the audio VAE's content and data.SOUND; an empty entry for a clip without
#   sound. Such a family's adapter has audio_sample_rate, audio_channels and encode_audio(waveforms
#   [1, channels, samples]).
# - control (models that follow a control video, data.control_column): what the adapter's
#   encode_control makes of the control frames aligned with the clip's window (data.decode_control),
#   keyed by the clip's video key and the control file's content (Wan VACE: and its mask's and
#   reference images', its control video possibly none): a changed control video is re-encoded, the
#   clip's latents kept.
# - loss_mask (data.loss_mask_column): the clip's loss mask on its latent grid [1, F', h, w]
#   (model_adapter.latent_weights of data.decode_control's frames; all 1 for a clip without one),
#   keyed by the clip's video key (its grid) and the mask file's content.
# So recaptioning encodes prompts and no video, a per-node copy of a model or of the clips reuses what
# its twin encoded, and a fine-tuned VAE or T5 never reuses stale entries. Entries are written
# atomically: an interrupted pass resumes where it was. cache.py keeps the headers and hashes.


CACHE_FIX = (
    "free space there, or set data.cache_dir to a disk with room, and run again: the entries written so far "
    "are kept"
)


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class Cache:
    """Entries under cache_dir/{video,image,text,audio,control,loss_mask}/<2 hex digits>/, named by what
    produced them."""

    def __init__(
        self,
        cfg: DataConfig,
        encoders: dict[str, dict],
        text_length: int | dict[str, int],
        dtype: str,
        image_seed: int | None,
        audio_dtype: str | None = None,
        control: bool = False,
        control_key: dict | None = None,
        loss_mask: bool = False,
        text_key: dict | None = None,
    ):
        """audio_dtype: the audio encoder's precision (in its entries' keys); None: no sound
        entries. control: whether each clip has a control entry; control_key: what else its key
        holds (the adapter's control_key). loss_mask: whether each clip has a loss mask entry
        (data.loss_mask_column); text_key: what else the text entries' key holds (the adapter's
        text_key)."""
        self.dir = Path(cfg.cache_dir or Path(cfg.data_root) / ".cache")
        self.encoders, self.text_length, self.dtype, self.image_seed = (
            encoders,
            text_length,
            dtype,
            image_seed,
        )
        self.audio_dtype, sound = audio_dtype, audio_dtype is not None
        self.kinds = ("video", "text") + ("image",) * (image_seed is not None) + ("audio",) * sound
        self.kinds += ("control",) * control + ("loss_mask",) * loss_mask
        self.control_key, self.text_key = control_key or {}, text_key or {}

    def path(self, item: data.Item, kind: str) -> str:
        if kind == "text":
            key = _key(
                prompt=item.clip.prompt,
                encoder=self.encoders["text"],
                length=self.text_length,
                dtype=self.dtype,
                **self.text_key,
            )
        elif kind == "audio":  # the window's seconds, not its crop
            key = _key(
                content=item.content,
                window=[item.rate, item.start, item.resolution[0]],
                sound=data.SOUND,
                encoder=self.encoders["audio"],
                dtype=self.audio_dtype,
            )
        # the window's frames of another file, by the VAE unless the family says otherwise
        elif kind == "control":
            video = os.path.basename(self.path(item, "video"))  # its key, wherever the cache lies
            # Wan VACE's mask and reference images shape the entry too (named only when given, one
            # reference by its hash: other keys stay what they were); its control video may be none.
            references = item.reference_content
            vace = {
                kind: content
                for kind, content in (
                    ("mask", item.mask_content),
                    ("reference", references[0] if len(references) == 1 else list(references)),
                )
                if content
            }
            key = _key(
                video=video,
                control=item.control_content,
                encoder=self.encoders.get("control"),
                **vace,
                **self.control_key,
            )
        elif kind == "loss_mask":  # on the video entry's latent grid: its key names the VAE
            video = os.path.basename(self.path(item, "video"))
            key = _key(video=video, loss_mask=item.loss_mask_content)
        else:
            key = _key(
                content=item.content,
                preprocessing=item.preprocessing(),
                encoder=self.encoders[kind],
                dtype=self.dtype,
            )
            # the window's first frame, or data.image_column's image, noised by a keyed draw
            if kind == "image":
                last = {} if item.last_image_content is None else {"last_image": item.last_image_content}
                key = _key(video=key, image=item.image_content, seed=self.image_seed, **last)
        # strings: 10,000 clips start in seconds
        return os.path.join(self.dir, kind, key[:2], f"{key}.safetensors")

    def missing(self, item: data.Item) -> set[str]:
        return {kind for kind in self.kinds if not os.path.isfile(self.path(item, kind))}

    def write(self, item: data.Item, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        path = Path(self.path(item, kind))
        path.parent.mkdir(parents=True, exist_ok=True)
        with faults.written(path, CACHE_FIX) as tmp:
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp)

    def load_batch(self, items: list[data.Item]) -> dict[str, torch.Tensor]:
        """The items' entries stacked, in host memory.

        A damaged or missing entry is named. A batch mixing clips with and without sound holds zeros
        in the place of the missing sound and audio_mask [B], true where a clip has sound (the
        adapter gives the others no audio loss)."""
        entries = [{k: v for kind in self.kinds for k, v in self.read(item, kind).items()} for item in items]
        for entry in entries:
            entry |= model_adapter.padded_text(entry, self.text_length)
        sound = [e for e in entries if "audio_latent_mean" in e]
        if sound and len(sound) < len(entries):  # the clips of a bucket share their window's length
            for entry in entries:
                entry["audio_mask"] = torch.tensor("audio_latent_mean" in entry)
                for k in ("audio_latent_mean", "audio_latent_logvar"):
                    entry.setdefault(k, torch.zeros_like(sound[0][k]))
        return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}

    def read(self, item: data.Item, kind: str) -> dict[str, torch.Tensor]:
        path = self.path(item, kind)
        try:
            return load_file(path)
        except (OSError, SafetensorError) as e:  # safetensors names neither the file nor what to do
            raise OSError(
                f"cache entry {path} cannot be read ({e}): delete it and launch again, the cache pass "
                "encodes it anew"
            ) from None


class Prefetch:
    """Reads the training step's micro-batches ahead, one background thread each.

    The training step's micro-batches, each read by one background thread while the micro-step
    before it computes: the cache files, the stack, and on a GPU a copy into pinned memory, from
    which the step's copy to the device queues behind the running step (from pageable memory CUDA
    would stage it synchronously). It reads exactly the items it is given, so batches and their
    order are the sampler's, and holds nothing a checkpoint needs. A read that fails raises its
    error in the step that takes the batch. The thread ends at close(), or when the object is
    collected (an error)."""

    def __init__(self, cache: Cache, device: torch.device):
        self.cache, self.device, self.ahead = cache, device, None  # ahead: (items, their read)
        # started once: no per-read start
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="vidtrain-prefetch")

    def batch(self, items: list[data.Item], following: list[data.Item] | None) -> dict[str, torch.Tensor]:
        """Return `items`' batch on the device and start reading `following`'s.

        `items`' batch on the device (read ahead when the last call named them), then `following`'s
        read started (None: nothing follows)."""
        ahead = self.ahead is not None and self.ahead[0] == items
        host = (self.ahead[1] if ahead else self.reader.submit(self.host, items)).result()
        # queued before the next read
        batch = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        self.ahead = (following, self.reader.submit(self.host, following)) if following is not None else None
        return batch

    def host(self, items: list[data.Item]) -> dict[str, torch.Tensor]:
        batch = self.cache.load_batch(items)
        return {k: v.pin_memory() for k, v in batch.items()} if self.device.type == "cuda" else batch

    def close(self) -> None:
        """Wait for the read under way, and end the thread.

        A stop after a step leaves the next step's read under way."""
        self.reader.shutdown(wait=True)
        self.ahead = None


# --------------------------------------------------------------------------------------------------
# The manifest: the cache's index of every clip's header and every file's content hash.
#
# One index in the cache folder of what every clip's header said and what every file's bytes hash to,
# each against the file's size and mtime. A restart re-reads only the files that changed; a clip whose
# file is gone keeps its entry, so with a complete cache it still trains; models and clips are known
# by content, so a per-node copy of either matches the cache its twin filled.


CHUNK = 1 << 24


def content_hash(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Manifest:
    def __init__(self, cache_dir: Path):
        self.path = cache_dir / "manifest.json"
        saved = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.entries: dict[str, dict] = saved.get("entries", {})
        self.changed = False

    def lookup(self, path: Path) -> dict | None:
        """The entry of an unchanged file, or the last one of a file that is gone.

        None if the file must be read."""
        entry = self.entries.get(os.path.abspath(path))
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return entry
        if entry and entry["size"] == stat.st_size and entry["mtime"] == stat.st_mtime_ns:
            return entry
        return None

    @staticmethod
    def read(path: Path, probe: bool) -> dict:
        """A new entry: the content hash, and (`probe`) the media header.

        decode.MediaError if the file is unusable."""
        stat = path.stat()
        entry = {"size": stat.st_size, "mtime": stat.st_mtime_ns, "content": content_hash(path)}
        if probe:
            entry["media"] = asdict(decode.probe(path))
        return entry

    def entry(self, path: Path, probe: bool = True) -> tuple[dict, bool]:
        """A file's entry and whether it is new.

        decode.MediaError when the file is gone and unknown, or unusable."""
        known = self.lookup(path)
        if known is not None and (not probe or "media" in known):
            return known, False
        if not path.is_file():  # a folder cannot be hashed: named as a bad file, which skip_bad skips
            raise decode.MediaError("is a folder, not a file" if path.is_dir() else "does not exist")
        return self.read(path, probe), True

    def add(self, path: Path, entry: dict) -> None:
        self.entries[os.path.abspath(path)] = entry
        self.changed = True

    def encoder_identity(self, adapter, d: ranks.Dist) -> dict[str, dict]:
        """Each encoder's files by content (name -> hash), hashed once on rank 0.

        Remembered here against size and mtime."""
        identity = None
        with ranks.all_or_none():
            if d.is_main:
                identity = {}
                for kind, folders in adapter.ENCODERS.items():
                    files = sorted(
                        p for folder in folders for p in (adapter.path / folder).rglob("*") if p.is_file()
                    )
                    identity[kind] = {}
                    for path in files:
                        entry, new = self.entry(path, probe=False)
                        if new:
                            self.add(path, entry)
                        identity[kind][str(path.relative_to(adapter.path))] = entry["content"]
        return ranks.broadcast(identity, d)

    def clip_entries(
        self, clip, with_image: bool, with_last: bool = False, with_control: bool = False, vace: bool = False
    ) -> tuple[dict, str | None, str | None, dict | None, dict | None, list]:
        """The clip's entry, (image-to-video) its image's and (first-last-frame) its last image's
        content hashes, (a control model) its control video's entry under "video" (None: a Wan VACE
        clip without one) with Wan VACE's mask entry (or None) under "mask" and its reference images'
        entries under "reference", its loss mask's entry (or None), reading what is not known yet;
        and the new entries.
        decode.MediaError names the file that failed, or the missing last image or control video."""
        new = []

        def entry(path: Path, kind: str = "") -> dict:
            try:
                found, is_new = self.entry(path)
            except decode.MediaError as e:
                raise decode.MediaError(f"{kind} {path}: {e}" if kind else str(e)) from None
            new.extend([(path, found)] if is_new else [])
            return found

        video, image = entry(clip.video), None
        if with_image and clip.image:
            image = entry(clip.image, "image")["content"]
        last = None
        if with_last:
            if clip.last_image is None:
                raise decode.MediaError(
                    "has no last image: a first-last-frame model needs each clip's last "
                    "frame (data.last_image_column's line, or the metadata file's "
                    "last_image column)"
                )
            last = entry(clip.last_image, "last image")["content"]
        control = None
        if with_control:
            # Wan VACE: without a control video the pipeline's zeros stand in, and its mask is all
            # white (the original VACE's too, whatever mask is given): a mask alone is refused.
            if clip.control is None and not (vace and clip.mask is None):
                raise decode.MediaError(
                    f"has a mask ({clip.mask}) but no control video: WanVACEPipeline takes a mask only "
                    "with a video; give the clip a control video or remove its mask"
                    if vace
                    else "has no control video: a control model needs one per clip "
                    "(data.control_column's line, or the metadata file's control column)"
                )
            # Wan VACE's mask (its entry) and reference images (their contents), beside the control
            # video's.
            control = {
                "video": clip.control and entry(clip.control, "control"),
                "mask": clip.mask and entry(clip.mask, "mask"),
                "reference": tuple(entry(path, "reference") for path in clip.reference),
            }
        loss_mask = clip.loss_mask and entry(clip.loss_mask, "loss mask")
        return video, image, last, control, loss_mask, new

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"entries": self.entries}, sort_keys=True))
        os.replace(tmp, self.path)


def media_of(entry: dict) -> decode.Media:
    media = dict(entry["media"])
    media["matrix"] = tuple(media["matrix"]) if media["matrix"] else None
    return decode.Media(**media)


# --------------------------------------------------------------------------------------------------
# Encoding the cache's missing entries: batches spread over the ranks, one round at a time.
#
# The texts (one per distinct prompt, T5 only) and the videos with their images, sound and control
# clips (decoded a batch ahead of the VAE by a thread pool). Ranks agree after every round (one encode
# batch per rank), so no collective waits longer than one round, and an error on one rank stops them
# all; what was written is kept, so an interrupted pass resumes where it was.


log = logging.getLogger("vidtrain")
PROGRESS_EVERY_S = 30.0
# Mean absolute difference (of 255) between an I2V image and its video's decoded first frame, both
# resized and cropped alike, above which the image is named: re-encoding the same frame (PNG, JPEG,
# H.264) stays within a few levels; another frame of a moving shot, or another shot, goes far past.
IMAGE_DIFFERENCE = 16


def batches(todo: list, size: int, world: int, same=lambda a, b: True) -> list[list[list]]:
    """The k-th unit to rank k % world, cut into batches of `size` whose units are `same` as the
    first."""
    per_rank = []
    for rank in range(world):
        mine = []
        for unit in todo[rank::world]:
            if mine and len(mine[-1]) < size and same(mine[-1][0], unit):
                mine[-1].append(unit)
            else:
                mine.append([unit])
        per_rank.append(mine)
    return per_rank


class _Held(logging.Filter):
    """Keeps the warnings logged while it is attached, instead of printing them."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        self.messages.append(record.getMessage())
        return False


def held_warnings(work, mine, r):
    """work(mine, r) with the warnings it logs (a truncated prompt of this rank's share, say) held
    back and returned with its result: rank 0 prints every rank's, once (the others print no
    warnings)."""
    held, level = _Held(), log.level
    log.addFilter(held)
    # command.quiet() drops them at the source
    log.setLevel(min(log.getEffectiveLevel(), logging.WARNING))
    try:
        return *work(mine, r), held.messages
    finally:
        log.removeFilter(held)
        log.setLevel(level)


def run_rounds(
    per_rank: list[list[list]], work, what: str, cfg: DataConfig, d: ranks.Dist
) -> list[data.Problem]:
    """One batch per rank per round, then the ranks agree: counts, problems (a clip that fails to
    decode stops the pass at once, with what was written kept, unless data.skip_bad) and stop
    signals."""
    total = sum(len(batch) for mine in per_rank for batch in mine)
    mine, rounds = per_rank[d.rank], max(len(m) for m in per_rank)
    problems, done, start = [], 0, time.perf_counter()
    last_log = start
    for r in range(rounds):
        for count, bad, held in ranks.agree(lambda: held_warnings(work, mine, r), d):
            done, problems = done + count, problems + bad
            for message in held if d.is_main else []:
                log.warning("%s", message)
        data.stop_on_problems(problems, cfg)
        ranks.stop_if_preempted(
            d,
            f"in the cache pass, with {done} of {total} {what} encoded and kept; the "
            "next run continues from there",
        )
        now = time.perf_counter()
        if now - last_log >= PROGRESS_EVERY_S or r == rounds - 1:
            rate = done / (now - start)
            log.info("cache: %d/%d %s, %.2f/s, ETA %.0f s", done, total, what, rate, (total - done) / rate)
            last_log = now
    return problems


def encode_texts(todo: list[data.Item], adapter, cache: Cache, cfg: DataConfig, d: ranks.Dist) -> None:
    """The missing text entries, one per distinct prompt: T5 only, no video decoded."""
    first_of = {}
    for item in todo:
        first_of.setdefault(item.clip.prompt, item)

    def work(mine, r):
        if r >= len(mine):
            return 0, []
        embeds = adapter.encode_text([item.clip.prompt for item in mine[r]])
        named = embeds if isinstance(embeds, dict) else {"prompt_embeds": embeds}
        for i, item in enumerate(mine[r]):
            cache.write(
                item, "text", {name: model_adapter.unpadded(embed[i]) for name, embed in named.items()}
            )
        return len(mine[r]), []

    run_rounds(batches(list(first_of.values()), cfg.cache_batch_size, d.world), work, "prompts", cfg, d)


def encode_videos(
    todo: dict[data.Item, set[str]], adapter, cache: Cache, cfg: DataConfig, seed: int, d: ranks.Dist
):
    """Encode the clips' missing video, image, audio and control entries.

    The missing video (and image, audio, control) entries, `todo` naming each clip's; returns the
    problems met while decoding.

    The k-th clip goes to rank k % world (sorted by bucket, so a batch shares a shape),
    cache_batch_size clips per VAE call (the sound one clip a call), one batch per rank per round,
    decoded by data.decode_workers threads per rank (PyAV releases the GIL) one batch ahead of the
    VAE. I2V entries hold the conditioning image's posterior (data.image_column's image, whose
    window starts at frame 0, or the window's own first frame), its noise augmentation keyed by
    (run.seed, clip); an image far from its video's first frame is named once, on rank 0. A clip
    missing only its audio entry (data.audio turned on, another audio VAE) decodes and encodes only
    its sound. Control frames (data.decode_control) are encoded by adapter.encode_control, a batch's
    at once.
    """
    per_rank = batches(
        sorted(todo, key=lambda item: item.bucket),
        cfg.cache_batch_size,
        d.world,
        lambda a, b: a.bucket == b.bucket,
    )
    workers = cfg.decode_workers or min(
        8, max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    )
    # Decoder threads per clip: the cores not already taken by workers (cores ~ workers x threads).
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) // workers)
    with ThreadPoolExecutor(workers) as pool:
        encoding = VideoEncoding(todo, adapter, cache, seed, threads, pool)
        problems = run_rounds(per_rank, encoding.work, "clips", cfg, d)
    far = sorted(f for part in ranks.agree(lambda: encoding.far, d) for f in part)
    read, sounding = (sum(counts) for counts in zip(*ranks.agree(lambda: encoding.heard, d)))
    if read and not sounding and d.is_main:
        log.warning(
            f"data.audio is on, but none of the {read} clip(s) whose sound this pass read has an "
            "audio stream: the run trains video alone (add clips with sound, or set data.audio = "
            "false)"
        )
    if far and d.is_main:
        named = "; ".join(name for _, name in far[:5]) + (
            f"; and {len(far) - 5} more" if len(far) > 5 else ""
        )
        log.warning(
            f"{len(far)} clip(s) have an image (data.image_column) that differs from their video's first "
            f"frame by more than {IMAGE_DIFFERENCE} of 255 (mean absolute difference, resized and cropped "
            f"alike): {named}. Training starts each such clip's window at frame 0 and conditions on the "
            "image: give each clip its own first frame, or clear data.image_column to condition on the "
            "window's first frame"
        )
    return problems


class VideoEncoding:
    """One rank's share of encode_videos: each round's batch encoded and written while the next one
    decodes in the pool, and what the ranks compare at the end (images far from their video's first
    frame, clips with sound)."""

    def __init__(
        self,
        todo: dict[data.Item, set[str]],
        adapter,
        cache: Cache,
        seed: int,
        threads: int,
        pool: ThreadPoolExecutor,
    ):
        self.todo, self.adapter, self.cache, self.seed = todo, adapter, cache, seed
        self.threads, self.pool = threads, pool  # decoder threads per clip; the decoding workers
        self.pending = {}  # item -> the future of its decoding, submitted a batch ahead
        self.written = 0  # clips written, counted for fault injection
        self.far = []  # (line, name) of the I2V images far from their video's first frame
        self.heard = [0, 0]  # clips whose sound this rank read, and those that had any

    def decoded(self, item: data.Item):
        """(video, (first image, last image), the image's distance from the first frame, sound,
        control, the loss mask on the latent grid)."""
        audio = control = weights = None
        if "loss_mask" in self.todo[item]:  # none: the whole frame counts
            frames, height, width = item.resolution
            pixels = (
                data.decode_control(item, self.threads, "loss_mask")
                if item.loss_mask_content
                else torch.full((frames, height, width, 3), 255, dtype=torch.uint8)
            )
            a = self.adapter
            weights = model_adapter.latent_weights(pixels, a.temporal_ratio, a.spatial_ratio)
        if "audio" in self.todo[item]:
            audio = data.decode_audio(item, self.adapter.audio_sample_rate, self.adapter.audio_channels)
        # Wan VACE's condition variants are drawn from the clip's own window
        variants = "control" in self.todo[item] and self.adapter.vace and self.adapter.condition_variants
        pictures = bool(self.todo[item] & {"video", "image"})
        video = data.decode_clip(item, self.threads) if pictures or variants else None
        if "control" in self.todo[item]:
            # Wan VACE: a clip may have no control video; its mask and references go with it
            control = data.decode_control(item, self.threads) if item.control_content else None
            if self.adapter.vace:
                control = (
                    control,
                    data.decode_control(item, self.threads, "mask") if item.mask_content else None,
                    data.load_references(item),
                    video if variants else None,
                )
        if not pictures:
            return None, None, 0.0, audio, control, weights
        last = data.load_image(item, last=True) if item.last_image_content is not None else None
        if not (item.clip.image and self.cache.image_seed is not None):
            return video, (video[0], last), 0.0, audio, control, weights  # the window's own first frame
        image = data.load_image(item)
        difference = float((image.float() - video[0].float()).abs().mean())
        return video, (image, last), difference, audio, control, weights

    def write_audio(self, item: data.Item, audio) -> None:
        entry = {}  # no sound: an empty entry says so
        # one clip a call: windows at other rates hold other numbers of samples
        if audio is not None:
            mean, logvar = self.adapter.encode_audio(audio[None])
            entry = {"audio_latent_mean": mean[0], "audio_latent_logvar": logvar[0]}
        self.cache.write(item, "audio", entry)

    def work(self, mine: list[list[data.Item]], r: int) -> tuple[int, list[data.Problem]]:
        """Round r: batch r encoded and written (none past this rank's last), r + 1 decoding."""
        for batch in mine[r : r + 2]:  # this batch, and the next one decoding meanwhile
            for item in batch:
                self.pending.setdefault(item, self.pool.submit(self.decoded, item))
        good, bad = [], []
        for item in mine[r] if r < len(mine) else []:
            try:
                video, image, difference, audio, control, weights = self.pending.pop(item).result()
            except data.BadClip as e:
                bad.append(data.Problem(item.clip, str(e)))
                continue
            if weights is not None:
                self.cache.write(item, "loss_mask", {"loss_mask": weights})
            good.append((item, video, image, audio, control))
            if difference > IMAGE_DIFFERENCE:
                name = f"{item.clip.source} line {item.clip.line}: {item.clip.image}"
                self.far.append((item.clip.line, f"{name} (difference {difference:.0f})"))
        pictures = [(item, video, image) for item, video, image, _, _ in good if video is not None]
        controls = [(item, control) for item, _, _, _, control in good if control is not None]
        if controls:  # one bucket per batch: the controls share a shape
            controlled, encoded = zip(*controls)
            if self.adapter.vace:
                videos, masks, references, clips = zip(*encoded)
                encoded = self.adapter.encode_control(
                    videos,
                    masks,
                    references,
                    controlled[0].resolution,
                    clips,
                    [item.content for item in controlled],  # the variants' draws are keyed by it
                )
            else:
                encoded = self.adapter.encode_control(torch.stack(encoded))
            for j, item in enumerate(controlled):
                self.cache.write(item, "control", {name: tensor[j] for name, tensor in encoded.items()})
        index, mean, logvar, image = {}, None, None, None
        if pictures:
            items, videos, images = zip(*pictures)
            index = {item: j for j, item in enumerate(items)}
            mean, logvar = self.adapter.encode_video(torch.stack(videos))
            if self.cache.image_seed is not None:
                noise = [data.keyed_generator(self.seed, "image_noise", item.content) for item in items]
                firsts, lasts = zip(*images)
                # First-last-frame (every clip has a last image then, read_headers checks): both
                # images at once.
                last = {"last_images": torch.stack(lasts)} if lasts[0] is not None else {}
                image = self.adapter.encode_image(torch.stack(firsts), noise, items[0].resolution[0], **last)
        for item, _, _, audio, _ in good:
            if item in index:
                j = index[item]
                self.cache.write(item, "video", {"latent_mean": mean[j], "latent_logvar": logvar[j]})
                if image is not None:
                    self.cache.write(item, "image", {name: tensor[j] for name, tensor in image.items()})
            if "audio" in self.todo[item]:
                self.write_audio(item, audio)
                self.heard[0], self.heard[1] = self.heard[0] + 1, self.heard[1] + (audio is not None)
            self.written += 1
            faults.fault("cache", self.written)
        return len(good) + len(bad), bad


HEADERS_PER_ROUND = 256  # per rank; a header from the manifest costs a stat, a new one ~30 ms


def plan_all(
    clips: list[data.Clip],
    shapes,
    cfg: DataConfig,
    i2v: bool,
    seed: int,
    cache: Cache,
    manifest: Manifest,
    d: ranks.Dist,
    first_last: bool = False,
    control: bool = False,
    vace: bool = False,
    multiple: int = 1,
):
    """Read every header (clip i on rank i % world) the manifest does not know, plan every clip and
    check its entries: per clip (item or problem, missing entry kinds, whether its file exists), the
    same on every rank; new manifest entries are added on every rank. Wan VACE's reference images
    must keep a pixel when fitted into the clip's frame, their sides cut to multiples of `multiple`
    (the VAE's spatial ratio)."""
    results = [None] * len(clips)
    share = range(d.rank, len(clips), d.world)
    rounds = math.ceil(math.ceil(len(clips) / d.world) / HEADERS_PER_ROUND)
    for r in range(rounds):

        def work():
            out = []
            for i in share[r * HEADERS_PER_ROUND : (r + 1) * HEADERS_PER_ROUND]:
                try:
                    video, image, last, controls, loss_mask, new = manifest.clip_entries(
                        clips[i], i2v, first_last, control, vace
                    )
                except decode.MediaError as e:
                    out.append((i, data.Problem(None, str(e)), set(), False, []))
                    continue
                extra = {"loss_mask": loss_mask and (media_of(loss_mask), loss_mask["content"])}
                references = ()
                if controls:  # Wan VACE: the mask's header and hash, the references' hashes
                    header = lambda e: e and (media_of(e), e["content"])  # noqa: E731
                    references = controls["reference"]
                    extra |= {
                        "mask": header(controls["mask"]),
                        "reference_content": tuple(e["content"] for e in references),
                    }
                    controls = header(controls["video"])
                planned = data.plan_clip(
                    clips[i],
                    media_of(video),
                    video["content"],
                    shapes,
                    cfg,
                    seed,
                    image,
                    last,
                    controls,
                    **extra,
                )
                if isinstance(planned, data.Item):  # before any compute: the pipeline's resize stops
                    problems = [
                        data.reference_problem(
                            path, (media.height, media.width), planned.resolution, multiple
                        )
                        for path, media in zip(clips[i].reference, map(media_of, references))
                    ]
                    problem = next((p for p in problems if p), None)
                    if problem:
                        planned = data.Problem(None, f"{problem}, or remove it (data.reference_column)")
                missing = cache.missing(planned) if isinstance(planned, data.Item) else set()
                # Sent without the clip, which every rank holds: unpickling paths is most of the
                # gather's cost.
                out.append(
                    (
                        i,
                        dataclasses.replace(planned, clip=None),
                        missing,
                        clips[i].video.exists(),
                        [(str(path), entry) for path, entry in new],
                    )
                )
            return out

        for part in ranks.agree(work, d):
            for i, planned, missing, present, new in part:
                results[i] = (dataclasses.replace(planned, clip=clips[i]), missing, present)
                for path, entry in new:
                    manifest.add(Path(path), entry)
        ranks.stop_if_preempted(d, "while reading clip headers, with nothing encoded yet")
    return results


def check_last_images(adapter, clips: list[data.Clip], cfg: DataConfig) -> None:
    """A first-last-frame model trains on clips with last images; another model takes none."""
    if adapter.first_last and not any(clip.last_image for clip in clips):
        raise ConfigError(
            f"model.path = {adapter.path} is a first-last-frame model (Wan FLF2V), but no clip has a "
            "last image: set data.last_image_column to a file under data_root with each clip's last "
            "frame, one per line (or give metadata.jsonl / metadata.csv a last_image column)"
        )
    if not adapter.first_last and cfg.last_image_column:
        raise ConfigError(
            f"data.last_image_column = {cfg.last_image_column} conditions first-last-frame models, and "
            f"model.path = {adapter.path} is not one: remove it, or train a first-last-frame model "
            "(Wan2.1-FLF2V-14B-720P)"
        )


def check_controls(adapter, cfg: DataConfig, clips: list[data.Clip]) -> None:
    """Control videos are for a model that follows them, and an in-context model (IC-LoRA) needs
    them: none at all is one error here (each clip's is checked as its header is read)."""
    if adapter.takes_control and not adapter.vace and not any(clip.control for clip in clips):
        raise ConfigError(
            f'model.path = {adapter.path} follows a control video (model.type = "{adapter.type}"), but '
            "no clip has one: set data.control_column to a file under data_root with each clip's "
            "control video, one per line (or give metadata.jsonl / metadata.csv a control column)"
        )
    if not adapter.takes_control and cfg.control_column:
        raise ConfigError(
            f"data.control_column = {cfg.control_column} gives control videos, and model.path = "
            f"{adapter.path} is not a model that follows one: remove it, or train a control model "
            "(docs/control.md)"
        )
    for key in ("mask_column", "reference_column"):
        if getattr(cfg, key) and not adapter.vace:
            raise ConfigError(
                f"data.{key} = {getattr(cfg, key)} conditions Wan VACE models, and "
                f"model.path = {adapter.path} is not one: remove it, or train a VACE model "
                '(model.type = "vace")'
            )
    # a batch's clips stack their references
    counts = sorted({len(clip.reference) for clip in clips})
    if adapter.vace and len(counts) > 1:
        odd = next(clip for clip in clips if len(clip.reference) == counts[0])
        many = sum(len(clip.reference) != counts[0] for clip in clips)
        raise ConfigError(
            f"{odd.source} line {odd.line} has {counts[0]} reference image(s), but {many} other "
            f"clip(s) have {' or '.join(map(str, counts[1:]))}: give every clip the same number of "
            "reference images (data.reference_column), or none"
        )


def prepare(cfg: Config, adapter, d: ranks.Dist):
    """Check every clip and complete the cache with the run's adapter, before any training.

    `adapter` comes checked (model.setup_adapter). A complete cache on a read-only data.cache_dir is
    only read. Returns the cache and the training and held-out items (the last data.held_out).
    """
    with ranks.all_or_none():
        shapes = data.resolutions(cfg.data, adapter.check_resolution)
        clips = data.read_clips(cfg.data)
    cache_dir = Path(cfg.data.cache_dir or Path(cfg.data.data_root) / ".cache")
    unwritable = None  # or why data.cache_dir cannot be written
    with ranks.all_or_none():
        if d.is_main:
            unwritable = command.write_problem(cache_dir)
    unwritable = ranks.broadcast(unwritable, d)
    if unwritable is None:  # a read-only cache is only read: each rank checks the entries it sees
        ranks.check_shared(str(cache_dir), "data.cache_dir", d)
    manifest = Manifest(cache_dir)
    encoders = manifest.encoder_identity(adapter, d)
    cache = Cache(
        cfg.data,
        encoders,
        adapter.text_length,
        adapter.encoding_precision(cfg.model.dtype),
        # image-to-video's image entries, for the families that cache one (LTX-2 does not)
        cfg.run.seed if cfg.model.type == "i2v" and "image" in adapter.ENCODERS else None,
        adapter.AUDIO_DTYPE if "audio" in adapter.ENCODERS and cfg.data.audio else None,
        adapter.takes_control,
        adapter.control_key(),
        bool(cfg.data.loss_mask_column),
        adapter.text_key(),
    )
    check_last_images(adapter, clips, cfg.data)
    check_controls(adapter, cfg.data, clips)
    planned = plan_all(
        clips,
        shapes,
        cfg.data,
        cache.image_seed is not None,  # the clips' image entries
        cfg.run.seed,
        cache,
        manifest,
        d,
        adapter.first_last,
        adapter.takes_control,
        adapter.vace,
        adapter.spatial_ratio if adapter.vace else 1,
    )
    if d.is_main and unwritable is None:  # read-only: what changed is read again next time
        manifest.save()
    # A clip whose file is gone trains from complete entries; without them it is bad input.
    gone = [
        data.Problem(p.clip, "does not exist")
        for p, missing, present in planned
        if isinstance(p, data.Item)
        and missing & {"video", "image", "audio", "control", "loss_mask"}
        and not present
    ]
    gone_clips = {problem.clip for problem in gone}
    problems = [p for p, _, _ in planned if isinstance(p, data.Problem)] + gone
    skipped = data.stop_on_problems(problems, cfg.data)
    items = [
        (p, missing) for p, missing, _ in planned if isinstance(p, data.Item) and p.clip not in gone_clips
    ]
    lacking = sum(bool(missing) for _, missing in items)
    if unwritable is not None and lacking:
        raise ConfigError(
            f"data.cache_dir = {cache_dir} cannot be written ({unwritable}) and lacks entries of "
            f"{lacking} of {len(items)} clips: make it writable, or set data.cache_dir to a writable "
            "folder or to a complete copy of the cache"
        )
    encode_texts([item for item, missing in items if "text" in missing], adapter, cache, cfg.data, d)
    # before the VAE: on one card T5-XXL's 9 GB would sit beside its encoding
    adapter.release_text_encoder()
    video_todo = {
        item: missing
        for item, missing in items
        if missing & {"video", "image", "audio", "control", "loss_mask"}
    }
    failed = encode_videos(video_todo, adapter, cache, cfg.data, cfg.run.seed, d)
    adapter.release_encoders()
    failed_clips = {p.clip for p in failed}
    items = [item for item, _ in items if item.clip not in failed_clips]
    skipped = sorted(skipped + failed, key=lambda p: p.clip.line)
    if skipped and d.is_main:
        Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.output_dir) / "skipped.txt").write_text(
            "".join(f"{p.clip.video}\t{p.reason}\n" for p in skipped)
        )
    per_bucket = {str(list(shape)): sum(item.bucket == b for item in items) for b, shape in enumerate(shapes)}
    encoded = len(video_todo) - len(failed)
    log.info(
        "cache: %d clips encoded, %d reused, %d skipped%s; clips per bucket %s; in %s",
        encoded,
        len(items) - encoded,
        len(skipped),
        f" (listed in {Path(cfg.run.output_dir) / 'skipped.txt'})" if skipped else "",
        per_bucket,
        cache.dir,
    )
    global_batch = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * d.dp_world
    for shape, count in per_bucket.items():
        if 0 < count < global_batch:
            log.warning(
                "bucket %s holds %d clips, fewer than the global batch of %d: they will never train "
                "(add clips, lower the batch, or drop the bucket)",
                shape,
                count,
                global_batch,
            )
    if len(items) <= cfg.data.held_out:
        raise ConfigError(
            f"{len(items)} usable clips but data.held_out = {cfg.data.held_out}: lower it or add clips"
        )
    held_out = len(items) - cfg.data.held_out
    return cache, items[:held_out], items[held_out:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cfg", required=True, help="TOML config file")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    command.run_command(lambda cfg, d: prepare(cfg, setup_adapter(cfg, d), d), args.cfg, overrides)


if __name__ == "__main__":
    main()
