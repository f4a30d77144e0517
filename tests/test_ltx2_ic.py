"""LTX-2 IC-LoRA (model.type = "ic"): the control clip's latents ride beside the clip's as clean
tokens at timestep 0, at the positions ltx-trainer gives them, outside the loss."""

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LTX2_PROMPTS as PROMPTS
from conftest import (
    PIPELINE_GUIDANCE,
    decode_mp4,
    ltx2_settings,
    ltx_core_cross_modulation,
    one_rank_group,
    original_top_level_linears,
    picked_frames,
    pipeline_guidance,
    ramp_video,
    run_cmd,
    run_ok,
    train_losses,
    write_toml,
)
from diffusers import LTX2InContextPipeline
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers
from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition, LTX2VideoCondition
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ckpt
import data
import render
import trainer
import validate
from config import ConfigError, DataConfig, ModelConfig, ValidationConfig, load_config
from families.ltx2 import TEXT_LENGTH, AudioStream, VideoStream, shifted_logit_normal
from model_adapter import check_config, load_adapter
from tools.make_synthetic_dataset import make_synthetic_dataset


def ltx_trainer_positions(frames: int, height: int, width: int, scale: tuple[int, int, int], fps: float):
    """Video positions as ltx-trainer computes them for a reference or a target.

    Video positions [1, 3, tokens, 2] as Lightricks/LTX-2's ltx-trainer computes them for a
    reference or a target
    (packages/ltx-trainer/src/ltx_trainer/training_strategies/base_strategy.py,
    _get_video_positions): ltx-core's VideoLatentPatchifier(patch_size=1).get_patch_grid_bounds
    (each latent cell's [start, end) per axis, in (frame, height, width) order), get_pixel_coords
    with causal_fix (times the VAE's scale factors, then the time axis shifted by 1 - time scale and
    clamped at 0), the time axis divided by fps. video_to_video.py concatenates the reference's and
    the target's; a reference of the target's size keeps its positions."""
    grid = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    starts = torch.stack(grid)
    bounds = torch.stack((starts, starts + 1), dim=-1).reshape(3, -1, 2)[None]
    pixels = (bounds * torch.tensor(scale).view(1, 3, 1, 1)).float()
    pixels[:, 0] = (pixels[:, 0] + 1 - scale[0]).clamp(min=0)
    pixels[:, 0] = pixels[:, 0] / fps
    return pixels


@pytest.fixture(scope="module")
def ic_adapter(ltx2_models):
    adapter = load_adapter(
        ModelConfig(family="ltx2", type="ic", path=str(ltx2_models("2.0")), dtype="fp32"),
        torch.device("cpu"),
    )
    return adapter, adapter.load_transformer().eval()


