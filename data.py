"""Each clip's plan and window: its bucket, first frame and crop, and the window's frames, control,
mask, references, images and sound, read from the clip list (clip_lists.py).

Every clip is planned from its header (decode.py reads it): its bucket, its first frame and its crop
offsets, drawn from a generator keyed by (run.seed, the clip's content). Its sound covers the
seconds its frames do; its control video (data.control_column) is read at its frames' times, resized
to its size and cropped as it is.
"""

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

import decode
import sound
from clip_lists import BadClip, Clip, Problem
from config import ConfigError, DataConfig


def keyed_generator(*keys, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from a tuple of keys, e.g. (seed, step, sample): no draw uses the global
    RNG. On the CPU unless `device` says otherwise (LoRA dropout draws its masks where the
    activations are: the same keys give other numbers on another device type, the same ones on every
    run)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass(frozen=True)
class Item:
    """A clip with its preprocessing decided: what the cache key and the decoder both use."""

    clip: Clip
    media: decode.Media  # what its header said
    content: str  # a hash of the file's bytes: cache entries and keyed draws follow the content
    image_content: str | None  # image-to-video: the hash of data.image_column's image, if given
    bucket: int
    resolution: tuple[int, int, int]  # frames, height, width
    resized: tuple[int, int]  # height, width after the aspect-preserving resize, before the crop
    rate: float  # frames are taken at this rate (data.target_fps, or the clip's own)
    start: int  # first frame, counted at that rate
    top: int
    left: int
    pad: bool  # the clip is shorter than its bucket: repeat its last frame
    # first-last-frame: the hash of data.last_image_column's image
    last_image_content: str | None = None
    control_media: decode.Media | None = None  # the control video's header (data.control_column)
    control_content: str | None = None  # and the hash of its bytes
    mask_media: decode.Media | None = None  # Wan VACE: the mask's header (data.mask_column)
    mask_content: str | None = None  # and the hash of its bytes
    # Wan VACE: the hashes of the reference images (data.reference_column), in order
    reference_content: tuple[str, ...] = ()

    def preprocessing(self) -> dict:
        """Everything besides the content and the encoder that shapes the clip's latents."""
        return {
            "resolution": self.resolution,
            "resized": self.resized,
            "rate": self.rate,
            "start": self.start,
            "top": self.top,
            "left": self.left,
            "pad": self.pad,
            "resize": decode.RESIZE,
        }


# Buckets and planning.
def resolutions(cfg: DataConfig, check) -> list[tuple[int, int, int]]:
    """data.buckets when set, else [data.train_resolution]; each checked by check(shape, key), the
    model's rules (the adapter's check_resolution)."""
    if cfg.target_fps < 0 or cfg.cache_batch_size < 1 or cfg.decode_workers < 0:
        raise ConfigError(
            "data.target_fps must be >= 0 (0 keeps the native rate), data.cache_batch_size >= 1 and "
            "data.decode_workers >= 0 (0 picks min(8, CPUs per rank))"
        )
    key, shapes = (
        ("data.buckets", cfg.buckets) if cfg.buckets else ("data.train_resolution", [cfg.train_resolution])
    )
    for i, shape in enumerate(shapes):
        name = f"{key}[{i}]" if cfg.buckets else key
        if len(shape) != 3:
            raise ConfigError(f"{name} must be [frames, height, width], got {shape}")
        check(shape, name)
    if len({tuple(s) for s in shapes}) != len(shapes):
        raise ConfigError(f"data.buckets lists a shape twice: {shapes}")
    return [tuple(s) for s in shapes]


def choose_bucket(shapes: list[tuple[int, int, int]], height: int, width: int, frames: int) -> int | None:
    """The bucket whose aspect ratio is nearest the clip's (as displayed), then of the largest area
    it fills without upscaling, then of the most frames it fills. Among those of the nearest aspect,
    a clip smaller than every one goes, upscaled, to the smallest; one too short for every one it
    covers to the shortest of them (data.short_clips decides). Images go to one-frame buckets,
    videos to the others; None when there is none of its kind."""
    kind = [i for i, shape in enumerate(shapes) if (shape[0] == 1) == (frames == 1)]
    if not kind:
        return None
    distance = {i: abs(math.log(shapes[i][2] / shapes[i][1]) - math.log(width / height)) for i in kind}
    nearest = [i for i in kind if distance[i] <= min(distance.values()) + 1e-9]
    area = lambda i: shapes[i][1] * shapes[i][2]
    covered = [i for i in nearest if shapes[i][1] <= height and shapes[i][2] <= width]
    smallest = min(area(i) for i in nearest)
    covered = covered or [i for i in nearest if area(i) == smallest]
    long_enough = [i for i in covered if shapes[i][0] <= frames]
    if long_enough:
        return max(long_enough, key=lambda i: (area(i), shapes[i][0]))
    return min(covered, key=lambda i: (shapes[i][0], -area(i)))


def plan_clip(
    clip: Clip,
    media: decode.Media,
    content: str,
    shapes: list[tuple[int, int, int]],
    cfg: DataConfig,
    seed: int,
    image_content: str | None = None,
    last_image_content: str | None = None,
    control: tuple[decode.Media, str] | None = None,
    mask: tuple[decode.Media, str] | None = None,
    reference_content: tuple[str, ...] = (),
) -> Item | Problem:
    """Plan a clip's bucket, frames and crop from its header alone.

    Decide bucket, frames and crop from the header alone; decoding comes later (cache pass). The
    window starts at a keyed random frame, or at frame 0 for a clip with an image-to-video image
    (`image_content`); without one, image-to-video conditions on the window's own first frame. A
    clip with a last image (`last_image_content`, first-last-frame) ends its window at its last
    frame. A control video (`control`: its header and content hash) must show every frame time of
    the window, and so must a mask video (`mask`, Wan VACE; a mask image stands for every frame)."""
    rate = 0.0 if media.image else cfg.target_fps or media.fps
    available = decode.available_frames(media, rate)
    bucket = choose_bucket(shapes, media.height, media.width, available)
    if bucket is None:
        kind = (
            "an image, but no bucket has 1 frame" if media.image else "a video, but every bucket has 1 frame"
        )
        return Problem(clip, f"{kind}: add a [frames, height, width] bucket of its kind to data.buckets")
    frames, out_h, out_w = shapes[bucket]
    if available < frames and cfg.short_clips != "pad":
        at = f"at {cfg.target_fps:g} fps" if cfg.target_fps else "in all"
        return Problem(
            clip, f"has {available} frames {at}, its bucket {list(shapes[bucket])} needs {frames}", "short"
        )
    scale = max(out_h / media.height, out_w / media.width)
    resized = (max(out_h, round(media.height * scale)), max(out_w, round(media.width * scale)))
    generator = keyed_generator(seed, "clip", content)  # the same wherever the file lies
    # An image-to-video clip's image (data.image_column) is its video's first frame: its window must
    # start there, or the model learns a jump from the image to a later frame. Still one draw (of
    # one choice): the crop draws after it stay the same. A last image (data.last_image_column) is
    # the clip's last frame: the window ends there, for the same reason.
    latest = 0 if image_content is not None else max(available - frames, 0)
    earliest = latest if last_image_content is not None else 0
    if last_image_content is not None and image_content is not None and available > frames:
        return Problem(
            clip,
            f"has {available} frames and both an image and a last image, which are its first and "
            f"last frames, but its bucket {list(shapes[bucket])} takes {frames}: cut the clip to "
            f"{frames} frames, or clear data.image_column to condition on the window's first frame",
        )
    start = int(torch.randint(earliest, latest + 1, (), generator=generator))
    if cfg.crop == "random":
        top = int(torch.randint(0, resized[0] - out_h + 1, (), generator=generator))
        left = int(torch.randint(0, resized[1] - out_w + 1, (), generator=generator))
    else:
        top, left = (resized[0] - out_h) // 2, (resized[1] - out_w) // 2
    if control is not None:
        # The window's frames the clip shows (a padded clip repeats its last one): the control must
        # show their times too, at whatever rate it was made.
        shown = min(start + frames, available)
        has = decode.available_frames(control[0], rate)
        if has < shown:
            at = f"at {rate:g} fps" if rate else "in all"
            return Problem(
                clip,
                f"control {clip.control} has {has} frames {at}, but the clip's window needs its "
                f"frames {start} to {shown - 1}: give each clip a control video as long as the clip",
            )
        if mask is not None and not mask[0].image and decode.available_frames(mask[0], rate) < shown:
            has = decode.available_frames(mask[0], rate)
            return Problem(
                clip,
                f"mask {clip.mask} has {has} frames, but the clip's window needs its "
                f"frames {start} to {shown - 1}: give each clip a mask video as long as "
                "the clip, or one image",
            )
    return Item(
        clip,
        media,
        content,
        image_content,
        bucket,
        shapes[bucket],
        resized,
        rate,
        start,
        top,
        left,
        available < frames,
        last_image_content,
        *(control or (None, None)),
        *(mask or (None, None)),
        reference_content,
    )


def window_times(item: Item) -> list[float]:
    """When each of the window's frames is shown, in seconds after the clip's first frame."""
    frames = item.resolution[0]
    return [(item.start + k) / item.rate for k in range(frames)] if item.rate else [0.0] * frames


def decode_clip(item: Item, threads: int = 0) -> torch.Tensor:
    """The planned frames, resized and cropped: uint8 [F, H, W, 3]. Frame k is the one shown at
    (start + k) / rate seconds after the clip's first frame."""
    frames, height, width = item.resolution
    times = window_times(item)
    crop = (item.top, item.left, height, width)
    try:
        return torch.from_numpy(
            decode.read_frames(item.clip.video, item.media, times, item.resized, crop, item.pad, threads)
        )
    except decode.MediaError as e:
        raise BadClip(str(e)) from None


def decode_control(item: Item, threads: int = 0, mask: bool = False) -> torch.Tensor:
    """The control video's frames of the planned window (with `mask`, Wan VACE's mask's, an image
    mask for every frame): those shown at the clip's frame times (whatever the control's own rate),
    resized to the clip's resized size (whatever the control's own) and cropped as the clip's frames
    are: uint8 [F, H, W, 3], frame k aligned with decode_clip's frame k."""
    frames, height, width = item.resolution
    kind, path, media = (
        ("mask", item.clip.mask, item.mask_media)
        if mask
        else ("control", item.clip.control, item.control_media)
    )
    try:
        crop = (item.top, item.left, height, width)
        return torch.from_numpy(
            decode.read_frames(path, media, window_times(item), item.resized, crop, item.pad, threads)
        )
    except decode.MediaError as e:
        raise BadClip(f"{kind} {path}: {e}") from None


def load_references(item: Item) -> list[torch.Tensor]:
    """Wan VACE: the clip's reference images in order, upright, at their own sizes (the family fits
    them into the frame): uint8 [H, W, 3] each."""
    references = []
    for path in item.clip.reference:
        try:
            with decode.Image.open(path) as image:
                size = decode.ImageOps.exif_transpose(image).size
        except (OSError, SyntaxError) as e:
            raise BadClip(f"reference {path}: not a readable image ({e})") from None
        pixels = decode.read_image(path, (size[1], size[0]), (0, 0, size[1], size[0]))
        # a writable copy: the uncropped image is PIL's read-only buffer
        references.append(torch.from_numpy(np.array(pixels)))
    return references


def decode_audio(item: Item, sample_rate: int, channels: int) -> torch.Tensor | None:
    """The sound of the planned frames' seconds, start / rate to (start + frames) / rate after the
    clip's first frame, mixed to `channels` at `sample_rate`: float32 [channels, round(frames / rate
    * sample_rate)]; zeros past the end of the stream (a padded clip's repeated frames). None for an
    image or a file without sound (sound.read_audio); BadClip when its sound cannot be decoded."""
    if item.media.image:
        return None
    frames = item.resolution[0]
    try:
        return sound.read_audio(
            item.clip.video, item.media, item.start / item.rate, frames / item.rate, sample_rate, channels
        )
    except decode.MediaError as e:
        raise BadClip(str(e)) from None


def load_image(item: Item, last: bool = False) -> torch.Tensor:
    """A clip's conditioning image (data.image_column, or with `last` data.last_image_column's),
    upright as displayed (EXIF orientation), resized to the clip's resized size and cropped as its
    frames are: uint8 [H, W, 3]. An image of the clip's own size (its first or last frame, say)
    lines up with the frames exactly."""
    frames, height, width = item.resolution
    path = item.clip.last_image if last else item.clip.image
    try:
        return torch.from_numpy(decode.read_image(path, item.resized, (item.top, item.left, height, width)))
    except decode.MediaError as e:
        raise BadClip(f"{'last image' if last else 'image'} {path}: {e}") from None
