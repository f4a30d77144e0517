"""Wan 2.1 and 2.2: key sets, training, sampling as the pipelines, exports diffusers loads.

The tiny models carry the published key sets; every variant trains, samples exactly as WanPipeline /
WanImageToVideoPipeline do (with and without our exported LoRA, switching experts at the boundary;
FLF2V with last_image), and exports what diffusers loads, in diffusers' layout and in ComfyUI's."""

import contextlib
import io
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from conftest import (
    assert_loads_lean,
    one_rank_group,
    picked_frames,
    prepare_run,
    ramp_clip,
    read_metrics,
    run_cmd,
    run_ok,
    train_losses,
    write_toml,
)
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from PIL import Image
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import data
import decode
import lora
import render
import trainer
import validate
from config import ConfigError, DataConfig, ModelConfig, load_config
from model_adapter import RunSettings, load_adapter
from ranks import StopRun

WAN21 = {
    "added_kv_proj_dim",
    "attention_head_dim",
    "cross_attn_norm",
    "eps",
    "ffn_dim",
    "freq_dim",
    "image_dim",
    "in_channels",
    "num_attention_heads",
    "num_layers",
    "out_channels",
    "patch_size",
    "qk_norm",
    "rope_max_seq_len",
    "text_dim",
}
# variant: (model.type, model.expert, published transformer key set, pipeline)
VARIANTS = {
    "t2v": ("t2v", "", WAN21, WanPipeline),
    "i2v": ("i2v", "", WAN21, WanImageToVideoPipeline),
    "flf2v": ("i2v", "", WAN21 | {"pos_embed_seq_len"}, WanImageToVideoPipeline),
    "ti2v-5b": ("i2v", "", WAN21 | {"pos_embed_seq_len"}, WanImageToVideoPipeline),
    "a14b-t2v": ("t2v", "low_noise", WAN21 | {"pos_embed_seq_len"}, WanPipeline),
    "a14b-i2v": ("i2v", "low_noise", WAN21 | {"pos_embed_seq_len"}, WanImageToVideoPipeline),
}
PROMPTS = ["a red circle moves right", "a blue square moves up"]


def test_a_folder_of_another_family_is_named(wan_models, tiny_models):
    """A Wan folder under model.family = "cogvideox", and the reverse, is named from its
    model_index.json with the family to set; model.family = "" (the default) takes the folder's."""
    with pytest.raises(
        ConfigError,
        match=r"holds a WanPipeline \(its model_index.json\), not a model of "
        r'model.family = "cogvideox": set model.family = "wan"',
    ):
        load_adapter(ModelConfig(path=str(wan_models("t2v")), family="cogvideox"), torch.device("cpu"))
    assert load_adapter(ModelConfig(path=str(wan_models("t2v"))), torch.device("cpu")).FAMILY == "wan"
    with pytest.raises(ConfigError, match=r'holds a CogVideoXPipeline .*: set model.family = "cogvideox"'):
        load_adapter(ModelConfig(path=str(tiny_models("2b")), family="wan"), torch.device("cpu"))


def test_a_resolution_past_the_rotary_table_names_the_key(wan_models):
    """More latent positions on an axis than WanRotaryPosEmbed's table holds (rope_max_seq_len) is
    refused naming the key, before any clip; diffusers' forward fails there on a shape."""
    adapter = load_adapter(ModelConfig(path=str(wan_models("t2v"))), torch.device("cpu"))
    limit = adapter.transformer_config["rope_max_seq_len"]
    adapter.check_resolution([9, 32, 16 * limit], "data.train_resolution")
    with pytest.raises(ConfigError) as refused:
        adapter.check_resolution([9, 32, 16 * limit + 16], "data.buckets[1]")
    assert str(refused.value) == (
        f"data.buckets[1] width = {16 * limit + 16} gives {limit + 1} latent positions, more than the "
        f"transformer's rotary table holds (rope_max_seq_len = {limit}): use at most {16 * limit}"
    )
    transformer = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    with pytest.raises(RuntimeError):  # what the check spares: the rotary table's shape error
        transformer.rope(torch.zeros(1, 16, 1, 4, 2 * limit + 2))


