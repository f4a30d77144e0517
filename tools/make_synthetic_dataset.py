"""Write short H.264 clips of simple moving shapes, with prompts that describe them.

CogVideo's layout: prompts.txt, videos.txt, videos/NNNNN.mp4, images.txt, images/NNNNN.png
(the first frames, for image-to-video). Byte-identical output for a given seed.

    python tools/make_synthetic_dataset.py --out DIR [--num-videos N] [--frames F] [--height H] [--width W] [--seed N]
"""

import argparse
import random
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


def shape_mask(shape: str, height: int, width: int, cx: float, cy: float, radius: float) -> np.ndarray:
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    dx, dy = xs - cx, ys - cy
    if shape == "square":
        return (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    # An upward triangle: below the apex, inside two slanted edges, above the base.
    return (dy <= radius) & (dy >= -radius) & (np.abs(dx) <= (dy + radius) / 2)


def render_clip(shape: str, colour: str, direction: str, frames: int, height: int, width: int, rng: random.Random):
    radius = min(height, width) * rng.uniform(0.12, 0.2)
    ux, uy = DIRECTIONS[direction]
    start_x = width / 2 - ux * width * 0.3 + rng.uniform(-2, 2)
    start_y = height / 2 - uy * height * 0.3 + rng.uniform(-2, 2)
    speed = rng.uniform(0.5, 0.7) * min(height, width) / max(frames - 1, 1)
    video = np.zeros((frames, height, width, 3), dtype=np.uint8)
    for f in range(frames):
        mask = shape_mask(shape, height, width, start_x + ux * speed * f, start_y + uy * speed * f, radius)
        video[f][mask] = COLOURS[colour]
    return video


def write_mp4(path: Path, video: np.ndarray, fps: int) -> None:
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = video.shape[2], video.shape[1]
        stream.pix_fmt = "yuv420p"
        # One thread and a fixed quality keep the bytes identical from run to run.
        stream.options = {"crf": "18", "threads": "1"}
        stream.thread_count = 1
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_synthetic_dataset(out: str, num_videos: int = 16, frames: int = 17, height: int = 40, width: int = 48, seed: int = 0):
    root = Path(out)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(exist_ok=True)
    rng = random.Random(seed)
    prompts, videos, images = [], [], []
    for i in range(num_videos):
        shape, colour, direction = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(DIRECTIONS))
        video = render_clip(shape, colour, direction, frames, height, width, rng)
        write_mp4(root / "videos" / f"{i:05d}.mp4", video, FPS)
        Image.fromarray(video[0]).save(root / "images" / f"{i:05d}.png")
        prompts.append(f"a {colour} {shape} moves {direction} on a black background")
        videos.append(f"videos/{i:05d}.mp4")
        images.append(f"images/{i:05d}.png")
    for name, lines in (("prompts.txt", prompts), ("videos.txt", videos), ("images.txt", images)):
        (root / name).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-videos", type=int, default=16)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=40)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_synthetic_dataset(args.out, args.num_videos, args.frames, args.height, args.width, args.seed)
    print(f"wrote {args.num_videos} clips to {args.out}")


if __name__ == "__main__":
    main()
