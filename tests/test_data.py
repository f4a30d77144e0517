"""Data at scale: formats, decoding, buckets, the sampler, the cache pass, bad input.

Cheap checks call the functions directly; the cache pass runs in this process through cache.main
(one process, a HashStore group), and the multi-rank and kill tests run the real commands.
"""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from conftest import picked_frames, ramp_clip, run_cmd, run_ok, train_losses
from diffusers import AutoencoderKLCogVideoX
from PIL import Image
from safetensors.torch import load_file
from transformers import T5EncoderModel

import cache
import data
import decode
import trainer
import validate
from config import ConfigError, DataConfig
from data import Sampler, micro_slice
from tools.make_synthetic_dataset import make_synthetic_dataset

TWO_BUCKETS = [[9, 48, 40], [17, 40, 48]]


def args_of(path: Path, *extra: str) -> list[str]:
    return ["--cfg", str(path), *extra]


def cache_log(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "clips encoded" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def run_cache_pass(caplog, config: Path, *extra: str) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vidtrain"):
        cache.main(args_of(config, *extra))
    return cache_log(caplog)


# Formats.
def write_rows(root: Path, rows: list[dict]) -> None:
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_three_formats_read_the_same_clips(tmp_path):
    cog, jsonl, csv_root = (tmp_path / n for n in ("cog", "jsonl", "csv"))
    for root in (cog, jsonl, csv_root):
        root.mkdir()
    (cog / "prompts.txt").write_text("a red square\na blue circle\n\n")
    (cog / "videos.txt").write_text("v/0.mp4\nv/1.mp4\n")
    write_rows(
        jsonl,
        [{"video": "v/0.mp4", "prompt": "a red square"}, {"video": "v/1.mp4", "prompt": "a blue circle"}],
    )
    (csv_root / "metadata.csv").write_text(
        'video,prompt,image\nv/0.mp4,a red square,\nv/1.mp4,"a blue circle",i/1.png\n'
    )
    read = {
        n: data.read_clips(DataConfig(data_root=str(r)))
        for n, r in (("cog", cog), ("jsonl", jsonl), ("csv", csv_root))
    }
    for clips in read.values():
        assert [(c.video.name, c.prompt) for c in clips] == [
            ("0.mp4", "a red square"),
            ("1.mp4", "a blue circle"),
        ]
    assert [c.line for c in read["csv"]] == [2, 3] and read["csv"][1].image == csv_root / "i/1.png"
    assert read["cog"][0].image is None and read["csv"][0].image is None


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {"prompts.txt": "a\nb\nc\n", "videos.txt": "0.mp4\n1.mp4\n"},
            "prompts.txt has 3 lines but .*videos.txt has 2.*line: 3",
        ),
        ({"prompts.txt": "a\n\nc\n", "videos.txt": "0.mp4\n1.mp4\n2.mp4\n"}, "prompts.txt line 2 is empty"),
        (
            {"metadata.jsonl": '{"video": "0.mp4", "prompt": "a"}\n{"video": "1.mp4", "prompt": " "}\n'},
            "metadata.jsonl line 2: empty or missing prompt",
        ),
        (
            {"metadata.jsonl": '{"video": "0.mp4", "prompt": "a"}\n{"video": \n'},
            "metadata.jsonl line 2 is not valid JSON",
        ),
        ({"metadata.csv": "video,caption\n0.mp4,a\n"}, "metadata.csv line 1 must be a header"),
        ({"metadata.csv": "video,prompt\n0.mp4,a\n1.mp4,\n"}, "metadata.csv line 3: empty or missing prompt"),
        ({"notes.txt": "x"}, "neither of metadata.jsonl and metadata.csv"),
        # a misspelt condition trained as none (every VACE condition is optional), exit 0
        (
            {
                "metadata.jsonl": '{"video": "0.mp4", "prompt": "a", "control": "c/0.mp4"}\n'
                '{"video": "1.mp4", "prompt": "b", "controls": "c/1.mp4", "references": "r/1.png"}\n'
            },
            r"metadata.jsonl line 2: column 'controls' is not one vidtrain reads \(did you mean "
            r"'control'\?\): rename it, or remove it \(the columns: video, prompt, image, last_image, ",
        ),
        (
            {"metadata.csv": "video,prompt,references\n0.mp4,a,r/0.png\n"},
            r"metadata.csv line 1: column 'references' is not one vidtrain reads \(did you mean 'reference'\?\)",
        ),
        # another tool's column: no suggestion; a trailing comma's empty name is no column
        (
            {"metadata.csv": "video,prompt,caption,\n0.mp4,a,x,\n"},
            "metadata.csv line 1: column 'caption' is not one vidtrain reads: rename it",
        ),
    ],
)
def test_list_mistakes_name_file_and_line(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=expected):
        data.read_clips(DataConfig(data_root=str(tmp_path)))


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {"prompts.txt": b"a\ncaf\xe9\n", "videos.txt": b"0.mp4\n1.mp4\n"},
            "prompts.txt line 2 is not UTF-8 \\(byte 0xe9\\)",
        ),
        ({"prompts.txt": b"a\nb\n", "videos.txt": b"0.mp4\n\n\xff.mp4\n"}, "videos.txt line 3 is not UTF-8"),
        (
            {"prompts.txt": b"a\n", "videos.txt": b"0.mp4\n", "images.txt": b"\x80.png\n"},
            "images.txt line 1 is not UTF-8",
        ),
        (
            {
                "metadata.jsonl": b'{"video": "0.mp4", "prompt": "a"}\n{"video": "1.mp4", "prompt": "\xe9t\xe9"}\n'
            },
            "metadata.jsonl line 2 is not UTF-8",
        ),
        (
            {"metadata.csv": b"video,prompt\n0.mp4,a\n1.mp4,b\n2.mp4,\xfc\n"},
            "metadata.csv line 4 is not UTF-8",
        ),
    ],
)
def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path, files, expected):
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    with pytest.raises(ConfigError, match=expected):
        data.read_clips(
            DataConfig(data_root=str(tmp_path), image_column="images.txt" if "images.txt" in files else "")
        )