def test_train_flow_shift_reaches_the_training_timesteps(wan_models):
    """train.flow_shift arrives through the adapter's constructor (RunSettings) and shifts
    training's draws as diffusers' FlowMatchEulerDiscreteScheduler shifts its sigmas, shift s / (1 +
    (shift - 1) s); 0 keeps the folder's scheduler's shift."""
    folder = ModelConfig(path=str(wan_models("t2v")), family="wan")
    scheduler = json.loads((wan_models("t2v") / "scheduler" / "scheduler_config.json").read_text())
    assert load_adapter(folder, torch.device("cpu")).shift == (
        scheduler.get("flow_shift") or scheduler["shift"]
    )
    shifted = load_adapter(folder, torch.device("cpu"), RunSettings(flow_shift=5.0))
    u = torch.rand((), generator=torch.Generator().manual_seed(3))
    expected = 5.0 * u / (1 + 4.0 * u)
    torch.testing.assert_close(shifted._sigmas([torch.Generator().manual_seed(3)]), expected[None])


def test_guidance_scale_2_needs_a_second_expert_before_the_cache_pass(
    wan_models, base_settings, tiny_data, tmp_path
):
    settings = wan_settings(
        "t2v", wan_models, base_settings, tiny_data, tmp_path, **{"validation.guidance_scale_2": 3.0}
    )
    with (
        one_rank_group() as d,
        pytest.raises(
            StopRun,
            match=r"validation.guidance_scale_2 guides Wan 2.2 A14B's "
            r"low-noise expert, but .* has one transformer: remove it",
        ),
    ):
        prepare_run(load_config(str(write_toml(tmp_path / "c.toml", settings))), d)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loading_builds_on_meta_and_equals_from_pretrained(variant, wan_models, monkeypatch):
    """bf16, with the class's fp32 modules: each expert's folder too."""
    model_type, expert = VARIANTS[variant][:2]
    adapter = load_adapter(
        ModelConfig(
            family="wan", path=str(wan_models(variant)), dtype="bf16", type=model_type, expert=expert
        ),
        torch.device("cpu"),
    )
    for folder in ["transformer", *adapter.other_experts()]:
        assert_loads_lean(adapter, monkeypatch, folder)


def test_tiny_models_carry_the_published_key_sets(wan_models):
    for variant, (_, _, keys, _) in VARIANTS.items():
        path = wan_models(variant)
        for folder in ("transformer", "transformer_2"):
            if (path / folder).is_dir():
                assert (
                    set(json.loads((path / folder / "config.json").read_text()))
                    - {"_class_name", "_diffusers_version"}
                    == keys
                )
        index = json.loads((path / "model_index.json").read_text())
        assert ("boundary_ratio" in index) == (variant not in ("t2v", "i2v", "flf2v")), variant
        assert (path / "transformer_2").is_dir() == variant.startswith("a14b")


def wan_settings(variant, wan_models, base_settings, tiny_data, output_dir, **extra) -> dict:
    model_type, expert, _, _ = VARIANTS[variant]
    settings = {
        **base_settings,
        "run.output_dir": str(output_dir),
        "model.path": str(wan_models(variant)),
        "model.family": "wan",
        "model.type": model_type,
        "model.expert": expert,
        "train.steps": 2,
        "train.learning_rate": 1e-2,
        "train.lr_warmup_steps": 1,
        "validation.do_validation": False,
        "validation.prompts": PROMPTS,
        "validation.num_inference_steps": 6,
    }
    if expert:  # the low-noise expert's own guidance, as the A14B configs set it
        settings["validation.guidance_scale_2"] = 3.0
    settings = {**settings, **extra}
    prompts = range(len(settings["validation.prompts"]))
    if model_type == "i2v":
        settings.setdefault(
            "validation.images", [str(tiny_data / "images" / f"0000{i}.png") for i in prompts]
        )
    # each clip's last frame (the dataset writes them), and another clip's for validation
    if variant == "flf2v":
        settings.setdefault("data.last_image_column", "last_images.txt")
        settings.setdefault(
            "validation.last_images", [str(tiny_data / "last_images" / f"0000{i + 2}.png") for i in prompts]
        )
    return settings


def image_tokens(config, gen: torch.Generator, batch: int = 2):
    """CLIP image tokens for `batch` rows of the tiny transformer: FLF2V's two images per row."""
    if not config["image_dim"]:
        return None
    return torch.randn(batch * (2 if config["pos_embed_seq_len"] else 1), 17, 16, generator=gen)


