"""The latent, text and audio cache, and the pass that completes it: batched, spread over ranks, resumable.

    python cache.py --cfg FILE.toml [overrides]     # this pass only (torchrun works too)

Four kinds of entry (video, image, text, audio), one safetensors file each, named by a hash of what
produced it (cache_files.py says what): an interrupted pass resumes where it was, and a fine-tuned VAE
or T5 never reuses stale entries. manifest.py keeps the headers and hashes.

Ranks agree after every round (a header chunk, or one encode batch per rank), so no collective waits
longer than one round, far below parallel.timeout_s, and an error on one rank stops them all.
"""

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import command
import data
import decode
import faults
import lora
import parallel
import ranks
import sequence
from cache_files import Cache
from config import Config, ConfigError, DataConfig
from manifest import Manifest, media_of
from model_adapter import load_adapter
from weights import Weights

log = logging.getLogger("vidtrain")
HEADERS_PER_ROUND = 256  # per rank; a header from the manifest costs a stat, a new one ~30 ms
PROGRESS_EVERY_S = 30.0
# Mean absolute difference (of 255) between an I2V image and its video's decoded first frame, both
# resized and cropped alike, above which the image is named: re-encoding the same frame (PNG, JPEG,
# H.264) stays within a few levels; another frame of a moving shot, or another shot, goes far past.
IMAGE_DIFFERENCE = 16


def plan_all(clips: list[data.Clip], shapes, cfg: Config, cache: Cache, manifest: Manifest, d: ranks.Dist,
             first_last: bool = False):
    """Read every header (clip i on rank i % world) the manifest does not know, plan every clip and
    check its entries: per clip (item or problem, missing entry kinds, whether its file exists), the
    same on every rank; new manifest entries are added on every rank."""
    results = [None] * len(clips)
    share = range(d.rank, len(clips), d.world)
    rounds = math.ceil(math.ceil(len(clips) / d.world) / HEADERS_PER_ROUND)
    for r in range(rounds):
        def work():
            out = []
            for i in share[r * HEADERS_PER_ROUND : (r + 1) * HEADERS_PER_ROUND]:
                try:
                    video, image, last, new = manifest.clip_entries(clips[i], cfg.model.type == "i2v", first_last)
                except decode.MediaError as e:
                    out.append((i, data.Problem(None, str(e)), set(), False, []))
                    continue
                planned = data.plan_clip(clips[i], media_of(video), video["content"], shapes, cfg.data, cfg.run.seed,
                                         image, last)
                missing = cache.missing(planned) if isinstance(planned, data.Item) else set()
                # Sent without the clip, which every rank holds: unpickling paths is most of the gather's cost.
                out.append((i, dataclasses.replace(planned, clip=None), missing, clips[i].video.exists(),
                            [(str(path), entry) for path, entry in new]))
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
        raise ConfigError(f"model.path = {adapter.path} is a first-last-frame model (Wan FLF2V), but no clip has a "
                          "last image: set data.last_image_column to a file under data_root with each clip's last "
                          "frame, one per line (or give metadata.jsonl / metadata.csv a last_image column)")
    if not adapter.first_last and cfg.last_image_column:
        raise ConfigError(f"data.last_image_column = {cfg.last_image_column} conditions first-last-frame models, and "
                          f"model.path = {adapter.path} is not one: remove it, or train a first-last-frame model "
                          "(Wan2.1-FLF2V-14B-720P)")


def stop_on_problems(problems: list[data.Problem], cfg: DataConfig) -> list[data.Problem]:
    """Raise with the lowest line unless every problem may be skipped; return the skipped ones."""
    fatal = [p for p in problems if not (cfg.short_clips == "skip" if p.kind == "short" else cfg.skip_bad)]
    if fatal:
        first = min(fatal, key=lambda p: p.clip.line)
        fix = ("set data.short_clips = \"skip\" or \"pad\", or choose shorter buckets" if first.kind == "short"
               else "fix or remove it, or set data.skip_bad = true to skip such clips and list them in skipped.txt")
        raise data.BadClip(f"{first}. {len(fatal)} clip(s) cannot be used; this is the lowest line: {fix}")
    return problems


