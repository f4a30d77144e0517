"""Data at scale: formats, decoding, buckets, the sampler, the cache pass, bad input.

Cheap checks call the functions directly; the cache pass runs in this process through cache.main (one
process, a HashStore group), and the multi-rank and kill tests run the real commands.
"""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX
from safetensors.torch import load_file
from transformers import T5EncoderModel

import cache
import data
import trainer
from config import ConfigError, DataConfig
from conftest import run_cmd, run_ok, train_losses
from tools.make_synthetic_dataset import make_synthetic_dataset, write_mp4

TWO_BUCKETS = [[9, 32, 32], [17, 32, 48]]


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
    write_rows(jsonl, [{"video": "v/0.mp4", "prompt": "a red square"}, {"video": "v/1.mp4", "prompt": "a blue circle"}])
    (csv_root / "metadata.csv").write_text('video,prompt,image\nv/0.mp4,a red square,\nv/1.mp4,"a blue circle",i/1.png\n')
    read = {n: data.read_clips(DataConfig(data_root=str(r))) for n, r in (("cog", cog), ("jsonl", jsonl), ("csv", csv_root))}
    for clips in read.values():
        assert [(c.video.name, c.prompt) for c in clips] == [("0.mp4", "a red square"), ("1.mp4", "a blue circle")]
    assert [c.line for c in read["csv"]] == [2, 3] and read["csv"][1].image == csv_root / "i/1.png"
    assert read["cog"][0].image is None and read["csv"][0].image is None


@pytest.mark.parametrize("files, expected", [
    ({"prompts.txt": "a\nb\nc\n", "videos.txt": "0.mp4\n1.mp4\n"}, "prompts.txt has 3 lines but .*videos.txt has 2.*line: 3"),
    ({"prompts.txt": "a\n\nc\n", "videos.txt": "0.mp4\n1.mp4\n2.mp4\n"}, "prompts.txt line 2 is empty"),
    ({"metadata.jsonl": '{"video": "0.mp4", "prompt": "a"}\n{"video": "1.mp4", "prompt": " "}\n'}, "metadata.jsonl line 2: empty or missing prompt"),
    ({"metadata.jsonl": '{"video": "0.mp4", "prompt": "a"}\n{"video": \n'}, "metadata.jsonl line 2 is not valid JSON"),
    ({"metadata.csv": "video,caption\n0.mp4,a\n"}, "metadata.csv line 1 must be a header"),
    ({"metadata.csv": "video,prompt\n0.mp4,a\n1.mp4,\n"}, "metadata.csv line 3: empty or missing prompt"),
    ({"notes.txt": "x"}, "neither of metadata.jsonl and metadata.csv"),
])
def test_list_mistakes_name_file_and_line(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=expected):
        data.read_clips(DataConfig(data_root=str(tmp_path)))


# Decoding and planning.
def ramp_clip(path: Path, frames: int, height: int = 32, width: int = 32) -> None:
    """Frame k is flat grey 10 + 12k: the decoded value tells which frame was picked."""
    video = np.stack([np.full((height, width, 3), 10 + 12 * k, np.uint8) for k in range(frames)])
    write_mp4(path, video, fps=8)


def item_for(path: Path, resolution, start: int, pad: bool = False, resized=None) -> data.Item:
    clip = data.Clip(path, "grey", 1, "videos.txt")
    return data.Item(clip, 0, tuple(resolution), resized or tuple(resolution[1:]), start, 0, 0, pad)


def picked_frames(video: torch.Tensor) -> list[int]:
    return [round((v - 10) / 12) for v in video.float().mean(dim=(1, 2, 3)).tolist()]


def test_frames_are_chosen_by_timestamp_and_padded(tmp_path):
    ramp_clip(tmp_path / "ramp.mp4", 17)
    assert picked_frames(data.decode_clip(item_for(tmp_path / "ramp.mp4", [5, 32, 32], 1), 4.0)) == [2, 4, 6, 8, 10]
    assert picked_frames(data.decode_clip(item_for(tmp_path / "ramp.mp4", [9, 32, 32], 3), 0.0)) == list(range(3, 12))
    ramp_clip(tmp_path / "short.mp4", 5)
    padded = data.decode_clip(item_for(tmp_path / "short.mp4", [9, 32, 32], 0, pad=True), 0.0)
    assert picked_frames(padded) == [0, 1, 2, 3, 4, 4, 4, 4, 4]
    with pytest.raises(data.BadClip, match="decodes to 5 of the 9 frames"):
        data.decode_clip(item_for(tmp_path / "short.mp4", [9, 32, 32], 0), 0.0)


