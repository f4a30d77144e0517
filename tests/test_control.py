"""Control videos as data (data.control_column): each clip's control is read at its window's frame
times, resized and cropped as its frames are, whatever the control's own rate and size; cached
beside the clip's latents by the adapter's encode_control, keyed by the control's content; bad input
is named."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from conftest import one_rank_group, picked_frames, prepare_run, ramp_video, write_toml
from safetensors.torch import load_file

import cache
import data
import decode
from config import ConfigError, DataConfig, load_config
from model import setup_adapter
from tools.calibrate_tiny_vae import VAES, calibrate, read_clip
from tools.make_synthetic_dataset import edge_map, make_synthetic_dataset


def ramp_data(root, count: int = 3):
    """Targets: 17 frames of 40 x 48 at 8 fps, frame k grey 10 + 12k. Controls: the same ramp at 24
    fps and twice the size (control frame j shows the target's time j / 24: grey 10 + 4j), so a
    control frame read at the target frame k's time has the target frame's grey; line 3's control
    covers only the clip's first 9 frames."""
    (root / "videos").mkdir(parents=True)
    (root / "controls").mkdir()
    rows = []
    for i in range(count):
        ramp_video(root / "videos" / f"{i}.mp4", 17, 40, 48, 8, 12, 40 * i)
        ramp_video(root / "controls" / f"{i}.mp4", 49, 80, 96, 24, 4, 40 * i)
        rows.append(f'{{"video": "videos/{i}.mp4", "prompt": "ramp {i}", "control": "controls/{i}.mp4"}}\n')
    (root / "metadata.jsonl").write_text("".join(rows))
    return root


@pytest.fixture
def control_settings(base_settings, tmp_path):
    """The session's tiny CogVideoX over a ramp dataset with controls, random crops, own cache."""
    root = ramp_data(tmp_path / "data")
    return {
        **base_settings,
        "run.output_dir": str(tmp_path / "out"),
        "data.data_root": str(root),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.held_out": 0,
        "data.crop": "random",
    }


def control_model(adapter, seen: list):
    """The run's adapter made a control model whose encode_control records the frames it is given."""
    adapter.takes_control = True
    encode = adapter.encode_control

    def recorded(video):
        seen.append(video.clone())
        return encode(video)

    adapter.encode_control = recorded
    return adapter


def test_cached_controls_are_the_target_windows_frames(control_settings, tmp_path, caplog):
    """The frames encode_control receives are, frame by frame, the target window's (the same grey:
    the same time; the same white corner: the same resize and crop), though the control has 3x the
    rate and 2x the size; the entry is their VAE posterior; a changed control re-encodes that clip's
    control alone."""
    seen = []
    cfg = load_config(str(write_toml(tmp_path / "c.toml", control_settings)))
    with one_rank_group() as d:
        adapter = control_model(setup_adapter(cfg, d), seen)
        entries, items, _ = cache.prepare(cfg, adapter, d)
        assert len(items) == 3 and "control" in entries.kinds
        assert len({item.start for item in items}) > 1 and len({item.left for item in items}) > 1
        frames = torch.cat(seen)  # one batch, in the items' order
        assert frames.shape == (3, 9, 32, 32, 3) and frames.dtype == torch.uint8
        # as one batch: the VAE's sums differ by batch size
        means, logvars = adapter.encode_video(frames)
        for item, control, mean, logvar in zip(items, frames, means, logvars):
            target = data.decode_clip(item)
            assert picked_frames(control) == picked_frames(target) == list(range(item.start, item.start + 9))
            # the corner's edge falls alike
            assert (control.float() - target.float()).abs().mean() < 3
            corner = (control.float().mean(dim=(0, 3)) > 200).nonzero()
            assert (
                corner.amax(0).tolist() == (target.float().mean(dim=(0, 3)) > 200).nonzero().amax(0).tolist()
            )
            cached = load_file(entries.path(item, "control"))
            torch.testing.assert_close(cached["control_latent_mean"], mean, rtol=0, atol=1e-6)
            torch.testing.assert_close(cached["control_latent_logvar"], logvar, rtol=0, atol=1e-6)
        batch = entries.load_batch(items[:2])
        assert batch["control_latent_mean"].shape == batch["latent_mean"].shape
        before = [entries.path(item, kind) for item in items for kind in ("video", "control")]
        # other greys: other content
        ramp_video(tmp_path / "data" / "controls" / "1.mp4", 49, 80, 96, 24, 4, 41)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vidtrain"):
            entries, items, _ = cache.prepare(cfg, adapter, d)
    after = [entries.path(item, kind) for item in items for kind in ("video", "control")]
    assert [b == a for b, a in zip(before, after)] == [True, True, True, False, True, True]
    assert len(seen) == 2 and seen[1].shape[0] == 1  # only the changed control went to the encoder
    assert any("cache: 1 clips encoded, 2 reused" in r.getMessage() for r in caplog.records), caplog.text


def test_a_control_shorter_than_the_window_is_named(tmp_path):
    """A control that stops before the window's last frame time is bad input naming it, at any rate;
    one that covers the window (though shorter than the clip) is fine."""
    root = ramp_data(tmp_path / "data", 1)
    # 27 / 24 s: the target's frames 0 to 8
    ramp_video(root / "controls" / "short.mp4", 27, 80, 96, 24, 4)
    clip = data.Clip(
        root / "videos" / "0.mp4",
        "ramp",
        1,
        "metadata.jsonl",
        control=root / "controls" / "short.mp4",
    )
    media, control = decode.probe(clip.video), (decode.probe(clip.control), "short")
    plans = [
        data.plan_clip(clip, media, "c", [(9, 32, 32)], DataConfig(), seed, control=control)
        for seed in range(20)
    ]
    late = next(
        seed
        for seed in range(20)
        if data.plan_clip(clip, media, "c", [(9, 32, 32)], DataConfig(), seed).start
    )
    start = data.plan_clip(clip, media, "c", [(9, 32, 32)], DataConfig(), late).start
    problem = plans[late]
    assert isinstance(problem, data.Problem) and problem.kind == "bad"
    assert (
        f"control {clip.control} has 9 frames at 8 fps, but the clip's window needs its frames {start} to "
        f"{start + 8}: give each clip a control video as long as the clip" in str(problem)
    )
    assert str(clip.video) in str(problem)
    item = next(plan for plan in plans if isinstance(plan, data.Item))  # a window at frame 0
    assert item.start == 0 and picked_frames(data.decode_control(item)) == list(range(9))


def test_control_refusals_name_the_key_or_the_clip(control_settings, base_settings, tmp_path):
    """data.control_column for a model that follows no control names the key; a control model's clip
    without a control names the clip, the line and the column, and no clip with one is one error
    naming the key (not one per clip with data.skip_bad's advice); an unreadable control its file."""
    with one_rank_group() as d:
        settings = {
            **base_settings,
            "run.output_dir": str(tmp_path / "plain"),
            "data.control_column": "videos.txt",
        }
        with pytest.raises(
            ConfigError,
            match="data.control_column = videos.txt gives control videos, and model.path",
        ):
            prepare_run(load_config(str(write_toml(tmp_path / "plain.toml", settings))), d)
        root = tmp_path / "data"
        rows = (root / "metadata.jsonl").read_text().splitlines()
        (root / "metadata.jsonl").write_text(
            rows[0] + "\n" + rows[1].replace(', "control": "controls/1.mp4"', "") + "\n"
        )
        cfg = load_config(str(write_toml(tmp_path / "c.toml", control_settings)))
        adapter = control_model(setup_adapter(cfg, d), [])
        with pytest.raises(
            data.BadClip,
            match=r"metadata.jsonl line 2: .*1.mp4: has no control video: a control "
            r"model needs one per clip \(data.control_column's line",
        ):
            cache.prepare(cfg, adapter, d)
        (root / "metadata.jsonl").write_text(  # no clip has one: one line for the config, not per clip
            "".join(row.replace(f', "control": "controls/{i}.mp4"', "") + "\n" for i, row in enumerate(rows))
        )
        with pytest.raises(ConfigError) as none:
            cache.prepare(cfg, adapter, d)
        assert str(none.value) == (
            f'model.path = {adapter.path} follows a control video (model.type = "t2v"), but no clip has '
            "one: set data.control_column to a file under data_root with each clip's control video, one "
            "per line (or give metadata.jsonl / metadata.csv a control column)"
        )
        (root / "metadata.jsonl").write_text(rows[0] + "\n")
        (root / "controls" / "0.mp4").write_bytes(b"not a video")
        with pytest.raises(
            data.BadClip, match=r"line 1: .*0.mp4: control .*controls/0.mp4: not a readable video"
        ):
            cache.prepare(cfg, adapter, d)


def test_synthetic_controls_are_each_clips_edge_map(tmp_path):
    """--control writes one control per clip, listed line by line: the clip's outline, frame by
    frame."""
    make_synthetic_dataset(str(tmp_path), num_videos=2, frames=9, control=True)
    lines = (tmp_path / "controls.txt").read_text().splitlines()
    assert lines == ["controls/00000.mp4", "controls/00001.mp4"]
    clip = data.Clip(tmp_path / "videos/00001.mp4", "x", 2, "videos.txt", control=tmp_path / lines[1])
    media = decode.probe(clip.video)
    item = data.plan_clip(
        clip, media, "c", [(9, 40, 48)], DataConfig(), 0, control=(decode.probe(clip.control), "c")
    )
    video, control = data.decode_clip(item).numpy(), data.decode_control(item).numpy()
    edges = edge_map(video.astype(np.int32).__gt__(60).astype(np.uint8) * 255)
    # H.264 blurs a few edge pixels
    assert (np.abs(control.astype(np.int32) - edges) > 128).mean() < 0.02
    assert (control > 128).mean() > 0.005 and (control > 128).mean() < (video.max(-1) > 60).mean()


@pytest.mark.parametrize("family", ["ltx2", "wan"])
def test_calibrated_tiny_vae_has_a_trained_ones_latent_statistics(family, ltx2_models, wan_models, tmp_path):
    """tools/calibrate_tiny_vae.py, as bench_control.py runs it: the clips' latents, normalised with
    the statistics diffusers loads back, have mean 0 and variance 1 per channel (before: nearly
    constant); Wan's posterior noise is a tenth of each channel's spread."""
    model = {"ltx2": lambda: ltx2_models("2.0"), "wan": lambda: wan_models("vace")}[family]()
    shutil.copytree(model / "vae", tmp_path / "model" / "vae")
    make_synthetic_dataset(str(tmp_path / "data"), num_videos=6, frames=9, height=32, width=32, control=True)
    clips = [
        read_clip(tmp_path / "data" / line, 9, (32, 32))
        for line in (tmp_path / "data" / "videos.txt").read_text().split()
    ]

    def encoded():
        vae = VAES[json.loads((tmp_path / "model/vae/config.json").read_text())["_class_name"]]
        vae = vae.from_pretrained(tmp_path / "model" / "vae").eval()
        stats = (
            vae.config
            if family == "wan"
            else {"latents_mean": vae.latents_mean, "latents_std": vae.latents_std}
        )
        mean, std = (torch.as_tensor(stats[k]).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std"))
        with torch.no_grad():
            posteriors = [vae.encode(clip).latent_dist for clip in clips]
        means = torch.cat([p.mean for p in posteriors])
        return (means - mean) / std, torch.cat([p.std for p in posteriors]) / std

    before, _ = encoded()
    assert before.std(dim=(0, 2, 3, 4)).max() < 0.2
    calibrate(str(tmp_path / "model"), str(tmp_path / "data"), frames=9, size=(32, 32))
    after, noise = encoded()
    torch.testing.assert_close(after.mean(dim=(0, 2, 3, 4)), torch.zeros(after.shape[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(after.std(dim=(0, 2, 3, 4)), torch.ones(after.shape[1]), atol=1e-4, rtol=0)
    if family == "wan":
        assert 0.05 < noise.mean() < 0.2
