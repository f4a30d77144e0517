"""Dataset reading, video decoding (PyAV), resize/crop/frame choice, the latent/text cache, the sampler.

    python data.py --cfg FILE.toml [overrides]     # build the cache only

The cache holds, per clip, the VAE posterior (mean, log-variance) and the T5 embedding as one
safetensors file named by a hash of the clip's path, size and mtime, its prompt, the preprocessing
and the model, so that any change invalidates exactly the entries it affects.
"""

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import av
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from config import ConfigError, DataConfig

log = logging.getLogger("vidtrain")


def keyed_generator(*keys) -> torch.Generator:
    """A CPU generator seeded from a tuple of keys, e.g. (seed, step, sample): no draw uses the global RNG."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass(frozen=True)
class Clip:
    video: Path
    prompt: str
    line: int  # 1-based line in videos.txt, for error messages


class BadClip(Exception):
    """A video that cannot be used; str() names the file and the reason."""


def _read_lines(root: Path, name: str) -> list[str]:
    path = root / name
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: data.data_root must hold {name} (CogVideo's layout)")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def read_clips(cfg: DataConfig) -> list[Clip]:
    """CogVideo's layout: one prompt per line in caption_column, one path per line in video_column."""
    root = Path(cfg.data_root)
    prompts = _read_lines(root, cfg.caption_column)
    videos = _read_lines(root, cfg.video_column)
    if len(prompts) != len(videos):
        raise ConfigError(
            f"{root / cfg.caption_column} has {len(prompts)} lines but {root / cfg.video_column} has "
            f"{len(videos)}: they must pair up line by line"
        )
    clips = []
    for line, (video, prompt) in enumerate(zip(videos, prompts), start=1):
        path = root / video
        if not path.is_file():
            raise ConfigError(f"{root / cfg.video_column} line {line}: {path} does not exist")
        clips.append(Clip(path, prompt, line))
    return clips


def decode_clip(path: Path, frames: int, height: int, width: int) -> torch.Tensor:
    """The first `frames` frames, resized keeping the aspect ratio to cover height x width, centre-cropped:
    uint8 [F, H, W, 3]."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadClip(f"{path}: no video stream")
            decoded = []
            for frame in container.decode(video=0):
                decoded.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
                if len(decoded) == frames:
                    break
    except (av.error.FFmpegError, UnicodeDecodeError) as e:
        raise BadClip(f"{path}: cannot decode ({e})") from None
    if len(decoded) < frames:
        raise BadClip(f"{path}: has {len(decoded)} frames, {frames} are needed")
    video = torch.stack(decoded).permute(0, 3, 1, 2).float()
    scale = max(height / video.shape[2], width / video.shape[3])
    size = (max(height, round(video.shape[2] * scale)), max(width, round(video.shape[3] * scale)))
    video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    video = video[:, :, top : top + height, left : left + width]
    return video.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def probe_clip(path: Path) -> None:
    """Open and demux without decoding: catches empty, truncated and non-video files cheaply."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadClip(f"{path}: no video stream")
            for _ in container.demux(video=0):
                pass
    except (av.error.FFmpegError, UnicodeDecodeError) as e:
        raise BadClip(f"{path}: not a readable video ({e})") from None


class Cache:
    """One safetensors file per clip under cache_dir, named by the hash of everything that produced it."""

    def __init__(self, cfg: DataConfig, model_identity: dict, text_length: int, dtype: str):
        self.dir = Path(cfg.cache_dir or Path(cfg.data_root) / ".cache")
        self.recipe = {
            "resolution": cfg.train_resolution,
            "frames": "first",
            "crop": "centre",
            "model": model_identity,
            "dtype": dtype,
            "text_length": text_length,
        }

    def path(self, clip: Clip) -> Path:
        stat = clip.video.stat()
        key = {"video": str(clip.video.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
               "prompt": clip.prompt, **self.recipe}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.dir / f"{digest}.safetensors"

    def missing(self, clips: list[Clip]) -> list[Clip]:
        return [c for c in clips if not self.path(c).is_file()]

    def write(self, clip: Clip, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(clip)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)

    def load_batch(self, clips: list[Clip]) -> dict[str, torch.Tensor]:
        entries = [load_file(self.path(c)) for c in clips]
        return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}


def build_cache(cache: Cache, clips: list[Clip], adapter, resolution: list[int], rank: int, world: int) -> int:
    """Encode the clips missing from the cache, this rank's share (clip i goes to rank i % world).
    Every uncached clip is checked first so that a bad file stops the run before any encoding."""
    todo = cache.missing(clips)[rank::world]
    for clip in todo:
        probe_clip(clip.video)
    cache.dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, clip in enumerate(todo, start=1):
        video = decode_clip(clip.video, *resolution)
        mean, logvar = adapter.encode_video(video[None])
        prompt_embeds = adapter.encode_text([clip.prompt])
        cache.write(clip, {"latent_mean": mean[0], "latent_logvar": logvar[0], "prompt_embeds": prompt_embeds[0]})
        if rank == 0 and (i % 50 == 0 or i == len(todo)):
            rate = i / (time.perf_counter() - start)
            log.info("cache: %d/%d clips on rank 0, %.1f clips/s, ETA %.0f s", i, len(todo), rate, (len(todo) - i) / rate)
    return len(todo)


class Sampler:
    """Global batches of G clip indices. For each (seed, epoch) one keyed permutation, cut into global
    batches of G, tail dropped. State: (epoch, global batches consumed in this epoch)."""

    def __init__(self, num_clips: int, global_batch: int, seed: int):
        if num_clips < global_batch:
            raise ConfigError(
                f"the dataset has {num_clips} training clips but the global batch (train.batch_size x "
                f"train.gradient_accumulation_steps x world size) is {global_batch}: lower it or add clips"
            )
        self.num_clips, self.global_batch, self.seed = num_clips, global_batch, seed
        self.epoch, self.consumed = 0, 0

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        order = torch.randperm(self.num_clips, generator=keyed_generator(self.seed, "epoch", epoch)).tolist()
        count = self.num_clips // self.global_batch
        return [order[i * self.global_batch : (i + 1) * self.global_batch] for i in range(count)]

    def next_batch(self) -> list[int]:
        batches = self._epoch_batches(self.epoch)
        if self.consumed == len(batches):
            self.epoch, self.consumed = self.epoch + 1, 0
            batches = self._epoch_batches(self.epoch)
        self.consumed += 1
        return batches[self.consumed - 1]

    def state_dict(self) -> dict:
        return {"epoch": torch.tensor(self.epoch), "consumed": torch.tensor(self.consumed),
                "global_batch": torch.tensor(self.global_batch)}

    def load_state_dict(self, state: dict) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ConfigError(
                f"the checkpoint was trained with global batch {state['global_batch']}, this run has "
                f"{self.global_batch}: keep train.batch_size x train.gradient_accumulation_steps x world size equal"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def micro_slice(step_batch: list[int], micro: int, rank: int, world: int, batch_size: int) -> range:
    """Positions in the global batch that this rank uses in this micro-step (design.md, Steps)."""
    start = (micro * world + rank) * batch_size
    return range(start, start + batch_size)


def main() -> None:
    from trainer import setup_run

    with setup_run(sys.argv[1:], build_only=True):
        pass


if __name__ == "__main__":
    main()
