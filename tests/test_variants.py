"""Every published CogVideoX checkpoint: 2b, 5b, 5b-I2V, 1.5-5b, 1.5-5b-I2V.

The tiny models carry the published config key sets; each variant trains, samples exactly as its
diffusers pipeline does (with and without our exported LoRA), and exports what diffusers loads."""

import contextlib
import dataclasses
import json
import re
import shutil

import pytest
import torch
from conftest import (
    assert_loads_lean,
    comfyui_linears,
    lora_and_sft_runs,
    one_rank_group,
    read_metrics,
    run_cmd,
    run_ok,
    train_losses,
    write_toml,
)
from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline, CogVideoXTransformer3DModel
from PIL import Image
from safetensors.torch import load_file, save_file

import cache
import ckpt
import data
import lora
import render
import validate
from config import ConfigError, ModelConfig, ValidationConfig, load_config
from model import build_model
from model_adapter import load_adapter

COMMON = {
    "activation_fn",
    "attention_bias",
    "attention_head_dim",
    "dropout",
    "flip_sin_to_cos",
    "freq_shift",
    "in_channels",
    "max_text_seq_length",
    "norm_elementwise_affine",
    "norm_eps",
    "num_attention_heads",
    "num_layers",
    "out_channels",
    "patch_size",
    "sample_frames",
    "sample_height",
    "sample_width",
    "spatial_interpolation_scale",
    "temporal_compression_ratio",
    "temporal_interpolation_scale",
    "text_embed_dim",
    "time_embed_dim",
    "timestep_activation_fn",
}
ROTARY, LEARNED = "use_rotary_positional_embeddings", "use_learned_positional_embeddings"
# The published transformer/config.json key sets (docs/models/cogvideox.md, "Published configs").
PUBLISHED = {
    "2b": COMMON,
    "5b": COMMON | {ROTARY},
    "5b-i2v": COMMON | {ROTARY, LEARNED},
    "1.5-5b": COMMON | {ROTARY, LEARNED, "patch_bias", "patch_size_t"},
    "1.5-5b-i2v": COMMON | {ROTARY, LEARNED, "patch_bias", "patch_size_t", "ofs_embed_dim"},
}
PROMPTS = ["a red circle moves right", "a blue square moves up"]


def model_type(variant: str) -> str:
    return "i2v" if variant.endswith("i2v") else "t2v"


def test_tiny_models_carry_the_published_key_sets(tiny_models):
    for variant, keys in PUBLISHED.items():
        path = tiny_models(variant)
        saved = json.loads((path / "transformer" / "config.json").read_text())
        assert set(saved) - {"_class_name", "_diffusers_version"} == keys, variant
        vae = json.loads((path / "vae" / "config.json").read_text())
        assert ("invert_scale_latents" in vae) == variant.startswith("1.5"), variant


@pytest.fixture(scope="module")
def images(tiny_data):
    """The validation images: the first frames of two clips (PNG files, as a user gives them)."""
    return [str(tiny_data / "images" / f"0000{i}.png") for i in range(len(PROMPTS))]


def variant_settings(variant, tiny_models, base_settings, images, output_dir, **extra) -> dict:
    settings = {
        **base_settings,
        "run.output_dir": str(output_dir),
        "model.path": str(tiny_models(variant)),
        "model.type": model_type(variant),
        "train.steps": 2,
        "train.learning_rate": 1e-2,
        "train.lr_warmup_steps": 1,
        "validation.do_validation": False,
        "validation.prompts": PROMPTS,
        "validation.num_inference_steps": 6,
        **extra,
    }
    if model_type(variant) == "i2v":
        settings["validation.images"] = images
    return settings


