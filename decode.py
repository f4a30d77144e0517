"""Reading media as a player presents it: headers, frames, images, and sound in a child process.

Any container PyAV reads. Matroska, WebM and fragmented mp4 carry no frame count in the header, and
their durations and rates are unreliable (a variable-frame-rate mp4 reports 0.77 s for 1.03 s): the
count, the first timestamp and the duration come from one pass over the packets, never from decoding
(~30 ms for 1000 frames). Phones store portrait clips landscape with a display matrix: it is read
from the first decoded frame (PyAV has no stream-level getter), applied to every frame, and the
displayed size is what buckets see. Frames are picked by their timestamps, after a keyframe seek to
the first one, resized by swscale as each is decoded (antialiased when shrinking) and kept uint8.
Images (EXIF orientation applied, 16-bit ones scaled to 8 bits: open_image) are one-frame clips.
Sound is decoded in a child process (last in this module); the module imports no torch, so the
child starts light.
"""

import atexit
import itertools
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from av.sidedata.sidedata import Type
from PIL import Image, ImageOps

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
EXIF_ORIENTATION = 0x0112
# Pillow's modes of a 16-bit grayscale image (it reduces 16-bit colour images to 8 bits itself)
GRAY16 = ("I;16", "I;16L", "I;16B", "I;16N")
RESIZE = "swscale-bilinear"  # part of the cache key: another resize gives other latents


class MediaError(Exception):
    """A file that cannot be used, and why."""


@dataclass(frozen=True)
class Media:
    """What a clip's header says, read once and kept in the manifest."""

    frames: int  # coded frames, counted from the packets (1 for an image)
    duration: float  # seconds from the first frame's start to the last one's end (0 for an image)
    first_pts: int | None  # the first frame's time in the stream's time base; None: no timestamps
    height: int  # as displayed
    width: int
    matrix: tuple[int, ...] | None  # the display matrix (9 ints, 16.16), None when upright
    # timestamps unusable (raw streams, AVI with B-frames): pick by decode order
    by_index: bool = False
    image: bool = False

    @property
    def fps(self) -> float:
        return self.frames / self.duration if self.duration else 0.0


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def probe(path: Path) -> Media:
    """The header of a video or an image; MediaError if it cannot be used."""
    if not path.is_file():
        raise MediaError("does not exist")
    return _probe_image(path) if is_image(path) else _probe_video(path)


def _probe_image(path: Path) -> Media:
    try:
        with Image.open(path) as image:
            width, height = image.size
            # Image.getexif() decodes a whole PNG to find its EXIF; the header's copy suffices.
            exif = Image.Exif()
            if image.info.get("exif"):
                exif.load(image.info["exif"])
            elif image.format != "PNG":
                exif = image.getexif()
    except (OSError, SyntaxError) as e:  # PIL reports unreadable images as either
        raise MediaError(f"not a readable image ({e})") from None
    # a quarter turn: the displayed size is swapped
    if exif.get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8):
        width, height = height, width
    return Media(1, 0.0, None, height, width, None, image=True)


def _open(path: Path):
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, UnicodeDecodeError) as e:
        raise MediaError(f"not a readable video ({e})") from None
    if not container.streams.video:
        container.close()
        raise MediaError("has no video stream")
    return container


def _probe_video(path: Path) -> Media:
    try:
        with _open(path) as container:
            stream = container.streams.video[0]
            count, stamps, durations = 0, [], {}
            for packet in container.demux(stream):
                if packet.size == 0 or packet.is_discard:  # the flush packet; an edit list's drops
                    continue
                count += 1
                if packet.pts is not None:
                    stamps.append(packet.pts)
                    durations[packet.pts] = packet.duration or 0
            by_index = len(stamps) != count or count < 2 or container.format.name == "avi"
            # raw streams have no pts; AVI with B-frames gives decoded frames decode-order pts
            if by_index:
                rate = float(stream.guessed_rate or stream.average_rate or 0)
                duration, first_pts = (count / rate if rate else 0.0), None
            else:
                stamps.sort()
                last = durations[stamps[-1]] or int(np.median(np.diff(stamps)))
                duration, first_pts = float((stamps[-1] + last - stamps[0]) * stream.time_base), stamps[0]
        # The display matrix travels as frame side data: decode one frame. Reopened, not sought to
        # 0: raw streams refuse to seek.
        with _open(path) as container:
            stream = container.streams.video[0]
            frame = next(container.decode(stream), None)
            width, height = stream.codec_context.width, stream.codec_context.height
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot read its packets ({e})") from None
    if frame is None or count == 0 or duration <= 0:
        raise MediaError("holds no frames that can be decoded")
    side = frame.side_data.get(Type.DISPLAYMATRIX)
    matrix = tuple(int(v) for v in np.frombuffer(bytes(side), np.int32)) if side is not None else None
    if _quarter_turn(matrix):
        width, height = height, width
    return Media(count, duration, first_pts, height, width, matrix, by_index)