def pipeline_frames(variant, path, cfg, lora_file=None):
    """The pipeline's float frames [F, H, W, 3] per prompt, and its transformers' calls (folder, t)."""
    pipe = VARIANTS[variant][3].from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora_file:
        pipe.load_lora_weights(str(lora_file), load_into_transformer_2=bool(VARIANTS[variant][1]))
    calls = []
    for folder in ("transformer", "transformer_2"):
        module = getattr(pipe, folder)
        if module is not None:
            module.register_forward_pre_hook(
                lambda m, a, kw, folder=folder: calls.append((folder, float(kw["timestep"].flatten()[0]))),
                with_kwargs=True,
            )
    frames = []
    for i, prompt in enumerate(cfg.prompts):
        extra = {"image": Image.open(cfg.images[i]).convert("RGB")} if cfg.images else {}
        if cfg.last_images:
            extra["last_image"] = Image.open(cfg.last_images[i]).convert("RGB")
        frames.append(
            pipe(
                prompt=prompt,
                num_frames=9,
                height=32,
                width=32,
                num_inference_steps=cfg.num_inference_steps,
                guidance_scale=cfg.guidance_scale,
                guidance_scale_2=cfg.guidance_scale_2 or None,
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                **extra,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
        )
    return frames, calls


def assert_comfy_file_equals_ours(variant, path, lora_dir, expert):
    """Our ComfyUI file, read by diffusers' converter of non-diffusers Wan LoRAs, gives the
    transformer our diffusers file gives (the converter bakes .alpha in; our file must carry no
    lora_adapter_metadata). Returns the trained expert's transformer of the pipeline that loaded our
    diffusers file."""
    comfy = next((lora_dir / "comfy").glob("*.safetensors"))
    assert expert in comfy.stem
    outputs, transformers = [], []
    for file in (lora_dir / "pytorch_lora_weights.safetensors", comfy):
        pipe = VARIANTS[variant][3].from_pretrained(str(path))
        pipe.load_lora_weights(str(file), load_into_transformer_2=expert == "low_noise")
        transformer = pipe.transformer_2 if expert == "low_noise" else pipe.transformer
        transformers.append(transformer)
        config = transformer.config
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, config.in_channels, 3, 4, 4, generator=gen)
        image = image_tokens(config, gen)
        with torch.no_grad():
            outputs.append(
                transformer(
                    hidden_states=x,
                    timestep=torch.tensor([10, 900]),
                    return_dict=False,
                    encoder_hidden_states=torch.randn(2, 512, 32, generator=gen),
                    encoder_hidden_states_image=image,
                )[0]
            )
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    return transformers[0]


