"""The latent/text cache and the pass that completes it: batched, spread over ranks, resumable.

    python cache.py --cfg FILE.toml [overrides]     # this pass only (torchrun works too)

One safetensors file per clip holds the VAE posterior (mean, log-variance) and the T5 embedding. It is
named by a hash of the clip's path, size and mtime, its prompt, its preprocessing (bucket, fps, crop,
first frame), the VAE/T5 files, the dtype and the text length: a change invalidates exactly the
entries it affects, and entries are written atomically, so an interrupted pass resumes where it was.

Ranks agree after every round (a header chunk, or one encode batch per rank), so no collective waits
longer than one round, far below parallel.timeout_s, and an error on one rank stops them all.
"""

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import data
import faults
import parallel
from config import Config, ConfigError, DataConfig
from model_adapter import load_adapter

log = logging.getLogger("vidtrain")
HEADERS_PER_ROUND = 256  # per rank; opening a header takes about a millisecond
PROGRESS_EVERY_S = 30.0
ENCODER_FOLDERS = ("vae/", "text_encoder/", "tokenizer/")


class Cache:
    """One safetensors file per clip under cache_dir/<2 hex digits>/, named by what produced it."""

    def __init__(self, cfg: DataConfig, model_identity: dict, text_length: int, dtype: str, image_seed: int | None):
        self.dir = Path(cfg.cache_dir or Path(cfg.data_root) / ".cache")
        # Only the encoders shape an entry: another transformer on the same VAE and T5 reuses the cache.
        encoders = {k: v for k, v in model_identity["files"].items() if k.startswith(ENCODER_FOLDERS)}
        self.recipe = {"model": encoders, "dtype": dtype, "text_length": text_length,
                       "target_fps": cfg.target_fps, "crop": cfg.crop}
        if image_seed is not None:  # I2V: the entry holds the image, noised by a draw keyed by the seed
            self.recipe["image_seed"] = image_seed

    def path(self, item: data.Item) -> Path:
        stat = item.clip.video.stat()
        key = {"video": str(item.clip.video.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
               "prompt": item.clip.prompt, "resolution": item.resolution, "resized": item.resized,
               "start": item.start, "top": item.top, "left": item.left, "pad": item.pad, **self.recipe}
        if "image_seed" in self.recipe and item.clip.image:
            image = item.clip.image.stat()
            key["image"] = [str(item.clip.image.resolve()), image.st_size, image.st_mtime_ns]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.dir / digest[:2] / f"{digest}.safetensors"

    def write(self, item: data.Item, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(item)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)

    def load_batch(self, items: list[data.Item]) -> dict[str, torch.Tensor]:
        entries = [load_file(self.path(item)) for item in items]
        return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}


def plan_all(clips: list[data.Clip], shapes, cfg: Config, cache: Cache, d: parallel.Dist):
    """Read every header (clip i on rank i % world) and check which entries exist: (item or problem,
    cached) per clip, the same list on every rank."""
    results = [None] * len(clips)
    share = range(d.rank, len(clips), d.world)
    rounds = math.ceil(math.ceil(len(clips) / d.world) / HEADERS_PER_ROUND)
    for r in range(rounds):
        def work():
            out = []
            for i in share[r * HEADERS_PER_ROUND : (r + 1) * HEADERS_PER_ROUND]:
                planned = data.plan_clip(clips[i], shapes, cfg.data, cfg.run.seed)
                out.append((i, planned, isinstance(planned, data.Item) and cache.path(planned).is_file()))
            return out
        for part in parallel.agree(work, d):
            for i, planned, cached in part:
                results[i] = (planned, cached)
    return results


def stop_on_problems(problems: list[data.Problem], cfg: DataConfig) -> list[data.Problem]:
    """Raise with the lowest line unless every problem may be skipped; return the skipped ones."""
    fatal = [p for p in problems if not (cfg.short_clips == "skip" if p.kind == "short" else cfg.skip_bad)]
    if fatal:
        first = min(fatal, key=lambda p: p.clip.line)
        fix = ("set data.short_clips = \"skip\" or \"pad\", or choose shorter buckets" if first.kind == "short"
               else "fix or remove it, or set data.skip_bad = true to skip such clips and list them in skipped.txt")
        raise data.BadClip(f"{first}. {len(fatal)} clip(s) cannot be used; this is the lowest line: {fix}")
    return problems