@pytest.mark.parametrize(
    "files",
    [
        {"prompts.txt": "a red square\n", "videos.txt": "v/0.mp4\n", "images.txt": "i/0.png\n"},
        {"metadata.jsonl": '{"video": "v/0.mp4", "prompt": "a red square", "image": "i/0.png"}\n'},
        {"metadata.csv": "video,prompt,image\nv/0.mp4,a red square,i/0.png\n"},
    ],
)
def test_a_byte_order_mark_is_not_part_of_the_first_entry(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    [clip] = data.read_clips(DataConfig(data_root=str(tmp_path), image_column="images.txt"))
    assert (clip.prompt, clip.video, clip.image) == (
        "a red square",
        tmp_path / "v/0.mp4",
        tmp_path / "i/0.png",
    )


# Decoding and planning.


def item_for(path: Path, resolution, start: int, pad: bool = False, rate: float = 0.0) -> data.Item:
    clip, media = data.Clip(path, "grey", 1, "videos.txt"), decode.probe(path)
    return data.Item(
        clip,
        media,
        "content",
        None,
        0,
        tuple(resolution),
        (media.height, media.width),
        rate or media.fps,
        start,
        0,
        0,
        pad,
    )


@pytest.mark.parametrize("kind", ["mp4", "mkv", "webm", "fmp4"])
def test_frames_are_chosen_by_timestamp_and_padded(tmp_path, kind):
    """Frames are chosen by timestamp in any container.

    Any container: the frame count comes from the packets (Matroska, WebM and fragmented mp4 headers
    have none), frames are picked by their timestamps after a seek to the first one."""
    ramp_clip(tmp_path / "ramp", 17, kind=kind)
    media = decode.probe(tmp_path / "ramp")
    assert (media.frames, media.duration, media.height, media.width) == (17, 17 / 8, 32, 32)
    assert picked_frames(data.decode_clip(item_for(tmp_path / "ramp", [5, 32, 32], 1, rate=4.0))) == [
        2,
        4,
        6,
        8,
        10,
    ]
    assert picked_frames(data.decode_clip(item_for(tmp_path / "ramp", [9, 32, 32], 3))) == list(range(3, 12))
    ramp_clip(tmp_path / "short", 5, kind=kind)
    padded = data.decode_clip(item_for(tmp_path / "short", [9, 32, 32], 0, pad=True))
    assert picked_frames(padded) == [0, 1, 2, 3, 4, 4, 4, 4, 4]
    with pytest.raises(data.BadClip, match="decodes to 5 of the 9 frames"):
        data.decode_clip(item_for(tmp_path / "short", [9, 32, 32], 0))


def test_variable_frame_rate_is_sampled_by_time(tmp_path):
    """A variable-frame-rate clip is sampled by time.

    Frame k of the vfr kind is shown at 125 (k + k // 3 / 2) ms: at 8 fps the picks are the frames
    nearest to each 125 ms tick, not every frame in turn."""
    ramp_clip(tmp_path / "vfr.mp4", 17, kind="vfr")
    media = decode.probe(tmp_path / "vfr.mp4")
    shown = [125 * (k + k // 3 * 0.5) for k in range(17)]
    assert media.frames == 17 and media.duration == pytest.approx((shown[-1] + 125) / 1000, abs=2e-3)
    expected = [min(range(17), key=lambda k: (abs(shown[k] - 125 * t), k)) for t in range(2, 11)]
    assert (
        picked_frames(data.decode_clip(item_for(tmp_path / "vfr.mp4", [9, 32, 32], 2, rate=8.0))) == expected
    )
    assert expected != list(range(2, 11))


def test_phone_clips_and_photos_come_out_as_displayed(tmp_path):
    """Phone clips and photos come out upright, as displayed.

    A portrait phone clip is stored landscape with a 90-degree display matrix, a portrait photo
    landscape with EXIF orientation 6: both read portrait, upright (the white corner top left)."""
    ramp_clip(tmp_path / "phone.mov", 9, height=48, width=32, kind="phone")
    ramp_clip(tmp_path / "photo.jpg", 1, height=48, width=32, kind="photo")
    with av.open(str(tmp_path / "phone.mov")) as container:
        stored = container.streams.video[0].codec_context
        assert (stored.height, stored.width) == (32, 48)  # as the phone stores it
    for name, frames in (("phone.mov", 9), ("photo.jpg", 1)):
        media = decode.probe(tmp_path / name)
        assert (media.height, media.width, media.frames) == (48, 32, frames)
        video = data.decode_clip(item_for(tmp_path / name, [frames, 48, 32], 0)).float()
        assert video[:, :12, :8].mean() > 240 and video[:, -12:, -8:].mean() < 60
        assert picked_frames(video) == list(range(frames))


def test_16_bit_images_read_as_their_8_bit_twins(tmp_path):
    """16-bit images read as their 8-bit twins, within one level, wherever an image is read.

    A 16-bit grayscale PNG ramp (what depth and normal renders, Blender and photo tools write;
    Pillow's convert("RGB") alone clips it at 255, almost all white) as a clip's frame, first and
    last image, image mask and reference, and as a validation image; a 32-bit one is refused by
    file."""
    ramp = (np.arange(48 * 64).reshape(48, 64) * 65535 // (48 * 64 - 1)).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    Image.fromarray(np.round(ramp / 257).astype(np.uint8)).save(tmp_path / "twin.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"

    def every_read(path: Path) -> list[torch.Tensor]:
        item = item_for(path, [1, 32, 48], 0)
        clip = dataclasses.replace(item.clip, image=path, last_image=path, mask=path, reference=(path,))
        item = dataclasses.replace(item, clip=clip, mask_media=item.media)
        return [
            data.decode_clip(item),
            data.load_image(item),
            data.load_image(item, last=True),
            data.decode_control(item, kind="mask"),
            *data.load_references(item),
            torch.from_numpy(np.array(validate.load_image(str(path)))),
        ]

    for deep, twin in zip(every_read(tmp_path / "deep.png"), every_read(tmp_path / "twin.png"), strict=True):
        assert deep.shape == twin.shape and (deep.int() - twin.int()).abs().max() <= 1
    Image.fromarray(ramp.astype(np.float32) / 65535).save(tmp_path / "float.tif")
    with pytest.raises(ConfigError, match=r"float.tif is unreadable \(a 32-bit image \(Pillow's mode F\)"):
        validate.load_image(str(tmp_path / "float.tif"))


def test_plan_keeps_aspect_and_draws_start_and_crop_from_the_seed(tmp_path):
    ramp_clip(tmp_path / "wide.mp4", 17, height=40, width=80)
    clip, media = (
        data.Clip(tmp_path / "wide.mp4", "grey", 1, "videos.txt"),
        decode.probe(tmp_path / "wide.mp4"),
    )
    shapes = [(9, 32, 32)]
    plan = lambda cfg, seed: data.plan_clip(clip, media, "content", shapes, cfg, seed)
    centre = plan(DataConfig(), 0)
    assert centre.resized == (32, 64) and (centre.top, centre.left) == (0, 16)
    plans = {s: plan(DataConfig(crop="random", target_fps=4.0), s) for s in range(8)}
    assert plans[3] == plan(DataConfig(crop="random", target_fps=4.0), 3)
    # 17 frames at 8 fps = 9 at 4 fps
    assert all(0 <= p.left <= 32 and 0 <= p.start <= 0 for p in plans.values())
    assert len({p.left for p in plans.values()}) > 1
    native = {plan(DataConfig(), s).start for s in range(8)}
    assert native <= set(range(9)) and len(native) > 1
    short = data.plan_clip(clip, media, "content", [(25, 32, 32)], DataConfig(), 0)
    assert isinstance(short, data.Problem) and short.kind == "short" and "17 frames" in short.reason
    assert data.plan_clip(clip, media, "content", [(25, 32, 32)], DataConfig(short_clips="pad"), 0).pad


def test_bucket_is_the_nearest_aspect_then_the_largest_the_clip_fills():
    shapes = [(9, 32, 32), (17, 32, 48), (9, 48, 48), (25, 32, 32), (17, 48, 32), (1, 48, 32), (1, 32, 48)]
    assert data.choose_bucket(shapes, 48, 72, 17) == 1  # 2:3 landscape, 32x48 filled
    # its portrait twin: the same area, the portrait one
    assert data.choose_bucket(shapes, 72, 48, 17) == 4
    # 16:9: the nearest aspect, though 48x48 is larger
    assert data.choose_bucket(shapes, 1080, 1920, 17) == 1
    assert data.choose_bucket(shapes, 40, 48, 17) == 0  # 5:6 is nearer square than 2:3
    assert data.choose_bucket(shapes, 64, 64, 9) == 2  # square: the largest square it fills
    assert data.choose_bucket(shapes, 32, 32, 30) == 3  # same area: more frames
    # smaller than every square: the smallest, upscaled
    assert data.choose_bucket(shapes, 20, 20, 30) == 3
    # too short for all it covers: the shortest, to pad or skip
    assert data.choose_bucket(shapes, 48, 72, 5) == 1
    # images
    assert data.choose_bucket(shapes, 64, 48, 1) == 5 and data.choose_bucket(shapes, 48, 64, 1) == 6
    assert (
        data.choose_bucket([(9, 32, 32)], 40, 48, 1) is None
        and data.choose_bucket([(1, 32, 32)], 40, 48, 9) is None
    )


# The sampler.
def test_sampler_batches_hold_one_bucket_and_resume_exactly():
    buckets = [0] * 10 + [1] * 7 + [2] * 3
    for world, batch_size, accumulation in ((1, 4, 1), (2, 1, 2)):
        global_batch = world * batch_size * accumulation
        straight = Sampler(buckets, global_batch, seed=5)
        sequence = [straight.next_batch() for _ in range(12)]
        per_epoch = 10 // 4 + 7 // 4
        for epoch in range(2):
            batches = sequence[epoch * per_epoch : (epoch + 1) * per_epoch]
            assert len({i for b in batches for i in b}) == per_epoch * global_batch
        for batch in sequence:
            assert len({buckets[i] for i in batch}) == 1
            slices = [micro_slice(m, r, world, batch_size) for m in range(accumulation) for r in range(world)]
            assert sorted(p for s in slices for p in s) == list(range(global_batch))
        first = Sampler(buckets, global_batch, seed=5)
        head = [first.next_batch() for _ in range(5)]
        state = first.state_dict()
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        resumed = Sampler(buckets, global_batch, seed=5)
        resumed.load_state_dict(state)
        assert head + [resumed.next_batch() for _ in range(7)] == sequence
    with pytest.raises(
        ConfigError, match="train.batch_size x train.gradient_accumulation_steps x world size"
    ):
        Sampler(buckets, 8, seed=5).load_state_dict(state)
    with pytest.raises(ConfigError, match="no bucket holds a full global batch of 11"):
        Sampler(buckets, 11, seed=5)


# The cache pass and training.
@pytest.fixture(scope="module")
def two_shape_data(tmp_path_factory) -> Path:
    """24 clips listed in metadata.jsonl: 12 landscape 17x40x48 and 12 portrait 9x48x40."""
    root = tmp_path_factory.mktemp("two_shapes")
    make_synthetic_dataset(str(root / "wide"), num_videos=12, frames=17, height=40, width=48, seed=1)
    make_synthetic_dataset(str(root / "tall"), num_videos=12, frames=9, height=48, width=40, seed=2)
    rows = []
    for part in ("wide", "tall"):
        prompts = (root / part / "prompts.txt").read_text().splitlines()
        videos = (root / part / "videos.txt").read_text().splitlines()
        rows += [{"video": f"{part}/{v}", "prompt": p} for v, p in zip(videos, prompts)]
    rows = [rows[i // 2 + (i % 2) * 12] for i in range(24)]  # interleaved, so ranks see both shapes
    write_rows(root, rows)
    return root


@pytest.mark.slow
def test_two_buckets_train_on_two_ranks_and_the_cache_is_reused(
    two_shape_data, write_config, tmp_path, caplog
):
    config = write_config(
        "buckets",
        **{
            "data.data_root": str(two_shape_data),
            "data.buckets": TWO_BUCKETS,
            "data.cache_dir": str(tmp_path / "cache"),
            "data.held_out": 0,
            "data.cache_batch_size": 3,
            "train.steps": 4,
            "validation.do_validation": False,
        },
    )
    first = run_ok(args_of(config), nproc=2)
    assert (
        "cache: 24 clips encoded, 0 reused, 0 skipped; clips per bucket {'[9, 48, 40]': 12, '[17, 40, 48]': 12}"
        in first.stderr
    )
    assert sorted(train_losses(tmp_path / "buckets")) == [1, 2, 3, 4]
    assert "0 clips encoded, 24 reused" in run_cache_pass(caplog, config)
    shapes = [
        tuple(load_file(p)["latent_mean"].shape)
        for p in (tmp_path / "cache" / "video").rglob("*.safetensors")
    ]
    assert sorted(shapes.count(s) for s in set(shapes)) == [12, 12]
    assert "12 clips encoded, 12 reused" in run_cache_pass(
        caplog, config, "--data.buckets", "[[9, 48, 40], [17, 32, 32]]"
    )


@pytest.mark.slow
def test_resolution_change_invalidates_and_killed_pass_resumes(write_config, tiny_data, tmp_path, caplog):
    config = write_config("cache", **{"data.cache_dir": str(tmp_path / "cache"), "data.cache_batch_size": 2})
    killed = run_cmd(args_of(config), env={"VIDTRAIN_FAULT": "cache_kill:5"}, script="cache.py")
    assert killed.returncode != 0 and "clips encoded" not in killed.stderr
    assert len(list((tmp_path / "cache" / "video").rglob("*.safetensors"))) == 5
    # SIGTERM after 3 more entries: the round under way (2 clips per batch) completes, then the pass
    # stops, exit 0.
    stopped = run_ok(args_of(config), env={"VIDTRAIN_FAULT": "cache_sigterm:3"}, script="cache.py")
    assert "stopped by a signal: in the cache pass, with 4 of 19 clips encoded and kept" in stopped.stderr
    assert len(list((tmp_path / "cache" / "video").rglob("*.safetensors"))) == 9
    assert "15 clips encoded, 9 reused" in run_cache_pass(caplog, config)
    assert "0 clips encoded, 24 reused" in run_cache_pass(caplog, config)
    assert "24 clips encoded, 0 reused" in run_cache_pass(
        caplog, config, "--data.train_resolution", "[9, 32, 48]"
    )
    # A random crop re-encodes exactly the clips whose offsets moved: the entries follow what was
    # encoded.
    clips, shapes = data.read_clips(DataConfig(data_root=str(tiny_data))), [(9, 32, 48)]

    def offsets(clip, crop):
        item = data.plan_clip(
            clip,
            decode.probe(clip.video),
            cache.content_hash(clip.video),
            shapes,
            DataConfig(crop=crop),
            42,
        )
        return item.top, item.left

    moved = sum(offsets(clip, "random") != offsets(clip, "center") for clip in clips)
    assert 0 < moved < 24
    log_line = run_cache_pass(
        caplog, config, "--data.train_resolution", "[9, 32, 48]", "--data.crop", "random"
    )
    assert f"{moved} clips encoded, {24 - moved} reused" in log_line


@pytest.mark.slow
def test_complete_cache_trains_without_vae_t5_videos_or_headers(
    write_config, tiny_data, tmp_path, caplog, monkeypatch
):
    """A complete cache trains without the VAE, T5, the videos or their headers.

    With a complete manifest and cache a restart reads no header and loads no encoder, and a clip
    whose file is gone trains from its entries."""
    data_root = tmp_path / "data"
    shutil.copytree(tiny_data, data_root)
    config = write_config(
        "no_encoders",
        **{"validation.do_validation": False, "train.steps": 2, "data.data_root": str(data_root)},
    )
    run_cache_pass(caplog, config)
    (data_root / "videos" / "00003.mp4").unlink()

    def refuse(*args, **kwargs):
        raise AssertionError(
            "a header was read, or the VAE or T5 constructed, although the cache is complete"
        )

    monkeypatch.setattr(AutoencoderKLCogVideoX, "from_pretrained", refuse)
    monkeypatch.setattr(T5EncoderModel, "from_pretrained", refuse)
    monkeypatch.setattr(decode, "probe", refuse)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vidtrain"):
        trainer.main(args_of(config))
    assert "0 clips encoded, 24 reused" in cache_log(caplog)
    assert sorted(train_losses(tmp_path / "no_encoders")) == [1, 2]


# Bad input.
BAD = {2: "videos/empty.mp4", 3: "videos/truncated.mp4", 5: "videos/text.mp4", 7: "videos/missing.mp4"}


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory) -> Path:
    """8 good 9x32x32 clips with four bad ones at lines 2, 3, 5 and 7 of videos.txt."""
    root = tmp_path_factory.mktemp("bad") / "data"
    make_synthetic_dataset(str(root), num_videos=8, frames=9, height=32, width=32, seed=3)
    (root / "videos" / "empty.mp4").write_bytes(b"")
    good = (root / "videos" / "00000.mp4").read_bytes()
    (root / "videos" / "truncated.mp4").write_bytes(good[: len(good) // 2])
    (root / "videos" / "text.mp4").write_text("this is a text file, not a video\n")
    videos = (root / "videos.txt").read_text().splitlines()
    prompts = (root / "prompts.txt").read_text().splitlines()
    for line, path in sorted(BAD.items()):
        videos.insert(line - 1, path)
        prompts.insert(line - 1, "a bad clip")
    (root / "videos.txt").write_text("\n".join(videos) + "\n")
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    return root


@pytest.mark.slow
def test_bad_input_stops_before_training_with_the_lowest_line(bad_data, write_config, tmp_path):
    # Line 2 is checked by rank 1, line 3 by rank 0: the report must still be line 2.
    config = write_config(
        "bad",
        **{"data.data_root": str(bad_data), "data.cache_dir": str(tmp_path / "cache"), "data.held_out": 0},
    )
    result = run_cmd(args_of(config), nproc=2)
    assert result.returncode != 0
    assert f"videos.txt line 2: {bad_data / BAD[2]}: not a readable video" in result.stderr
    assert "4 clip(s) cannot be used" in result.stderr and "data.skip_bad = true" in result.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors")) and "step 1/" not in result.stderr


@pytest.mark.slow
def test_skip_bad_trains_on_the_rest_and_lists_the_skipped(bad_data, write_config, tmp_path, caplog):
    config = write_config(
        "skip",
        **{
            "data.data_root": str(bad_data),
            "data.cache_dir": str(tmp_path / "cache"),
            "data.held_out": 0,
            "data.skip_bad": True,
            "train.steps": 2,
            "validation.do_validation": False,
        },
    )
    with caplog.at_level(logging.INFO, logger="vidtrain"):
        trainer.main(args_of(config))
    assert "8 clips encoded, 0 reused, 4 skipped" in cache_log(caplog)
    listed = [line.split("\t") for line in (tmp_path / "skip" / "skipped.txt").read_text().splitlines()]
    assert [path for path, _ in listed] == [str(bad_data / BAD[line]) for line in sorted(BAD)]
    assert "does not exist" in listed[3][1] and all(reason for _, reason in listed)
    assert sorted(train_losses(tmp_path / "skip")) == [1, 2]


def test_a_higher_rate_reads_up_to_the_last_frames_end(tiny_data):
    """A target rate above the clip's reads up to the end of its last frame.

    data.target_fps above the clip's rate: the window that ends where the clip does takes the last
    frame for every time it is shown (until the clip's end), not only for the times nearer it than
    half a frame."""
    path = sorted((tiny_data / "videos").iterdir())[0]
    media = decode.probe(path)
    rate = 3 * media.fps
    end = decode.available_frames(media, rate)
    times = [k / rate for k in range(end - 9, end)]
    window = decode.read_frames(path, media, times, (40, 48), (0, 0, 40, 48), pad=False)
    last = decode.read_frames(
        path, media, [(media.frames - 1) / media.fps], (40, 48), (0, 0, 40, 48), pad=False
    )
    shown = [t for t in times if t >= (media.frames - 1) / media.fps]
    assert len(shown) == 3 and all((frame == last[0]).all() for frame in window[-len(shown) :])