# diffusers adds zero image-key LoRAs when it loads a LoRA into a 2.1 I2V transformer: its warning
# is expected.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_trains_exports_and_samples_as_its_pipeline(
    variant, wan_models, base_settings, tiny_data, tmp_path
):
    """Every variant trains, exports, and samples as its pipeline does.

    Two LoRA steps and two sft steps; our loop's frames equal the pipeline's within 1e-4 in fp32
    with the base model and with our exported LoRA loaded by load_lora_weights (into transformer_2
    for a low-noise expert); the experts take the same timesteps; the sft export loads with
    from_pretrained and computes what the checkpoint's weights compute."""
    settings = wan_settings(variant, wan_models, base_settings, tiny_data, tmp_path / "lora")
    trainer.main(["--cfg", str(write_toml(tmp_path / "lora.toml", settings))])
    sft = {
        **settings,
        "run.output_dir": str(tmp_path / "sft"),
        "train.training_type": "sft",
        "train.learning_rate": 1e-3,
    }
    trainer.main(["--cfg", str(write_toml(tmp_path / "sft.toml", sft))])
    lora_file = tmp_path / "lora" / "lora" / "pytorch_lora_weights.safetensors"
    assert_comfy_file_equals_ours(variant, wan_models(variant), lora_file.parent, VARIANTS[variant][1])

    cfg = load_config(str(tmp_path / "lora.toml"))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    # lora.init_from (and render.py --lora) read the ComfyUI file back to the same weights.
    comfy_weights, comfy_info = lora.load_lora(
        str(next((lora_file.parent / "comfy").glob("*"))), adapter.diffusers_key
    )
    weights, info = lora.load_lora(str(lora_file))
    assert comfy_weights.keys() == weights.keys() and all(
        torch.equal(comfy_weights[k], weights[k]) for k in weights
    )
    assert (comfy_info["rank"], comfy_info["alpha"]) == (info["rank"], info["alpha"])
    with one_rank_group() as d:
        frozen = {}
        renderer = validate.ClipRenderer(
            adapter,
            cfg.validation,
            cfg.data,
            str(tmp_path),
            d,
            lambda folder: frozen.setdefault(folder, adapter.load_transformer(folder=folder).eval()),
        )
        base = None  # the base model's frames, from the first pass
        for source in (None, lora_file):
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None).eval()
            denoisers = renderer.denoisers(model)
            calls = []
            hooks = [
                module.register_forward_pre_hook(
                    lambda m, a, kw, folder=folder: calls.append(
                        (folder, float(kw["timestep"].flatten()[0]))
                    ),
                    with_kwargs=True,
                )
                for folder, module in denoisers.items()
            ]
            scheduler = adapter.sampler("")
            ours = [
                renderer.frames(model, i, scheduler, contextlib.nullcontext()) for i in range(len(PROMPTS))
            ]
            for hook in hooks:
                hook.remove()
            theirs, their_calls = pipeline_frames(variant, wan_models(variant), cfg.validation, source)
            for a, b in zip(ours, theirs):
                assert a.shape == b.shape == (9, 32, 32, 3)
                assert (a - b).abs().max() <= 1e-4, (variant, source, (a - b).abs().max())
            # One forward per step (cond and uncond batched) against the pipeline's two: the same
            # expert each time.
            assert calls == their_calls[::2]
            if source is not None:
                assert max((a - b).abs().max() for a, b in zip(ours, base)) > 1e-3  # the LoRA shows
            base = ours
        if variant.startswith("a14b"):
            assert {folder for folder, _ in calls} == {"transformer", "transformer_2"}

        sft_cfg = load_config(str(tmp_path / "sft.toml"))
        ours = render.load_model(sft_cfg, adapter, d, str(tmp_path / "sft" / "checkpoint-2"), None).eval()
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "sft" / "transformer").eval()
    config = adapter.transformer_config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, config["in_channels"], 3, 4, 4, generator=gen)
    embeds = torch.randn(2, adapter.text_length, 32, generator=gen)
    image = image_tokens(config, gen)
    with torch.no_grad():
        expected = adapter._predict(ours, x, torch.tensor([10.0, 900.0]), embeds, image)
        torch.testing.assert_close(
            adapter._predict(exported, x, torch.tensor([10.0, 900.0]), embeds, image),
            expected,
            rtol=0,
            atol=1e-5,
        )


@pytest.mark.slow
def test_each_expert_trains_only_on_its_range(wan_models, base_settings, tiny_data, tmp_path, monkeypatch):
    """Each A14B expert trains only on its range of timesteps.

    A14B: transformer/ (high noise) takes t >= boundary_ratio x 1000, transformer_2/ the rest, as
    the pipeline splits them; the held-out loss measures each on its own range."""
    seen = []
    forward = WanTransformer3DModel.forward
    monkeypatch.setattr(
        WanTransformer3DModel,
        "forward",
        lambda self, *a, **kw: seen.append(kw["timestep"].flatten().tolist()) or forward(self, *a, **kw),
    )
    for expert in ("high_noise", "low_noise"):
        seen.clear()
        settings = wan_settings(
            "a14b-t2v",
            wan_models,
            base_settings,
            tiny_data,
            tmp_path / expert,
            **{
                "model.expert": expert,
                "train.steps": 4,
                "validation.prompts": [],
                "validation.do_validation": True,
                "validation.validation_steps": 4,
            },
        )
        trainer.main(["--cfg", str(write_toml(tmp_path / f"{expert}.toml", settings))])
        # training batches of 2 (held-out: 1 clip x 1-5 t)
        drawn = [t for call in seen for t in call if len(call) == 2]
        assert len(drawn) == 8 and all((t >= 875) == (expert == "high_noise") for t in drawn), drawn
        held_out = {k for m in read_metrics(tmp_path / expert) for k in m if k.startswith("val/loss_t")}
        assert held_out == (
            {"val/loss_t900"}
            if expert == "high_noise"
            else {"val/loss_t100", "val/loss_t300", "val/loss_t500", "val/loss_t700"}
        )