def test_plan_keeps_aspect_and_draws_start_and_crop_from_the_seed(tmp_path):
    ramp_clip(tmp_path / "wide.mp4", 17, height=40, width=80)
    clip = data.Clip(tmp_path / "wide.mp4", "grey", 1, "videos.txt")
    shapes = [(9, 32, 32)]
    centre = data.plan_clip(clip, shapes, DataConfig(), seed=0)
    assert centre.resized == (32, 64) and (centre.top, centre.left) == (0, 16)
    plans = {s: data.plan_clip(clip, shapes, DataConfig(crop="random", target_fps=4.0), seed=s) for s in range(8)}
    assert plans[3] == data.plan_clip(clip, shapes, DataConfig(crop="random", target_fps=4.0), seed=3)
    assert all(0 <= p.left <= 32 and 0 <= p.start <= 0 for p in plans.values())  # 17 frames at 8 fps = 9 at 4 fps
    assert len({p.left for p in plans.values()}) > 1
    native = {data.plan_clip(clip, shapes, DataConfig(), seed=s).start for s in range(8)}
    assert native <= set(range(9)) and len(native) > 1
    short = data.plan_clip(clip, [(25, 32, 32)], DataConfig(), seed=0)
    assert isinstance(short, data.Problem) and short.kind == "short" and "17 frames" in short.reason
    assert data.plan_clip(clip, [(25, 32, 32)], DataConfig(short_clips="pad"), seed=0).pad


def test_bucket_is_the_largest_the_clip_fills():
    shapes = [(9, 32, 32), (17, 32, 48), (9, 48, 48), (25, 32, 32)]
    assert data.choose_bucket(shapes, 40, 48, 17) == 1  # covers 32x48, not 48x48
    assert data.choose_bucket(shapes, 40, 48, 9) == 0  # too short for 32x48
    assert data.choose_bucket(shapes, 64, 64, 9) == 2
    assert data.choose_bucket(shapes, 32, 32, 30) == 3  # same area: more frames
    assert data.choose_bucket(shapes, 20, 20, 30) == 3  # smaller than every bucket: the smallest, upscaled
    assert data.choose_bucket(shapes, 40, 48, 5) == 0  # too short for all it covers: the shortest


# The sampler.
def test_sampler_batches_hold_one_bucket_and_resume_exactly():
    buckets = [0] * 10 + [1] * 7 + [2] * 3
    for world, batch_size, accumulation in ((1, 4, 1), (2, 1, 2)):
        global_batch = world * batch_size * accumulation
        straight = data.Sampler(buckets, global_batch, seed=5)
        sequence = [straight.next_batch() for _ in range(12)]
        per_epoch = 10 // 4 + 7 // 4
        for epoch in range(2):
            batches = sequence[epoch * per_epoch : (epoch + 1) * per_epoch]
            assert len({i for b in batches for i in b}) == per_epoch * global_batch
        for batch in sequence:
            assert len({buckets[i] for i in batch}) == 1
            slices = [data.micro_slice(m, r, world, batch_size) for m in range(accumulation) for r in range(world)]
            assert sorted(p for s in slices for p in s) == list(range(global_batch))
        first = data.Sampler(buckets, global_batch, seed=5)
        head = [first.next_batch() for _ in range(5)]
        state = first.state_dict()
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        resumed = data.Sampler(buckets, global_batch, seed=5)
        resumed.load_state_dict(state)
        assert head + [resumed.next_batch() for _ in range(7)] == sequence
    with pytest.raises(ConfigError, match="train.batch_size x train.gradient_accumulation_steps x world size"):
        data.Sampler(buckets, 8, seed=5).load_state_dict(state)
    with pytest.raises(ConfigError, match="no bucket holds a full global batch of 11"):
        data.Sampler(buckets, 11, seed=5)


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