def _quarter_turn(matrix) -> bool:
    return matrix is not None and matrix[0] == 0 and matrix[4] == 0


def _upright(pixels: np.ndarray, matrix) -> np.ndarray:
    """H x W x C pixels as a player shows them, from the display matrix's signs: the 8 rotations and
    mirrors (PyAV's frame.rotation misreads the mirrored ones)."""
    if matrix is None:
        return pixels
    a, b, c, d = (int(np.sign(matrix[i])) for i in (0, 1, 3, 4))
    if a == 0 and d == 0:
        pixels = pixels.swapaxes(0, 1)
        pixels = pixels[::-1] if b < 0 else pixels
        pixels = pixels[:, ::-1] if c < 0 else pixels
    else:
        pixels = pixels[::-1] if d < 0 else pixels
        pixels = pixels[:, ::-1] if a < 0 else pixels
    return np.ascontiguousarray(pixels)


def available_frames(media: Media, rate: float) -> int:
    """Frames at `rate` frames per second (0: the clip's own rate) that the clip shows."""
    if media.image:
        return 1
    if not rate:
        return media.frames
    return math.floor(media.duration * rate - 1e-6) + 1


def read_frames(
    path: Path,
    media: Media,
    times: list[float],
    resized: tuple[int, int],
    crop: tuple[int, int, int, int],
    pad: bool,
    threads: int = 0,
) -> np.ndarray:
    """The frames shown at `times` (seconds from the first frame; the nearest one in time), resized
    to `resized` (height, width as displayed) and cropped to (top, left, height, width): uint8 [F,
    H, W, 3]. A clip that ends early repeats its last frame when `pad` (the plan decided so), else
    is an error."""
    if media.image:
        return read_image(path, resized, crop)[None].repeat(len(times), axis=0)
    top, left, height, width = crop
    coded = resized[::-1] if _quarter_turn(media.matrix) else resized  # resize first, then turn
    out = np.empty((len(times), height, width, 3), np.uint8)

    def keep(k: int, frame) -> None:
        small = frame.reformat(width=coded[1], height=coded[0], format="rgb24", interpolation="BILINEAR")
        out[k] = _upright(small.to_ndarray(), media.matrix)[top : top + height, left : left + width]

    try:
        with _open(path) as container:
            stream = container.streams.video[0]
            stream.thread_type, stream.thread_count = "AUTO", threads
            frames = (
                _frames_by_index(container, stream, media)
                if media.by_index
                else _frames_from(container, stream, media, times[0])
            )
            k, previous = 0, None
            for t, frame in frames:
                while k < len(times) and t >= times[k] - 0.5 / media.fps:
                    nearer = previous if previous and times[k] - previous[0] < t - times[k] else (t, frame)
                    keep(k, nearer[1])
                    k += 1
                if k == len(times):
                    return out
                previous = (t, frame)
            # the last frame, shown until then
            while previous and k < len(times) and times[k] < media.duration:
                keep(k, previous[1])
                k += 1
            if k == len(times):
                return out
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode ({e})") from None
    if k == 0 or not pad:
        raise MediaError(f"decodes to {k} of the {len(times)} frames its header promised (truncated?)")
    out[k:] = out[k - 1]
    return out