def batches(todo: list, size: int, world: int, same=lambda a, b: True) -> list[list[list]]:
    """The k-th unit to rank k % world, cut into batches of `size` whose units are `same` as the first."""
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
    """work(mine, r) with the warnings it logs (a truncated prompt of this rank's share, say) held back and
    returned with its result: rank 0 prints every rank's, once (the others print no warnings)."""
    held, level = _Held(), log.level
    log.addFilter(held)
    log.setLevel(min(log.getEffectiveLevel(), logging.WARNING))  # command.quiet() drops them at the source
    try:
        return *work(mine, r), held.messages
    finally:
        log.removeFilter(held)
        log.setLevel(level)


def run_rounds(per_rank: list[list[list]], work, what: str, cfg: DataConfig, d: ranks.Dist) -> list[data.Problem]:
    """One batch per rank per round, then the ranks agree: counts, problems (a clip that fails to decode
    stops the pass at once, with what was written kept, unless data.skip_bad) and stop signals."""
    total = sum(len(batch) for mine in per_rank for batch in mine)
    mine, rounds = per_rank[d.rank], max(len(m) for m in per_rank)
    problems, done, start = [], 0, time.perf_counter()
    last_log = start
    for r in range(rounds):
        for count, bad, held in ranks.agree(lambda: held_warnings(work, mine, r), d):
            done, problems = done + count, problems + bad
            for message in held if d.is_main else []:
                log.warning("%s", message)
        stop_on_problems(problems, cfg)
        ranks.stop_if_preempted(d, f"in the cache pass, with {done} of {total} {what} encoded and kept; the "
                                      "next run continues from there")
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
            # Rows of zeros at the end are padding (Wan's pipeline zeroes the rows past the attention
            # mask): not stored, load_batch puts them back.
            kept = int(embed.abs().sum(-1).nonzero().max()) + 1
            cache.write(item, "text", {"prompt_embeds": embed[:kept]})
        return len(mine[r]), []

    run_rounds(batches(list(first_of.values()), cfg.cache_batch_size, d.world), work, "prompts", cfg, d)


