"""The dataset: its lists, each clip's plan and window (frames, conditions, sound), the clip sampler.

In this order: the dataset's lists (which clips, with which prompts and conditions) and bad clips;
each clip's plan and window: its bucket, first frame and crop, and the window's frames, control,
mask, references, images; the window's sound as a model hears it; the clip sampler.

Every clip is planned from its header (decode.py reads it): its bucket, its first frame and its crop
offsets, drawn from a generator keyed by (run.seed, the clip's content). Its sound covers the
seconds its frames do; its control video (data.control_column) is read at its frames' times, resized
to its size and cropped as it is.
"""

import csv
import functools
import hashlib
import io
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import decode
import faults
from config import VALIDATION_FILES, ConfigError, DataConfig, ValidationConfig, nearest
from decode import Media, MediaError

# --------------------------------------------------------------------------------------------------
# The dataset's lists: which clips, with which prompts, images, controls, masks and references, and
# what is done with a clip that cannot be used.
#
# Formats: CogVideo's layout (prompts.txt and videos.txt, optional images.txt, one entry per line,
# paths relative to data_root) when those files exist, else metadata.jsonl or metadata.csv with
# `video`, `prompt` and optional `image`, `last_image`, `control`, `mask` and `reference` columns (an
# empty entry: none; several references separated by REFERENCES, or a JSON list in metadata.jsonl; any
# other column refused by name). A
# `video` may be an image (.png, .jpg, .webp): a one-frame clip. A clip that cannot be used (a Problem,
# or a BadClip raised while decoding it) is named by its list file's line; stop_on_problems stops at
# the lowest, or skips them as data.skip_bad and data.short_clips say. data.py plans each clip's window.


METADATA_FILES = ("metadata.jsonl", "metadata.csv")
# Wan VACE: what separates a clip's reference images on one line of a list file or a CSV cell (a
# path with it is listed in metadata.jsonl's JSON list); and the columns whose entry may be empty
# (none: Wan VACE's control video, mask, references).
REFERENCES = "|"
OPTIONAL = ("control", "mask", "reference", "loss_mask")
# a metadata file's columns; any other is refused by name (a misspelt condition would train as none)
COLUMNS = ("video", "prompt", "image", "last_image", "control", "mask", "reference", "loss_mask")


@dataclass(frozen=True)
class Clip:
    video: Path
    prompt: str
    line: int  # 1-based line in the list file, for messages and for reporting the lowest bad line
    source: str  # the list file the line belongs to
    image: Path | None = None
    # first-last-frame: the clip's last frame (data.last_image_column)
    last_image: Path | None = None
    control: Path | None = None  # a control video aligned with the clip (data.control_column)
    mask: Path | None = None  # Wan VACE: the control's mask, a video or an image (data.mask_column)
    reference: tuple[Path, ...] = ()  # Wan VACE: its reference images (data.reference_column)
    loss_mask: Path | None = None  # the loss's weights, a video or an image (data.loss_mask_column)


@dataclass(frozen=True)
class Problem:
    """A clip that cannot be used. kind "short" follows data.short_clips, every other kind
    data.skip_bad."""

    clip: Clip
    reason: str
    kind: str = "bad"

    def __str__(self) -> str:
        return f"{self.clip.source} line {self.clip.line}: {self.clip.video}: {self.reason}"


class BadClip(ConfigError):
    """A clip, or the first of several, that cannot be used; the message names the file and what to
    do."""


# Formats.
def stop_on_problems(problems: list[Problem], cfg: DataConfig) -> list[Problem]:
    """Raise with the lowest line unless every problem may be skipped; return the skipped ones."""
    fatal = [p for p in problems if not (cfg.short_clips == "skip" if p.kind == "short" else cfg.skip_bad)]
    if fatal:
        first = min(fatal, key=lambda p: p.clip.line)
        fix = (
            'set data.short_clips = "skip" or "pad", or choose shorter buckets'
            if first.kind == "short"
            else "fix or remove it, or set data.skip_bad = true to skip such clips and list them in skipped.txt"
        )
        raise BadClip(f"{first}. {len(fatal)} clip(s) cannot be used; this is the lowest line: {fix}")
    return problems


