"""The manifest: the cache's index of every clip's header and every file's content hash.

One index in the cache folder of what every clip's header said and what every file's bytes hash to,
each against the file's size and mtime. A restart re-reads only the files that changed; a clip whose
file is gone keeps its entry, so with a complete cache it still trains; models and clips are known
by content, so a per-node copy of either matches the cache its twin filled."""

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import decode
import ranks

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
        if not path.exists():
            raise decode.MediaError("does not exist")
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
    ) -> tuple[dict, str | None, str | None, dict | None, list]:
        """The clip's entry, (image-to-video) its image's and (first-last-frame) its last image's
        content hashes, (a control model) its control video's entry under "video" (None: a Wan VACE
        clip without one) with Wan VACE's mask entry (or None) under "mask" and its reference images'
        hashes under "reference", reading what is not known yet; and the new entries.
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
                "reference": tuple(entry(path, "reference")["content"] for path in clip.reference),
            }
        return video, image, last, control, new

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
