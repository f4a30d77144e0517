"""bench/bench_memory.py: the fake-tensor estimate and the per-rank arithmetic.

The estimate is held against a measured step."""

import dataclasses
import json
import math
import shutil
import sys

import pytest
import torch
from conftest import REPO, write_toml
from diffusers import WanTransformer3DModel
from transformers import Qwen2_5_VLTextModel, T5EncoderModel

sys.path.insert(0, str(REPO / "bench"))
import bench_memory  # noqa: E402
import one_gpu  # noqa: E402
import published  # noqa: E402

import ranks  # noqa: E402
from config import load_config  # noqa: E402
from model import build_model, build_optimizer  # noqa: E402


@pytest.mark.slow
def test_estimate_matches_a_measured_step(tiny_models, tmp_path):
    """The estimate's state, step and peak are within 15% of a measured step.

    sft with EMA and checkpointing on a 512-wide CogVideoX: the estimate's state, step and peak are
    within 15% of what a fresh process measures (resident growth, VmHWM)."""
    model = shutil.copytree(tiny_models("5b"), tmp_path / "model")
    config = json.loads((model / "transformer" / "config.json").read_text())
    config.update(
        num_attention_heads=8,
        attention_head_dim=64,
        text_embed_dim=512,
        time_embed_dim=256,
        max_text_seq_length=64,
    )
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    cfg_file = write_toml(
        tmp_path / "sft.toml",
        {
            "run.output_dir": str(tmp_path / "run"),
            "model.path": str(model),
            "data.data_root": str(tmp_path),
            "data.train_resolution": [17, 96, 160],
            "train.training_type": "sft",
            "train.ema_decay": 0.99,
        },
    )
    cfg = load_config(str(cfg_file))
    family, adapter = bench_memory.make_adapter(cfg, None, tmp_path, bench_memory.torch.device("cpu"))
    ratios = bench_memory.check(cfg, family, adapter, ["--cfg", str(cfg_file)])
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


@pytest.mark.slow
def test_hunyuanvideo15_estimate_follows_the_masks_values(family_models, tmp_path):
    """A step that reads its text masks' values is estimated as it runs.

    HunyuanVideo 1.5's step cuts the texts to the batch's longest prompt (a length read from the
    masks) and diffusers' forward reorders them by their masks (boolean indexing): the bench's real
    masks (HostValues) give those reads their values on fake tensors. On the tiny model widened to 512
    (8 heads x 64), every prompt at its full 1000 + 256 tokens, the estimate's state, step and peak are
    within 15% of what a fresh process measures."""
    model = shutil.copytree(family_models("hunyuanvideo15")("t2v"), tmp_path / "model")
    config = json.loads((model / "transformer" / "config.json").read_text())
    config.update(num_attention_heads=8, attention_head_dim=64, rope_axes_dim=[16, 24, 24])
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    cfg_file = write_toml(
        tmp_path / "lora.toml",
        {
            "run.output_dir": str(tmp_path / "run"),
            "model.path": str(model),
            "model.family": "hunyuanvideo15",
            "data.data_root": str(tmp_path),
            "data.train_resolution": [17, 128, 128],
        },
    )
    cfg = load_config(str(cfg_file))
    family, adapter = bench_memory.make_adapter(cfg, None, tmp_path, bench_memory.torch.device("cpu"))
    ratios = bench_memory.check(cfg, family, adapter, ["--cfg", str(cfg_file)])
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_fit_counts_both_text_encoders(family_models, tmp_path):
    """--fit's cache pass of a family with two text encoders runs the adapter's own encode_text.

    HunyuanVideo 1.5's Qwen2.5-VL and ByT5 (the tiny folder's) on fake tensors: their weights are
    both encoders' as the adapter loads them (bf16), and the pass over one full-length prompt keeps
    Qwen's every hidden state (the pipeline asks for them all and takes the third-last), over the
    template's 108 rows and the 1000 of the prompt."""
    model = family_models("hunyuanvideo15")("t2v")
    settings = {
        "run.output_dir": tmp_path / "run",
        "model.path": model,
        "model.family": "hunyuanvideo15",
        "data.data_root": tmp_path,
        "data.train_resolution": "[17, 64, 64]",
        "data.cache_batch_size": 1,
    }
    cfg = load_config(None, [str(a) for key, value in settings.items() for a in (f"--{key}", value)])
    family, adapter = published.make_adapter(cfg, None, tmp_path, torch.device("cpu"))
    parts = bench_memory.one_gpu_parts(cfg, family, adapter)
    qwen = Qwen2_5_VLTextModel.from_pretrained(model, subfolder="text_encoder", dtype=torch.bfloat16)
    byt5 = T5EncoderModel.from_pretrained(model, subfolder="text_encoder_2", dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for m in (qwen, byt5) for p in m.parameters())
    assert 0 <= parts["text_encoder"] - weights < 0.01 * weights
    hidden = (qwen.config.num_hidden_layers + 1) * (1000 + 108) * qwen.config.hidden_size * 2
    assert parts["text_1"] >= hidden


