"""Write short clips of simple moving shapes, with prompts that describe them.

CogVideo's layout: prompts.txt, videos.txt, videos/NNNNN.<ext>, images.txt, images/NNNNN.png (the
first frames, for image-to-video), last_images.txt, last_images/NNNNN.png (the last frames, for
first-last-frame). Byte-identical output for a given seed (in the default kind, mp4). --kinds cycles
the clips through the ways phones and the web store video:

  mp4    H.264 in mp4 (the header counts its frames) mkv    H.264 in Matroska          webm   VP9 in
  WebM          fmp4   fragmented mp4 vfr    mp4 with irregular frame times (a variable frame rate)
  phone  a portrait clip as phones store it: landscape pixels in a .mov with a 90-degree display
  matrix photo  a portrait JPEG as cameras store it: landscape pixels with EXIF orientation 6

--control writes controls.txt and controls/NNNNN.mp4: each clip's edge map (the shape's outline,
white on black, moving as the shape does), for control models (data.control_column): a mapping from
outline to filled shape. A tiny random model learns it once its VAE is given a trained one's latent
statistics (tools/calibrate_tiny_vae.py MODEL_DIR DATA_DIR): BENCHMARKS.md, Control.

--audio gives every video a mono soundtrack: a tone whose pitch follows the shape along its path
(from 220 Hz to 880 Hz across the frame, rising to the right and upwards), so picture and sound are
related. AAC at 44.1 kHz in mp4 and mov, Opus at 48 kHz in Matroska and WebM; --kinds then defaults
to mp4,mkv. Without --audio the clips are the same bytes as before.

    python tools/make_synthetic_dataset.py --out DIR [--num-videos N] [--frames F] [--height H]
    [--width W] [--audio] [--control] [--seed N] [--kinds mp4,mkv,...]
"""

import argparse
import random
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "purple": (160, 60, 200),
    "orange": (250, 140, 30),
    "cyan": (40, 220, 220),
}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
FPS = 8
AUDIO = {
    "mp4": ("aac", 44100),
    "fmp4": ("aac", 44100),
    "vfr": ("aac", 44100),
    "phone": ("aac", 44100),
    "mkv": ("libopus", 48000),
    "webm": ("libopus", 48000),
}  # codec, sample rate