def pipeline_run(variant, path, cfg: ValidationConfig, adapter, images, lora_file=None):
    """The diffusers pipeline's float frames [F, H, W, 3] per prompt, and the transformer's first
    input."""
    pipeline_cls = CogVideoXImageToVideoPipeline if model_type(variant) == "i2v" else CogVideoXPipeline
    pipe = pipeline_cls.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = adapter.sampler(cfg.scheduler)
    if lora_file:
        pipe.load_lora_weights(str(lora_file))
    inputs = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: inputs.append(kw["hidden_states"]), with_kwargs=True
    )
    frames = []
    for i, prompt in enumerate(cfg.prompts):
        extra = {"image": Image.open(images[i]).convert("RGB")} if model_type(variant) == "i2v" else {}
        frames.append(
            pipe(
                prompt=prompt,
                num_frames=9,
                height=32,
                width=32,
                num_inference_steps=cfg.num_inference_steps,
                guidance_scale=cfg.guidance_scale,
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                max_sequence_length=adapter.text_length,
                **extra,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
        )
    return frames, inputs[0]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PUBLISHED))
def test_variant_trains_exports_and_samples_as_its_pipeline(
    variant, tiny_models, base_settings, images, tmp_path
):
    """Every variant trains, exports, and samples as its pipeline does.

    Two LoRA steps and two sft steps; our loop's frames equal the pipeline's within 1e-4 in fp32,
    with the base model and with our exported LoRA loaded by load_lora_weights (so at the trained
    scale); for I2V the transformer's first input equals the pipeline's (channel order, scale,
    padding); the sft export loads with from_pretrained and computes what the checkpoint's weights
    compute."""
    lora_file, cfg, adapter = lora_and_sft_runs(
        variant_settings(variant, tiny_models, base_settings, images, tmp_path / "lora"), tmp_path
    )
    with one_rank_group() as d:
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        first_inputs = {}
        base_frames = None  # the base model's frames, from the first pass
        for source in (None, lora_file):
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None)
            ours, seen = [], []
            hook = model.register_forward_pre_hook(
                lambda m, a, kw: seen.append(kw["hidden_states"]), with_kwargs=True
            )
            with adapter.sampling_attention(model):
                ours = [
                    renderer.frames(model, i, adapter.sampler("dpm"), contextlib.nullcontext())
                    for i in range(len(PROMPTS))
                ]
            hook.remove()
            theirs, their_input = pipeline_run(
                variant, tiny_models(variant), cfg.validation, adapter, images, source
            )
            for a, b in zip(ours, theirs):
                assert a.shape == b.shape == (9, 32, 32, 3)
                assert (a - b).abs().max() <= 1e-4, (variant, source)
            first_inputs[source] = (seen[0], their_input)
            if source is not None:
                # the LoRA shows
                assert max((a - b).abs().max() for a, b in zip(ours, base_frames)) > 1e-3
            base_frames = ours
        ours_input, their_input = first_inputs[None]
        assert torch.equal(ours_input, their_input.to(ours_input.dtype))
        # channels: noisy latents, then the image latent at frame 0, zeros after
        if model_type(variant) == "i2v":
            channels = ours_input.shape[2] // 2
            assert ours_input[:, 0, channels:].abs().sum() > 0 and not ours_input[:, 1:, channels:].any()

        # The ComfyUI file holds the same LoRA: read back through lora.init_from and as the render's
        # --lora.
        comfy_file = next((lora_file.parent / "comfy").glob("*.safetensors"))
        assert_comfyui_layout(comfy_file)
        trained, _ = lora.load_lora(str(lora_file))
        init_from = dataclasses.replace(cfg.lora, init_from=str(comfy_file))
        for model in (
            build_model(adapter, cfg.train, init_from, cfg.parallel, 0, d),
            render.load_model(cfg, adapter, d, None, str(comfy_file)),
        ):
            weights = lora.lora_state_dict(model)
            assert weights.keys() == trained.keys() and all(
                torch.equal(weights[k], trained[k]) for k in trained
            )

        sft_cfg = load_config(str(tmp_path / "sft.toml"))
        ours = render.load_model(sft_cfg, adapter, d, str(tmp_path / "sft" / "checkpoint-2"), None).eval()
    exported = CogVideoXTransformer3DModel.from_pretrained(tmp_path / "sft" / "transformer").eval()
    config = adapter.transformer_config
    # 5b-I2V's learned positions: exactly 3 latent frames
    frames = 4 if config["patch_size_t"] else 3
    gen = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, frames, config["in_channels"], 8, 8, generator=gen)
    embeds = torch.randn(2, adapter.text_length, 32, generator=gen)
    rotary = adapter.rotary_embeddings(frames, 8, 8)
    with torch.no_grad():
        expected = adapter.predict_v(ours, x_t, torch.tensor([10, 900]), embeds, rotary)
        torch.testing.assert_close(
            adapter.predict_v(exported, x_t, torch.tensor([10, 900]), embeds, rotary),
            expected,
            rtol=0,
            atol=1e-5,
        )