def test_reference_tokens_are_clean_at_timestep_0_at_ltx_trainers_positions_outside_the_loss(
    ic_adapter,
):
    """One training forward of two clips: the transformer sees the clip's noised tokens, then the
    control's normalised means unchanged, with timestep 1000 s and 0, at ltx-trainer's positions;
    the loss is the clip's tokens' alone, each computed from the keyed draws (s, the audio's s, the
    noise) as ltx-trainer's formula."""
    adapter, transformer = ic_adapter
    assert adapter.takes_control
    gen = torch.Generator().manual_seed(0)
    shape = (2, 8, 2, 4, 4)
    batch = {
        "latent_mean": torch.randn(shape, generator=gen),
        "latent_logvar": torch.full(shape, -4.0),
        "control_latent_mean": torch.randn(shape, generator=gen),
        "control_latent_logvar": torch.full(shape, -4.0),
        "prompt_embeds": torch.randn(2, TEXT_LENGTH, 32, generator=gen),
    }
    seen = {}

    def record(module, args, kwargs, output):
        seen.update(kwargs, output=output[0])

    hook = transformer.register_forward_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            losses = adapter.train_loss(transformer, batch, [data.keyed_generator(0, 1, i) for i in range(2)])
    finally:
        hook.remove()
    pack = lambda x: adapter._pack(adapter._normalise(x))
    x0, reference = pack(batch["latent_mean"]), pack(batch["control_latent_mean"])
    tokens = x0.shape[1]
    assert seen["hidden_states"].shape == (2, 2 * tokens, 8)
    assert torch.equal(seen["hidden_states"][:, tokens:], reference)  # not noised
    draws = [data.keyed_generator(0, 1, i) for i in range(2)]
    sigmas = torch.stack([shifted_logit_normal(tokens, g) for g in draws])
    # the audio's s, drawn though the batch has no sound
    [shifted_logit_normal(1, g) for g in draws]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in draws])
    s = sigmas.view(-1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"][:, :tokens], (1 - s) * x0 + s * noise, rtol=0, atol=1e-6)
    assert torch.equal(seen["timestep"][:, tokens:], torch.zeros(2, tokens))
    assert torch.equal(seen["timestep"][:, :tokens], (1000 * sigmas)[:, None].expand(2, tokens))
    position = ltx_trainer_positions(
        2,
        4,
        4,
        (adapter.temporal_ratio, adapter.spatial_ratio, adapter.spatial_ratio),
        adapter.frame_rate,
    )
    torch.testing.assert_close(
        seen["video_coords"],
        torch.cat([position, position], dim=2).expand(2, -1, -1, -1),
        rtol=0,
        atol=1e-6,
    )
    # ltx-trainer's VideoToVideoStrategy.compute_loss: the prediction's target tokens against noise
    # - x0 (no first frame conditioned: every target token in the mask), the reference's left out.
    expected = (seen["output"].float().view(2, -1, 8)[:, :tokens] - (noise - x0)).pow(2).mean(dim=(1, 2))
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    with_reference = (seen["output"].float().view(2, -1, 8) - torch.cat([noise - x0, reference * 0], 1)).pow(
        2
    )
    assert not torch.allclose(losses, with_reference.mean(dim=(1, 2)))


def test_a_downscaled_reference_and_a_clean_first_frame_as_ltx_trainer(ic_adapter):
    """model.reference_downscale_factor = 2 and train.first_frame_conditioning_p = 0.5, one forward
    of four clips: the reference's tokens are its own 1/2-size grid's, at ltx-trainer's positions
    for it (its grid's, the spatial ones times 2: FlexibleStrategy._apply_reference_condition); the
    samples whose keyed draw after the noise falls below p have their first latent frame clean, at
    timestep 0 and outside their loss (ltx-trainer's masked mean), the others none."""
    adapter, transformer = ic_adapter
    gen = torch.Generator().manual_seed(1)
    shape, n = (4, 8, 2, 4, 4), 4
    batch = {
        "latent_mean": torch.randn(shape, generator=gen),
        "latent_logvar": torch.full(shape, -4.0),
        "control_latent_mean": torch.randn((4, 8, 2, 2, 2), generator=gen),
        "control_latent_logvar": torch.full((4, 8, 2, 2, 2), -4.0),
        "prompt_embeds": torch.randn(n, TEXT_LENGTH, 32, generator=gen),
    }
    seen = {}

    def record(module, args, kwargs, output):
        seen.update(kwargs, output=output[0])

    hook = transformer.register_forward_hook(record, with_kwargs=True)
    adapter.reference_downscale, adapter.first_frame_p = 2, 0.5
    try:
        with pytest.raises(
            ConfigError,
            match="data.train_resolution height = 40, but model.reference_downscale_factor = 2 reads the "
            "control at 1/2 of it, which must be a multiple of 8 too: use a multiple of 16, or another factor",
        ):
            adapter.check_resolution([9, 40, 32], "data.train_resolution")
        with torch.no_grad():
            losses = adapter.train_loss(transformer, batch, [data.keyed_generator(0, 3, i) for i in range(n)])
    finally:
        hook.remove()
        adapter.reference_downscale, adapter.first_frame_p = 1, 0.0
    pack = lambda x: adapter._pack(adapter._normalise(x))
    x0, reference = pack(batch["latent_mean"]), pack(batch["control_latent_mean"])
    tokens, frame = x0.shape[1], 16  # a latent frame: 4 x 4 tokens
    assert reference.shape[1] == 8 and seen["hidden_states"].shape == (n, tokens + 8, 8)
    assert torch.equal(seen["hidden_states"][:, tokens:], reference)
    draws = [data.keyed_generator(0, 3, i) for i in range(n)]
    sigmas = torch.stack([shifted_logit_normal(tokens, g) for g in draws])
    [shifted_logit_normal(1, g) for g in draws]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in draws])
    [torch.randn((0, 128), generator=g) for g in draws]  # the audio's noise: no tokens
    clean = torch.stack([torch.rand((), generator=g) < 0.5 for g in draws])
    assert 0 < clean.sum() < n, clean  # both kinds in the batch
    # ltx-trainer: the conditioning mask's tokens clean at timestep 0, the others noised at s
    mask = torch.zeros(n, tokens, dtype=torch.bool)
    mask[clean, :frame] = True
    s = sigmas.view(-1, 1, 1)
    expected = torch.where(mask[..., None], x0, (1 - s) * x0 + s * noise)
    torch.testing.assert_close(seen["hidden_states"][:, :tokens], expected, rtol=0, atol=1e-6)
    timesteps = torch.where(mask, 0.0, 1000 * sigmas[:, None].expand(n, tokens))
    torch.testing.assert_close(
        seen["timestep"], torch.cat([timesteps, torch.zeros(n, 8)], 1), rtol=0, atol=1e-4
    )
    scale = (adapter.temporal_ratio, adapter.spatial_ratio, adapter.spatial_ratio)
    target = ltx_trainer_positions(2, 4, 4, scale, adapter.frame_rate)
    ref = ltx_trainer_positions(2, 2, 2, scale, adapter.frame_rate)
    ref[:, 1:] *= 2
    torch.testing.assert_close(
        seen["video_coords"], torch.cat([target, ref], dim=2).expand(n, -1, -1, -1), rtol=0, atol=1e-6
    )
    # _compute_modality_loss: the squared error's masked mean, normalised by the mask's mean
    keep = (~mask).unsqueeze(-1).float()
    errors = (seen["output"].float().view(n, -1, 8)[:, :tokens] - (noise - x0)).pow(2)
    masked = (errors * keep).mean(dim=(1, 2)) / keep.mean(dim=(1, 2)).clamp(min=1e-8)
    torch.testing.assert_close(losses, masked, rtol=1e-6, atol=0)
    assert not torch.allclose(losses[clean], errors.mean(dim=(1, 2))[clean])