def shape_mask(shape: str, height: int, width: int, cx: float, cy: float, radius: float) -> np.ndarray:
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    dx, dy = xs - cx, ys - cy
    if shape == "square":
        return (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    # An upward triangle: below the apex, inside two slanted edges, above the base.
    return (dy <= radius) & (dy >= -radius) & (np.abs(dx) <= (dy + radius) / 2)


def render_clip(
    shape: str, colour: str, direction: str, frames: int, height: int, width: int, rng: random.Random
):
    radius = min(height, width) * rng.uniform(0.12, 0.2)
    ux, uy = DIRECTIONS[direction]
    start_x = width / 2 - ux * width * 0.3 + rng.uniform(-2, 2)
    start_y = height / 2 - uy * height * 0.3 + rng.uniform(-2, 2)
    speed = rng.uniform(0.5, 0.7) * min(height, width) / max(frames - 1, 1)
    video = np.zeros((frames, height, width, 3), dtype=np.uint8)
    for f in range(frames):
        mask = shape_mask(shape, height, width, start_x + ux * speed * f, start_y + uy * speed * f, radius)
        video[f][mask] = COLOURS[colour]
    # Where the shape is along its path, frame by frame: 0 at the left (or bottom) edge, 1 at the
    # right (or top).
    along = np.array(
        [
            (start_x + ux * speed * f) / width if ux else 1 - (start_y + uy * speed * f) / height
            for f in range(frames)
        ]
    )
    return video, along


def edge_map(video: np.ndarray) -> np.ndarray:
    """uint8 [F, H, W, 3] -> the outline of what is not black, white on black: the pixels of the
    shape that touch the background (or the frame's edge) in one of the four directions."""
    shape = video.any(-1)
    inner = np.pad(shape, ((0, 0), (1, 1), (1, 1)))
    inner = inner[:, :-2, 1:-1] & inner[:, 2:, 1:-1] & inner[:, 1:-1, :-2] & inner[:, 1:-1, 2:] & shape
    return np.repeat(((shape & ~inner) * 255).astype(np.uint8)[..., None], 3, axis=-1)


def frame_times(kind: str, frames: int, fps: int) -> np.ndarray:
    """When each frame is shown, in seconds; vfr: every third interval 1.5 times as long."""
    k = np.arange(frames)
    return (k + k // 3 * 0.5) / fps if kind == "vfr" else k / fps


def tone(along: np.ndarray, times: np.ndarray, fps: int, rate: int) -> np.ndarray:
    """A sine from the first frame's time to the last one's end whose pitch follows `along` (linear
    in time between frames, as the shape moves): 220 Hz at 0, 880 Hz at 1. float32 [samples]."""
    t = np.arange(round((times[-1] + 1 / fps) * rate)) / rate
    pitch = 220 * 4 ** np.clip(np.interp(t, times, along), 0, 1)
    return (0.3 * np.sin(2 * np.pi * np.cumsum(pitch) / rate)).astype(np.float32)


ENCODERS = {
    "mp4": ("libx264", "mp4"),
    "mkv": ("libx264", "matroska"),
    "webm": ("libvpx-vp9", "webm"),
    "fmp4": ("libx264", "mp4"),
    "vfr": ("libx264", "mp4"),
    "phone": ("libx264", "mov"),
}
SUFFIXES = {"mkv": ".mkv", "webm": ".webm", "phone": ".mov", "photo": ".jpg"}


def write_clip(
    path: Path, video: np.ndarray, fps: int, kind: str = "mp4", sound: np.ndarray | None = None
) -> None:
    """uint8 frames [F, H, W, 3], as displayed, stored the way `kind` stores them; with `sound`
    (float32 [channels, samples] at AUDIO[kind]'s rate, from the first frame's time on) muxed in."""
    if kind == "photo":
        exif = Image.Exif()
        exif[0x0112] = 6  # turn 90 degrees clockwise to display: the pixels are stored turned back
        Image.fromarray(np.rot90(video[0], k=1)).save(path, exif=exif, quality=95)
        return
    codec, container_format = ENCODERS[kind]
    options = {"movflags": "frag_keyframe+empty_moov+default_base_moof"} if kind == "fmp4" else {}
    with av.open(str(path), mode="w", format=container_format, options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        if kind == "phone":  # shown turned 90 degrees clockwise (PyAV counts counter-clockwise)
            stream.set_display_rotation(-90)
            video = np.rot90(video, k=1, axes=(1, 2))
        stream.width, stream.height = video.shape[2], video.shape[1]
        stream.pix_fmt = "yuv420p"
        # One thread and a fixed quality keep the bytes identical from run to run.
        stream.options = (
            {"crf": "18", "threads": "1"}
            if codec == "libx264"
            else {"crf": "20", "b:v": "0", "deadline": "realtime", "cpu-used": "8", "threads": "1"}
        )
        stream.thread_count = 1
        # Every stream exists before the first packet is written (the header lists them).
        audio = add_sound_stream(container, len(sound), *AUDIO[kind]) if sound is not None else None
        # frame k shown at 1000 / fps * (k + k // 3 * 0.5) ms: every third interval longer
        if kind == "vfr":
            stream.codec_context.time_base = Fraction(1, 1000)
        for pixels, t in zip(video, frame_times(kind, len(video), fps)):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            if kind == "vfr":
                frame.pts, frame.time_base = round(1000 * t), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if audio is not None:
            write_sound(container, audio, sound)


def add_sound_stream(container, channels: int, codec: str, rate: int):
    stream = container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")
    stream.options = {"threads": "1"}
    return stream


def write_sound(container, stream, sound: np.ndarray, start_pts: int = 0) -> None:
    """float32 [channels, samples] encoded into `stream`, its first sample at `start_pts` (in
    samples). Packed frames: PyAV 18.1 cannot build planar ones of 8 channels; the encoder converts."""
    rate = stream.codec_context.sample_rate
    for start in range(0, sound.shape[1], 1024):
        packed = np.ascontiguousarray(sound[:, start : start + 1024].T).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(packed, format="flt", layout=stream.layout.name)
        frame.sample_rate, frame.pts, frame.time_base = rate, start_pts + start, Fraction(1, rate)
        container.mux(stream.encode(frame))
    # FLAC's encoder ends with an empty packet, which Matroska refuses.
    container.mux([packet for packet in stream.encode() if packet.size])


def make_synthetic_dataset(
    out: str,
    num_videos: int = 16,
    frames: int = 17,
    height: int = 40,
    width: int = 48,
    seed: int = 0,
    kinds: tuple[str, ...] | None = None,
    audio: bool = False,
    control: bool = False,
):
    root = Path(out)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(exist_ok=True)
    (root / "last_images").mkdir(exist_ok=True)
    rng = random.Random(seed)
    kinds = kinds or (("mp4", "mkv") if audio else ("mp4",))
    prompts, videos, images, last_images, controls = [], [], [], [], []
    if control:
        (root / "controls").mkdir(exist_ok=True)
    for i in range(num_videos):
        kind = kinds[i % len(kinds)]
        shape, colour, direction = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(DIRECTIONS))
        # Phones and cameras make portraits: those kinds render height and width swapped.
        h, w = (width, height) if kind in ("phone", "photo") else (height, width)
        video, along = render_clip(shape, colour, direction, frames, h, w, rng)
        name = f"videos/{i:05d}{SUFFIXES.get(kind, '.mp4')}"
        sound = (
            tone(along, frame_times(kind, frames, FPS), FPS, AUDIO[kind][1])[None]
            if audio and kind in AUDIO
            else None
        )
        write_clip(root / name, video, FPS, kind, sound)
        Image.fromarray(video[0]).save(root / "images" / f"{i:05d}.png")
        Image.fromarray(video[-1]).save(root / "last_images" / f"{i:05d}.png")
        prompts.append(f"a {colour} {shape} moves {direction} on a black background")
        videos.append(name)
        images.append(f"images/{i:05d}.png")
        last_images.append(f"last_images/{i:05d}.png")
        if control:  # as displayed, in plain mp4 whatever the clip's kind
            write_clip(root / f"controls/{i:05d}.mp4", edge_map(video), FPS)
            controls.append(f"controls/{i:05d}.mp4")
    for name, lines in (
        ("prompts.txt", prompts),
        ("videos.txt", videos),
        ("images.txt", images),
        ("last_images.txt", last_images),
        ("controls.txt", controls),
    ):
        if lines:
            (root / name).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-videos", type=int, default=16)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=40)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds",
        default="",
        help=f"comma-separated, cycled over the clips: {','.join([*ENCODERS, 'photo'])} "
        "(default mp4; mp4,mkv with --audio)",
    )
    parser.add_argument(
        "--audio", action="store_true", help="a soundtrack per video: a tone following the shape"
    )
    parser.add_argument("--control", action="store_true", help="a control video per clip: its edge map")
    args = parser.parse_args()
    make_synthetic_dataset(
        args.out,
        args.num_videos,
        args.frames,
        args.height,
        args.width,
        args.seed,
        tuple(args.kinds.split(",")) if args.kinds else None,
        args.audio,
        args.control,
    )
    print(f"wrote {args.num_videos} clips to {args.out}")


if __name__ == "__main__":
    main()