def assert_comfyui_layout(path) -> None:
    keys = load_file(path).keys()
    pattern = re.compile(r"diffusion_model\.(.+)\.(lora_A\.weight|lora_B\.weight|alpha)")
    modules = {pattern.fullmatch(k).group(1) for k in keys}
    block_names = {m.split(".", 2)[2] for m in modules if m.startswith("blocks.")}
    assert modules and block_names <= {
        "norm1.linear",
        "q",
        "k",
        "v",
        "attn_out",
        "norm2.linear",
        "ff_proj",
        "ff_out",
    }
    assert len(keys) == 3 * len(modules)


@pytest.mark.parametrize("variant", ["2b", "1.5-5b-i2v"])
def test_comfy_export_names_every_linear_as_comfyui_does(variant, tiny_models, tmp_path):
    """The ComfyUI export names every linear as ComfyUI does, and reads back.

    A LoRA on every nn.Linear of the transformer (what lora.target_modules may name) exports to
    ComfyUI's module names and shapes, and reads back to the same weights."""
    adapter = load_adapter(
        ModelConfig(path=str(tiny_models(variant)), type=model_type(variant)), torch.device("cpu")
    )
    with torch.device("meta"):
        transformer = CogVideoXTransformer3DModel.from_config(adapter.transformer_config)
    names = lora.inject_lora(
        transformer,
        [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)],
        2,
        3.0,
        0.0,
        0,
        torch.device("cpu"),
    )
    weights = {k: torch.randn(v.shape) for k, v in lora.lora_state_dict(transformer).items()}
    shapes = {
        adapter.comfy_key(n): (weights[f"{n}.lora_A.weight"].shape[1], weights[f"{n}.lora_B.weight"].shape[0])
        for n in names
    }
    assert shapes == comfyui_linears(adapter.transformer_config)
    ckpt._export_comfy(weights, 3.0, adapter, tmp_path / "lora", "run")
    assert_comfyui_layout(tmp_path / "lora" / "comfy" / "run.safetensors")
    read, info = lora.load_lora(str(tmp_path / "lora" / "comfy" / "run.safetensors"), adapter.diffusers_key)
    assert read.keys() == weights.keys() and all(torch.equal(read[k], weights[k]) for k in weights)
    assert (info["rank"], info["alpha"]) == (2, 3.0)