def test_in_context_is_ltx2s(tiny_models, write_config):
    """model.type = "ic" on another family names the key; its condition is a control video and,
    optionally, a first-frame image per prompt (validation.images: one per prompt or none, refused
    for text-to-video); IC-LoRA's own keys are refused out of range or for another type, each naming
    the key."""
    with pytest.raises(
        ConfigError,
        match='model.type = "ic" trains a model in context with a control clip, which '
        "vidtrain does for LTX-2",
    ):
        load_adapter(ModelConfig(type="ic", path=str(tiny_models("2b"))), torch.device("cpu"))
    images = {"model.type": "ic", "validation.prompts": ["x"], "validation.images": ["x.png"]}
    load_config(str(write_config("ic", **images)))
    with pytest.raises(
        ConfigError,
        match=r"validation.images has 2 for 1 validation.prompts: an in-context model renders each "
        r"prompt from its control video and, given images, its first frame; give one per prompt, or none",
    ):
        load_config(str(write_config("ic", **images | {"validation.images": ["x.png", "y.png"]})))
    with pytest.raises(
        ConfigError,
        match=r"validation.images conditions image-to-video models and in-context ones' first frame: "
        r'set model.type = "i2v" \(or "ic"\), or remove it',
    ):
        load_config(str(write_config("t2v", **images | {"model.type": "t2v"})))
    ltx2 = {"model.family": "ltx2", "model.type": "ic", "model.path": "/nowhere"}  # the config alone
    for settings, message in (
        (
            {**ltx2, "model.type": "t2v", "model.reference_downscale_factor": 2},
            r'model.reference_downscale_factor = 2 shapes IC-LoRA training \(model.type = "ic"\), and '
            r'model.type is "t2v": remove it, or set model.type = "ic"',
        ),
        (
            {**ltx2, "model.reference_downscale_factor": 0},
            "model.reference_downscale_factor = 0 is out of range: a whole factor, 1 or more",
        ),
        (
            {**ltx2, "train.first_frame_conditioning_p": 1.5},
            "train.first_frame_conditioning_p = 1.5 is out of range: a probability, 0 to 1",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check_config(load_config(str(write_config("keys", **settings))))


def test_a_checkpoint_holds_its_reference_downscale_factor(ltx2_models, write_config, tmp_path):
    """A checkpoint's meta.json records model.reference_downscale_factor: an export, resume or render
    from a config with another factor (the key left out: 1) is refused, naming the factor to set,
    so the exported files carry the trained one."""

    def identity(**settings):
        ic = {"model.family": "ltx2", "model.type": "ic", "model.path": str(ltx2_models("2.0"))}
        cfg = load_config(str(write_config("ic", **ic, **settings)))
        return ckpt.run_identity(load_adapter(cfg.model, torch.device("cpu")), cfg.model, cfg.train, cfg.lora)

    trained = identity(**{"model.reference_downscale_factor": 2})
    assert trained["model"] == {"model.reference_downscale_factor": "2"}
    ckpt.check_identity(tmp_path, {"identity": trained}, trained, resuming=True)
    for resuming in (False, True):
        with pytest.raises(
            ConfigError,
            match=re.escape(
                f"checkpoint {tmp_path} was trained with model.reference_downscale_factor = 2, and this "
                "config has 1: set model.reference_downscale_factor = 2 (its run's config.toml)"
            ),
        ):
            ckpt.check_identity(tmp_path, {"identity": trained}, identity(), resuming=resuming)


@pytest.fixture(scope="module")
def ic_data(tmp_path_factory):
    """Four clips with their edge maps as control videos (two train, two held out)."""
    path = tmp_path_factory.mktemp("ic_data") / "shapes"
    make_synthetic_dataset(str(path), num_videos=4, frames=17, height=40, width=48, seed=0, control=True)
    return path


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_ic_lora_trains_and_samples_as_the_in_context_pipeline(ltx2_models, base_settings, ic_data, tmp_path):
    """Our IC-LoRA training and sampling equal LTX2InContextPipeline's.

    Two IC-LoRA steps with model.reference_downscale_factor = 2 on clips with control videos: the
    cache holds each control at half the clip's size, the exports carry the factor in their metadata
    as ltx-trainer writes it. Our loop with the control as its reference renders what
    LTX2InContextPipeline renders with it as an LTX2ReferenceCondition, within 1e-4 in fp32: the
    base model with a full-size reference, and our exported LoRA loaded by load_lora_weights with
    the pipeline's reference_downscale_factor = 2 (the pipelines' guidance terms on) and a
    first-frame image (validation.images) as the pipeline's `conditions` (an LTX2VideoCondition at
    index 0) beside its reference_conditions: the image of another size and aspect,
    H.264-compressed, resized to cover and cropped as the pipeline does (rendered without it, ours
    differ from the pipeline's by 0.6). The pipeline's
    transformer takes ltx-core's audio-video cross-attention modulation, as ours (the reference's
    and the image's tokens at their own timestep 0, as I2V's: test_ltx2_training)."""
    control = ic_data / "controls" / "00000.mp4"
    settings = ltx2_settings(
        "2.0",
        ltx2_models,
        base_settings,
        ic_data,
        tmp_path / "lora",
        **{
            "model.type": "ic",
            "model.reference_downscale_factor": 2,
            "data.control_column": "controls.txt",
            "validation.control_videos": [str(control)],
            **{f"validation.{k}": v for k, v in PIPELINE_GUIDANCE.items()},
        },
    )
    trainer.main(["--cfg", str(write_toml(tmp_path / "lora.toml", settings))])
    cfg = load_config(str(tmp_path / "lora.toml"))
    # each clip's control entry at 1/2 of its 9 x 32 x 32 (latents 2 x 4 x 4), keyed apart from
    # the full-size ones
    entries = [load_file(f) for f in (Path(cfg.data.cache_dir) / "control").rglob("*.safetensors")]
    shapes = [tuple(e["control_latent_mean"].shape) for e in entries if "control_latent_mean" in e]
    assert shapes.count((8, 2, 2, 2)) == 4, shapes
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    lora_file = tmp_path / "lora" / "lora" / "pytorch_lora_weights.safetensors"
    for exported in (lora_file, next((lora_file.parent / "comfy").glob("*.safetensors"))):
        with safe_open(exported, framework="pt") as f:
            assert f.metadata()["reference_downscale_factor"] == "2"
    pipe = LTX2InContextPipeline.from_pretrained(str(ltx2_models("2.0")))
    pipe.set_progress_bar_config(disable=True)
    image = tmp_path / "first.png"  # 40 x 48, the clips' own size: covered and cropped to 32 x 32
    Image.fromarray(decode_mp4(ic_data / "videos" / "00001.mp4")[0][0].numpy()).save(image)
    with one_rank_group() as d, ltx_core_cross_modulation(pipe.transformer):
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        frames = renderer.controls[0]
        assert frames.shape == (9, 32, 32, 3)
        reference = LTX2ReferenceCondition(frames=[Image.fromarray(frame) for frame in frames.numpy()])
        for source, factor, images in ((None, 1, []), (lora_file, 2, [image])):
            adapter.reference_downscale = factor
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None).eval()
            if images:  # validation.images' (the lifecycle reads it from the config)
                renderer.images = [validate.load_image(str(images[0]))]
            ours = renderer.frames(model, 0, adapter.sampler(""), contextlib.nullcontext())
            if source:
                pipe.load_lora_weights(str(source))
            first = [LTX2VideoCondition(frames=Image.open(images[0]), index=0)] if images else None
            theirs = (
                pipe(
                    prompt=PROMPTS[0],
                    negative_prompt=cfg.validation.negative_prompt,
                    reference_conditions=[reference],
                    conditions=first,
                    reference_downscale_factor=factor,
                    num_frames=9,
                    height=32,
                    width=32,
                    num_inference_steps=cfg.validation.num_inference_steps,
                    **pipeline_guidance(cfg.validation),
                    generator=data.keyed_generator(cfg.validation.seed, 0),
                    output_type="pt",
                )
                .frames[0]
                .permute(0, 2, 3, 1)
            )
            assert ours.shape == theirs.shape == (9, 32, 32, 3)
            assert (ours - theirs).abs().max() <= 1e-4, (source, images, (ours - theirs).abs().max())


def test_validation_shows_the_control_beside_the_clip_and_refuses_what_does_not_fit(
    ltx2_models, ic_data, tmp_path
):
    """A control video is read at the clip's rate from its first frame, resized to cover and
    centre-cropped; TensorBoard's val/clip_i is the control and the clip side by side, the mp4 the
    clip alone. An in-context model without control videos, or control videos for another model, are
    named before anything renders."""
    control = tmp_path / "ramp.mp4"
    # another size and aspect, 24 fps: the frame at k / 8 s shows 10 + 12k
    ramp_video(control, 33, 80, 60, 24, 4)
    frames = validate.load_control(str(control), [9, 32, 32], 8.0)
    assert frames.shape == (9, 32, 32, 3) and picked_frames(frames) == list(range(9))
    # Covered (43 x 32) and centre-cropped: the white corner's 11 rows lose their top 5.
    assert frames[:, :5, :7].float().mean() > 240 and frames[:, 7:, :7].float().mean() < 220
    with pytest.raises(
        ConfigError,
        match=r"validation control video .*ramp.mp4 has 11 frames at 8 fps, and the "
        r"clips have 17: fix validation.control_videos or --control",
    ):
        validate.load_control(str(control), [17, 32, 32], 8.0)
    adapter = load_adapter(
        ModelConfig(family="ltx2", type="ic", path=str(ltx2_models("2.0")), dtype="fp32"),
        torch.device("cpu"),
    )
    cfg = ValidationConfig(prompts=PROMPTS, num_inference_steps=2, gen_fps=24, guidance_scale=1.0)
    with one_rank_group() as d:
        with pytest.raises(
            ConfigError,
            match=r"follows a control video \(model.type = \"ic\"\): each validation "
            r"prompt renders from one; set validation.control_videos",
        ):
            validate.ClipRenderer(adapter, cfg, DataConfig(train_resolution=[9, 32, 32]), str(tmp_path), d)
        videos = dataclasses.replace(cfg, control_videos=[str(ic_data / "controls" / "00000.mp4")])
        plain = load_adapter(
            ModelConfig(family="ltx2", path=str(ltx2_models("2.0")), dtype="fp32"),
            torch.device("cpu"),
        )
        with pytest.raises(
            ConfigError,
            match=r"validation.control_videos conditions control models, and .* is not "
            r"one here: remove them \(and --control\)",
        ):
            validate.ClipRenderer(plain, videos, DataConfig(train_resolution=[9, 32, 32]), str(tmp_path), d)
        renderer = validate.ClipRenderer(
            adapter, videos, DataConfig(train_resolution=[9, 32, 32]), str(tmp_path), d
        )
        # a LoRA trained with another reference_downscale_factor (its metadata) is named
        lora_file = tmp_path / "halved.safetensors"
        save_file({"w": torch.zeros(1)}, str(lora_file), metadata={"reference_downscale_factor": "2"})
        with pytest.raises(
            ConfigError,
            match=r"--lora .*halved.safetensors was trained with reference_downscale_factor = 2 \(its "
            r"metadata\), and model.reference_downscale_factor is 1: set model.reference_downscale_factor = 2",
        ):
            render.load_model(None, adapter, d, None, str(lora_file))  # refused before the config counts
        clip = torch.full((9, 32, 32, 3), 7, dtype=torch.uint8)
        renderer.render = lambda model, autocast: [clip]
        shown = {}

        class Metrics:
            def clip(self, step, tag, frames, fps):
                shown[tag] = frames

            def text(self, step, tag, text):
                shown[tag] = text

        renderer.run(None, 3, Metrics(), contextlib.nullcontext())
    assert torch.equal(shown["val/clip_0"], torch.cat([renderer.controls[0], clip], dim=2))
    assert shown["val/prompt_0"] == PROMPTS[0]
    written = decode_mp4(tmp_path / "validation_res" / "step_3_prompt_0.mp4")[0]
    # H.264's rounding
    assert written.shape == clip.shape and (written.float() - 7).abs().max() <= 2


@pytest.mark.slow
def test_ic_lora_lifecycle(ltx2_models, base_settings, ic_data, tmp_path):
    """2 FSDP ranks training IC-LoRA with validation and ltx-trainer's random first-frame
    conditioning (its keyed draws): SIGKILL after step 3, the next launch resumes from step 2 and
    ends bitwise equal to the run never stopped, clips included; validation renders from a control
    video and a first-frame image together (validation.images), and TensorBoard shows each clip
    beside its control and its image; the export loads in LTX2InContextPipeline and computes, reference appended, what our
    model computes, and so does its ComfyUI file through the pipeline's loader, every key converted
    back; the ComfyUI file names only weights of ComfyUI's LTX-2 model, every module of the export
    once; both carry reference_downscale_factor = "1" as ltx-trainer writes it."""
    image = tmp_path / "first.png"  # a held-out clip's first frame
    Image.fromarray(decode_mp4(ic_data / "videos" / "00003.mp4")[0][0].numpy()).save(image)
    lifecycle = {
        "validation.images": [str(image)],
        "model.type": "ic",
        "train.first_frame_conditioning_p": 0.5,
        "data.control_column": "controls.txt",
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 4,
        "checkpoint.checkpointing_steps": 2,
        "validation.do_validation": True,
        "validation.validation_steps": 2,
        "validation.save_frames": True,
        "validation.control_videos": [str(ic_data / "controls" / "00000.mp4")],
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            ltx2_settings("2.0", ltx2_models, base_settings, ic_data, tmp_path / name, **lifecycle),
        )
        for name in ("reference", "killed")
    }
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    assert (
        run_cmd(["--cfg", str(configs["killed"])], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:3"}).returncode
        != 0
    )
    resumed = run_ok(["--cfg", str(configs["killed"])], nproc=2)
    assert f"resumed from step 2 ({tmp_path / 'killed' / 'checkpoint-2'})" in resumed.stderr
    losses = train_losses(tmp_path / "reference")
    assert sorted(losses) == [1, 2, 3, 4] and train_losses(tmp_path / "killed") == losses
    lora_file = tmp_path / "reference" / "lora" / "pytorch_lora_weights.safetensors"
    ours, theirs = (
        load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")
        for name in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    clip = "validation_res/step_4_prompt_0.safetensors"
    frames = load_file(tmp_path / "reference" / clip)["frames"]
    assert frames.shape == (9, 32, 32, 3) and torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"], frames
    )
    cfg = load_config(str(configs["reference"]))
    control = validate.load_control(cfg.validation.control_videos[0], [9, 32, 32], 24.0)
    events = EventAccumulator(str(tmp_path / "reference" / "logs"), size_guidance={"images": 0})
    events.Reload()
    shown = events.Images("val/clip_0")
    assert [c.step for c in shown] == [0, 2, 4]
    with Image.open(io.BytesIO(shown[-1].encoded_image_string)) as gif:
        first = torch.from_numpy(np.array(gif.convert("RGB"))).float()
    assert first.shape == (32, 96, 3)  # control, image, clip
    held = torch.from_numpy(np.array(Image.open(image).resize((32, 32)))).float()
    # The GIF's 256-colour palette rounds the noisy tiny-model clip by a few levels.
    assert (first[:, :32] - control[0].float()).abs().mean() < 4
    assert (first[:, 32:64] - held).abs().mean() < 4
    assert (first[:, 64:] - frames[0].float()).abs().mean() < 10
    assert (first[:, 64:] - control[0].float()).abs().mean() > 40
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(cfg, adapter, d, None, str(lora_file)).eval()
    pipe = LTX2InContextPipeline.from_pretrained(str(ltx2_models("2.0")))
    pipe.load_lora_weights(str(lora_file))
    expected = in_context_output(model, adapter)
    torch.testing.assert_close(in_context_output(pipe.transformer, adapter), expected, rtol=0, atol=1e-5)
    comfy_file = next((lora_file.parent / "comfy").glob("*.safetensors"))
    comfy = load_file(comfy_file)
    # ComfyUI's loader patches diffusion_model.<module>.weight of its model (test_ltx2's helper for
    # the modules outside the blocks, comfyui_block_linears for the blocks')
    c = adapter.transformer_config
    comfyui_model = original_top_level_linears(c) | comfyui_block_linears(c)
    modules = {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in comfy}
    assert all(k.startswith("diffusion_model.") for k in comfy) and modules <= comfyui_model
    # lora.target_modules (to_q, to_k, to_v, to_out.0): every attention projection of every block
    assert modules == {
        m for m in comfyui_block_linears(c) if m.endswith(("to_q", "to_k", "to_v", "to_out.0"))
    }
    for exported in (lora_file, comfy_file):
        with safe_open(exported, framework="pt") as f:
            assert f.metadata()["reference_downscale_factor"] == "1"
    converted = _convert_non_diffusers_ltx2_lora_to_diffusers(comfy)
    assert converted.keys() == load_file(lora_file).keys()  # no key lost
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(comfy_file))
    torch.testing.assert_close(in_context_output(pipe.transformer, adapter), expected, rtol=0, atol=1e-5)


