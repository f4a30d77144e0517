"""Real-world video and a cache for many clips.

Containers and orientations as phones and the web make them, aspect-aware buckets, images as
one-frame clips, entries that survive recaptioning and per-node copies, the manifest."""

import gc
import json
import logging
import os
import shutil
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import one_rank_group, prepare_run, read_metrics, run_cmd, run_ok, train_losses
from diffusers import AutoencoderKLCogVideoX
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import T5EncoderModel

import cache
import data
import decode
import ranks
from config import load_config
from tools.make_synthetic_dataset import make_synthetic_dataset, write_clip

REAL_WORLD = ("mkv", "webm", "fmp4", "vfr", "phone", "photo")
# Equal-area landscape and portrait buckets, and one for portrait photos.
BUCKETS = [[9, 40, 48], [9, 48, 40], [1, 48, 40]]


def cache_log(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "clips encoded" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def cache_pass(caplog, config, *extra) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vidtrain"):
        cache.main(["--cfg", str(config), *extra])
    return cache_log(caplog)


@pytest.fixture(scope="module")
def real_world(tmp_path_factory):
    """12 clips: Matroska (H.264), WebM (VP9), fragmented mp4, variable-frame-rate mp4, portrait
    phone .mov (90-degree display matrix), portrait JPEG (EXIF orientation), twice each."""
    root = tmp_path_factory.mktemp("real_world") / "data"
    make_synthetic_dataset(str(root), num_videos=12, frames=17, height=40, width=48, seed=5, kinds=REAL_WORLD)
    return root


@pytest.mark.slow
def test_phones_and_the_web_train_in_buckets_of_their_aspect(real_world, write_config, tmp_path):
    """Phone and web clips train in buckets of their aspect.

    All of them train with skip_bad off; the rotated clips land in the portrait bucket beside the
    landscape one of equal area, the photos in the one-frame bucket."""
    config = write_config(
        "real",
        **{
            "data.data_root": str(real_world),
            "data.buckets": BUCKETS,
            "data.held_out": 0,
            "train.steps": 2,
            "validation.do_validation": False,
        },
    )
    result = run_ok(["--cfg", str(config)])
    assert "clips per bucket {'[9, 40, 48]': 8, '[9, 48, 40]': 2, '[1, 48, 40]': 2}" in result.stderr
    assert sorted(train_losses(tmp_path / "real")) == [1, 2]


def test_a_bucket_too_small_for_a_global_batch_is_named(real_world, write_config, caplog):
    config = write_config(
        "small",
        **{
            "data.data_root": str(real_world),
            "data.buckets": BUCKETS,
            "data.held_out": 0,
            "train.batch_size": 4,
        },
    )
    cache_pass(caplog, config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(w.split(" holds")[0] for w in warnings) == ["bucket [1, 48, 40]", "bucket [9, 48, 40]"]
    assert "fewer than the global batch of 4: they will never train" in warnings[0]


@pytest.fixture
def own_copy(tiny_model, tiny_data, tmp_path):
    """A private model and dataset, with their cache complete."""
    shutil.copytree(tiny_model, tmp_path / "model")
    shutil.copytree(tiny_data, tmp_path / "data")
    return tmp_path / "model", tmp_path / "data"


def refuse(what):
    def load(*args, **kwargs):
        raise AssertionError(f"the {what} was loaded")

    return load


def count_calls(monkeypatch, owner, name) -> list:
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_recaptioning_encodes_prompts_and_no_video(own_copy, write_config, caplog, monkeypatch):
    """A new prompt is encoded again, its clip's video is not.

    And the first pass frees the text encoder before the VAE encodes (T5-XXL's 9 GB would sit beside
    the VAE's encoding on one card)."""
    model, data = own_copy
    config = write_config(
        "recaption",
        **{
            "model.path": str(model),
            "data.data_root": str(data),
            "data.cache_dir": str(data.parent / "cache"),
        },
    )
    text_encoders, t5_forward, vae_encode = [], T5EncoderModel.forward, AutoencoderKLCogVideoX.encode

    def remembered(self, *args, **kwargs):
        text_encoders.append(weakref.ref(self))
        return t5_forward(self, *args, **kwargs)

    def after_the_text_encoder(self, *args, **kwargs):
        gc.collect()
        assert text_encoders and all(ref() is None for ref in text_encoders)
        return vae_encode(self, *args, **kwargs)

    monkeypatch.setattr(T5EncoderModel, "forward", remembered)
    monkeypatch.setattr(AutoencoderKLCogVideoX, "encode", after_the_text_encoder)
    assert "24 clips encoded, 0 reused" in cache_pass(caplog, config)
    monkeypatch.undo()
    prompts = (data / "prompts.txt").read_text().splitlines()
    prompts[:3] = ["a red ball rolls left", "a green box moves up", "a small circle drifts right"]
    (data / "prompts.txt").write_text("\n".join(prompts) + "\n")
    monkeypatch.setattr(AutoencoderKLCogVideoX, "from_pretrained", refuse("VAE"))
    encoded = count_calls(monkeypatch, T5EncoderModel, "forward")
    assert "0 clips encoded, 24 reused" in cache_pass(caplog, config)
    assert len(encoded) == 1 and encoded[0][1].shape[0] == 3  # one T5 call, on the 3 new prompts
    assert "cache: 3/3 prompts" in caplog.text


@pytest.mark.slow
def test_per_node_copies_share_the_cache_and_a_finetuned_vae_does_not(
    own_copy, write_config, tmp_path, caplog, monkeypatch
):
    """Per-node copies share the cache; a fine-tuned VAE does not.

    Models and clips are known by content: copies elsewhere (new paths, new mtimes) reuse every
    entry; the manifest keeps each hash and header, so a restart reads only the clips that changed;
    a VAE whose weights changed re-encodes every video and no prompt."""
    model, data = own_copy
    private = {"data.cache_dir": str(tmp_path / "cache")}
    assert "24 clips encoded, 0 reused" in cache_pass(
        caplog, write_config("node0", **{"model.path": str(model), "data.data_root": str(data), **private})
    )
    shutil.copytree(model, tmp_path / "node1-model")
    shutil.copytree(data, tmp_path / "node1-data")
    copies = write_config(
        "node1",
        **{
            "model.path": str(tmp_path / "node1-model"),
            "data.data_root": str(tmp_path / "node1-data"),
            **private,
        },
    )
    with monkeypatch.context() as patched:
        patched.setattr(AutoencoderKLCogVideoX, "from_pretrained", refuse("VAE"))
        patched.setattr(T5EncoderModel, "from_pretrained", refuse("text encoder"))
        probes = count_calls(patched, decode, "probe")
        assert "0 clips encoded, 24 reused" in cache_pass(caplog, copies)
        assert len(probes) == 24  # new paths: each header read once
        probes.clear()
        assert "0 clips encoded, 24 reused" in cache_pass(caplog, copies)
        assert probes == []  # a restart reads no header the manifest holds
    make_synthetic_dataset(str(tmp_path / "other"), num_videos=1, seed=9)
    shutil.copy(tmp_path / "other" / "videos" / "00000.mp4", tmp_path / "node1-data" / "videos" / "00004.mp4")
    with monkeypatch.context() as patched:
        probes = count_calls(patched, decode, "probe")
        assert "1 clips encoded, 23 reused" in cache_pass(caplog, copies)
        assert [str(args[0]) for args in probes] == [str(tmp_path / "node1-data" / "videos" / "00004.mp4")]
    weights = tmp_path / "node1-model" / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors = {k: v * 1.01 if k.endswith("conv_in.conv.weight") else v for k, v in tensors.items()}
    save_file(tensors, weights)
    with monkeypatch.context() as patched:
        patched.setattr(T5EncoderModel, "from_pretrained", refuse("text encoder"))
        assert "24 clips encoded, 0 reused" in cache_pass(caplog, copies)


def metadata_dataset(root, tiny_data, rows: list[dict]) -> None:
    """A metadata.jsonl dataset at root over the session's clips and images (linked, not copied)."""
    root.mkdir()
    for name in ("images", "videos"):
        (root / name).symlink_to(tiny_data / name)
    (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["images", "images and videos"])
def test_images_train_as_one_frame_clips(mix, tiny_data, write_config, tmp_path):
    """Images train as one-frame clips in one-frame buckets.

    Listed images are one-frame samples in one-frame buckets, alone or mixed with videos (each
    global batch one bucket); the held-out loss falls as it does for videos."""
    rows = [
        {"video": f"images/{i:05d}.png", "prompt": p}
        for i, p in enumerate((tiny_data / "prompts.txt").read_text().splitlines())
    ]
    if mix == "images and videos":
        rows = [
            row for i, image in enumerate(rows) for row in (image, {**image, "video": f"videos/{i:05d}.mp4"})
        ]
    metadata_dataset(tmp_path / "data", tiny_data, rows)
    config = write_config(
        "mix",
        **{
            "data.data_root": str(tmp_path / "data"),
            "data.cache_dir": str(tmp_path / "cache"),
            "data.buckets": [[9, 40, 48], [1, 40, 48]],
            "train.steps": 60,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "lora.lora_alpha": 4,
            "checkpoint.checkpointing_steps": 60,
            "validation.validation_steps": 60,
        },
    )
    result = run_ok(["--cfg", str(config)])
    counts = (
        "{'[9, 40, 48]': 0, '[1, 40, 48]': 24}"
        if mix == "images"
        else "{'[9, 40, 48]': 24, '[1, 40, 48]': 24}"
    )
    assert f"clips per bucket {counts}" in result.stderr
    held_out = {m["step"]: m["val/loss"] for m in read_metrics(tmp_path / "mix") if "val/loss" in m}
    assert held_out[60] < 0.9 * held_out[0], held_out


@pytest.mark.slow
def test_a_clip_failing_to_decode_stops_the_pass_at_once(own_copy, write_config, tmp_path, caplog):
    """A clip failing to decode stops the pass at once, naming it; data.skip_bad skips it.

    The header was fine (the manifest holds it), the decode fails: the pass stops in that round,
    naming the clip and keeping what it wrote; with data.skip_bad it is listed in skipped.txt
    instead."""
    model, data = own_copy
    settings = {
        "model.path": str(model),
        "data.data_root": str(data),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.cache_batch_size": 2,
    }
    cache_pass(caplog, write_config("first", **settings))
    clip = data / "videos" / "00002.mp4"
    stat = clip.stat()
    # the same size...
    clip.write_bytes(clip.read_bytes()[: stat.st_size // 2].ljust(stat.st_size, b"\0"))
    # ...and mtime: the manifest trusts its header
    os.utime(clip, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    shutil.rmtree(tmp_path / "cache" / "video")
    stopped = run_cmd(["--cfg", str(write_config("stopped", **settings))], script="cache.py")
    assert stopped.returncode == 1 and f"videos.txt line 3: {clip}: " in stopped.stderr
    assert "1 clip(s) cannot be used" in stopped.stderr
    # stopped in its round, kept
    assert len(list((tmp_path / "cache" / "video").rglob("*.safetensors"))) == 3
    skipping = write_config("skipped", **settings, **{"data.skip_bad": True})
    assert "20 clips encoded, 3 reused, 1 skipped" in cache_pass(caplog, skipping)
    assert (tmp_path / "skipped" / "skipped.txt").read_text().startswith(f"{clip}\t")


# Frame 0 of each clip is its first colour, every later frame its second: a window starting anywhere
# but frame 0 opens on the second colour.
I2V_MODELS = {
    "cogvideox": lambda tiny_models, wan_models: ("cogvideox", tiny_models("1.5-5b-i2v")),
    "wan-2.1-i2v": lambda tiny_models, wan_models: ("wan", wan_models("i2v")),
    "wan-ti2v": lambda tiny_models, wan_models: ("wan", wan_models("ti2v-5b")),
}
COLOUR_PAIRS = [
    ((200, 30, 30), (30, 30, 200)),
    ((30, 200, 30), (200, 200, 30)),
    ((30, 200, 200), (200, 30, 200)),
    ((220, 120, 30), (30, 120, 220)),
]


@pytest.fixture(scope="module")
def colour_switch_data(tmp_path_factory):
    """4 clips of 33 frames, their image (images.txt) their frame 0, except the last one's: its
    second colour."""
    root = tmp_path_factory.mktemp("switch") / "data"
    (root / "videos").mkdir(parents=True)
    (root / "images").mkdir()
    for i, (first, second) in enumerate(COLOUR_PAIRS):
        video = np.empty((33, 40, 48, 3), np.uint8)
        video[0], video[1:] = first, second
        write_clip(root / "videos" / f"{i}.mp4", video, fps=8)
        Image.fromarray(video[0] if i < len(COLOUR_PAIRS) - 1 else video[1]).save(
            root / "images" / f"{i}.png"
        )
    for name, lines in (
        ("prompts.txt", [f"clip {i}" for i in range(4)]),
        ("videos.txt", [f"videos/{i}.mp4" for i in range(4)]),
        ("images.txt", [f"images/{i}.png" for i in range(4)]),
    ):
        (root / name).write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("image_column", ["images.txt", ""])
@pytest.mark.parametrize("family", list(I2V_MODELS))
def test_i2v_condition_is_the_trained_windows_first_frame(
    family, image_column, colour_switch_data, tiny_models, wan_models, write_config, tmp_path, caplog
):
    """An I2V clip's cached condition is the first frame of the window it trains on.

    Every I2V family caches as its condition the first frame of the window it trains on: with
    data.image_column the window starts at frame 0 (the image is that frame), and an image far from
    it is named once; without it the window starts anywhere and the condition is its own first
    frame."""
    model_family, path = I2V_MODELS[family](tiny_models, wan_models)
    config = write_config(
        "i2v",
        **{
            "model.path": str(path),
            "model.family": model_family,
            "model.type": "i2v",
            "data.data_root": str(colour_switch_data),
            "data.image_column": image_column,
            "data.cache_dir": str(tmp_path / "cache"),
            "data.held_out": 0,
        },
    )
    cfg = load_config(str(config))
    with one_rank_group() as d, caplog.at_level(logging.INFO, logger="vidtrain"):
        adapter, entries, items, _ = prepare_run(cfg, d)
    named = [
        r.getMessage() for r in caplog.records if "differs from their video's first frame" in r.getMessage()
    ]
    if image_column:
        assert [item.start for item in items] == [0, 0, 0, 0]
        assert (
            len(named) == 1
            and "1 clip(s)" in named[0]
            and f"line 4: {colour_switch_data / 'images' / '3.png'} (" in named[0]
        ), named
    else:
        assert named == [] and any(item.start > 0 for item in items)
    for item, (first, second) in list(zip(items, COLOUR_PAIRS))[: 3 if image_column else 4]:
        window_first = data.decode_clip(item)[0].float().mean((0, 1))
        expected = min(
            (first, second), key=lambda colour: float((window_first - torch.tensor(colour)).abs().sum())
        )
        solid = torch.tensor([first, second], dtype=torch.uint8)[:, None, None].expand(2, 32, 32, 3)
        noise = [data.keyed_generator(cfg.run.seed, "image_noise", item.content) for _ in range(2)]
        references = adapter.encode_image(solid.contiguous(), noise, 9)
        cached = load_file(entries.path(item, "image"))
        distance = [sum(float((cached[k] - references[k][j]).abs().mean()) for k in cached) for j in range(2)]
        assert distance.index(min(distance)) == (first, second).index(expected), (item.start, distance)


@pytest.mark.slow
def test_two_ranks_print_each_warning_once(tiny_data, write_config, tmp_path):
    """A 2-rank cache pass prints every warning once, from rank 0.

    One every rank logs (a bucket too small), and one only a rank's share sees (its prompts
    truncated: held, and printed by rank 0).
    """
    long = "a red square drifts left across an empty grey field for a long while, far past the tiny text length, clip {}"
    rows = [
        {"video": f"videos/{i:05d}.mp4", "prompt": long.format(i) if i % 2 else f"clip {i}"} for i in range(8)
    ]
    rows.append({"video": "images/00000.png", "prompt": "a still"})  # alone in the 1-frame bucket
    metadata_dataset(tmp_path / "data", tiny_data, rows)
    config = write_config(
        "ranks",
        **{
            "data.data_root": str(tmp_path / "data"),
            "data.cache_dir": str(tmp_path / "cache"),
            "data.buckets": [[9, 32, 32], [1, 32, 32]],
            "data.held_out": 0,
            "train.batch_size": 1,
        },
    )
    stderr = run_ok(["--cfg", str(config)], nproc=2, script="cache.py").stderr
    assert stderr.count("bucket [1, 32, 32] holds 1 clips, fewer than the global batch of 2") == 1, stderr
    for i in (1, 3, 5, 7):  # the odd clips' prompts are rank 1's share of the text pass
        assert (
            stderr.count(f"clip {i}'") == 1 and f"prompt truncated to 16 tokens: '{long.format(i)}'" in stderr
        ), stderr


def test_a_transformer_without_weights_is_named_before_the_pass(tiny_model, write_config, tmp_path):
    """A transformer without its weights stops the cache pass before it encodes anything.

    A model copy whose transformer/ lost its weights stops the cache pass before it encodes anything
    (training would read them only after the whole pass)."""
    bare = shutil.copytree(tiny_model, tmp_path / "bare")
    for weights in (bare / "transformer").glob("*.safetensors"):
        weights.unlink()
    config = write_config("bare", **{"model.path": str(bare), "data.cache_dir": str(tmp_path / "cache")})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ranks.StopRun, match="transformer holds no diffusion_pytorch_model.safetensors"):
            prepare_run(load_config(str(config)), ranks.Dist(0, 1, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


class InFolder(cache.Cache):
    """A cache whose entries are files in `folder` named by their item (a string) and kind."""

    def __init__(self, folder, text_length: int):
        self.dir, self.kinds, self.text_length = folder, ("video", "text"), text_length

    def path(self, item, kind: str) -> str:
        return str(self.dir / f"{item}-{kind}.safetensors")


def test_a_damaged_entry_is_named_by_the_step_that_takes_it(tmp_path):
    """A damaged cache entry is named by the step that takes its batch.

    An entry cut short (a full disk, an interrupted copy) read ahead by the prefetch thread stops
    the step that takes its batch, naming the file and the fix; the thread ends with the failed
    run's prefetch."""
    for item in ("a", "b"):
        save_file(
            {"latent_mean": torch.zeros(2, 4), "latent_logvar": torch.zeros(2, 4)},
            tmp_path / f"{item}-video.safetensors",
        )
        save_file({"prompt_embeds": torch.ones(3, 8)}, tmp_path / f"{item}-text.safetensors")
    damaged = tmp_path / "b-video.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8])
    prefetch = cache.Prefetch(InFolder(tmp_path, 5), torch.device("cpu"))
    assert prefetch.batch(["a"], ["b"])["prompt_embeds"].shape == (1, 5, 8)  # b is read meanwhile
    with pytest.raises(OSError) as raised:
        prefetch.batch(["b"], None)
    assert str(raised.value) == (
        f"cache entry {damaged} cannot be read (Error while deserializing header: incomplete "
        "metadata, file not fully covered): delete it and launch again, the cache pass "
        "encodes it anew"
    )
    threads = [thread for thread in threading.enumerate() if thread.name.startswith("vidtrain-prefetch")]
    assert len(threads) == 1
    # A failed run drops its prefetch; the error's traceback holds it in a cycle, which
    # command.shutdown's gc.collect() frees: the thread ends then.
    del prefetch, raised
    gc.collect()
    for thread in threads:
        thread.join(timeout=30)
    assert not threads[0].is_alive()