def encode_videos(todo: dict[data.Item, set[str]], adapter, cache: Cache, cfg: DataConfig, seed: int,
                  d: ranks.Dist):
    """The missing video (and image, and audio) entries, `todo` naming each clip's: the k-th clip to rank
    k % world (sorted by bucket, so a batch shares a shape), cache_batch_size clips per VAE call (the sound
    one clip a call), one batch per rank per round, decoded by
    data.decode_workers threads per rank (PyAV releases the GIL) one batch ahead of the VAE. I2V
    entries hold the conditioning image's posterior (data.image_column's image, whose window starts at
    frame 0, or the window's own first frame), its noise augmentation keyed by (run.seed, clip); an
    image far from its video's first frame is named once, on rank 0. A clip missing only its audio entry
    (data.audio turned on, another audio VAE) decodes and encodes only its sound. Returns the problems
    met while decoding."""
    per_rank = batches(sorted(todo, key=lambda item: item.bucket), cfg.cache_batch_size, d.world,
                       lambda a, b: a.bucket == b.bucket)
    workers = cfg.decode_workers or min(8, max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    # Decoder threads per clip: the cores not already taken by workers (cores ~ workers x threads).
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) // workers)
    written, pending, far = 0, {}, []
    heard = [0, 0]  # clips whose sound this rank read, and those that had any

    def decoded(item):
        audio = None
        if "audio" in todo[item]:
            audio = data.decode_audio(item, adapter.audio_sample_rate, adapter.audio_channels)
        if not todo[item] & {"video", "image"}:
            return None, None, 0.0, audio
        video = data.decode_clip(item, threads)
        last = data.load_image(item, last=True) if item.last_image_content is not None else None
        if not (item.clip.image and cache.image_seed is not None):
            return video, (video[0], last), 0.0, audio  # the window's own first frame
        image = data.load_image(item)
        return video, (image, last), float((image.float() - video[0].float()).abs().mean()), audio

    def write_audio(item, audio):
        entry = {}  # no sound: an empty entry says so
        if audio is not None:  # one clip a call: windows at other rates hold other numbers of samples
            mean, logvar = adapter.encode_audio(audio[None])
            entry = {"audio_latent_mean": mean[0], "audio_latent_logvar": logvar[0]}
        cache.write(item, "audio", entry)

    def work(mine, r):
        nonlocal written
        for batch in mine[r : r + 2]:  # this batch, and the next one decoding meanwhile
            for item in batch:
                pending.setdefault(item, pool.submit(decoded, item))
        good, bad = [], []
        for item in mine[r] if r < len(mine) else []:
            try:
                video, image, difference, audio = pending.pop(item).result()
            except data.BadClip as e:
                bad.append(data.Problem(item.clip, str(e)))
                continue
            good.append((item, video, image, audio))
            if difference > IMAGE_DIFFERENCE:
                far.append((item.clip.line, f"{item.clip.source} line {item.clip.line}: {item.clip.image} "
                                            f"(difference {difference:.0f})"))
        pictures = [(item, video, image) for item, video, image, _ in good if video is not None]
        index, mean, logvar, image = {}, None, None, None
        if pictures:
            items, videos, images = zip(*pictures)
            index = {item: j for j, item in enumerate(items)}
            mean, logvar = adapter.encode_video(torch.stack(videos))
            if cache.image_seed is not None:
                noise = [data.keyed_generator(seed, "image_noise", item.content) for item in items]
                firsts, lasts = zip(*images)
                # First-last-frame (every clip has a last image then, read_headers checks): both images at once.
                last = {"last_images": torch.stack(lasts)} if lasts[0] is not None else {}
                image = adapter.encode_image(torch.stack(firsts), noise, items[0].resolution[0], **last)
        for item, _, _, audio in good:
            if item in index:
                j = index[item]
                cache.write(item, "video", {"latent_mean": mean[j], "latent_logvar": logvar[j]})
                if image is not None:
                    cache.write(item, "image", {name: tensor[j] for name, tensor in image.items()})
            if "audio" in todo[item]:
                write_audio(item, audio)
                heard[0], heard[1] = heard[0] + 1, heard[1] + (audio is not None)
            written += 1
            faults.fault("cache", written)
        return len(good) + len(bad), bad

    with ThreadPoolExecutor(workers) as pool:
        problems = run_rounds(per_rank, work, "clips", cfg, d)
    far = sorted(f for part in ranks.agree(lambda: far, d) for f in part)
    read, sounding = (sum(counts) for counts in zip(*ranks.agree(lambda: heard, d)))
    if read and not sounding and d.is_main:
        log.warning(f"data.audio is on, but none of the {read} clip(s) whose sound this pass read has an "
                    "audio stream: the run trains video alone (add clips with sound, or set data.audio = "
                    "false)")
    if far and d.is_main:
        named = "; ".join(name for _, name in far[:5]) + (f"; and {len(far) - 5} more" if len(far) > 5 else "")
        log.warning(f"{len(far)} clip(s) have an image (data.image_column) that differs from their video's first "
                    f"frame by more than {IMAGE_DIFFERENCE} of 255 (mean absolute difference, resized and cropped "
                    f"alike): {named}. Training starts each such clip's window at frame 0 and conditions on the "
                    "image: give each clip its own first frame, or clear data.image_column to condition on the "
                    "window's first frame")
    return problems