def test_every_family_publishes_folders_its_adapter_loads(tmp_path):
    """Every registered family names its published checkpoints (Adapter.PUBLISHED), so --arch reaches
    a new family without an edit of bench/; each folder of configs alone builds the family's adapter
    with the published transformer config (a key diffusers' class does not know would be dropped)."""
    from model_adapter import ADAPTERS

    assert sorted({cls.FAMILY for cls in published.families().values()}) == sorted(ADAPTERS)
    args = ["--run.output_dir", str(tmp_path / "run"), "--data.data_root", str(tmp_path)]
    cfg = load_config(None, [*args, "--model.path", str(tmp_path / "none")])
    for arch in published.families():
        cls, config = published.transformer_config(arch)
        # what a config of such a checkpoint sets: VACE's type, one of two experts
        experts = "transformer_2" in published.families()[arch].PUBLISHED[arch]
        kind = "vace" if "vace_layers" in config else "t2v"
        model = dataclasses.replace(cfg.model, type=kind, expert="high_noise" if experts else "")
        arch_cfg = dataclasses.replace(cfg, model=model)
        family, adapter = published.make_adapter(arch_cfg, arch, tmp_path / arch, torch.device("cpu"))
        assert family == published.families()[arch].FAMILY and adapter.TRANSFORMER is cls, arch
        assert {k: adapter.transformer_config[k] for k in config} == config, arch


def test_sharding_and_sequence_parallel(tmp_path):
    """FSDP divides the state by the shards; sequence parallelism halves the video tokens.

    One full-width Wan 2.1 14B block: FSDP divides the state by the shards and adds what is in
    flight; sp 2 halves the video tokens and about halves the activations."""
    cfg_file = write_toml(
        tmp_path / "wan.toml",
        {
            "run.output_dir": str(tmp_path / "run"),
            "model.path": str(tmp_path),
            "data.data_root": str(tmp_path),
            "data.train_resolution": [81, 720, 1280],
            "lora.rank": 16,
        },
    )
    cfg = load_config(str(cfg_file))
    family, adapter = bench_memory.make_adapter(
        cfg, "wan2.1-t2v-14b", tmp_path, bench_memory.torch.device("cpu")
    )
    adapter.transformer_config["num_layers"] = 1
    ddp, ddp_sp2 = (bench_memory.estimate(cfg, family, adapter, sp, world=8) for sp in (1, 2))
    cfg.parallel.strategy = "fsdp"
    fsdp = bench_memory.estimate(cfg, family, adapter, 1, world=8)
    assert (ddp["video_tokens"], ddp["rank_tokens"], ddp_sp2["rank_tokens"]) == (75600, 75600, 37800)
    assert ddp["frozen"] == ddp_sp2["frozen"] and ddp["trainable"] == ddp_sp2["trainable"]
    assert 0.45 < ddp_sp2["activations"] / ddp["activations"] < 0.55
    assert fsdp["frozen"] == ddp["frozen"] / 8 and fsdp["trainable"] == ddp["trainable"] / 8
    assert fsdp["in_flight"] > 3 * ddp["frozen"] / 8 and fsdp["activations"] <= ddp["activations"]


