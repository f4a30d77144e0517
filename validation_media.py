"""Validation clips' media: the conditions they are rendered from, read; the clips, written.

The conditions: a validation image upright as displayed, a control video (or Wan VACE's mask) at the
clip's frame times, covering its size and centre-cropped to it, as the pipelines take them; a bad
file is a ConfigError naming the key or flag that gave it. The clips: the VAE's output as frames
rounded as diffusers rounds them, written as H.264 mp4 with the soundtrack as AAC beside it, under a
temporary name (faults.written: a full disk names the file). validate.py's renderer uses them.
"""

from fractions import Fraction
from pathlib import Path

import av
import torch
from PIL import Image, ImageOps

import decode
import faults
from config import ConfigError


def to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output [C, F, H, W] in [-1, 1] -> float frames [F, H, W, C] in [0, 1], as the pipeline's
    postprocess."""
    return (pixels.float() * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).cpu()


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """As diffusers' numpy_to_pil rounds."""
    return (frames * 255).round().to(torch.uint8)


CLIP_FIX = (
    "free space (or move run.output_dir) and launch again; a training run resumes from its last checkpoint"
)


def write_mp4(
    path: Path, frames: torch.Tensor, fps: Fraction, sound: torch.Tensor | None = None, rate: int = 0
) -> None:
    """uint8 [F, H, W, 3] -> H.264 mp4, with `sound` (float [channels, samples] at `rate`) as AAC
    beside it. yuv420p (what players accept) needs even sizes: odd ones get their last row or column
    repeated. Written under a temporary name, then renamed."""
    if frames.shape[1] % 2:
        frames = torch.cat([frames, frames[:, -1:]], dim=1)
    if frames.shape[2] % 2:
        frames = torch.cat([frames, frames[:, :, -1:]], dim=2)
    with faults.written(path, CLIP_FIX) as tmp, av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        # Every stream before the first packet: the header is written then.
        audio = (
            None
            if sound is None
            else container.add_stream("aac", rate=rate, layout="stereo" if len(sound) == 2 else "mono")
        )
        for frame in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:
            write_aac(container, audio, sound, rate)


def write_aac(container, stream, sound: torch.Tensor, rate: int) -> None:
    """float [channels, samples] into the AAC `stream`, clipped to [-1, 1]."""
    samples = sound.clamp(-1, 1).contiguous().numpy()
    for start in range(0, samples.shape[1], 1024):  # AAC's frame size
        frame = av.AudioFrame.from_ndarray(
            samples[:, start : start + 1024], format="fltp", layout=stream.layout.name
        )
        frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def load_image(path: str):
    """A validation image, upright as displayed (EXIF orientation), in RGB: the pipeline resizes it."""
    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except OSError as e:
        raise ConfigError(
            f"validation image {path} is unreadable ({e}): fix validation.images or --image "
            "(validation.last_images or --last-image)"
        ) from None


def load_control(path: str, resolution, rate: float, mask: bool = False) -> torch.Tensor:
    """A validation control video (with `mask`, Wan VACE's mask: a video, or an image for every
    frame): the frames shown at the clip's frame times from its first frame, resized to cover the
    clip's size (keeping its aspect) and centre-cropped to it, as LTX2InContextPipeline's crop mode
    does: uint8 [F, H, W, 3]."""
    frames, height, width = resolution
    try:
        media = decode.probe(Path(path))
        if decode.available_frames(media, rate) < frames and not (mask and media.image):
            raise decode.MediaError(
                f"has {decode.available_frames(media, rate)} frames at {rate:g} fps, and the "
                f"clips have {frames}"
            )
        scale = max(height / media.height, width / media.width)
        resized = (max(height, round(media.height * scale)), max(width, round(media.width * scale)))
        crop = ((resized[0] - height) // 2, (resized[1] - width) // 2, height, width)
        times = [k / rate for k in range(frames)]
        return torch.from_numpy(decode.read_frames(Path(path), media, times, resized, crop, False))
    except decode.MediaError as e:
        keys = "masks or --mask" if mask else "control_videos or --control"
        raise ConfigError(
            f"validation {'mask' if mask else 'control video'} {path} {e}: fix validation.{keys}"
        ) from None
