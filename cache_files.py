"""The cache's entries on disk: names, atomic writes, reads and the read-ahead.

Where each entry lives (named by a hash of what produced it), writing one atomically, reading a
micro-batch's entries, and the read-ahead that brings the next micro-batch in while the current one
computes. cache.py runs the pass that writes them; the trainer only reads.

Five kinds of entry, one safetensors file each, named by a hash of what produced it:
- video: the VAE posterior (mean, log-variance) of a clip, keyed by the clip's content, its
  preprocessing (bucket, rate, first frame, crop, resize) and the VAE's content;
- image (image-to-video): the conditioning image's posterior, keyed by the same plus the image's
  content and the seed of its noise augmentation;
- text: the T5 embedding of a prompt, keyed by the prompt, the text encoder's and tokenizer's
  content and the text length;
- audio (families with sound, data.audio): the audio VAE posterior (audio_latent_mean,
  audio_latent_logvar) of the sound of a clip's window (data.decode_audio), keyed by the clip's
  content, the window, the audio VAE's content and sound.SOUND; an empty entry for a clip without
  sound. Such a family's adapter has audio_sample_rate, audio_channels and encode_audio(waveforms
  [1, channels, samples]).
- control (models that follow a control video, data.control_column): what the adapter's
  encode_control makes of the control frames aligned with the clip's window (data.decode_control),
  keyed by the clip's video key and the control file's content (Wan VACE: and its mask's and
  reference images', its control video possibly none): a changed control video is re-encoded, the
  clip's latents kept.
So recaptioning encodes prompts and no video, a per-node copy of a model or of the clips reuses what
its twin encoded, and a fine-tuned VAE or T5 never reuses stale entries. Entries are written
atomically: an interrupted pass resumes where it was. manifest.py keeps the headers and hashes.
"""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import data
import faults
from config import DataConfig

CACHE_FIX = (
    "free space there, or set data.cache_dir to a disk with room, and run again: the entries written so far "
    "are kept"
)


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class Cache:
    """Entries under cache_dir/{video,image,text,audio,control}/<2 hex digits>/, named by what
    produced them."""

    def __init__(
        self,
        cfg: DataConfig,
        encoders: dict[str, dict],
        text_length: int,
        dtype: str,
        image_seed: int | None,
        audio_dtype: str | None = None,
        control: bool = False,
        control_key: dict | None = None,
    ):
        """audio_dtype: the audio encoder's precision (in its entries' keys); None: no sound
        entries. control: whether each clip has a control entry; control_key: what else its key
        holds (the adapter's control_key)."""
        self.dir = Path(cfg.cache_dir or Path(cfg.data_root) / ".cache")
        self.encoders, self.text_length, self.dtype, self.image_seed = (
            encoders,
            text_length,
            dtype,
            image_seed,
        )
        self.audio_dtype, sound = audio_dtype, audio_dtype is not None
        self.kinds = ("video", "text") + ("image",) * (image_seed is not None) + ("audio",) * sound
        self.kinds += ("control",) * control
        self.control_key = control_key or {}

    def path(self, item: data.Item, kind: str) -> str:
        if kind == "text":
            key = _key(
                prompt=item.clip.prompt,
                encoder=self.encoders["text"],
                length=self.text_length,
                dtype=self.dtype,
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
            text = entry["prompt_embeds"]
            entry["prompt_embeds"] = torch.cat(
                [text, text.new_zeros(self.text_length - len(text), text.shape[1])]
            )
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