def _frames_from(container, stream, media: Media, t: float):
    """(time, frame) from the keyframe at or before time t on. A fragmented mp4 with B-frames
    indexes decode times, and an MPEG transport stream has no index (its seek bisects the file by
    timestamps), so the seek can land after t, or find nothing: then back off 1 s, 2 s, 4 s, ... to
    the first frame, and past it decode from the file's start."""
    tb, half = stream.time_base, 0.5 / media.fps
    target, margin = media.first_pts + t / tb, 0.0
    while True:
        seek = max(math.floor(target - half / tb - margin), media.first_pts)
        container.seek(seek, stream=stream, backward=True, any_frame=False)
        frames = container.decode(stream)
        first = next(frames, None)
        if first is None or first.pts > target + half / tb:
            if seek > media.first_pts:
                margin = max(2 * margin, 1 / tb)
                continue
            # the file's start (a transport stream's seek to its first frame can miss it)
            container.seek(0)
            frames = container.decode(stream)
            first = next(frames, None)
        if first is None:
            return
        yield float((first.pts - media.first_pts) * tb), first
        for frame in frames:
            yield float((frame.pts - media.first_pts) * tb), frame
        return


def _frames_by_index(container, stream, media: Media):
    for index, frame in enumerate(container.decode(stream)):
        yield index / media.fps, frame


def open_image(path: Path) -> Image.Image:
    """An image upright as displayed (EXIF orientation), in 8-bit RGB: every image vidtrain reads.

    A 16-bit grayscale image (depth and normal renders, Blender's and photo tools' PNGs and TIFFs:
    Pillow's I;16 modes) is scaled to 8 bits (x / 257, rounded), as Pillow itself reduces 16-bit
    colour images: convert("RGB") alone clips it at 255, a 0..65535 ramp turning almost all white.
    A 32-bit one (integer or floating point) has no range to scale from: MediaError, as for an
    unreadable file."""
    try:
        with Image.open(path) as image:
            upright = ImageOps.exif_transpose(image)
            if upright.mode in GRAY16:
                levels = np.round(np.asarray(upright, dtype=np.float32) / 257).astype(np.uint8)
                upright = Image.fromarray(levels)
            elif upright.mode in ("I", "F") or upright.mode.startswith("I;"):
                raise MediaError(
                    f"a 32-bit image (Pillow's mode {upright.mode}), whose levels have no 8-bit "
                    "equivalent vidtrain can tell: save it as an 8-bit or 16-bit PNG"
                )
            return upright.convert("RGB")
    except (OSError, SyntaxError) as e:
        raise MediaError(f"not a readable image ({e})") from None


def read_image(path: Path, resized: tuple[int, int], crop: tuple[int, int, int, int]) -> np.ndarray:
    """An image upright as displayed (open_image), resized (antialiased) and cropped: uint8
    [H, W, 3]."""
    top, left, height, width = crop
    upright = open_image(path)
    pixels = np.asarray(upright.resize((resized[1], resized[0]), Image.Resampling.BILINEAR))
    return np.ascontiguousarray(pixels[top : top + height, left : left + width])


# --------------------------------------------------------------------------------------------------
# A clip's sound as float samples at its own rate, decoded by PyAV in a child process.
#
# FFmpeg and PyAV are C: a file that trips a bug in them (PyAV 18.1 segfaulted reading planar 7.1
# frames) kills the process that decodes it. Decoded in a child, such a crash becomes the clip's
# bad-input message, naming the signal, and the run goes on with a new child. Each decode-pool thread
# borrows an idle child (Python with PyAV and numpy, no torch: started once per thread) and gets the
# samples back over a pipe; the child's cost is small beside the decoding itself (BENCHMARKS.md,
# "Sound decoding in a child process").
#
# Frames are placed by their own timestamps, in the stream's time base (a converter's output stamps
# count samples instead); a frame within a timestamp tick of where the previous one ended follows it
# directly (Matroska stores milliseconds, not samples); a frame without one follows the previous one.


class Failed(Exception):
    """The sound cannot be decoded, and why."""


def native(path: str, first_pts: int | None, start: float, seconds: float) -> tuple[int, np.ndarray] | None:
    """Decode the first audio stream's samples over a window of the clip.

    The first audio stream's samples from `start` seconds after the first frame is shown
    (`first_pts`, in the video stream's time base; None: the video stream's start time) for
    `seconds`: its rate and float32 [channels, ceil(seconds * rate)], zeros where the stream has no
    sound. None when the file has no audio stream, or one without a single frame."""
    with av.open(path) as container:
        if not container.streams.audio:
            return None
        stream, video = container.streams.audio[0], container.streams.video[0]
        shown = first_pts if first_pts is not None else video.start_time or 0
        rate = stream.codec_context.sample_rate
        # the span's first sample, in the container's seconds
        begin = float(shown * video.time_base) + start
        span = _span(container, stream, begin, math.ceil(seconds * rate), rate)
    return None if span is None else (rate, span)