@pytest.fixture(scope="module")
def one_gpu_parts(tmp_path_factory):
    """What bench/one_gpu.py adds up, on fake tensors: 4 of Wan 2.1 14B's published blocks at
    17x480x832, LoRA r32 with validation, and a small VAE and UMT5 (the published ones, 10.6 GiB for
    UMT5-XXL, would hide the training phase below 12 GiB; their figures are in BENCHMARKS.md)."""
    tmp = tmp_path_factory.mktemp("one_gpu")
    overrides = [
        "--data.train_resolution",
        "[17, 480, 832]",
        "--data.cache_batch_size",
        "1",
        "--model.path",
        str(tmp),
    ]
    cfg = load_config(str(REPO / "configs" / "wan-t2v-14b.toml"), overrides)
    published.make_adapter(cfg, "wan2.1-t2v-14b", tmp, bench_memory.torch.device("cpu"))
    small_umt5 = {
        **json.loads((tmp / "text_encoder" / "config.json").read_text()),
        "d_model": 64,
        "d_ff": 128,
        "num_layers": 2,
        "num_heads": 2,
    }
    (tmp / "text_encoder" / "config.json").write_text(json.dumps(small_umt5))
    (tmp / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "base_dim": 8}))
    family, adapter = published.make_adapter(cfg, None, tmp, bench_memory.torch.device("cpu"))
    adapter.transformer_config["num_layers"] = 4
    return bench_memory.one_gpu_parts(cfg, family, adapter)


def test_one_gpu_parts(one_gpu_parts):
    """The one-GPU parts equal arithmetic on the published sizes.

    The parts against arithmetic on the published sizes: a 14B block's frozen bytes in bf16 and with
    its ten linear weights in fp8 (one byte each, an fp32 scale per row); the checkpointed block
    inputs, 4 x 7800 video tokens (5x60x104 latents in 2x2 patches) x 5120 in bf16; what activation
    offload copies: those, and once, the 512 text tokens and the 6 x 5120 timestep projection every
    block shares (the first block call copies them with its tokens); with them on the host the step
    needs less, but no less than the step without them."""
    p, width, ffn = one_gpu_parts, 5120, 13824
    # attention's q, k, v, out (x2); the FFN
    linears, rows = 8 * width * width + 2 * width * ffn, 9 * width + ffn
    assert p["layers"] == 4 and 0 < p["block"] - 2 * linears < 0.01 * p["block"]
    assert p["block_fp8"] == p["block"] - linears + 4 * rows
    tokens, shared = 7800 * width * 2, (512 + 6) * width * 2
    assert p["inputs"] == 4 * tokens and p["block_input"] == tokens + shared
    assert p["offloaded"] == 4 * tokens + shared
    assert p["activations"] - p["inputs"] <= p["offload_activations"] < p["activations"]


def test_fit_is_monotone_and_fastest(one_gpu_parts):
    """--fit picks the fastest setting that fits, and never a slower one on a larger card.

    Cards from 2.5 to 13.5 GiB, with any host RAM and with 1.5 GiB beside the process: each pick
    fits its own estimate (every phase, with the margin; the host RAM), no faster setting does, and
    a larger card never picks a slower one. The picks stream 0, 3 and 4 blocks (the first two
    streamed blocks save nothing: they come back as the two in flight), with activation offload or
    fp8 where they fit first (both, with 1.5 GiB of host RAM, where bf16's pinned blocks do not fit
    it)."""
    order, chosen = one_gpu.settings(one_gpu_parts), set()
    for ram in (None, one_gpu_parts["process"] / one_gpu.GIB + 1.5):
        picks = [(gb, one_gpu.fit(one_gpu_parts, gb, ram)) for gb in [x / 100 for x in range(250, 1351)]]
        ranks = [order.index(s) for _, s in picks if s is not None]
        assert ranks == sorted(ranks, reverse=True)
        for gb, s in picks:
            if s is not None:
                p = one_gpu.with_cache_batch(one_gpu_parts, gb)
                assert max(one_gpu.gpu(p, s).values()) + one_gpu.MARGIN <= gb * one_gpu.GIB
                assert ram is None or one_gpu.host_needed(p, s) <= ram * one_gpu.GIB
                assert not any(one_gpu.fits(p, faster, gb, ram) for faster in order[: order.index(s)])
                chosen.add(s)
    assert {s.streamed for s in chosen} == {0, 3, 4}
    assert {(s.fp8, s.activation_offload) for s in chosen} == {
        (fp8, offload) for fp8 in (False, True) for offload in (False, True)
    }