def test_two_buckets_train_on_two_ranks_and_the_cache_is_reused(two_shape_data, write_config, tmp_path, caplog):
    config = write_config("buckets", **{"data.data_root": str(two_shape_data), "data.buckets": TWO_BUCKETS,
                                        "data.cache_dir": str(tmp_path / "cache"), "data.held_out": 0,
                                        "data.cache_batch_size": 3, "train.steps": 4,
                                        "validation.do_validation": False})
    first = run_ok(args_of(config), nproc=2)
    assert "cache: 24 clips encoded, 0 reused, 0 skipped; clips per bucket {'[9, 32, 32]': 12, '[17, 32, 48]': 12}" in first.stderr
    assert sorted(train_losses(tmp_path / "buckets")) == [1, 2, 3, 4]
    assert "0 clips encoded, 24 reused" in run_cache_pass(caplog, config)
    shapes = [tuple(load_file(p)["latent_mean"].shape) for p in (tmp_path / "cache").rglob("*.safetensors")]
    assert sorted(shapes.count(s) for s in set(shapes)) == [12, 12]
    assert "12 clips encoded, 12 reused" in run_cache_pass(caplog, config, "--data.buckets", "[[9, 32, 32], [17, 32, 32]]")


def test_resolution_change_invalidates_and_killed_pass_resumes(write_config, tmp_path, caplog):
    config = write_config("cache", **{"data.cache_dir": str(tmp_path / "cache"), "data.cache_batch_size": 2})
    killed = run_cmd(args_of(config), env={"VIDTRAIN_FAULT": "cache_kill:5"}, script="cache.py")
    assert killed.returncode != 0 and "clips encoded" not in killed.stderr
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 5
    # SIGTERM after 3 more entries: the round under way (2 clips per batch) completes, then the pass stops, exit 0.
    stopped = run_ok(args_of(config), env={"VIDTRAIN_FAULT": "cache_sigterm:3"}, script="cache.py")
    assert "stopped by a signal: in the cache pass, with 4 of 19 clips encoded and kept" in stopped.stderr
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 9
    assert "15 clips encoded, 9 reused" in run_cache_pass(caplog, config)
    assert "0 clips encoded, 24 reused" in run_cache_pass(caplog, config)
    assert "24 clips encoded, 0 reused" in run_cache_pass(caplog, config, "--data.train_resolution", "[9, 32, 48]")
    assert "24 clips encoded, 0 reused" in run_cache_pass(caplog, config, "--data.crop", "random")


def test_complete_cache_trains_without_vae_or_t5(write_config, tmp_path, caplog, monkeypatch):
    config = write_config("no_encoders", **{"validation.do_validation": False, "train.steps": 2})
    run_cache_pass(caplog, config)

    def refuse(*args, **kwargs):
        raise AssertionError("the VAE or T5 was constructed although the cache is complete")

    monkeypatch.setattr(AutoencoderKLCogVideoX, "from_pretrained", refuse)
    monkeypatch.setattr(T5EncoderModel, "from_pretrained", refuse)
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


def test_bad_input_stops_before_training_with_the_lowest_line(bad_data, write_config, tmp_path):
    # Line 2 is checked by rank 1, line 3 by rank 0: the report must still be line 2.
    config = write_config("bad", **{"data.data_root": str(bad_data), "data.cache_dir": str(tmp_path / "cache"),
                                    "data.held_out": 0})
    result = run_cmd(args_of(config), nproc=2)
    assert result.returncode != 0
    assert f"videos.txt line 2: {bad_data / BAD[2]}: not a readable video" in result.stderr
    assert "4 clip(s) cannot be used" in result.stderr and "data.skip_bad = true" in result.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors")) and "step 1/" not in result.stderr


def test_skip_bad_trains_on_the_rest_and_lists_the_skipped(bad_data, write_config, tmp_path, caplog):
    config = write_config("skip", **{"data.data_root": str(bad_data), "data.cache_dir": str(tmp_path / "cache"),
                                     "data.held_out": 0, "data.skip_bad": True, "train.steps": 2,
                                     "validation.do_validation": False})
    with caplog.at_level(logging.INFO, logger="vidtrain"):
        trainer.main(args_of(config))
    assert "8 clips encoded, 0 reused, 4 skipped" in cache_log(caplog)
    listed = [line.split("\t") for line in (tmp_path / "skip" / "skipped.txt").read_text().splitlines()]
    assert [path for path, _ in listed] == [str(bad_data / BAD[line]) for line in sorted(BAD)]
    assert "does not exist" in listed[3][1] and all(reason for _, reason in listed)
    assert sorted(train_losses(tmp_path / "skip")) == [1, 2]