@pytest.mark.slow
def test_wan_lowers_the_held_out_loss(wan_models, base_settings, tiny_data, tmp_path):
    settings = wan_settings(
        "t2v",
        wan_models,
        base_settings,
        tiny_data,
        tmp_path / "learn",
        **{
            "train.steps": 60,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "lora.lora_alpha": 4,
            "checkpoint.checkpointing_steps": 60,
            "validation.do_validation": True,
            "validation.prompts": [],
            "validation.validation_steps": 60,
        },
    )
    run_ok(["--cfg", str(write_toml(tmp_path / "learn.toml", settings))])
    losses = {m["step"]: m["val/loss"] for m in read_metrics(tmp_path / "learn") if "val/loss" in m}
    assert sorted(losses) == [0, 60] and losses[60] < 0.9 * losses[0], losses


@pytest.mark.slow
# 2.1 T2V has no lifecycle of its own: FLF2V's runs its single transformer through every step with
# the image condition besides (T2V's blocks, embedders and head, and the image embedder and image
# keys), and A14B-T2V's runs text-to-video's inputs.
@pytest.mark.parametrize("variant, expert", [("a14b-t2v", "high_noise"), ("flf2v", "")])
def test_full_lifecycle(variant, expert, wan_models, base_settings, tiny_data, tmp_path):
    """Wan's whole lifecycle on 2 FSDP ranks: kill, resume bitwise, export to the pipeline.

    2 FSDP ranks with validation: SIGKILL after step 4, the next launch resumes from step 3 and ends
    bitwise equal to the run never stopped, clips included; the export loads in the variant's
    pipeline and its ComfyUI file equals it through diffusers' converter."""
    lifecycle = {
        "model.expert": expert,
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 6,
        "checkpoint.checkpointing_steps": 3,
        "validation.do_validation": True,
        "validation.validation_steps": 3,
        "validation.num_inference_steps": 3,
        "validation.save_frames": True,
        "validation.prompts": PROMPTS[:1],
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            wan_settings(variant, wan_models, base_settings, tiny_data, tmp_path / name, **lifecycle),
        )
        for name in ("reference", "killed")
    }
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    # once: each rank read its own rows of the base weights (Wan's 1-row scale_shift_tables
    if expert:
        # leave rank 1 an empty, padded shard; the other expert is sharded too), so the held-out
        # loss before any step is the one process's, which loads them whole.
        one = wan_settings(
            variant,
            wan_models,
            base_settings,
            tiny_data,
            tmp_path / "one",
            **{**lifecycle, "parallel.strategy": "ddp", "train.steps": 1, "validation.prompts": []},
        )
        run_ok(["--cfg", str(write_toml(tmp_path / "one.toml", one))])
        val_loss = [
            next(m["val/loss"] for m in read_metrics(tmp_path / name) if "val/loss" in m and m["step"] == 0)
            for name in ("reference", "one")
        ]
        assert val_loss[0] == pytest.approx(val_loss[1], rel=1e-5)
    assert (
        run_cmd(["--cfg", str(configs["killed"])], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:4"}).returncode
        != 0
    )
    resumed = run_ok(["--cfg", str(configs["killed"])], nproc=2)
    assert f"resumed from step 3 ({tmp_path / 'killed' / 'checkpoint-3'})" in resumed.stderr
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "reference")
    lora_dir = tmp_path / "reference" / "lora"
    ours, theirs = (
        load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")
        for name in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    clip = "validation_res/step_6_prompt_0.safetensors"
    assert torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"], load_file(tmp_path / "reference" / clip)["frames"]
    )
    # the export, loaded by the pipeline's load_lora_weights
    theirs = assert_comfy_file_equals_ours(variant, wan_models(variant), lora_dir, expert)
    cfg = load_config(str(configs["reference"]))
    if variant == "flf2v":  # TensorBoard shows the clip between the prompt's first and last image
        events = EventAccumulator(str(tmp_path / "reference" / "logs"), size_guidance={"images": 0})
        events.Reload()
        shown = events.Images("val/clip_0")
        assert [c.step for c in shown] == [0, 3, 6]
        with Image.open(io.BytesIO(shown[-1].encoded_image_string)) as gif:
            pixels = torch.from_numpy(np.array(gif.convert("RGB"))).float()
        first, last = (
            torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((32, 32)))).float()
            for path in (cfg.validation.images[0], cfg.validation.last_images[0])
        )
        frame = load_file(tmp_path / "reference" / clip)["frames"][0].float()
        # The GIF's 256-colour palette rounds the noisy tiny-model clip by a few levels.
        assert pixels.shape == (32, 96, 3) and (pixels[:, :32] - first).abs().mean() < 4
        assert (pixels[:, 64:] - last).abs().mean() < 4 and (pixels[:, 32:64] - frame).abs().mean() < 10
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(
            cfg, adapter, d, None, str(lora_dir / "pytorch_lora_weights.safetensors")
        ).eval()
    gen = torch.Generator().manual_seed(0)
    config = adapter.transformer_config
    x, embeds = (
        torch.randn(2, config["in_channels"], 3, 4, 4, generator=gen),
        torch.randn(2, 512, 32, generator=gen),
    )
    image = image_tokens(config, gen)
    with torch.no_grad():
        t = torch.tensor([10, 900])
        torch.testing.assert_close(
            adapter._predict(theirs, x, t, embeds, image),
            adapter._predict(model, x, t, embeds, image),
            rtol=0,
            atol=1e-5,
        )