def test_none_fits_names_why(one_gpu_parts, capsys):
    """When no setting fits, the report says so and why.

    Below what the leanest setting needs, with too little host RAM, and with a text encoder larger
    than the card allows, the report says that none fits and why."""
    leanest = min(max(one_gpu.gpu(one_gpu_parts, s).values()) for s in one_gpu.settings(one_gpu_parts))
    gb = (leanest + one_gpu.MARGIN) / one_gpu.GIB - 0.01
    assert one_gpu.fit(one_gpu_parts, gb) is None and one_gpu.report(one_gpu_parts, gb, "") is None
    assert f"none fits {gb:g} GiB: the setting that needs the least" in capsys.readouterr().out
    assert (
        "in the training: the trainable state and one step's gradients and activations need"
        in one_gpu.why_none(one_gpu_parts, gb)
    )
    ram = one_gpu_parts["process"] / one_gpu.GIB
    assert one_gpu.fit(one_gpu_parts, 12, ram) is None
    assert one_gpu.why_none(one_gpu_parts, 12, ram).startswith(
        f"none fits 12 GiB with {ram:g} GiB of host RAM"
    )
    big_text_encoder = one_gpu_parts | {"text_encoder": 11 * one_gpu.GIB}
    assert one_gpu.fit(big_text_encoder, 12) is None
    assert one_gpu.why_none(big_text_encoder, 12).startswith(
        "none fits 12 GiB: the cache pass needs 11.0 GiB + 2.5 GiB margin whatever the setting: "
        "the text encoder's pass"
    )


def test_fp8_block_bytes_are_what_the_loader_stores(wan_models, tmp_path):
    """The estimate's fp8 block bytes are what the loader stores.

    The estimate's block in fp8 against the tiny Wan as the trainer loads it with
    model.storage_dtype = "fp8" (memory.py's weights and scales, counted on the real tensors), and
    the same in model.dtype."""
    cfg_file = write_toml(
        tmp_path / "fp8.toml",
        {
            "run.output_dir": str(tmp_path / "run"),
            "model.path": str(wan_models("t2v")),
            "model.family": "wan",
            "data.data_root": str(tmp_path),
            "data.train_resolution": [9, 32, 32],
            "model.storage_dtype": "fp8",
        },
    )
    cfg = load_config(str(cfg_file))
    family, adapter = published.make_adapter(cfg, None, tmp_path, bench_memory.torch.device("cpu"))
    parts = bench_memory.estimate(cfg, family, adapter)
    stored = adapter.load_transformer()
    frozen = [
        sum(t.numel() * t.element_size() for t in [*block.parameters(), *block.buffers()])
        for block in adapter.blocks(stored)
    ]
    assert parts["block_fp8"] == max(frozen) < parts["block"]


def test_ltx2_block_and_its_audio(tmp_path):
    """An LTX-2 19B block's bytes, and what its sound adds to the step.

    One published LTX-2 19B block (bench/published.py), configs/ltx2-19b.toml's LoRA r32 at
    121x64x96: its frozen bytes are those of its linear weights in bf16 and little else (video 4096
    wide: self-, text- and feed-forward 4 + 4 + 8 d^2; audio 2048: 16 a^2; the audio-video
    cross-attentions at the audio's width, 4da + 4a^2); with the clip's sound (121 frames at 24 fps:
    126 audio latent frames) each checkpointed block input holds the audio tokens beside the
    video's, 16 x 2 x 3 latents in 1x1 patches, and the step needs more than without (the audio
    stream then runs on one zero token); activation offload copies those and what every block
    shares."""
    cfg = load_config(
        str(REPO / "configs" / "ltx2-19b.toml"),
        ["--data.train_resolution", "[121, 64, 96]", "--data.audio", "true", "--data.target_fps", "24"],
    )
    family, adapter = published.make_adapter(cfg, "ltx2-19b", tmp_path, bench_memory.torch.device("cpu"))
    adapter.transformer_config["num_layers"] = 1
    with_audio = bench_memory.estimate(cfg, family, adapter)
    cfg.data.audio = False
    without = bench_memory.estimate(cfg, family, adapter)
    d, a = 4096, 2048
    linears = 16 * d * d + 16 * a * a + 4 * d * a + 4 * a * a
    assert 0 < with_audio["block"] - 2 * linears < 0.01 * with_audio["block"]
    assert (with_audio["audio_tokens"], with_audio["video_tokens"], without["audio_tokens"]) == (126, 96, 0)
    assert with_audio["inputs"] == (96 * d + 126 * a) * 2 and without["inputs"] == (96 * d + a) * 2
    # What activation offload copies from the first block call: also the 1024 text tokens of each
    # stream and the timestep embeddings every block shares (6 + 4 + 1 rows of each stream's width).
    assert with_audio["block_input"] == with_audio["inputs"] + (1024 + 11) * (d + a) * 2
    assert with_audio["activations"] > without["activations"]