def encode_batches(todo: list[data.Item], adapter, cache: Cache, cfg: DataConfig, seed: int, d: parallel.Dist):
    """Encode the missing entries: the k-th missing clip goes to rank k % world (sorted by bucket, so a
    rank's consecutive clips share a shape), cache_batch_size clips per VAE and T5 call, one batch per
    rank per round. I2V entries also hold the conditioning image's posterior (data.image_column's image,
    or the clip's first frame), its noise augmentation keyed by (run.seed, clip). Returns the problems
    met while decoding."""
    todo = sorted(todo, key=lambda item: item.bucket)
    def batches_of(rank):
        batches = []
        for item in todo[rank :: d.world]:
            if batches and batches[-1][-1].bucket == item.bucket and len(batches[-1]) < cfg.cache_batch_size:
                batches[-1].append(item)
            else:
                batches.append([item])
        return batches
    mine, rounds = batches_of(d.rank), max(len(batches_of(r)) for r in range(d.world))
    problems, done, written = [], 0, 0
    start = last_log = time.perf_counter()
    for r in range(rounds):
        def work():
            nonlocal written
            good, bad = [], []
            for item in mine[r] if r < len(mine) else []:
                try:
                    video = data.decode_clip(item, cfg.target_fps)
                    image = data.load_image(item) if item.clip.image and adapter.type == "i2v" else video[0]
                    good.append((item, video, image))
                except data.BadClip as e:
                    bad.append(data.Problem(item.clip, str(e)))
            if good:
                items, videos, images = zip(*good)
                mean, logvar = adapter.encode_video(torch.stack(videos))
                entries = {"latent_mean": mean, "latent_logvar": logvar,
                           "prompt_embeds": adapter.encode_text([item.clip.prompt for item in items])}
                if adapter.type == "i2v":
                    noise = [data.keyed_generator(seed, "image_noise", str(item.clip.video.resolve())) for item in items]
                    entries["image_mean"], entries["image_logvar"] = adapter.encode_image(torch.stack(images), noise)
                for j, item in enumerate(items):
                    cache.write(item, {name: tensor[j] for name, tensor in entries.items()})
                    written += 1
                    faults.fault("cache", written)
            return len(good) + len(bad), bad
        for count, bad in parallel.agree(work, d):
            done, problems = done + count, problems + bad
        parallel.stop_if_preempted(d, f"in the cache pass, with {done} of {len(todo)} clips encoded and kept; "
                                      "the next run continues from there")
        now = time.perf_counter()
        if now - last_log >= PROGRESS_EVERY_S or r == rounds - 1:
            rate = done / (now - start)
            log.info("cache: %d/%d clips, %.2f clips/s, ETA %.0f s", done, len(todo), rate, (len(todo) - done) / rate)
            last_log = now
    return problems


def prepare(cfg: Config, d: parallel.Dist):
    """Check the model, the resolutions and every clip, and complete the cache, before any training.
    Returns the adapter, the cache and the training and held-out items (the last data.held_out)."""
    with parallel.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
        shapes = data.resolutions(cfg.data, adapter.check_resolution)
        clips = data.read_clips(cfg.data)
        cache = Cache(cfg.data, adapter.identity(), adapter.text_length, cfg.model.dtype,
                      cfg.run.seed if cfg.model.type == "i2v" else None)
    parallel.check_shared(str(cache.dir), "data.cache_dir", d)
    planned = plan_all(clips, shapes, cfg, cache, d)
    skipped = stop_on_problems([p for p, _ in planned if isinstance(p, data.Problem)], cfg.data)
    items = [p for p, _ in planned if isinstance(p, data.Item)]
    todo = [p for p, cached in planned if isinstance(p, data.Item) and not cached]
    failed = stop_on_problems(encode_batches(todo, adapter, cache, cfg.data, cfg.run.seed, d), cfg.data)
    adapter.release_encoders()
    failed_clips = {p.clip for p in failed}
    items = [item for item in items if item.clip not in failed_clips]
    skipped = sorted(skipped + failed, key=lambda p: p.clip.line)
    if skipped and d.is_main:
        Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.output_dir) / "skipped.txt").write_text("".join(f"{p.clip.video}\t{p.reason}\n" for p in skipped))
    per_bucket = {str(list(shape)): sum(item.bucket == b for item in items) for b, shape in enumerate(shapes)}
    encoded = len(todo) - len(failed)
    log.info("cache: %d clips encoded, %d reused, %d skipped%s; clips per bucket %s; in %s",
             encoded, len(items) - encoded, len(skipped),
             f" (listed in {Path(cfg.run.output_dir) / 'skipped.txt'})" if skipped else "", per_bucket, cache.dir)
    if len(items) <= cfg.data.held_out:
        raise ConfigError(f"{len(items)} usable clips but data.held_out = {cfg.data.held_out}: lower it or add clips")
    held_out = len(items) - cfg.data.held_out
    return adapter, cache, items[:held_out], items[held_out:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", required=True, help="TOML config file")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    parallel.run_command(prepare, args.cfg, overrides)


if __name__ == "__main__":
    main()