def comfyui_block_linears(c: dict) -> set[str]:
    """The linear layers of ComfyUI's native LTX-2 (LTX-2.0, no attention gates) blocks.

    Written from comfyanonymous/ComfyUI 2fb2e7567fc2a6a2752c7055e47f8f9f24976134,
    comfy/ldm/lightricks/av_model.py (BasicAVTransformerBlock: attn1, audio_attn1, attn2, audio_attn2,
    audio_to_video_attn, video_to_audio_attn, ff, audio_ff) and c4a6b389de1014471a75a46ee57d2fdac4f8df93,
    comfy/ldm/lightricks/model.py (CrossAttention: to_q, to_k, to_v, to_out.0; FeedForward: net.0.proj,
    GELU_approx's, and net.2), under LTXAVModel's transformer_blocks."""
    attentions = (
        "attn1",
        "audio_attn1",
        "attn2",
        "audio_attn2",
        "audio_to_video_attn",
        "video_to_audio_attn",
    )
    block = {f"{a}.{p}" for a in attentions for p in ("to_q", "to_k", "to_v", "to_out.0")}
    block |= {f"{ff}.net.{p}" for ff in ("ff", "audio_ff") for p in ("0.proj", "2")}
    return {f"transformer_blocks.{i}.{name}" for i in range(c["num_layers"]) for name in block}


def in_context_output(transformer, adapter):
    """Both streams' velocities of a clip with a reference appended (per-token timesteps, 0 on the
    reference)."""
    gen = torch.Generator().manual_seed(0)
    c = adapter.transformer_config
    video = torch.randn(2, 2 * 2 * 4 * 4, c["in_channels"], generator=gen)
    audio = torch.randn(2, 9, c["audio_in_channels"], generator=gen)
    embeds = torch.randn(2, TEXT_LENGTH, 32, generator=gen)
    t = torch.tensor([10.0, 900.0])
    video_t = torch.cat([t[:, None].expand(2, 32), torch.zeros(2, 32)], dim=1)
    with torch.no_grad():
        return torch.cat(
            [
                x.flatten(1)
                for x in adapter._predict(
                    transformer,
                    VideoStream(video, video_t, t, (2, 4, 4), reference=1),
                    AudioStream(audio, t, 9),
                    embeds,
                )
            ],
            1,
        )