def handed_out(nbytes: int) -> int:
    """The bytes torch 2.13's pinned allocator hands out for a request of nbytes, under the settings
    ranks.ALLOCATOR_SETTINGS gives it (aten/src/ATen/core/CachingHostAllocator.h,
    CachingHostAllocatorImpl::allocate: `size <= pinned_max_round_threshold() && size <=
    pinned_max_cached_size()` rounds to c10::llvm::PowerOf2Ceil(size), else the size itself; both
    keys in MiB, c10/core/AllocatorConfig.h)."""
    limits = [
        int(ranks.ALLOCATOR_SETTINGS[k]) * 2**20
        for k in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
    ]
    return 2 ** math.ceil(math.log2(nbytes)) if all(nbytes <= limit for limit in limits) else nbytes


def test_host_ram_is_what_torch_pins(one_gpu_parts, capsys):
    """--fit's host RAM is what torch pins for streamed blocks and offloaded activations.

    --fit's host RAM for a pick with blocks streamed and activations offloaded: each frozen
    parameter of a published Wan 14B block (diffusers' own, on the meta device) is pinned on its
    own, as FSDP2 pins a streamed unit's parameters (every block streamed: the root's too), in bf16
    and with memory.py's fp8 (each linear weight at one byte, its bf16 row scales a second
    parameter); activation offload pins each block's 7800 video tokens and, once, the 512 text
    tokens and the 6 x 5120 timestep projection. Each request as torch hands it out; the printed
    host RAM is their sum with the process and the parked VAE."""
    _, config = published.transformer_config("wan2.1-t2v-14b")
    width = config["num_attention_heads"] * config["attention_head_dim"]
    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config({**config, "num_layers": 1})
    # bf16 loading keeps these in fp32 (diffusers)
    fp32 = set(WanTransformer3DModel._keep_in_fp32_modules)
    sizes = {id(p): 4 if set(name.split(".")) & fp32 else 2 for name, p in transformer.named_parameters()}
    block = transformer.blocks[0]
    linears = {id(m.weight) for m in block.modules() if isinstance(m, torch.nn.Linear)}
    bf16 = sum(handed_out(p.numel() * sizes[id(p)]) for p in block.parameters())
    fp8 = sum(
        handed_out(p.numel()) + handed_out(2 * p.shape[0])
        if id(p) in linears
        else handed_out(p.numel() * sizes[id(p)])
        for p in block.parameters()
    )
    root = sum(
        handed_out(p.numel() * sizes[id(p)])
        for name, p in transformer.named_parameters()
        if not name.startswith("blocks.")
    )
    activations = 4 * handed_out(7800 * width * 2) + handed_out(512 * width * 2) + handed_out(6 * width * 2)
    assert one_gpu_parts["block_pinned"] == bf16 and one_gpu_parts["block_fp8_pinned"] == fp8
    for s in (one_gpu.Setting(False, True, 3), one_gpu.Setting(True, True, 3)):
        host = one_gpu.host(one_gpu_parts, s)
        assert host["pinned weights"] == 3 * (fp8 if s.fp8 else bf16)
        assert host["offloaded activations"] == activations
    assert one_gpu.host(one_gpu_parts, one_gpu.Setting(False, False, 4))["pinned weights"] == 4 * bf16 + root
    setting = one_gpu.Setting(False, True, 3)  # with too little host RAM to stream all 4 blocks
    card = (max(one_gpu.gpu(one_gpu_parts, setting).values()) + one_gpu.MARGIN) / one_gpu.GIB
    ram = one_gpu.host_needed(one_gpu_parts, setting) / one_gpu.GIB
    assert one_gpu.report(one_gpu_parts, card, "", ram) == setting
    total = 3 * bf16 + activations + one_gpu_parts["process"] + one_gpu_parts["vae"]
    out = capsys.readouterr().out
    assert (
        f"host RAM: pinned weights {3 * bf16 / one_gpu.GIB:.1f}, offloaded activations "
        f"{activations / one_gpu.GIB:.1f}"
        in out
        and f"= {total / one_gpu.GIB:.1f} GiB in training" in out
    )
    assert ",".join(f"{k}:{v}" for k, v in ranks.ALLOCATOR_SETTINGS.items()) in out


