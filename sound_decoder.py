"""A clip's sound as float samples at its own rate, decoded by PyAV in a child process.

FFmpeg and PyAV are C: a file that trips a bug in them (PyAV 18.1 segfaulted reading planar 7.1
frames) kills the process that decodes it. Decoded in a child, such a crash becomes the clip's
bad-input message, naming the signal, and the run goes on with a new child. Each decode-pool thread
borrows an idle child (Python with PyAV and numpy, no torch: started once per thread) and gets the
samples back over a pipe; the child's cost is small beside the decoding itself (BENCHMARKS.md,
"Sound decoding in a child process").

Frames are placed by their own timestamps, in the stream's time base (a converter's output stamps
count samples instead); a frame within a timestamp tick of where the previous one ended follows it
directly (Matroska stores milliseconds, not samples); a frame without one follows the previous one.
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

import av
import numpy as np


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


if __name__ == "__main__":
    serve()
