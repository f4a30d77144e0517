"""Wan FLF2V (first-last-frame): each clip's window ends at its last frame, the cached condition is built
from the window's first frame and the clip's last image and follows the last image's content, and each
refusal names the key or file to fix. Sampling parity with WanImageToVideoPipeline(last_image=...) and
the 2-process lifecycle are test_wan.py's, parametrized over the flf2v variant."""

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

import cache
import data
import decode
import validate
from config import ConfigError, DataConfig, load_config
from test_data import picked_frames, ramp_clip
from test_variants import one_rank_group
from test_wan import wan_settings


def test_the_window_ends_at_the_clips_last_frame(tmp_path):
    """A clip with a last image trains its last 9 frames whatever the seed; without one the window starts
    anywhere; with both images the clip must be exactly the window."""
    ramp_clip(tmp_path / "ramp.mp4", 17)
    clip, media = data.Clip(tmp_path / "ramp.mp4", "grey", 1, "videos.txt"), decode.probe(tmp_path / "ramp.mp4")
    for seed in range(4):
        item = data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), seed, None, "last")
        assert item.start == 8 and item.last_image_content == "last"
        assert picked_frames(data.decode_clip(item)) == list(range(8, 17))
    starts = {data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), seed).start for seed in range(8)}
    assert len(starts) > 1
    both = data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), 0, "first", "last")
    assert isinstance(both, data.Problem) and "has 17 frames and both an image and a last image" in both.reason
    whole = data.plan_clip(clip, media, "content", [(17, 32, 32)], DataConfig(), 0, "first", "last")
    assert whole.start == 0 and picked_frames(data.decode_clip(whole)) == list(range(17))


def flf2v_data(root, tiny_data):
    """A metadata.jsonl dataset of 4 of the session's clips with their last frames (copied: a test edits one)."""
    root.mkdir()
    (root / "videos").symlink_to(tiny_data / "videos")
    shutil.copytree(tiny_data / "last_images", root / "last_images")
    rows = [f'{{"video": "videos/0000{i}.mp4", "prompt": "clip {i}", "last_image": "last_images/0000{i}.png"}}\n'
            for i in range(4)]
    (root / "metadata.jsonl").write_text("".join(rows))
    return root


def test_the_cache_holds_both_images_condition_keyed_by_the_last_image(wan_models, base_settings, tiny_data,
                                                                       tmp_path, caplog):
    """The image entry is the condition of the window's first frame and the clip's last image, as the
    adapter encodes them together; replacing one last image's content re-encodes that clip only."""
    root = flf2v_data(tmp_path / "data", tiny_data)
    settings = wan_settings("flf2v", wan_models, base_settings, tiny_data, tmp_path / "out", **{
        "data.data_root": str(root), "data.last_image_column": "", "data.cache_dir": str(tmp_path / "cache"),
        "data.held_out": 0})
    from conftest import write_toml
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with one_rank_group() as d:
        adapter, entries, items, _ = cache.prepare(cfg, d)
        assert [item.start for item in items] == [8] * 4  # 17-frame clips, 9-frame windows ending at the last
        item = items[1]
        reference = adapter.encode_image(data.decode_clip(item)[:1], [torch.Generator()], 9,
                                         last_images=data.load_image(item, last=True)[None])
        cached = load_file(entries.path(item, "image"))
        assert cached["image_embeds"].shape == (2 * 17, 16)  # both images' CLIP tokens
        for key in cached:
            torch.testing.assert_close(cached[key], reference[key][0], rtol=0, atol=1e-5)
        before = entries.path(item, "image")
        shutil.copy(root / "last_images" / "00002.png", root / "last_images" / "00001.png")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vidtrain"):
            _, entries, items, _ = cache.prepare(cfg, d)
    assert entries.path(items[1], "image") != before
    assert [entries.path(i, "image") for i in items[::2]] == [entries.path(i, "image") for i in (items[0], items[2])]
    assert any("cache: 1 clips encoded, 3 reused" in r.getMessage() for r in caplog.records), caplog.text


def test_refusals_name_the_key(wan_models, base_settings, tiny_data, tmp_path):
    """A first-last-frame model without last images, last images for another model, a missing last image
    file, and validation.last_images that do not pair with the prompts: each stops with its fix."""
    from conftest import write_toml

    def prepare(name, variant="flf2v", **extra):
        settings = wan_settings(variant, wan_models, base_settings, tiny_data, tmp_path / name,
                                **{"data.cache_dir": str(tmp_path / "cache"), **extra})
        with one_rank_group() as d:
            cache.prepare(load_config(str(write_toml(tmp_path / f"{name}.toml", settings))), d)

    with pytest.raises(ConfigError, match=r"is a first-last-frame model \(Wan FLF2V\), but no clip has a last image: "
                                          r"set data.last_image_column"):
        prepare("none", **{"data.last_image_column": ""})
    with pytest.raises(ConfigError, match=r"data.last_image_column = last_images.txt conditions first-last-frame "
                                          r"models, and model.path = .* is not one"):
        prepare("i2v", "i2v", **{"data.last_image_column": "last_images.txt"})
    root = flf2v_data(tmp_path / "data", tiny_data)
    (root / "last_images" / "00002.png").unlink()
    with pytest.raises(data.BadClip, match=r"line 3: .*00002.mp4: last image .*00002.png: .*fix or remove it"):
        prepare("missing", **{"data.data_root": str(root), "data.last_image_column": "", "data.held_out": 0})
    settings = wan_settings("flf2v", wan_models, base_settings, tiny_data, tmp_path / "count")
    settings["validation.last_images"] = settings["validation.last_images"][:1]
    settings["validation.do_validation"] = True
    with pytest.raises(ConfigError, match=r"validation.last_images has 1 for 2 validation.prompts"):
        load_config(str(write_toml(tmp_path / "count.toml", settings)))


def test_validate_renders_between_the_images(wan_models, base_settings, tiny_data, tmp_path, caplog):
    """validate.py --last-image renders the base model's clip; without it a first-last-frame model is refused,
    and an image-to-video model refuses one."""
    from conftest import write_toml
    settings = wan_settings("flf2v", wan_models, base_settings, tiny_data, tmp_path / "out",
                            **{"validation.num_inference_steps": 2, "validation.last_images": []})
    config = str(write_toml(tmp_path / "c.toml", settings))
    first, last = str(tiny_data / "images" / "00000.png"), str(tiny_data / "last_images" / "00000.png")
    validate.main(["--cfg", config, "--prompt", "a square", "--image", first, "--last-image", last])
    assert len(list((tmp_path / "out" / "validation_res").glob("render_base_prompt_0_*.mp4"))) == 1
    i2v = wan_settings("i2v", wan_models, base_settings, tiny_data, tmp_path / "i2v",
                       **{"validation.num_inference_steps": 2})
    refusals = {"is a first-last-frame model (Wan FLF2V): each validation prompt renders between its image and its "
                "last image; set validation.last_images (validate.py: --last-image), one per prompt": [config],
                "validation.last_images conditions first-last-frame models, and": [
                    str(write_toml(tmp_path / "i2v.toml", i2v)), "--last-image", last]}
    for message, arguments in refusals.items():
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="vidtrain"), pytest.raises(SystemExit):
            validate.main(["--cfg", arguments[0], "--prompt", "a square", "--image", first, *arguments[1:]])
        assert message in caplog.text