def test_activation_offload_pins_what_the_estimate_counts(wan_models, tmp_path):
    """Activation offload on real tensors pins what the fake-tensor estimate counts.

    The tiny Wan trained two steps with train.activation_offload on real tensors: HostActivations
    copies each block's tokens and, once, what every block shares (the text tokens, the timestep
    projection), into buffers it makes in the first step and reuses in the second; those are the
    copies the fake-tensor estimate counts, and the trained weights are those of the run without
    offload."""
    cfg_file = write_toml(
        tmp_path / "offload.toml",
        {
            "run.output_dir": str(tmp_path / "run"),
            "model.path": str(wan_models("t2v")),
            "model.family": "wan",
            "data.data_root": str(tmp_path),
            "data.train_resolution": [9, 32, 32],
            "model.dtype": "fp32",
            "train.mixed_precision": "no",
            "train.activation_offload": True,
        },
    )
    cfg = load_config(str(cfg_file))
    family, adapter = published.make_adapter(cfg, None, tmp_path, torch.device("cpu"))
    parts = bench_memory.estimate(cfg, family, adapter)
    d, s = ranks.Dist(0, 1, 0, torch.device("cpu")), bench_memory.shapes(cfg, adapter, 1)
    trained, pinned = {}, []
    for offload in (True, False):
        train = dataclasses.replace(cfg.train, activation_offload=offload)
        model = build_model(adapter, train, cfg.lora, cfg.parallel, cfg.run.seed, d)
        params, optimizer = build_optimizer(model, train)
        torch.manual_seed(0)  # the batches' draws
        for _ in range(2):
            bench_memory.train_step(cfg, adapter, model, params, optimizer, None, s, d.device)
            if offload:
                pinned.append(list(model._gradient_checkpointing_func.__self__.pinned))
        trained[offload] = [p.detach().clone() for p in params]
    layers = adapter.transformer_config["num_layers"]
    assert pinned[0] == pinned[1] and len(pinned[0]) == layers + 2  # nothing new in the second step
    assert sorted(pinned[0]) == sorted(parts["copies"]) and sum(pinned[0]) == parts["offloaded"]
    assert all(torch.equal(a, b) for a, b in zip(trained[True], trained[False]))