def check_lora_targets(adapter, targets: list[str]) -> None:
    """lora.target_modules against the transformer's layers, before the cache pass: the injection's own
    rule, on a copy built on the meta device from the config (no weights read, nothing allocated)."""
    with torch.device("meta"):
        skeleton = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    try:
        lora.inject_lora(skeleton, targets, 1, 1.0, 0.0, 0)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare(cfg: Config, d: ranks.Dist):
    """Check the model, the resolutions and every clip, and complete the cache, before any training (a
    complete cache on a read-only data.cache_dir is only read). Returns the adapter, the cache and the
    training and held-out items (the last data.held_out)."""
    with ranks.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
        if adapter.single_file is None:  # model.transformer_file's were checked with the adapter
            Weights(adapter.path / adapter.transformer_folder)  # read after the pass: missing files are named now
        sequence.check_heads(cfg.parallel.sp_size, adapter.transformer_config["num_attention_heads"], d.world)
        parallel.check_offload_blocks(cfg.parallel, adapter.transformer_config["num_layers"])
        adapter.check_guidance(cfg.validation)  # validate.py's renderer checks it too, for renders without training
        if cfg.validation.do_validation and cfg.validation.resolution:  # the renderer's own check, done now
            adapter.check_resolution(cfg.validation.resolution, "validation.resolution")
        if cfg.train.training_type == "lora":
            check_lora_targets(adapter, cfg.lora.target_modules)
        if cfg.train.flow_shift:  # only flow-matching families accept the key (config.py checks)
            adapter.shift = cfg.train.flow_shift
        if "audio" in adapter.ENCODERS:  # a family with sound
            adapter.audio_loss_weight = cfg.train.audio_loss_weight
            adapter.trains_sound = cfg.data.audio
        if adapter.GRAPH_VARIES and adapter.trains_sound and cfg.parallel.offload_blocks:
            # model.build_model streams LoRA with its block then: some blocks' on the host, others' on the GPU
            raise ConfigError(
                f"parallel.offload_blocks = {cfg.parallel.offload_blocks} with data.audio = true: batches "
                "with and without sound keep LoRA's weights in their blocks' FSDP units, which would split "
                "them between host and GPU; set parallel.offload_blocks = 0 (every block on the host) or "
                "remove parallel.cpu_offload")
        if cfg.data.target_fps:  # every clip's rate: LTX-2's video positions count seconds at it
            adapter.frame_rate = cfg.data.target_fps
        if cfg.validation.do_validation:  # validate.py's renderer asks it too, for renders without training
            adapter.clip_rate(cfg.validation.gen_fps)
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
    cache = Cache(cfg.data, encoders, adapter.text_length, adapter.encoding_precision(cfg.model.dtype),
                  cfg.run.seed if cfg.model.type == "i2v" else None,
                  adapter.AUDIO_DTYPE if "audio" in adapter.ENCODERS and cfg.data.audio else None)
    check_last_images(adapter, clips, cfg.data)
    planned = plan_all(clips, shapes, cfg, cache, manifest, d, adapter.first_last)
    if d.is_main and unwritable is None:  # read-only: what changed is read again next time
        manifest.save()
    # A clip whose file is gone trains from complete entries; without them it is bad input.
    gone = [data.Problem(p.clip, "does not exist") for p, missing, present in planned
            if isinstance(p, data.Item) and missing & {"video", "image", "audio"} and not present]
    gone_clips = {problem.clip for problem in gone}
    problems = [p for p, _, _ in planned if isinstance(p, data.Problem)] + gone
    skipped = stop_on_problems(problems, cfg.data)
    items = [(p, missing) for p, missing, _ in planned if isinstance(p, data.Item) and p.clip not in gone_clips]
    lacking = sum(bool(missing) for _, missing in items)
    if unwritable is not None and lacking:
        raise ConfigError(f"data.cache_dir = {cache_dir} cannot be written ({unwritable}) and lacks entries of "
                          f"{lacking} of {len(items)} clips: make it writable, or set data.cache_dir to a writable "
                          "folder or to a complete copy of the cache")
    encode_texts([item for item, missing in items if "text" in missing], adapter, cache, cfg.data, d)
    adapter.release_text_encoder()  # before the VAE: on one card T5-XXL's 9 GB would sit beside its encoding
    video_todo = {item: missing for item, missing in items if missing & {"video", "image", "audio"}}
    failed = encode_videos(video_todo, adapter, cache, cfg.data, cfg.run.seed, d)
    adapter.release_encoders()
    failed_clips = {p.clip for p in failed}
    items = [item for item, _ in items if item.clip not in failed_clips]
    skipped = sorted(skipped + failed, key=lambda p: p.clip.line)
    if skipped and d.is_main:
        Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.output_dir) / "skipped.txt").write_text("".join(f"{p.clip.video}\t{p.reason}\n" for p in skipped))
    per_bucket = {str(list(shape)): sum(item.bucket == b for item in items) for b, shape in enumerate(shapes)}
    encoded = len(video_todo) - len(failed)
    log.info("cache: %d clips encoded, %d reused, %d skipped%s; clips per bucket %s; in %s",
             encoded, len(items) - encoded, len(skipped),
             f" (listed in {Path(cfg.run.output_dir) / 'skipped.txt'})" if skipped else "", per_bucket, cache.dir)
    global_batch = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * d.dp_world
    for shape, count in per_bucket.items():
        if 0 < count < global_batch:
            log.warning("bucket %s holds %d clips, fewer than the global batch of %d: they will never train "
                        "(add clips, lower the batch, or drop the bucket)", shape, count, global_batch)
    if len(items) <= cfg.data.held_out:
        raise ConfigError(f"{len(items)} usable clips but data.held_out = {cfg.data.held_out}: lower it or add clips")
    held_out = len(items) - cfg.data.held_out
    return adapter, cache, items[:held_out], items[held_out:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", required=True, help="TOML config file")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    command.run_command(prepare, args.cfg, overrides)


if __name__ == "__main__":
    main()