def _read_text(path: Path) -> str:
    """A list or metadata file as UTF-8 text, without the byte-order mark some editors write first
    (it would become part of the first prompt or path); other bytes are an error naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path} line {line} is not UTF-8 (byte {raw[e.start]:#04x}): save the file as UTF-8"
        ) from None


def _list_file(path: Path, blanks: int = 0) -> list[str]:
    """Stripped lines; blank lines at the end are tolerated, a blank line inside is an error. With
    `blanks` (the clips' count, for a column whose entries may be empty) blank lines are entries,
    those past that count dropped."""
    lines = [line.strip() for line in _read_text(path).splitlines()]
    while len(lines) > blanks and not lines[-1]:
        lines.pop()
    for number, line in enumerate(lines, start=1):
        if not line and not blanks:
            raise ConfigError(f"{path} line {number} is empty: every line must hold one entry")
    return lines


def _cogvideo_rows(root: Path, cfg: DataConfig) -> tuple[str, list[tuple[int, dict]]]:
    columns = {
        "prompt": cfg.caption_column,
        "video": cfg.video_column,
        "image": cfg.image_column,
        "last_image": cfg.last_image_column,
        "control": cfg.control_column,
        "mask": cfg.mask_column,
        "reference": cfg.reference_column,
        "loss_mask": cfg.loss_mask_column,
    }
    values = {key: _list_file(root / name) for key, name in columns.items() if name and key not in OPTIONAL}
    for key in OPTIONAL:  # an empty line: the clip has none
        if columns[key]:
            values[key] = _list_file(root / columns[key], len(values["prompt"]))
    for key in ("video", "image", "last_image", "control", "mask", "reference", "loss_mask"):
        if key in values and len(values[key]) != len(values["prompt"]):
            raise ConfigError(
                f"{root / cfg.caption_column} has {len(values['prompt'])} lines but {root / columns[key]} has "
                f"{len(values[key])}: they must pair up line by line (first unpaired line: "
                f"{min(len(values[key]), len(values['prompt'])) + 1})"
            )
    rows = [(i + 1, {key: column[i] for key, column in values.items()}) for i in range(len(values["prompt"]))]
    return str(root / cfg.video_column), rows


def _jsonl_rows(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {number} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path} line {number} must be a JSON object with video and prompt")
            _check_columns(path, number, list(row))
            rows.append((number, row))
    return rows


def _csv_rows(path: Path) -> list[tuple[int, dict]]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    rows = [(reader.line_num, row) for row in reader]
    if reader.fieldnames is None or not {"video", "prompt"} <= set(reader.fieldnames):
        raise ConfigError(
            f"{path} line 1 must be a header naming the columns video and prompt (and optionally image)"
        )
    _check_columns(path, 1, reader.fieldnames)
    return rows


def _check_columns(path: Path, line: int, names: list[str]) -> None:
    """Refuse a column vidtrain does not read, naming the nearest it does where one is near (other
    tools' columns, caption or file_name, have none); an empty name (a CSV's trailing comma) is no
    column."""
    unknown = [name for name in names if name and name not in COLUMNS]
    if unknown:
        raise ConfigError(
            f"{path} line {line}: column {unknown[0]!r} is not one vidtrain reads"
            f"{nearest(unknown[0], list(COLUMNS), cutoff=0.6)}: rename it, or remove it (the columns: "
            f"{', '.join(COLUMNS)})"
        )


def read_clips(cfg: DataConfig) -> list[Clip]:
    """The clip list in file order. Missing videos are not an error here: they are bad input
    (skip_bad)."""
    root = Path(cfg.data_root)
    if not root.is_dir():
        raise ConfigError(f"data.data_root = {cfg.data_root} is not a folder")
    if (root / cfg.caption_column).is_file() and (root / cfg.video_column).is_file():
        source, rows = _cogvideo_rows(root, cfg)
    else:
        present = [root / name for name in METADATA_FILES if (root / name).is_file()]
        if len(present) != 1:
            found = "both" if present else "neither"
            raise ConfigError(
                f"{root} holds {found} of {' and '.join(METADATA_FILES)} and not {cfg.caption_column} with "
                f"{cfg.video_column}: give it exactly one dataset format"
            )
        source = str(present[0])
        rows = _jsonl_rows(present[0]) if present[0].suffix == ".jsonl" else _csv_rows(present[0])
    # where a clip's references are listed, for messages
    listed = str(root / cfg.reference_column) if source == str(root / cfg.video_column) else source
    clips = []
    for line, row in rows:
        for key in ("video", "prompt"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ConfigError(
                    f"{source} line {line}: empty or missing {key}: every clip needs a video and a prompt"
                )
        paths = (row.get(key) for key in ("image", "last_image", "control", "mask"))
        clips.append(
            Clip(
                root / row["video"].strip(),
                row["prompt"].strip(),
                line,
                source,
                *(_path(root, path) for path in paths),
                _references(root, row.get("reference"), listed, line),
                _path(root, row.get("loss_mask")),
            )
        )
    if not clips:
        raise ConfigError(f"{source} lists no clips")
    return clips


def _path(root: Path, entry) -> Path | None:
    """An optional column's path under data_root; None for an empty entry."""
    return root / entry.strip() if isinstance(entry, str) and entry.strip() else None


def _references(root: Path, entry, source: str, line: int) -> tuple[Path, ...]:
    """Wan VACE: a clip's reference images: paths separated by REFERENCES (a list file's line, a CSV
    cell, a metadata.jsonl string), or a JSON list of paths (metadata.jsonl); empty: none."""
    entry = entry.split(REFERENCES) if isinstance(entry, str) else [] if entry is None else entry
    if not isinstance(entry, list) or not all(isinstance(path, str) for path in entry):
        raise ConfigError(f"{source} line {line}: reference must be a path or a list of paths, got {entry!r}")
    paths = [path.strip() for path in entry]
    if len(paths) > 1 and not all(paths):
        raise ConfigError(
            f"{source} line {line}: an empty reference image among {paths}: list each clip's reference "
            f"images separated by {REFERENCES!r}, none empty"
        )
    return tuple(root / path for path in paths if path)


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
    loss_mask_media: decode.Media | None = None  # the loss mask's header (data.loss_mask_column)
    loss_mask_content: str | None = None  # and the hash of its bytes

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
    loss_mask: tuple[decode.Media, str] | None = None,
) -> Item | Problem:
    """Plan a clip's bucket, frames and crop from its header alone.

    Decide bucket, frames and crop from the header alone; decoding comes later (cache pass). The
    window starts at a keyed random frame, or at frame 0 for a clip with an image-to-video image
    (`image_content`); without one, image-to-video conditions on the window's own first frame. A
    clip with a last image (`last_image_content`, first-last-frame) ends its window at its last
    frame. A control video (`control`: its header and content hash) must show every frame time of
    the window, and so must a mask video (`mask`, Wan VACE; a mask image stands for every frame) and
    a loss mask video (`loss_mask`)."""
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
    lacking = loss_mask is not None and not loss_mask[0].image
    if lacking and decode.available_frames(loss_mask[0], rate) < min(start + frames, available):
        return Problem(
            clip,
            f"loss mask {clip.loss_mask} has {decode.available_frames(loss_mask[0], rate)} frames, but "
            f"the clip's window needs its frames {start} to {min(start + frames, available) - 1}: give "
            "each clip a loss mask video as long as the clip, or one image",
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
        *(loss_mask or (None, None)),
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


def decode_control(item: Item, threads: int = 0, kind: str = "control") -> torch.Tensor:
    """The control video's frames of the planned window (kind "mask": Wan VACE's mask's; "loss_mask":
    the loss mask's; an image stands for every frame): those shown at the clip's frame times
    (whatever the control's own rate), resized to the clip's resized size (whatever the control's
    own) and cropped as the clip's frames are: uint8 [F, H, W, 3], frame k aligned with decode_clip's
    frame k."""
    frames, height, width = item.resolution
    path, media = getattr(item.clip, kind), getattr(item, f"{kind}_media")
    try:
        crop = (item.top, item.left, height, width)
        return torch.from_numpy(
            decode.read_frames(path, media, window_times(item), item.resized, crop, item.pad, threads)
        )
    except decode.MediaError as e:
        raise BadClip(f"{kind.replace('_', ' ')} {path}: {e}") from None


def fitted_size(size: tuple[int, int], frame: tuple[int, int], multiple: int) -> tuple[int, int]:
    """A reference image's (height, width) `size` once fitted into a (height, width) frame as
    WanVACEPipeline fits it: its sides cut to multiples of the VAE's spatial ratio (`multiple`), then
    scaled to fit inside the frame with its aspect kept ((0, 0) when a side is cut away)."""
    height, width = (side // multiple * multiple for side in size)
    if not height or not width:
        return 0, 0
    scale = min(frame[0] / height, frame[1] / width)
    return int(height * scale), int(width * scale)


def reference_problem(path, size: tuple[int, int], frame, multiple: int) -> str | None:
    """Why a reference image of (height, width) `size` leaves nothing once fitted into a frame
    (fitted_size: a side under a pixel, where the pipeline's resize stops with a ValueError), or
    None."""
    fitted = fitted_size(size, (frame[-2], frame[-1]), multiple)
    if min(fitted) >= 1:
        return None
    return (
        f"reference {path} is {size[1]}x{size[0]} (width x height): fitted into the {frame[-1]}x"
        f"{frame[-2]} frame (its sides cut to multiples of {multiple} first) it keeps {fitted[1]}x"
        f"{fitted[0]} pixels; crop it nearer the frame's aspect ratio"
    )


def check_validation_references(cfg: ValidationConfig, resolution, multiple: int) -> None:
    """validation.reference_images that cannot be read, or leave nothing once fitted into the
    rendered frame (reference_problem), refused naming the file and the key before any compute."""
    for i, paths in enumerate(cfg.reference_images):
        for path in [paths] if isinstance(paths, str) else paths:
            fix = VALIDATION_FILES["reference_images"]
            try:
                media = decode.probe(Path(path))
            except decode.MediaError as e:
                raise ConfigError(f"validation.reference_images[{i}] = {path}: {e}; fix {fix}") from None
            problem = reference_problem(path, (media.height, media.width), resolution, multiple)
            if problem:
                raise ConfigError(f"validation.reference_images[{i}]: {problem}; fix {fix}")


def load_references(item: Item) -> list[torch.Tensor]:
    """Wan VACE: the clip's reference images in order, upright, at their own sizes (the family fits
    them into the frame): uint8 [H, W, 3] each."""
    references = []
    for path in item.clip.reference:
        try:
            # a writable copy: PIL's buffer is read-only
            references.append(torch.from_numpy(np.array(decode.open_image(path))))
        except decode.MediaError as e:
            raise BadClip(f"reference {path}: {e}") from None
    return references


def decode_audio(item: Item, sample_rate: int, channels: int) -> torch.Tensor | None:
    """The sound of the planned frames' seconds, start / rate to (start + frames) / rate after the
    clip's first frame, mixed to `channels` at `sample_rate`: float32 [channels, round(frames / rate
    * sample_rate)]; zeros past the end of the stream (a padded clip's repeated frames). None for an
    image or a file without sound (data.read_audio); BadClip when its sound cannot be decoded."""
    if item.media.image:
        return None
    frames = item.resolution[0]
    try:
        return read_audio(
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


# --------------------------------------------------------------------------------------------------
# Reading sound: a clip's audio as a model hears it.
#
# A clip's first audio stream, cut to the seconds its frames cover on the same clock (both
# streams' timestamps, measured from the first frame's display time: an audio stream may start before
# or after the video), decoded in a child process (decode.py: a crashing decoder names the
# clip), mixed to the channels a model takes and resampled with a windowed sinc (equal to torchaudio's
# default, which the official LTX-2 trainer uses), then turned into the log-mel spectrogram an audio
# VAE encodes.


# Decoded on each side of the window: a decoder restarted by a seek needs frames to settle
# (Opus: 80 ms), the resampler a few samples.
AUDIO_MARGIN_S = 0.5
RESAMPLE_TAPS = 6  # zero crossings on each side of the sinc (torchaudio's lowpass_filter_width)
RESAMPLE_ROLLOFF = 0.99  # cutoff as a share of the lower Nyquist frequency (torchaudio's rolloff)
# Louder than this, a decoded sample comes from a corrupt stream (a damaged Opus packet decodes to
# hundreds); lossy codecs overshoot full scale by a few dB at most.
LOUDEST = 4.0
# Past this many phase-kernel values, resample computes each output's weights where it needs them:
# 44,101 Hz to 16 kHz (no common factor) would take 16,000 kernels of 44,135 taps, 5.6 GB.
KERNEL_VALUES = 1 << 22
SOUND = "sinc-hann-6-0.99"  # part of the audio cache key: another resampler gives other latents
# clips whose sound this process decoded (the sound_segv fault)
_sounds, _sounds_lock = 0, threading.Lock()


def read_audio(
    path: Path, media: Media, start: float, duration: float, sample_rate: int, channels: int
) -> torch.Tensor | None:
    """The clip's sound from `start` seconds after its first frame is shown, for `duration` seconds:
    float32 [channels, round(duration * sample_rate)] at `sample_rate`; zeros where the stream has
    no sound (before it starts, after it ends). None when the file has no audio stream, or one
    without a single frame. Decoded in a child process (decode.py): a decoder that crashes
    names the clip."""
    global _sounds
    with _sounds_lock:
        _sounds += 1
        crash = faults.active("sound_segv", _sounds)
    try:
        found = decode.decode(
            str(path), media.first_pts, start - AUDIO_MARGIN_S, duration + 2 * AUDIO_MARGIN_S, crash
        )
    except decode.Failed as e:
        raise MediaError(str(e)) from None
    if found is None:
        return None
    rate, native = found
    peak = float(np.abs(native).max())
    if peak > LOUDEST:
        raise MediaError(
            f"its sound decodes to samples up to {peak:.3g}, far outside [-1, 1] (a corrupt "
            "stream): re-encode its sound or remove the clip"
        )
    waveform = resample(mix(torch.from_numpy(native), channels), rate, sample_rate)
    first = round(AUDIO_MARGIN_S * sample_rate)
    return waveform[:, first : first + round(duration * sample_rate)]


def mix(waveform: torch.Tensor, channels: int) -> torch.Tensor:
    """[C, N] samples to `channels` (1 or 2), as the official LTX-2 trainer mixes: mono is copied to
    both sides; 5.1 and 7.1 (FFmpeg's order: L, R, C, LFE, then the surrounds) keep each side's
    front, add the centre and that side's surrounds at 0.707 and drop the LFE, scaled so the weights
    sum to 1; any other layout is averaged; one channel out is the mean of two."""
    count = waveform.shape[0]
    if count in (6, 8):
        left, right = [0, 4, 6][: count // 2 - 1], [1, 5, 7][: count // 2 - 1]
        total = 1 + 0.707 * len(left)  # the front, then the centre and the surrounds of one side
        waveform = torch.stack(
            [
                (waveform[side[0]] + 0.707 * (waveform[2] + waveform[side[1:]].sum(0))) / total
                for side in (left, right)
            ]
        )
    elif count > 2:
        waveform = waveform.mean(0, keepdim=True)
    if channels == 1:
        return waveform.mean(0, keepdim=True)
    return waveform.expand(2, -1).clone() if waveform.shape[0] == 1 else waveform


def resample(waveform: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """[C, N] at `rate` to `new_rate`: a Hann-windowed sinc (RESAMPLE_TAPS zero crossings each side,
    cutoff RESAMPLE_ROLLOFF of the lower Nyquist), output sample j at input time j / new_rate (no
    delay); ceil(N * new_rate / rate) samples, in the waveform's dtype. The same filter as
    torchaudio.functional.resample's default."""
    divisor = math.gcd(rate, new_rate)
    rate, new_rate = rate // divisor, new_rate // divisor
    if rate == new_rate:
        return waveform
    samples = math.ceil(new_rate * waveform.shape[1] / rate)
    width = _width(rate, new_rate)
    if new_rate * (2 * width + rate) > KERNEL_VALUES:
        return _resample_pointwise(waveform, rate, new_rate, samples)
    kernels = _sinc_kernels(rate, new_rate)
    padded = torch.nn.functional.pad(waveform[:, None], (width, width + rate))
    # [C, new_rate phases, blocks]
    out = torch.nn.functional.conv1d(padded, kernels.to(waveform.dtype), stride=rate)
    return out.transpose(1, 2).reshape(waveform.shape[0], -1)[:, :samples]


def _width(rate: int, new_rate: int) -> int:
    """Input samples each side of an output sample within the filter's reach."""
    return math.ceil(RESAMPLE_TAPS * rate / (min(rate, new_rate) * RESAMPLE_ROLLOFF))


def _sinc(t: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """The filter's weight of input sample n for output sample m at t = n / rate - m / new_rate."""
    cutoff = min(rate, new_rate) * RESAMPLE_ROLLOFF  # in cycles per `rate` input samples, times 2
    t = (t * cutoff).clamp(-RESAMPLE_TAPS, RESAMPLE_TAPS)
    window = torch.cos(t * math.pi / RESAMPLE_TAPS / 2) ** 2
    sinc = torch.where(t == 0, 1.0, torch.sin(t * math.pi) / (t * math.pi).where(t != 0, 1.0))
    return sinc * window * cutoff / rate


@functools.lru_cache(maxsize=8)
def _sinc_kernels(rate: int, new_rate: int) -> torch.Tensor:
    """One kernel per output phase ([new_rate, 1, 2 * _width + rate], float64)."""
    width = _width(rate, new_rate)
    offsets = torch.arange(-width, width + rate, dtype=torch.float64)[None] / rate
    phases = -torch.arange(new_rate, dtype=torch.float64)[:, None] / new_rate
    return _sinc(offsets + phases, rate, new_rate)[:, None]


def _resample_pointwise(waveform: torch.Tensor, rate: int, new_rate: int, samples: int) -> torch.Tensor:
    """resample's filter, each output sample's weights computed for the inputs within its reach: for
    rates with little in common, whose phase kernels would not fit in memory. Chunks of 2**16
    outputs."""
    width, count = _width(rate, new_rate), waveform.shape[1]
    reach = torch.arange(-width, width + 2)
    chunks = []
    for first in range(0, samples, 1 << 16):
        m = torch.arange(first, min(first + (1 << 16), samples))[:, None]
        n = m * rate // new_rate + reach  # [outputs, inputs]: the inputs around each output's time
        weights = _sinc((n * new_rate - m * rate).double() / (rate * new_rate), rate, new_rate)
        weights = (weights * ((n >= 0) & (n < count))).to(waveform.dtype)  # zeros past either end
        chunks.append((waveform[:, n.clamp(0, count - 1)] * weights).sum(-1))
    return torch.cat(chunks, 1)


def log_mel(waveform: torch.Tensor, sample_rate: int, n_fft: int, hop: int, mel_bins: int) -> torch.Tensor:
    """[C, N] samples to the log-mel spectrogram LTX-2's audio VAE encodes (docs/models/ltx2.md,
    Audio input): [C, N // hop + 1, mel_bins], in the waveform's dtype. The magnitude (not power)
    STFT with a periodic Hann window of n_fft, centred with reflection; Slaney's mel scale and
    area-normalised filters from 0 Hz to Nyquist; the natural log, floored at 1e-5."""
    spectrum = torch.stft(
        waveform,
        n_fft,
        hop,
        window=torch.hann_window(n_fft, dtype=waveform.dtype),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    ).abs()
    # [C, mel_bins, frames]
    mel = _mel_filters(sample_rate, n_fft, mel_bins).to(spectrum.dtype).T @ spectrum
    return mel.clamp(min=1e-5).log().transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _mel_filters(sample_rate: int, n_fft: int, mel_bins: int) -> torch.Tensor:
    """Triangular filters [n_fft // 2 + 1, mel_bins] (float64), evenly spaced on Slaney's mel scale
    (linear below 1 kHz, logarithmic above), each scaled by 2 / its width in Hz."""

    def to_mel(hz):
        return torch.where(hz < 1000, hz * 3 / 200, 15 + torch.log(hz / 1000) * 27 / math.log(6.4))

    def to_hz(mel):
        return torch.where(mel < 15, mel * 200 / 3, 1000 * torch.exp((mel - 15) * math.log(6.4) / 27))

    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    top = float(to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64)))
    edges = to_hz(torch.linspace(0, top, mel_bins + 2, dtype=torch.float64))
    rising = (freqs[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[None, 2:] - freqs[:, None]) / (edges[2:] - edges[1:-1])
    return torch.minimum(rising, falling).clamp(min=0) * 2 / (edges[2:] - edges[:-2])


# --------------------------------------------------------------------------------------------------
# The sampler: which clips each optimizer step trains on, the same for any number of ranks.
#
# Global batches of clips from one bucket each, in an order keyed by (run.seed, epoch), and each rank's
# positions in a global batch per micro-step (docs/training.md, Steps and batches). Its state is two
# counters, so a resume continues the same sequence bitwise.


class Sampler:
    """Global batches of G clip indices, each from one bucket. For each (seed, epoch): one keyed
    permutation within each bucket, cut into global batches of G with the tails dropped, then the
    batches of all buckets in one keyed order. State: (epoch, global batches consumed in this
    epoch)."""

    def __init__(self, buckets: list[int], global_batch: int, seed: int):
        self.members: dict[int, list[int]] = {}
        for index, bucket in enumerate(buckets):
            self.members.setdefault(bucket, []).append(index)
        if all(len(m) < global_batch for m in self.members.values()):
            sizes = {b: len(m) for b, m in sorted(self.members.items())}
            raise ConfigError(
                f"no bucket holds a full global batch of {global_batch} (train.batch_size x "
                f"train.gradient_accumulation_steps x world size); clips per bucket: {sizes}: lower it or add clips"
            )
        self.global_batch, self.seed = global_batch, seed
        self.epoch, self.consumed = 0, 0
        self._batches: tuple[int, list[list[int]]] = (-1, [])

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._batches[0] != epoch:
            batches, g = [], self.global_batch
            for bucket, members in sorted(self.members.items()):
                order = torch.randperm(
                    len(members), generator=keyed_generator(self.seed, "epoch", epoch, bucket)
                )
                shuffled = [members[i] for i in order.tolist()]
                batches += [shuffled[i * g : (i + 1) * g] for i in range(len(shuffled) // g)]
            order = torch.randperm(
                len(batches), generator=keyed_generator(self.seed, "epoch", epoch, "batches")
            )
            self._batches = (epoch, [batches[i] for i in order.tolist()])
        return self._batches[1]

    def next_batch(self) -> list[int]:
        self.epoch, self.consumed = self._after()
        return self._epoch_batches(self.epoch)[self.consumed - 1]

    def peek(self) -> list[int]:
        """The batch next_batch returns next, not taken: the state a checkpoint holds stays as it
        is."""
        epoch, consumed = self._after()
        return self._epoch_batches(epoch)[consumed - 1]

    def _after(self) -> tuple[int, int]:
        """(epoch, consumed) once the next batch is taken."""
        if self.consumed == len(self._epoch_batches(self.epoch)):
            return self.epoch + 1, 1
        return self.epoch, self.consumed + 1

    def state_dict(self) -> dict:
        return {
            "epoch": torch.tensor(self.epoch),
            "consumed": torch.tensor(self.consumed),
            "global_batch": torch.tensor(self.global_batch),
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ConfigError(
                f"the checkpoint was trained with global batch {int(state['global_batch'])}, this run has "
                f"{self.global_batch}: keep train.batch_size x train.gradient_accumulation_steps x world size equal"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def micro_slice(micro: int, rank: int, world: int, batch_size: int) -> range:
    """Positions in the global batch that this rank uses in this micro-step (docs/training.md, Steps
    and batches)."""
    start = (micro * world + rank) * batch_size
    return range(start, start + batch_size)