def test_ic_lora_counts_the_reference_tokens(tmp_path):
    """configs/ltx2-ic-lora.toml at 121x64x96 on one published block: the control clip's tokens
    double the video sequence every checkpointed block input holds, and the step's activations grow
    with them."""
    overrides = ["--data.train_resolution", "[121, 64, 96]"]
    cfg = load_config(str(REPO / "configs" / "ltx2-ic-lora.toml"), overrides)
    family, adapter = published.make_adapter(cfg, "ltx2-19b", tmp_path, bench_memory.torch.device("cpu"))
    adapter.transformer_config["num_layers"] = 1
    ic = bench_memory.estimate(cfg, family, adapter)
    adapter.takes_control = False
    plain = bench_memory.estimate(cfg, family, adapter)
    d, a = 4096, 2048
    assert (ic["video_tokens"], plain["video_tokens"]) == (192, 96)
    assert ic["inputs"] == (192 * d + a) * 2 and plain["inputs"] == (96 * d + a) * 2
    assert ic["activations"] > plain["activations"]
    # model.reference_downscale_factor = 2: the control's latents at half the height and width, a
    # quarter of the clip's tokens beside them (16 x 2 x 3 latents: 96 + 16), in the step too
    adapter.takes_control, adapter.reference_downscale = True, 2
    small = bench_memory.estimate(cfg, family, adapter)
    assert small["video_tokens"] == 96 + 16 and small["inputs"] == (112 * d + a) * 2
    assert plain["activations"] < small["activations"] < ic["activations"]
    # 121 x 128 x 192 (16 x 4 x 6 latents) with sp 2: each rank's half of the width, its control's
    # half of that
    big = load_config(
        str(REPO / "configs" / "ltx2-ic-lora.toml"), ["--data.train_resolution", "[121, 128, 192]"]
    )
    s = bench_memory.shapes(big, adapter, 2)
    assert s["control"] == (1, 128, 16, 2, 1)
    assert (s["video_tokens"], s["rank_tokens"]) == (384 + 96, 192 + 32)


def test_vace_counts_its_context_blocks(wan_models, tmp_path):
    """Wan VACE: the estimate builds the VACE transformer (its frozen weights are all the loaded
    model's, the context blocks and their patch embedding included) and runs its step with the
    context, which the VACE blocks make larger than the same base's without them."""
    settings = {
        "run.output_dir": str(tmp_path / "run"),
        "model.path": str(wan_models("vace")),
        "model.family": "wan",
        "model.type": "vace",
        "model.dtype": "fp32",
        "train.mixed_precision": "no",
        "data.data_root": str(tmp_path),
        "data.train_resolution": [9, 32, 32],
    }
    cfg = load_config(str(write_toml(tmp_path / "vace.toml", settings)))
    family, adapter = published.make_adapter(cfg, None, tmp_path, bench_memory.torch.device("cpu"))
    parts = bench_memory.estimate(cfg, family, adapter)
    stored = adapter.load_transformer()
    assert any(name.startswith("vace_blocks.") for name, _ in stored.named_parameters())
    tensors = [*stored.parameters(), *stored.buffers()]
    assert parts["frozen"] == sum(t.numel() * t.element_size() for t in tensors)
    without = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, type="t2v"))
    base = {**adapter.transformer_config}
    # the same base blocks, no context
    adapter.vace, adapter.TRANSFORMER = False, WanTransformer3DModel
    adapter.transformer_config = {k: v for k, v in base.items() if not k.startswith("vace_")}
    plain = bench_memory.estimate(without, family, adapter)
    assert plain["frozen"] < parts["frozen"] and plain["activations"] < parts["activations"]


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "muon", "prodigy", "adamw8bit"])
def test_the_estimate_counts_each_optimizers_state_as_it_holds_it(optimizer, monkeypatch):
    """bench_memory's count of train.optimizer's state equals what the optimizer holds after a step
    (memory.local_state_bytes: torchao's 8-bit moments by their codes and scales). AdamW8bit's step
    runs eagerly: inductor's compile takes a minute on these CPUs, for the same state."""
    import memory
    from config import TrainConfig

    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)

    torch.manual_seed(0)
    # a matrix torchao keeps in 8 bits (64 x 128), one it does not (8 x 4), a vector, a 5-D conv
    net = torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 1), torch.nn.Flatten(), torch.nn.Linear(4, 8), torch.nn.Linear(8, 8 * 16)
    )
    net.append(torch.nn.Linear(128, 64, bias=False))
    t = TrainConfig(optimizer=optimizer, learning_rate=1.0 if optimizer == "prodigy" else 1e-3)
    params, optimizers = build_optimizer(net, t)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizers.step(torch.tensor(False))
    held = memory.local_state_bytes(net, optimizers) - sum(p.numel() * p.element_size() for p in params)
    step_counters = sum(
        v.numel() * v.element_size()
        for s in optimizers.state.values()
        for k, v in s.items()
        if k == "step" and isinstance(v, torch.Tensor)
    )
    assert bench_memory.optimizer_state_bytes(params, t) == held - step_counters