@pytest.mark.slow
def test_i2v_15_full_lifecycle(tiny_models, base_settings, images, tmp_path):
    """CogVideoX1.5-5B-I2V's whole lifecycle on 2 FSDP ranks.

    CogVideoX1.5-5B-I2V's key set on 2 FSDP ranks with validation (images): SIGKILL after step 6,
    the next launch resumes from step 4 and ends bitwise equal to the run that was never stopped,
    clips included; the exported LoRA loads in CogVideoXImageToVideoPipeline and computes what ours
    does."""
    lifecycle = {
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 8,
        "checkpoint.checkpointing_steps": 4,
        "validation.do_validation": True,
        "validation.validation_steps": 4,
        "validation.num_inference_steps": 4,
        "validation.save_frames": True,
        "validation.prompts": PROMPTS[:1],
        "validation.images": images[:1],
    }
    configs = {}
    for name in ("reference", "killed"):
        settings = variant_settings(
            "1.5-5b-i2v", tiny_models, base_settings, images, tmp_path / name, **lifecycle
        )
        configs[name] = write_toml(tmp_path / f"{name}.toml", {**settings, "validation.images": images[:1]})
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    assert (
        run_cmd(["--cfg", str(configs["killed"])], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:6"}).returncode
        != 0
    )
    resumed = run_ok(["--cfg", str(configs["killed"])], nproc=2)
    assert f"resumed from step 4 ({tmp_path / 'killed' / 'checkpoint-4'})" in resumed.stderr
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "reference")
    lora_file = "lora/pytorch_lora_weights.safetensors"
    ours, theirs = load_file(tmp_path / "killed" / lora_file), load_file(tmp_path / "reference" / lora_file)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    clip = "validation_res/step_8_prompt_0.safetensors"
    assert torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"], load_file(tmp_path / "reference" / clip)["frames"]
    )
    assert [m["step"] for m in read_metrics(tmp_path / "killed") if "val/loss" in m] == [0, 4, 8]

    cfg = load_config(str(configs["reference"]))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    pipe = CogVideoXImageToVideoPipeline.from_pretrained(str(tiny_models("1.5-5b-i2v")))
    pipe.load_lora_weights(str(tmp_path / "reference" / lora_file))
    with one_rank_group() as d:
        model = render.load_model(cfg, adapter, d, None, str(tmp_path / "reference" / lora_file)).eval()
    gen = torch.Generator().manual_seed(0)
    x_t, embeds = (
        torch.randn(2, 4, 8, 8, 8, generator=gen),
        torch.randn(2, adapter.text_length, 32, generator=gen),
    )
    rotary = adapter.rotary_embeddings(4, 8, 8)
    with torch.no_grad():
        expected = adapter.predict_v(model, x_t, torch.tensor([10, 900]), embeds, rotary)
        theirs = adapter.predict_v(pipe.transformer, x_t, torch.tensor([10, 900]), embeds, rotary)
        pipe.unload_lora_weights()
        plain = adapter.predict_v(pipe.transformer, x_t, torch.tensor([10, 900]), embeds, rotary)
    torch.testing.assert_close(theirs, expected, rtol=0, atol=1e-5)
    assert (plain - expected).abs().max() > 1e-4  # the LoRA shows


@pytest.mark.slow
def test_i2v_images_follow_the_bad_input_rules_and_are_encoded_once(
    tiny_models, tiny_data, write_config, tmp_path, caplog
):
    data_root = tmp_path / "data"
    shutil.copytree(tiny_data, data_root)
    images = (data_root / "images.txt").read_text().splitlines()
    images[2], images[4] = "images/missing.png", "images/not-an-image.png"
    (data_root / "images" / "not-an-image.png").write_text("a text file\n")
    (data_root / "images.txt").write_text("\n".join(images) + "\n")
    settings = {
        "model.path": str(tiny_models("5b-i2v")),
        "model.type": "i2v",
        "data.data_root": str(data_root),
        "data.image_column": "images.txt",
        "data.cache_dir": str(tmp_path / "cache"),
    }
    stopped = run_cmd(["--cfg", str(write_config("bad", **settings))], script="cache.py")
    assert stopped.returncode == 1
    assert (
        f"videos.txt line 3: {data_root / 'videos/00002.mp4'}: image {data_root / images[2]}: does not exist"
        in stopped.stderr
    )
    assert "2 clip(s) cannot be used" in stopped.stderr and not list(
        (tmp_path / "cache").rglob("*.safetensors")
    )
    config = write_config("skip", **settings, **{"data.skip_bad": True})
    caplog.set_level("INFO", logger="vidtrain")
    cache.main(["--cfg", str(config)])
    assert "22 clips encoded, 0 reused, 2 skipped" in caplog.text
    skipped = (tmp_path / "skip" / "skipped.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in skipped] == [
        str(data_root / f"videos/0000{i}.mp4") for i in (2, 4)
    ]
    video = load_file(next((tmp_path / "cache" / "video").rglob("*.safetensors")))
    image = load_file(next((tmp_path / "cache" / "image").rglob("*.safetensors")))
    assert image["image_mean"].shape == (4, 1, 8, 8) and video["latent_mean"].shape == (4, 3, 8, 8)
    assert len(list((tmp_path / "cache" / "image").rglob("*.safetensors"))) == 22
    caplog.clear()
    cache.main(["--cfg", str(config)])
    assert "0 clips encoded, 22 reused, 2 skipped" in caplog.text


