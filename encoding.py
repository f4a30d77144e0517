"""Encoding the cache's missing entries: batches spread over the ranks, one round at a time.

The texts (one per distinct prompt, T5 only) and the videos with their images, sound and control
clips (decoded a batch ahead of the VAE by a thread pool). Ranks agree after every round (one encode
batch per rank), so no collective waits longer than one round, and an error on one rank stops them
all; what was written is kept, so an interrupted pass resumes where it was.
"""

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import data
import faults
import ranks
from cache_files import Cache
from config import DataConfig

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
        for item, embed in zip(mine[r], embeds):
            # Rows of zeros at the end are padding (Wan's pipeline zeroes the rows past the
            # attention mask): not stored, load_batch puts them back.
            kept = int(embed.abs().sum(-1).nonzero().max()) + 1
            cache.write(item, "text", {"prompt_embeds": embed[:kept]})
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
        control)."""
        audio = control = None
        if "audio" in self.todo[item]:
            audio = data.decode_audio(item, self.adapter.audio_sample_rate, self.adapter.audio_channels)
        if "control" in self.todo[item]:
            # Wan VACE: a clip may have no control video; its mask and references go with it
            control = data.decode_control(item, self.threads) if item.control_content else None
            if self.adapter.vace:
                control = (
                    control,
                    data.decode_control(item, self.threads, mask=True) if item.mask_content else None,
                    data.load_references(item),
                )
        if not self.todo[item] & {"video", "image"}:
            return None, None, 0.0, audio, control
        video = data.decode_clip(item, self.threads)
        last = data.load_image(item, last=True) if item.last_image_content is not None else None
        if not (item.clip.image and self.cache.image_seed is not None):
            return video, (video[0], last), 0.0, audio, control  # the window's own first frame
        image = data.load_image(item)
        return video, (image, last), float((image.float() - video[0].float()).abs().mean()), audio, control

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
                video, image, difference, audio, control = self.pending.pop(item).result()
            except data.BadClip as e:
                bad.append(data.Problem(item.clip, str(e)))
                continue
            good.append((item, video, image, audio, control))
            if difference > IMAGE_DIFFERENCE:
                name = f"{item.clip.source} line {item.clip.line}: {item.clip.image}"
                self.far.append((item.clip.line, f"{name} (difference {difference:.0f})"))
        pictures = [(item, video, image) for item, video, image, _, _ in good if video is not None]
        controls = [(item, control) for item, _, _, _, control in good if control is not None]
        if controls:  # one bucket per batch: the controls share a shape
            controlled, encoded = zip(*controls)
            if self.adapter.vace:
                videos, masks, references = zip(*encoded)
                encoded = self.adapter.encode_control(videos, masks, references, controlled[0].resolution)
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
