"""The dataset's lists: which clips, with which prompts, images, controls, masks and references, and
what is done with a clip that cannot be used.

Formats: CogVideo's layout (prompts.txt and videos.txt, optional images.txt, one entry per line,
paths relative to data_root) when those files exist, else metadata.jsonl or metadata.csv with
`video`, `prompt` and optional `image`, `last_image`, `control`, `mask` and `reference` columns (an
empty entry: none; several references separated by REFERENCES, or a JSON list in metadata.jsonl). A
`video` may be an image (.png, .jpg, .webp): a one-frame clip. A clip that cannot be used (a Problem,
or a BadClip raised while decoding it) is named by its list file's line; stop_on_problems stops at
the lowest, or skips them as data.skip_bad and data.short_clips say. data.py plans each clip's window.
"""

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from config import ConfigError, DataConfig

METADATA_FILES = ("metadata.jsonl", "metadata.csv")
# Wan VACE: what separates a clip's reference images on one line of a list file or a CSV cell (a
# path with it is listed in metadata.jsonl's JSON list); and the columns whose entry may be empty
# (none: Wan VACE's control video, mask, references).
REFERENCES = "|"
OPTIONAL = ("control", "mask", "reference")


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
    }
    values = {key: _list_file(root / name) for key, name in columns.items() if name and key not in OPTIONAL}
    for key in OPTIONAL:  # an empty line: the clip has none
        if columns[key]:
            values[key] = _list_file(root / columns[key], len(values["prompt"]))
    for key in ("video", "image", "last_image", "control", "mask", "reference"):
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
            rows.append((number, row))
    return rows


def _csv_rows(path: Path) -> list[tuple[int, dict]]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    rows = [(reader.line_num, row) for row in reader]
    if reader.fieldnames is None or not {"video", "prompt"} <= set(reader.fieldnames):
        raise ConfigError(
            f"{path} line 1 must be a header naming the columns video and prompt (and optionally image)"
        )
    return rows


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
                *(root / path.strip() if isinstance(path, str) and path.strip() else None for path in paths),
                _references(root, row.get("reference"), listed, line),
            )
        )
    if not clips:
        raise ConfigError(f"{source} lists no clips")
    return clips


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