def _span(container, stream, begin: float, length: int, rate: int) -> np.ndarray | None:
    """Decode `length` samples at `rate` from `begin` seconds on.

    `length` samples at `rate` from `begin` seconds on (the container's clock), each frame placed as
    the module says; None when the stream holds no frame from the seek on."""
    tick = float(stream.time_base)
    seek = max(math.floor(begin / tick), stream.start_time or 0)
    container.seek(seek, stream=stream, backward=True)
    frames = container.decode(stream)
    first = next(frames, None)
    if first is None:
        return None
    # Packed float, reshaped here: PyAV 18.1 reports 9 planes for a planar 8-channel frame, and its
    # to_ndarray then reads past the frame (a segfault).
    # any sample format to packed float, rate and layout kept
    to_float = av.AudioResampler(format="flt")
    buffer, position = np.zeros((first.layout.nb_channels, length), np.float32), None
    for frame in itertools.chain([first], frames):
        converted = [c.to_ndarray().reshape(-1, c.layout.nb_channels) for c in to_float.resample(frame)]
        samples = np.concatenate(converted).T if converted else buffer[:, :0]
        if frame.pts is not None:
            stamped = round((frame.pts * tick - begin) * rate)
            if position is None or abs(stamped - position) > tick * rate + 1:
                position = stamped
        elif position is None:  # no timestamp at all: where the seek went
            position = round((seek * tick - begin) * rate)
        lo, hi = max(position, 0), min(position + samples.shape[1], length)
        if lo < hi:
            buffer[:, lo:hi] = samples[:, lo - position : hi - position]
        position += samples.shape[1]
        if position >= length:
            break
    return buffer


class _Child:
    """A Python process that decodes what it is sent, one request at a time (serve, below)."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def ask(self, request: dict):
        pickle.dump(request, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.flush()
        return pickle.load(self.process.stdout)

    def ended(self) -> str:
        """How the process ended, once it has."""
        code = self.process.wait()
        return signal.Signals(-code).name if code < 0 else f"exit status {code}"

    def close(self) -> None:
        self.process.stdin.close()  # the child stops at the end of its input
        self.process.wait()


_idle: list[_Child] = []
_lock = threading.Lock()


def decode(
    path: str, first_pts: int | None, start: float, seconds: float, crash: bool = False
) -> tuple[int, np.ndarray] | None:
    """Run native(...) in an idle child process, so that a crashing decoder names the clip.

    native(...) in an idle child; Failed with the reason when the stream cannot be decoded, or when
    decoding it ends the child (`crash`: the child segfaults first, as a decoder's bug would)."""
    with _lock:
        child = _idle.pop() if _idle else None
    child = child or _Child()
    request = {"path": path, "first_pts": first_pts, "start": start, "seconds": seconds, "crash": crash}
    try:
        ok, found = child.ask(request)
    except (OSError, EOFError, pickle.UnpicklingError):  # a broken pipe, or a reply cut short
        raise Failed(
            f"crashed the audio decoder ({child.ended()}), a bug in FFmpeg or PyAV that this file "
            "triggers: re-encode its sound (ffmpeg -i CLIP -c:v copy -c:a aac OUT.mp4) or remove "
            "the clip"
        ) from None
    with _lock:
        _idle.append(child)
    if not ok:
        raise Failed(found)
    return found


@atexit.register
def _close_idle() -> None:
    with _lock:
        while _idle:
            _idle.pop().close()


def serve() -> None:
    """The child: requests from stdin, replies (ok, value) to stdout, until stdin ends."""
    # Signals to the process group (Ctrl-C, a scheduler's SIGTERM) are the parent's to handle: it
    # stops this child by closing its input.
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything FFmpeg or PyAV prints goes to stderr, not into the replies
    requests = sys.stdin.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request.pop("crash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            reply = True, native(**request)
        except (av.error.FFmpegError, UnicodeDecodeError) as e:
            reply = False, f"cannot decode its audio stream ({e})"
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


# the sound child: _Child starts this file as a script
if __name__ == "__main__":
    serve()