# Wan FLF2V (first-last-frame): each clip's window ends at its last frame, the cached condition is
# built from the window's first frame and the clip's last image and follows its content, and each
# refusal names the key or file to fix.
def test_the_window_ends_at_the_clips_last_frame(tmp_path):
    """With a last image, the window ends at the clip's last frame.

    A clip with a last image trains its last 9 frames whatever the seed; without one the window
    starts anywhere; with both images the clip must be exactly the window."""
    ramp_clip(tmp_path / "ramp.mp4", 17)
    clip, media = (
        data.Clip(tmp_path / "ramp.mp4", "grey", 1, "videos.txt"),
        decode.probe(tmp_path / "ramp.mp4"),
    )
    for seed in range(4):
        item = data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), seed, None, "last")
        assert item.start == 8 and item.last_image_content == "last"
        assert picked_frames(data.decode_clip(item)) == list(range(8, 17))
    starts = {
        data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), seed).start for seed in range(8)
    }
    assert len(starts) > 1
    both = data.plan_clip(clip, media, "content", [(9, 32, 32)], DataConfig(), 0, "first", "last")
    assert (
        isinstance(both, data.Problem) and "has 17 frames and both an image and a last image" in both.reason
    )
    whole = data.plan_clip(clip, media, "content", [(17, 32, 32)], DataConfig(), 0, "first", "last")
    assert whole.start == 0 and picked_frames(data.decode_clip(whole)) == list(range(17))


def flf2v_data(root, tiny_data):
    """A metadata.jsonl dataset of 4 of the session's clips with their last frames (copied: a test
    edits one)."""
    root.mkdir()
    (root / "videos").symlink_to(tiny_data / "videos")
    shutil.copytree(tiny_data / "last_images", root / "last_images")
    rows = [
        f'{{"video": "videos/0000{i}.mp4", "prompt": "clip {i}", "last_image": "last_images/0000{i}.png"}}\n'
        for i in range(4)
    ]
    (root / "metadata.jsonl").write_text("".join(rows))
    return root


def test_the_cache_holds_both_images_condition_keyed_by_the_last_image(
    wan_models, base_settings, tiny_data, tmp_path, caplog
):
    """The cache holds both images' condition, keyed by the last image's content.

    The image entry is the condition of the window's first frame and the clip's last image, as the
    adapter encodes them together; replacing one last image's content re-encodes that clip only."""
    root = flf2v_data(tmp_path / "data", tiny_data)
    settings = wan_settings(
        "flf2v",
        wan_models,
        base_settings,
        tiny_data,
        tmp_path / "out",
        **{
            "data.data_root": str(root),
            "data.last_image_column": "",
            "data.cache_dir": str(tmp_path / "cache"),
            "data.held_out": 0,
        },
    )
    from conftest import write_toml

    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with one_rank_group() as d:
        adapter, entries, items, _ = prepare_run(cfg, d)
        # 17-frame clips, 9-frame windows ending at the last
        assert [item.start for item in items] == [8] * 4
        item = items[1]
        reference = adapter.encode_image(
            data.decode_clip(item)[:1],
            [torch.Generator()],
            9,
            last_images=data.load_image(item, last=True)[None],
        )
        cached = load_file(entries.path(item, "image"))
        assert cached["image_embeds"].shape == (2 * 17, 16)  # both images' CLIP tokens
        for key in cached:
            torch.testing.assert_close(cached[key], reference[key][0], rtol=0, atol=1e-5)
        before = entries.path(item, "image")
        shutil.copy(root / "last_images" / "00002.png", root / "last_images" / "00001.png")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vidtrain"):
            _, entries, items, _ = prepare_run(cfg, d)
    assert entries.path(items[1], "image") != before
    assert [entries.path(i, "image") for i in items[::2]] == [
        entries.path(i, "image") for i in (items[0], items[2])
    ]
    assert any("cache: 1 clips encoded, 3 reused" in r.getMessage() for r in caplog.records), caplog.text


