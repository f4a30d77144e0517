"""The cache of latents, text embeddings and sound, and the pass that completes it.

The latent, text and audio cache, and the pass that completes it: batched, spread over ranks,
resumable.

    python cache.py --cfg FILE.toml [overrides]     # this pass only (torchrun works too)

Five kinds of entry (video, image, text, audio, control), one safetensors file each, named by a hash
of what produced it (cache_files.py says what): an interrupted pass resumes where it was, and a
fine-tuned VAE or T5 never reuses stale entries. manifest.py keeps the headers and hashes.

Ranks agree after every round (a header chunk, or one encode batch per rank), so no collective waits
longer than one round, far below parallel.timeout_s, and an error on one rank stops them all.
"""

import argparse
import dataclasses
import logging
import math
import sys
from pathlib import Path

import command
import data
import decode
import encoding
import ranks
from cache_files import Cache
from config import Config, ConfigError, DataConfig
from manifest import Manifest, media_of
from model import setup_adapter

log = logging.getLogger("vidtrain")
HEADERS_PER_ROUND = 256  # per rank; a header from the manifest costs a stat, a new one ~30 ms


def plan_all(
    clips: list[data.Clip],
    shapes,
    cfg: Config,
    cache: Cache,
    manifest: Manifest,
    d: ranks.Dist,
    first_last: bool = False,
    control: bool = False,
    vace: bool = False,
):
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
                    video, image, last, controls, new = manifest.clip_entries(
                        clips[i], cfg.model.type == "i2v", first_last, control, vace
                    )
                except decode.MediaError as e:
                    out.append((i, data.Problem(None, str(e)), set(), False, []))
                    continue
                extra = {}
                if controls:  # Wan VACE: the mask's header and hash, the references' hashes
                    header = lambda e: e and (media_of(e), e["content"])  # noqa: E731
                    extra = {"mask": header(controls["mask"]), "reference_content": controls["reference"]}
                    controls = header(controls["video"])
                planned = data.plan_clip(
                    clips[i],
                    media_of(video),
                    video["content"],
                    shapes,
                    cfg.data,
                    cfg.run.seed,
                    image,
                    last,
                    controls,
                    **extra,
                )
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


def check_controls(adapter, cfg: DataConfig, clips: list[data.Clip] = ()) -> None:
    """Control videos are for a model that follows them (each clip's is checked as its header is
    read)."""
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
        cfg.run.seed if cfg.model.type == "i2v" else None,
        adapter.AUDIO_DTYPE if "audio" in adapter.ENCODERS and cfg.data.audio else None,
        adapter.takes_control,
        adapter.control_key(),
    )
    check_last_images(adapter, clips, cfg.data)
    check_controls(adapter, cfg.data, clips)
    planned = plan_all(
        clips, shapes, cfg, cache, manifest, d, adapter.first_last, adapter.takes_control, adapter.vace
    )
    if d.is_main and unwritable is None:  # read-only: what changed is read again next time
        manifest.save()
    # A clip whose file is gone trains from complete entries; without them it is bad input.
    gone = [
        data.Problem(p.clip, "does not exist")
        for p, missing, present in planned
        if isinstance(p, data.Item) and missing & {"video", "image", "audio", "control"} and not present
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
    encoding.encode_texts([item for item, missing in items if "text" in missing], adapter, cache, cfg.data, d)
    # before the VAE: on one card T5-XXL's 9 GB would sit beside its encoding
    adapter.release_text_encoder()
    video_todo = {
        item: missing for item, missing in items if missing & {"video", "image", "audio", "control"}
    }
    failed = encoding.encode_videos(video_todo, adapter, cache, cfg.data, cfg.run.seed, d)
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