def test_shapes_each_variant_refuses_before_compute(tiny_models):
    learned = load_adapter(
        ModelConfig(path=str(tiny_models("5b-i2v")), dtype="fp32", type="i2v"), torch.device("cpu")
    )
    learned.check_resolution([9, 32, 32], "data.train_resolution")
    # diffusers would refuse the size, but swap embeddings for the frames
    for shape in ([17, 32, 32], [9, 32, 48]):
        with pytest.raises(
            ConfigError, match=r"learned positional embeddings .* sized for \[9, 32, 32\] only"
        ):
            data.resolutions(data.DataConfig(buckets=[[9, 32, 32], shape]), learned.check_resolution)
    capped = load_adapter(ModelConfig(path=str(tiny_models("1.5-5b")), dtype="fp32"), torch.device("cpu"))
    capped.check_resolution([17, 48, 48], "validation.resolution")
    with pytest.raises(ConfigError, match="1.5's rotary grid covers at most 48x48"):
        capped.check_resolution([9, 64, 32], "validation.resolution")
    with pytest.raises(ConfigError, match='model.type = "t2v", but .* is an image-to-video model'):
        load_adapter(ModelConfig(path=str(tiny_models("5b-i2v")), dtype="fp32"), torch.device("cpu"))


@pytest.mark.parametrize("variant", PUBLISHED)
def test_loading_builds_on_meta_and_equals_from_pretrained(variant, tiny_models, monkeypatch):
    adapter = load_adapter(
        ModelConfig(path=str(tiny_models(variant)), dtype="bf16", type=model_type(variant)),
        torch.device("cpu"),
    )
    assert_loads_lean(adapter, monkeypatch)


def test_loading_reads_sharded_files_and_names_the_folder_on_a_mismatch(tiny_models, monkeypatch, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(tiny_models("2b"), path)
    CogVideoXTransformer3DModel.from_pretrained(path, subfolder="transformer").save_pretrained(
        path / "transformer", max_shard_size="100KB"
    )
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    adapter = load_adapter(ModelConfig(path=str(path), dtype="fp32"), torch.device("cpu"))
    assert_loads_lean(adapter, monkeypatch)
    weights = load_file(tiny_models("2b") / "transformer" / "diffusion_pytorch_model.safetensors")
    shutil.rmtree(path / "transformer")
    shutil.copytree(tiny_models("2b") / "transformer", path / "transformer")
    file = path / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file(
        {**{k: v for k, v in weights.items() if k != "proj_out.bias"}, "extra.weight": torch.zeros(1)}, file
    )
    with pytest.raises(
        ConfigError,
        match=rf"{path / 'transformer'}: .* 1 missing .*proj_out.bias.* 1 unexpected "
        r".*extra.weight",
    ):
        adapter.load_transformer()
    save_file({**weights, "proj_out.bias": torch.zeros(3)}, file)
    with pytest.raises(ConfigError, match=r"1 weights have another shape .* proj_out.bias"):
        adapter.load_transformer()


def test_tiled_vae_decode_equals_the_pipelines(tiny_models, tmp_path):
    """Our tiled VAE decode equals the pipeline's.

    A VAE whose tiles (24x20 pixels: the real models' stride rule) are smaller than the 48x64 clip:
    our decode tiles as the pipeline with enable_tiling() does, and tiling changes the frames."""
    path = tmp_path / "tiled"
    shutil.copytree(tiny_models("5b"), path)
    vae_config = json.loads((path / "vae" / "config.json").read_text())
    (path / "vae" / "config.json").write_text(
        json.dumps({**vae_config, "sample_height": 48, "sample_width": 40})
    )
    adapter = load_adapter(ModelConfig(path=str(path), dtype="fp32"), torch.device("cpu"))
    latents = torch.randn(1, 3, 4, 12, 16, generator=torch.Generator().manual_seed(0))
    tiled = adapter.decode_latents(latents)
    pipe = CogVideoXPipeline.from_pretrained(str(path))
    pipe.vae.enable_tiling()
    assert pipe.vae.tile_sample_min_height == 24 and pipe.vae.tile_sample_min_width == 20
    torch.testing.assert_close(tiled, pipe.decode_latents(latents), rtol=0, atol=1e-5)
    pipe.vae.disable_tiling()
    assert (tiled - pipe.decode_latents(latents)).abs().max() > 1e-3