def test_refusals_name_the_key(wan_models, base_settings, tiny_data, tmp_path):
    """First-last-frame refusals name the key and the fix.

    A first-last-frame model without last images, last images for another model, a missing last
    image file, and validation.last_images that do not pair with the prompts: each stops with its
    fix."""
    from conftest import write_toml

    def prepare(name, variant="flf2v", **extra):
        settings = wan_settings(
            variant,
            wan_models,
            base_settings,
            tiny_data,
            tmp_path / name,
            **{"data.cache_dir": str(tmp_path / "cache"), **extra},
        )
        with one_rank_group() as d:
            prepare_run(load_config(str(write_toml(tmp_path / f"{name}.toml", settings))), d)

    with pytest.raises(
        ConfigError,
        match=r"is a first-last-frame model \(Wan FLF2V\), but no clip has a last image: "
        r"set data.last_image_column",
    ):
        prepare("none", **{"data.last_image_column": ""})
    with pytest.raises(
        ConfigError,
        match=r"data.last_image_column = last_images.txt conditions first-last-frame "
        r"models, and model.path = .* is not one",
    ):
        prepare("i2v", "i2v", **{"data.last_image_column": "last_images.txt"})
    root = flf2v_data(tmp_path / "data", tiny_data)
    (root / "last_images" / "00002.png").unlink()
    with pytest.raises(
        data.BadClip, match=r"line 3: .*00002.mp4: last image .*00002.png: .*fix or remove it"
    ):
        prepare("missing", **{"data.data_root": str(root), "data.last_image_column": "", "data.held_out": 0})
    settings = wan_settings("flf2v", wan_models, base_settings, tiny_data, tmp_path / "count")
    settings["validation.last_images"] = settings["validation.last_images"][:1]
    settings["validation.do_validation"] = True
    with pytest.raises(ConfigError, match=r"validation.last_images has 1 for 2 validation.prompts"):
        load_config(str(write_toml(tmp_path / "count.toml", settings)))


def test_validate_renders_between_the_images(wan_models, base_settings, tiny_data, tmp_path, caplog):
    """render.py --last-image renders between the images.

    render.py --last-image renders the base model's clip; without it a first-last-frame model is
    refused, and an image-to-video model refuses one."""
    from conftest import write_toml

    settings = wan_settings(
        "flf2v",
        wan_models,
        base_settings,
        tiny_data,
        tmp_path / "out",
        **{"validation.num_inference_steps": 2, "validation.last_images": []},
    )
    config = str(write_toml(tmp_path / "c.toml", settings))
    first, last = str(tiny_data / "images" / "00000.png"), str(tiny_data / "last_images" / "00000.png")
    render.main(["--cfg", config, "--prompt", "a square", "--image", first, "--last-image", last])
    assert len(list((tmp_path / "out" / "validation_res").glob("render_base_prompt_0_*.mp4"))) == 1
    i2v = wan_settings(
        "i2v", wan_models, base_settings, tiny_data, tmp_path / "i2v", **{"validation.num_inference_steps": 2}
    )
    refusals = {
        "is a first-last-frame model (Wan FLF2V): each validation prompt renders between its image and its "
        "last image; set validation.last_images (render.py: --last-image), one per prompt": [config],
        "validation.last_images conditions first-last-frame models, and": [
            str(write_toml(tmp_path / "i2v.toml", i2v)),
            "--last-image",
            last,
        ],
    }
    for message, arguments in refusals.items():
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="vidtrain"), pytest.raises(SystemExit):
            render.main(["--cfg", arguments[0], "--prompt", "a square", "--image", first, *arguments[1:]])
        assert message in caplog.text
