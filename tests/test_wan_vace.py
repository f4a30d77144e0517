"""Wan VACE: the tiny model carries the published key set; our sampling loop renders what
WanVACEPipeline renders from a control video, its mask and reference images (with our LoRA on the
base and the VACE blocks, loaded by load_lora_weights); the training forward reads the context the
pipeline builds, with the reference frames in the loss as the makers train them; the condition
randomisation (train.vace_*_p) draws and encodes as VideoX-Fun's VACE trainer."""

import contextlib
import io
import json
import logging
import random
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    one_rank_group,
    prepare_run,
    ramp_video,
    read_metrics,
    run_cmd,
    run_ok,
    train_losses,
    write_toml,
)
from diffusers import WanVACEPipeline, WanVACETransformer3DModel
from PIL import Image
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader

import cache
import data
import lora
import model
import ranks
import render
import trainer
import validate
from config import ConfigError, DataConfig, ModelConfig, ValidationConfig, load_config
from families import wan_vace
from families.wan import WanAdapter
from model_adapter import RunSettings, check_config, load_adapter

WAN_VACE_KEYS = {
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
    "pos_embed_seq_len",
    "qk_norm",
    "rope_max_seq_len",
    "text_dim",
    "vace_in_channels",
    "vace_layers",
}
PROMPT = "a red circle moves right"
# LoRA on the base blocks' and the VACE blocks' attention, and on the first VACE block's input
# projection.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]


def conditions(seed: int = 0):
    """A control video and a binary mask (9 frames of 32 x 32, PIL, as the pipeline takes them), and
    two reference images of other sizes and aspects than the clip's."""
    g = np.random.default_rng(seed)
    control = [Image.fromarray(g.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(9)]
    mask = [
        Image.fromarray(np.where(g.random((32, 32)) > 0.5, 255, 0).astype(np.uint8)).convert("RGB")
        for _ in range(9)
    ]
    references = [
        Image.fromarray(g.integers(0, 256, size, dtype=np.uint8)) for size in ((24, 40, 3), (40, 16, 3))
    ]
    return control, mask, references


def vace_settings(wan_models, base_settings, output_dir, **extra) -> dict:
    return {
        **base_settings,
        "model.path": str(wan_models("vace")),
        "model.family": "wan",
        "model.type": "vace",
        "lora.target_modules": TARGETS,
        "run.output_dir": str(output_dir),
        "validation.do_validation": False,
        **extra,
    }


def vace_adapter(wan_models):
    return load_adapter(
        ModelConfig(family="wan", path=str(wan_models("vace")), dtype="fp32", type="vace"),
        torch.device("cpu"),
    )


def pipeline_frames(pipe, cfg: ValidationConfig, **conditions) -> torch.Tensor:
    """WanVACEPipeline's clip of PROMPT at 9x32x32 with validation's steps, guidance and keyed
    generator, given these conditions (video, mask, reference_images): [F, H, W, 3] in [0, 1]."""
    return (
        pipe(
            prompt=PROMPT,
            num_frames=9,
            height=32,
            width=32,
            num_inference_steps=cfg.num_inference_steps,
            guidance_scale=cfg.guidance_scale,
            generator=data.keyed_generator(cfg.seed, 0),
            output_type="pt",
            **conditions,
        )
        .frames[0]
        .permute(0, 2, 3, 1)
    )


def test_the_tiny_model_carries_the_published_key_set_and_the_type_is_checked(wan_models):
    path = wan_models("vace")
    config = json.loads((path / "transformer" / "config.json").read_text())
    assert set(config) - {"_class_name", "_diffusers_version"} == WAN_VACE_KEYS
    assert config["_class_name"] == "WanVACETransformer3DModel"
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "WanVACEPipeline"
    with pytest.raises(
        ConfigError,
        match=r'is a VACE model \(its transformer has vace_layers\): set model.type = "vace"',
    ):
        load_adapter(ModelConfig(family="wan", path=str(path), type="t2v"), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r'is not a VACE model .*: set model.type = "t2v" or "i2v"'):
        load_adapter(ModelConfig(family="wan", path=str(wan_models("t2v")), type="vace"), torch.device("cpu"))
    adapter = vace_adapter(wan_models)
    # The context blocks are FSDP and checkpointing units too, in the order the forward runs them.
    transformer = adapter.load_transformer()
    assert adapter.blocks(transformer) == [*transformer.vace_blocks, *transformer.blocks]


def test_the_vace_configs_train_at_videox_funs_shift(wan_models):
    """Every shipped VACE config draws s as VideoX-Fun's Wan 2.1 VACE trainer does, not at the
    folder's inference shift (3.0: mean s 0.677)."""
    from conftest import REPO
    from diffusers import FlowMatchEulerDiscreteScheduler

    # VideoX-Fun, scripts/wan2.1_vace/train.py:762 builds diffusers' scheduler from train.sh's
    # config/wan2.1/wan_civitai.yaml (`shift: 5.0`, :31); --uniform_sampling draws a uniform index
    # into its timesteps (videox_fun/utils/discrete_sampler.py), whose sigmas the loss uses.
    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0).sigmas
    configs = [
        path
        for path in sorted((REPO / "configs").glob("*.toml"))
        if load_config(str(path)).model.type == "vace"
    ]
    assert configs
    for path in configs:
        cfg = load_config(str(path), ["--model.path", str(wan_models("vace"))])
        adapter = load_adapter(cfg.model, torch.device("cpu"), RunSettings.of(cfg))
        ours = adapter._sigmas([data.keyed_generator(0, i) for i in range(20_000)])
        assert abs(ours.mean() - theirs.mean()) < 0.01, path.name


def as_uint8(frames) -> torch.Tensor:
    """PIL frames -> uint8 [F, H, W, 3], as the cache pass reads a clip's frames."""
    return torch.from_numpy(np.stack([np.asarray(f) for f in frames]))


def pipeline_context(pipe, control, mask, references):
    """The pipeline's own context for these inputs: preprocess_conditions, prepare_video_latents and
    prepare_masks, concatenated as its __call__ does."""
    video, mask, references = pipe.preprocess_conditions(
        control, mask, references, 1, 32, 32, 9, torch.float32, torch.device("cpu")
    )
    return torch.cat(
        [pipe.prepare_video_latents(video, mask, references), pipe.prepare_masks(mask, references)],
        1,
    )


def test_the_training_forward_reads_the_pipelines_context_and_trains_the_references(wan_models):
    """A cached clip's VACE condition (from uint8 pixels, as the cache pass reads them) gives the
    transformer the pipeline's conditioning latents exactly (inactive, reactive, mask packing,
    references in front in the pipeline's order); the noisy sequence holds the references' frames in
    front of the clip's, and the loss is over them all, as the makers train VACE."""
    adapter = vace_adapter(wan_models)
    control, mask, references = conditions()
    pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
    theirs = pipeline_context(pipe, control, mask, references)

    pixels = as_uint8(control).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    mask_pixels = as_uint8(mask).permute(3, 0, 1, 2)[None].float() / 255.0
    canvases = torch.stack([wan_vace.reference_canvas(np.asarray(r), 32, 32, 8) for r in references])[None]
    condition = adapter.vace_condition(pixels, mask_pixels, canvases, 9, 32, 32)
    assert condition["reference_latents"].shape == (1, 16, 2, 4, 4)
    torch.testing.assert_close(
        wan_vace.context(condition["control_latents"], condition["reference_latents"]),
        theirs,
        rtol=0,
        atol=1e-5,
    )

    transformer = adapter.load_transformer().train()
    seen = {}
    transformer.register_forward_hook(lambda m, a, kw, out: seen.update(kw, out=out[0]), with_kwargs=True)
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(2, 16, 3, 4, 4, generator=gen)
    batch = {
        "latent_mean": mean,
        "latent_logvar": torch.full_like(mean, -30.0),  # x0 is the mean (to 3e-7)
        "prompt_embeds": torch.randn(2, 512, 32, generator=gen),
        **condition,
    }
    loss = adapter.train_loss(transformer, batch, [data.keyed_generator(0, i) for i in range(2)])
    assert seen["control_hidden_states"].shape == (2, 96, 5, 4, 4)
    torch.testing.assert_close(
        seen["control_hidden_states"], theirs.expand(2, -1, -1, -1, -1), rtol=0, atol=1e-5
    )
    x_t, s = seen["hidden_states"], seen["timestep"].view(-1, 1, 1, 1, 1) / 1000
    assert x_t.shape == (2, 16, 5, 4, 4)
    # The makers' loss. VideoX-Fun, scripts/wan2.2_vace_fun/train.py (and wan2.1_vace/train.py
    # 1808, 1880, 1883, 1912): 1862 `latents = torch.cat([subject_ref_images, latents], dim=2)`,
    # 1934 `noisy_latents = (1.0 - sigmas) * latents + sigmas * noise`, 1937 `target = noise -
    # latents`, 1966 custom_mse_loss's `masked_loss.mean()` over every element (its threshold of 50
    # and unit weighting change nothing here); DiffSynth-Studio, diffsynth/pipelines/wan_video.py:437
    # prepends the references to input_latents and diffsynth/diffusion/loss.py:31 takes
    # mse_loss(noise_pred, training_target) over all of it.
    latents = torch.cat(
        [condition["reference_latents"].expand(2, -1, -1, -1, -1), adapter._normalise(mean)], dim=2
    )
    noise = (x_t - (1 - s) * latents) / s  # read back from noisy_latents
    target = noise - latents
    makers = (seen["out"] - target).pow(2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(loss, makers, rtol=1e-4, atol=1e-5)
    clip_only = (seen["out"] - target)[:, :, 2:].pow(2).mean(dim=(1, 2, 3, 4))
    # the reference frames show: a loss over the clip's frames alone is another one
    assert (makers - clip_only).abs().min() > 1e-3


def random_lora(adapter, path) -> tuple[list[str], dict]:
    """Our LoRA on TARGETS with random weights, written as the export writes it; the module names,
    weights."""
    transformer = adapter.load_transformer()
    names = lora.inject_lora(transformer, TARGETS, 4, 4.0, 0.0, seed=0)
    gen = torch.Generator().manual_seed(3)
    weights = {
        k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in lora.lora_state_dict(transformer).items()
    }
    lora.save_lora(str(path), weights, 4, 4.0, TARGETS)
    return names, weights


def comfyui_vace_linears(c: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's native Wan VACE model's linear layers, as (in, out) features.

    The nn.Linear modules, as (in, out) features, of ComfyUI's native Wan VACE model for a
    diffusers transformer config, written from comfy/ldm/wan/model.py (WanModel's WanAttentionBlock
    with t2v cross- attention: self_attn and cross_attn q, k, v, o, ffn.0 and ffn.2; VaceWanModel's
    vace_blocks, each a VaceWanAttentionBlock: the same, with after_proj, and before_proj on block
    0) as read at comfyanonymous/ComfyUI 01c4fa4c746a16712ccabac3ce7ff71c48340214. ComfyUI's LoRA
    loader (comfy/lora.py model_lora_keys_unet) patches `diffusion_model.<module>.weight` of every
    such module from `diffusion_model.<module>.lora_A/lora_B.weight`; a key naming no module of the
    model is dropped."""
    dim, ffn = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"]
    block = {f"{attn}.{x}": (dim, dim) for attn in ("self_attn", "cross_attn") for x in "qkvo"}
    block |= {"ffn.0": (dim, ffn), "ffn.2": (ffn, dim)}
    linears = {f"blocks.{i}.{name}": shape for i in range(c["num_layers"]) for name, shape in block.items()}
    for i in range(len(c["vace_layers"])):
        linears |= {
            f"vace_blocks.{i}.{name}": shape for name, shape in (block | {"after_proj": (dim, dim)}).items()
        }
    return linears | {"vace_blocks.0.before_proj": (dim, dim)}


def test_the_comfyui_file_loses_no_vace_key(wan_models, tmp_path):
    """Our ComfyUI file of a LoRA on base and VACE blocks: every module is one ComfyUI's Wan VACE
    model has, with its shapes, none lost; lora.init_from reads it back to the same weights."""
    adapter = vace_adapter(wan_models)
    names, weights = random_lora(adapter, tmp_path / "ours.safetensors")
    comfy = tmp_path / "comfy.safetensors"
    # as export writes it
    lora.save_comfy(str(comfy), weights, 4.0, adapter.comfy_key, adapter.COMFY_ALPHA)
    linears = comfyui_vace_linears(adapter.transformer_config)
    tensors = load_file(comfy)
    modules = {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k}
    assert len(modules) == len(names) and modules <= linears.keys(), modules - linears.keys()
    assert {m.split(".")[0] for m in modules} == {
        "blocks",
        "vace_blocks",
    } and "vace_blocks.0.before_proj" in modules
    for module in modules:
        fan_in, fan_out = linears[module]
        assert tensors[f"diffusion_model.{module}.lora_A.weight"].shape == (4, fan_in)
        assert tensors[f"diffusion_model.{module}.lora_B.weight"].shape == (fan_out, 4)
    back, info = lora.load_lora(str(comfy), adapter.diffusers_key)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    assert (info["rank"], info["alpha"]) == (4, 4.0)


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_our_loop_renders_as_the_pipeline_with_our_lora_on_both_kinds_of_block(
    wan_models, base_settings, tmp_path
):
    """Control video, mask and two reference images; 4 steps with guidance: our frames equal
    WanVACEPipeline's within 1e-4 in fp32 with our LoRA file (on the base blocks and the VACE
    blocks) loaded by load_lora_weights, every module of it, and differ from the base model's (whose
    parity the A14B and validation tests hold: one pipeline render less here)."""
    adapter = vace_adapter(wan_models)
    lora_file = tmp_path / "pytorch_lora_weights.safetensors"
    names, _ = random_lora(adapter, lora_file)
    assert {n.split(".")[0] for n in names} == {
        "blocks",
        "vace_blocks",
    } and "vace_blocks.0.proj_in" in names
    control, mask, references = conditions()
    cfg = ValidationConfig(prompts=[PROMPT], num_inference_steps=4, guidance_scale=5.0)
    config = load_config(
        str(write_toml(tmp_path / "vace.toml", vace_settings(wan_models, base_settings, tmp_path)))
    )
    embeds = adapter.encode_text(["", PROMPT])
    renders = []
    with one_rank_group() as d:
        for source in (None, lora_file):
            model = render.load_model(config, adapter, d, None, str(source) if source else None).eval()
            state = validate.sample_latents(
                adapter,
                {"transformer": model},
                adapter.sampler(""),
                embeds[1:],
                embeds[:1],
                data.keyed_generator(cfg.seed, 0),
                cfg,
                [9, 32, 32],
                contextlib.nullcontext(),
                control=control,
                mask=mask,
                references=references,
            )
            ours = validate.to_frames(adapter.decode_latents(adapter.sampled(state))[0])
            renders.append(ours)
            if not source:  # the base model's parity: the A14B and validation tests below
                continue
            pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
            pipe.set_progress_bar_config(disable=True)
            pipe.load_lora_weights(str(source))
            loaded = {
                n.removesuffix(".lora_A.default_0").removesuffix(".lora_A.default")
                for n, _ in pipe.transformer.named_modules()
                if ".lora_A." in n
            }
            assert loaded == set(names)
            theirs = pipeline_frames(pipe, cfg, video=control, mask=mask, reference_images=references)
            assert ours.shape == theirs.shape == (9, 32, 32, 3)
            assert (ours - theirs).abs().max() <= 1e-4, (source, (ours - theirs).abs().max())
    assert (renders[0] - renders[1]).abs().max() > 1e-3  # the LoRA shows


def test_validation_renders_each_prompt_with_its_reference_image(
    wan_models, base_settings, tiny_data, tmp_path
):
    """validation.reference_images, one per prompt, through the renderer the training run uses: the
    pipeline's frames for that reference (no control video: its zeros and all-ones mask); with a
    control video, its mask and two references, the pipeline's frames for those, shown side by side
    in TensorBoard; refused for other models, in another count than the prompts, and a mask
    without a control video (as the pipeline refuses it)."""
    reference = tiny_data / "images" / "00001.png"
    settings = vace_settings(
        wan_models,
        base_settings,
        tmp_path,
        **{
            "validation.prompts": [PROMPT],
            "validation.reference_images": [str(reference)],
            "validation.num_inference_steps": 2,
        },
    )
    cfg = load_config(str(write_toml(tmp_path / "vace.toml", settings)))
    adapter = vace_adapter(wan_models)
    with one_rank_group() as d:
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        model = render.load_model(cfg, adapter, d, None, None).eval()
        ours = renderer.frames(model, 0, adapter.sampler(""), contextlib.nullcontext())
    pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipeline_frames(pipe, cfg.validation, reference_images=[Image.open(reference).convert("RGB")])
    assert (ours - theirs).abs().max() <= 1e-4
    # With a control video, its mask (an image for every frame: left half generated) and two
    # reference images (validation.control_videos, .masks, .reference_images): the pipeline given
    # the same frames; TensorBoard's clip shows control, mask and output side by side.
    control_path, mask_path = tmp_path / "control.mp4", tmp_path / "mask.png"
    ramp_video(control_path, 20, 32, 32, 16, 10)
    half = np.zeros((40, 48), np.uint8)
    half[:, :24] = 255
    Image.fromarray(half).save(mask_path)
    second = tiny_data / "images" / "00002.png"
    conditioned = {
        "validation.control_videos": [str(control_path)],
        "validation.masks": [str(mask_path)],
        "validation.reference_images": [[str(reference), str(second)]],
    }
    with_control = load_config(str(write_toml(tmp_path / "c.toml", {**settings, **conditioned})))
    shown, rendered = {}, []

    class Metrics:  # what run() shows
        def clip(self, step, name, frames, fps):
            shown[name] = frames

        def text(self, *args):
            pass

    with one_rank_group() as d:
        renderer = validate.ClipRenderer(adapter, with_control.validation, cfg.data, str(tmp_path), d)
        clip = renderer.clip
        renderer.clip = lambda *args: rendered.append(clip(*args)) or rendered[-1]
        renderer.run(model, 0, Metrics(), contextlib.nullcontext())
    controlled = rendered[0][0]
    control = validate.load_control(str(control_path), [9, 32, 32], float(renderer.fps))
    mask = validate.load_control(str(mask_path), [9, 32, 32], float(renderer.fps), mask=True)
    assert mask[:, :, :8].min() == 255 and mask[:, :, -8:].max() == 0  # centre-cropped from 48 wide
    theirs = pipeline_frames(
        pipe,
        cfg.validation,
        video=[Image.fromarray(frame) for frame in control.numpy()],
        mask=[Image.fromarray(frame) for frame in mask.numpy()],
        reference_images=[Image.open(path).convert("RGB") for path in (reference, second)],
    )
    assert (controlled - theirs).abs().max() <= 1e-4
    assert (controlled - ours).abs().max() > 1e-3  # the control shows
    held = [
        torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((32, 32)))).expand(9, -1, -1, -1)
        for path in (reference, second)
    ]
    assert torch.equal(
        shown["val/clip_0"], torch.cat([control, mask, *held, validate.to_uint8(controlled)], dim=2)
    )
    with pytest.raises(ConfigError, match="validation.masks has 1 for 0 validation.control_videos"):
        load_config(
            str(
                write_toml(
                    tmp_path / "m.toml",
                    {**settings, "validation.masks": [str(mask_path)], "validation.do_validation": True},
                )
            )
        )
    with pytest.raises(ConfigError, match="validation.reference_images conditions VACE models"):
        load_config(
            str(
                write_toml(
                    tmp_path / "t2v.toml",
                    {**settings, "model.type": "t2v", "validation.do_validation": True},
                )
            )
        )
    with pytest.raises(ConfigError, match="validation.reference_images has 1 for 2 validation.prompts"):
        load_config(
            str(
                write_toml(
                    tmp_path / "two.toml",
                    {
                        **settings,
                        "validation.prompts": [PROMPT, PROMPT],
                        "validation.do_validation": True,
                    },
                )
            )
        )


def vace_data(root, tiny_data, count: int = 4):
    """A metadata.jsonl dataset of 4 of the session's clips, each with a control video (another
    clip, to restyle), a mask image (left half white: generate; right half black: keep) and a
    reference image (another clip's first frame); masks and references copied, as a test edits them.
    """
    (root / "masks").mkdir(parents=True)
    (root / "videos").symlink_to(tiny_data / "videos")
    shutil.copytree(tiny_data / "images", root / "references")
    rows = []
    for i in range(count):
        mask = np.zeros((40, 48), np.uint8)
        mask[:, :24] = 255
        Image.fromarray(mask).save(root / "masks" / f"{i}.png")
        rows.append(
            json.dumps(
                {
                    "video": f"videos/0000{i}.mp4",
                    "prompt": f"clip {i}",
                    "control": f"videos/{i + 8:05d}.mp4",
                    "mask": f"masks/{i}.png",
                    "reference": f"references/{(i + 1) % count:05d}.png",
                }
            )
            + "\n"
        )
    (root / "metadata.jsonl").write_text("".join(rows))
    return root


def test_vace_list_files_may_leave_a_condition_empty_and_list_several_references(tmp_path):
    """references.txt lists a clip's references separated by "|" (metadata.csv alike), an empty
    line of controls.txt, masks.txt or references.txt gives the clip none (the last line's too);
    an empty path among several is named."""
    (tmp_path / "prompts.txt").write_text("a\nb\nc\n")
    (tmp_path / "videos.txt").write_text("v0.mp4\nv1.mp4\nv2.mp4\n")
    (tmp_path / "controls.txt").write_text("\nc1.mp4\n\n")
    (tmp_path / "masks.txt").write_text("\nm1.png\n\n")
    (tmp_path / "references.txt").write_text("r0.png | r1.png\nr2.png\n\n")
    cfg = DataConfig(
        data_root=str(tmp_path),
        control_column="controls.txt",
        mask_column="masks.txt",
        reference_column="references.txt",
    )
    clips = data.read_clips(cfg)
    assert [c.control and c.control.name for c in clips] == [None, "c1.mp4", None]
    assert [c.mask and c.mask.name for c in clips] == [None, "m1.png", None]
    assert [[r.name for r in c.reference] for c in clips] == [["r0.png", "r1.png"], ["r2.png"], []]
    (tmp_path / "masks.txt").write_text("\nm1.png\n\n\n\n")  # blanks past the clips: dropped
    assert [c.mask and c.mask.name for c in data.read_clips(cfg)] == [None, "m1.png", None]
    (tmp_path / "references.txt").write_text("r0.png|\n\n\n")
    with pytest.raises(ConfigError, match=r"references.txt line 1: an empty reference image among"):
        data.read_clips(cfg)
    for name in ("prompts.txt", "videos.txt"):
        (tmp_path / name).unlink()
    (tmp_path / "metadata.csv").write_text("video,prompt,reference\nv0.mp4,a,r0.png|r1.png\nv1.mp4,b,\n")
    clips = data.read_clips(DataConfig(data_root=str(tmp_path)))
    assert [[r.name for r in c.reference] for c in clips] == [["r0.png", "r1.png"], []]


def test_a_folder_or_a_reference_too_wide_for_the_frame_is_named_before_any_compute(
    wan_models, base_settings, tiny_data, tmp_path
):
    """A control video that is a folder, and a reference image that leaves no row once fitted into
    the frame (900 x 3 on 32 x 32: the pipeline's resize would stop with a ValueError), are each
    named by the clip's file and line before any compute, as a bad clip data.skip_bad skips; in
    validation.reference_images (the render command's --reference) by the key, before the cache
    pass, and so is a validation file that is missing or a folder."""
    root = vace_data(tmp_path / "data", tiny_data)
    rows = (root / "metadata.jsonl").read_text().splitlines()
    wide = root / "references" / "wide.png"
    Image.fromarray(np.zeros((3, 900, 3), np.uint8)).save(wide)
    settings = vace_settings(wan_models, base_settings, tmp_path / "run", **{"data.data_root": str(root)})
    cfg = load_config(str(write_toml(tmp_path / "vace.toml", settings)))
    for row, reason in (
        ({"control": "videos"}, f"control {root / 'videos'}: is a folder, not a file"),
        (
            {"reference": "references/wide.png"},
            f"reference {wide} is 900x3 (width x height): fitted into the 32x32 frame (its sides cut to "
            "multiples of 8 first) it keeps 0x0 pixels; crop it nearer the frame's aspect ratio, or "
            "remove it (data.reference_column)",
        ),
    ):
        (root / "metadata.jsonl").write_text(
            "\n".join([rows[0], json.dumps(json.loads(rows[1]) | row), *rows[2:]]) + "\n"
        )
        with one_rank_group() as d, pytest.raises(data.BadClip) as refused:
            prepare_run(cfg, d)
        assert f"metadata.jsonl line 2: {root / 'videos' / '00001.mp4'}: {reason}. 1 clip(s)" in str(
            refused.value
        )
        assert "data.skip_bad = true" in str(refused.value)
    validation = {"validation.do_validation": True, "validation.prompts": [PROMPT]}
    cfg = load_config(
        str(
            write_toml(
                tmp_path / "v.toml", {**settings, **validation, "validation.reference_images": [str(wide)]}
            )
        )
    )
    with one_rank_group() as d, pytest.raises(ranks.StopRun) as refused:  # every rank's check
        prepare_run(cfg, d)
    assert str(refused.value) == (
        f"validation.reference_images[0]: reference {wide} is 900x3 (width x height): fitted into the "
        "32x32 frame (its sides cut to multiples of 8 first) it keeps 0x0 pixels; crop it nearer the "
        "frame's aspect ratio; fix validation.reference_images or --reference"
    )
    with one_rank_group() as d, pytest.raises(ConfigError) as rendered:  # render.py --reference
        validate.ClipRenderer(vace_adapter(wan_models), cfg.validation, cfg.data, str(tmp_path), d)
    assert str(rendered.value) == str(refused.value)
    (tmp_path / "text.png").write_text("not an image")
    cfg.validation.reference_images = [str(tmp_path / "text.png")]
    unreadable = f"validation.reference_images[0] = {tmp_path / 'text.png'}: not a readable image ("
    with one_rank_group() as d, pytest.raises(ranks.StopRun, match=re.escape(unreadable)):
        prepare_run(cfg, d)
    for path, what in (
        (tmp_path / "gone.png", "does not exist"),
        (root / "references", "is a folder, not a file"),
    ):
        cfg.validation.reference_images = [str(path)]
        message = (
            f"validation.reference_images[0] = {path} {what}: fix validation.reference_images or --reference"
        )
        with one_rank_group() as d, pytest.raises(ranks.StopRun, match=re.escape(message)):
            prepare_run(cfg, d)


def test_the_cache_holds_each_clips_vace_condition_keyed_by_its_files(
    wan_models, base_settings, tiny_data, tmp_path, caplog
):
    """The control entry is the clip's window of its control video, its mask and its reference
    image, encoded as encode_control encodes them (the pipeline's, test above); changing a clip's
    mask or its reference image re-encodes that clip's control entry only, and keeps its video
    latents; the other families refuse the VACE columns."""
    root = vace_data(tmp_path / "data", tiny_data)
    settings = vace_settings(
        wan_models,
        base_settings,
        tmp_path / "out",
        **{
            "data.data_root": str(root),
            "data.cache_dir": str(tmp_path / "cache"),
            "data.held_out": 0,
        },
    )
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with one_rank_group() as d:
        adapter, entries, items, _ = prepare_run(cfg, d)
        item = items[1]
        mask = data.decode_control(item, kind="mask")
        # the left edge survives the crop
        assert mask.shape == (9, 32, 32, 3) and mask[:, :, :4].min() == 255
        expected = adapter.encode_control(
            [data.decode_control(item)], [mask], [data.load_references(item)], item.resolution
        )
        cached = load_file(entries.path(item, "control"))
        assert cached.keys() == {"control_latents", "reference_latents"}
        assert cached["control_latents"].shape == (96, 3, 4, 4) and cached["reference_latents"].shape == (
            16,
            1,
            4,
            4,
        )
        for key in cached:
            torch.testing.assert_close(cached[key], expected[key][0], rtol=0, atol=1e-5)
        before = {kind: [entries.path(i, kind) for i in items] for kind in ("video", "control")}
        shutil.copy(
            root / "references" / "00003.png", root / "references" / "00002.png"
        )  # clip 1's reference
        mask = np.asarray(Image.open(root / "masks" / "2.png")).copy()
        Image.fromarray(255 - mask).save(root / "masks" / "2.png")  # clip 2's mask, inverted
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vidtrain"):
            entries, items, _ = cache.prepare(cfg, adapter, d)
        after = {kind: [entries.path(i, kind) for i in items] for kind in ("video", "control")}
        assert after["video"] == before["video"]
        assert [a != b for a, b in zip(after["control"], before["control"])] == [
            False,
            True,
            True,
            False,
        ]
        assert any("cache: 2 clips encoded, 2 reused" in r.getMessage() for r in caplog.records), caplog.text
        # Reference-to-video and several references: clip 0 without a control video or mask (the
        # pipeline's video=None), every clip with two references (a JSON list; clip 3's separated
        # by "|"). The references re-key every control entry; the video latents stay.
        rows = [json.loads(row) for row in (root / "metadata.jsonl").read_text().splitlines()]
        del rows[0]["control"], rows[0]["mask"]
        for row in rows:
            row["reference"] = [row["reference"], "references/00004.png"]
        rows[3]["reference"] = "|".join(rows[3]["reference"])
        (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        entries, items, _ = cache.prepare(cfg, adapter, d)
        assert [entries.path(i, "video") for i in items] == after["video"]
        assert not {entries.path(i, "control") for i in items} & set(after["control"])
        assert items[3].clip.reference == (
            root / "references" / "00000.png",
            root / "references" / "00004.png",
        )
        cached = load_file(entries.path(items[0], "control"))
        pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
        references = [Image.open(path).convert("RGB") for path in items[0].clip.reference]
        torch.testing.assert_close(
            wan_vace.context(cached["control_latents"][None], cached["reference_latents"][None]),
            pipeline_context(pipe, None, None, references),
            rtol=0,
            atol=1e-5,
        )
        # a mask without a control video: the pipeline refuses it (and VACE's own code drops it)
        del rows[1]["control"]
        (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(ConfigError, match=r"line 2: .*has a mask \(.*1.png\) but no control video"):
            cache.prepare(cfg, adapter, d)
        t2v = {
            **settings,
            "model.path": str(wan_models("t2v")),
            "model.type": "t2v",
            "lora.target_modules": ["to_q"],
        }
        for key in ("mask_column", "reference_column"):
            with pytest.raises(
                ConfigError, match=f"data.{key} = x.txt conditions Wan VACE models, and model.path"
            ):
                prepare_run(
                    load_config(str(write_toml(tmp_path / "t.toml", {**t2v, f"data.{key}": "x.txt"}))),
                    d,
                )
        rows[1]["control"] = "videos/00009.mp4"
        rows[3]["reference"] = "references/00000.png"
        (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(
            ConfigError,
            match=r"metadata.jsonl line 4 has 1 reference image\(s\), but 3 other clip\(s\) have 2",
        ):
            prepare_run(cfg, d)


@pytest.fixture(scope="module")
def vace_dataset(tiny_data, tmp_path_factory):
    """vace_data's 6 clips and a cache shared by this module's training runs."""
    root = tmp_path_factory.mktemp("vace")
    return vace_data(root / "data", tiny_data, count=6), root / "cache"


def vace_run(wan_models, base_settings, vace_dataset, output_dir, **extra) -> dict:
    """Settings of a short in-process run on vace_dataset: 4 clips to train, 2 held out."""
    root, cache_dir = vace_dataset
    return vace_settings(
        wan_models,
        base_settings,
        output_dir,
        **{"data.data_root": str(root), "data.cache_dir": str(cache_dir), "data.held_out": 2, **extra},
    )


# LoRA on the VACE blocks alone, by glob: DiffSynth-Studio's VACE LoRA (--lora_base_model "vace").
VACE_GLOBS = ["vace_blocks.*.attn1.to_*", "vace_blocks.*.ffn.net.0.proj", "vace_blocks.0.proj_in"]


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_a_lora_on_the_vace_blocks_alone_by_glob(wan_models, base_settings, vace_dataset, tmp_path):
    """lora.target_modules as globs: 2 steps train adapters on the VACE blocks alone; every exported
    key is a VACE block's, the file's header names the modules the globs matched (PEFT's LoraConfig
    reads no globs) and WanVACEPipeline's load_lora_weights loads every one; the ComfyUI file holds
    them under the names ComfyUI's VACE model has. A glob matching nothing is refused, naming the
    closest modules."""
    settings = vace_run(
        wan_models,
        base_settings,
        vace_dataset,
        tmp_path / "run",
        **{"lora.target_modules": VACE_GLOBS, "train.steps": 2},
    )
    trainer.main(["--cfg", str(write_toml(tmp_path / "glob.toml", settings))])
    lora_file = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    ours = load_file(lora_file)
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in ours}
    adapter = vace_adapter(wan_models)
    vace_blocks = range(len(adapter.transformer_config["vace_layers"]))
    per_block = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ffn.net.0.proj"]
    assert modules == {f"vace_blocks.{i}.{m}" for i in vace_blocks for m in per_block} | {
        "vace_blocks.0.proj_in"
    }
    assert lora.load_lora(str(lora_file))[1]["target_modules"] == sorted(modules)
    pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
    pipe.load_lora_weights(str(lora_file))
    loaded = {n.rsplit(".lora_A", 1)[0] for n, _ in pipe.transformer.named_modules() if n.endswith(".lora_A")}
    assert loaded == modules
    comfy = load_file(next((lora_file.parent / "comfy").glob("*.safetensors")))
    in_comfy = {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in comfy if ".lora_" in k}
    assert (
        len(in_comfy) == len(modules) and in_comfy <= comfyui_vace_linears(adapter.transformer_config).keys()
    )
    assert all(m.startswith("vace_blocks.") for m in in_comfy) and "vace_blocks.0.before_proj" in in_comfy
    with pytest.raises(
        ConfigError,
        match=r"\['vace_blocks\.\*\.attn1\.to_qq'\] match no nn.Linear .* closest to "
        r"'vace_blocks\.\*\.attn1\.to_qq': \['vace_blocks\.",
    ):
        model.check_lora_targets(adapter, ["vace_blocks.*.attn1.to_qq"])


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_a_run_with_condition_randomisation_resumes_bitwise(
    wan_models, base_settings, vace_dataset, tmp_path, monkeypatch
):
    """train.vace_*_p at 0.5 through the trainer: the cache pass adds each clip's inpainting and
    frame-reference variants to its control entry, and a run stopped at step 3 resumes to the losses
    of the run never stopped, bitwise (every draw keyed)."""
    randomised = {
        "train.vace_inpaint_p": 0.5,
        "train.vace_frame_reference_p": 0.5,
        "train.vace_drop_references_p": 0.5,
        "train.steps": 4,
        "checkpoint.checkpointing_steps": 2,
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            vace_run(wan_models, base_settings, vace_dataset, tmp_path / name, **randomised),
        )
        for name in ("reference", "stopped")
    }
    trainer.main(["--cfg", str(configs["reference"])])
    monkeypatch.setenv("VIDTRAIN_FAULT", "step_fail:3")
    with pytest.raises(SystemExit):
        trainer.main(["--cfg", str(configs["stopped"])])
    monkeypatch.delenv("VIDTRAIN_FAULT")
    trainer.main(["--cfg", str(configs["stopped"])])
    losses = train_losses(tmp_path / "reference")
    assert sorted(losses) == [1, 2, 3, 4] and train_losses(tmp_path / "stopped") == losses
    cfg = load_config(str(configs["reference"]))
    with one_rank_group() as d:
        adapter, entries, items, _ = prepare_run(cfg, d)
    assert load_file(entries.path(items[0], "control")).keys() == {
        "control_latents",
        "reference_latents",
        "inpaint_control_latents",
        "frame_reference_latents",
    }


@pytest.mark.slow
def test_sft_of_the_vace_modules_alone(wan_models, base_settings, vace_dataset, tmp_path, monkeypatch):
    """train.trainable_modules = ["vace"] (VideoX-Fun's --trainable_modules "vace"), FSDP, EMA: the
    VACE modules train in fp32 and the rest stays frozen in model.dtype; checkpoints hold only the
    VACE modules' weights, AdamW state and averages; a run stopped at step 3 resumes bitwise; the
    export is the whole transformer (the frozen rest too), which from_pretrained loads: the base
    blocks as they were, the VACE ones trained. A name matching no parameter is refused."""
    trains = {
        "train.training_type": "sft",
        "train.trainable_modules": ["vace"],
        "parallel.strategy": "fsdp",
        "train.ema_decay": 0.9,
        "train.steps": 4,
        "checkpoint.checkpointing_steps": 2,
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            vace_run(wan_models, base_settings, vace_dataset, tmp_path / name, **trains),
        )
        for name in ("reference", "stopped")
    }
    trainer.main(["--cfg", str(configs["reference"])])
    monkeypatch.setenv("VIDTRAIN_FAULT", "step_fail:3")
    with pytest.raises(SystemExit):
        trainer.main(["--cfg", str(configs["stopped"])])
    monkeypatch.delenv("VIDTRAIN_FAULT")
    trainer.main(["--cfg", str(configs["stopped"])])
    losses = train_losses(tmp_path / "reference")
    assert sorted(losses) == [1, 2, 3, 4] and train_losses(tmp_path / "stopped") == losses

    base = WanVACETransformer3DModel.from_pretrained(str(wan_models("vace")), subfolder="transformer")
    vace = {name for name, _ in base.named_parameters() if "vace" in name}
    assert {n.split(".")[0] for n in vace} == {"vace_blocks", "vace_patch_embedding"}
    saved = FileSystemReader(str(tmp_path / "reference" / "checkpoint-4")).read_metadata().state_dict_metadata
    for part in ("model", "ema"):
        assert {k.removeprefix(f"{part}.") for k in saved if k.startswith(f"{part}.")} == vace, part
    assert all("vace" in k for k in saved if k.startswith("optimizer."))
    for suffix in ("", "_ema"):
        exported = {
            name: WanVACETransformer3DModel.from_pretrained(str(tmp_path / name / f"transformer{suffix}"))
            for name in ("reference", "stopped")
        }
        ours, theirs = (dict(m.named_parameters()) for m in exported.values())
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        for name, param in base.named_parameters():
            assert torch.equal(ours[name], param) == (name not in vace), name

    adapter = load_adapter(
        ModelConfig(family="wan", path=str(wan_models("vace")), dtype="bf16", type="vace"),
        torch.device("cpu"),
    )
    transformer = adapter.load_transformer(torch.float32, trains=lambda n: lora.trainable(n, ["vace"]))
    for name, param in transformer.named_parameters():
        trained = name in vace or adapter.keeps_fp32(name)
        assert param.dtype == (torch.float32 if trained else torch.bfloat16), name
    with pytest.raises(ConfigError, match=r"train.trainable_modules: 'vcae' names no parameter .* closest"):
        model.check_trainable_modules(adapter, ["vace", "vcae"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_full_lifecycle(wan_models, base_settings, vace_dataset, tmp_path):
    """2 FSDP ranks train a LoRA on the base and VACE blocks from control, mask and reference, with
    validation from a reference image: SIGKILL after step 4, the next launch resumes from step 3 and
    ends bitwise equal to the run never stopped, clips included; TensorBoard shows the reference
    beside the clip; the export loads into WanVACEPipeline with every module, and computes there
    what our model computes; its ComfyUI file holds the VACE blocks' modules."""
    root, cache_dir = vace_dataset  # the cache the in-process runs above filled
    reference = root / "references" / "00005.png"
    lifecycle = {
        "data.data_root": str(root),
        "data.cache_dir": str(cache_dir),
        "data.held_out": 2,
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 6,
        "train.learning_rate": 1e-2,
        "checkpoint.checkpointing_steps": 3,
        "validation.do_validation": True,
        "validation.validation_steps": 3,
        "validation.num_inference_steps": 3,
        "validation.save_frames": True,
        "validation.prompts": [PROMPT],
        "validation.reference_images": [str(reference)],
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            vace_settings(wan_models, base_settings, tmp_path / name, **lifecycle),
        )
        for name in ("reference", "killed")
    }
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    assert (
        run_cmd(["--cfg", str(configs["killed"])], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:4"}).returncode
        != 0
    )
    resumed = run_ok(["--cfg", str(configs["killed"])], nproc=2)
    assert f"resumed from step 3 ({tmp_path / 'killed' / 'checkpoint-3'})" in resumed.stderr
    losses = train_losses(tmp_path / "reference")
    assert sorted(losses) == list(range(1, 7)) and train_losses(tmp_path / "killed") == losses
    val = [m for m in read_metrics(tmp_path / "reference") if "val/loss" in m]
    assert [m["step"] for m in val] == [0, 3, 6] and val[-1]["val/loss"] < val[0]["val/loss"]
    lora_dir = tmp_path / "reference" / "lora"
    ours, theirs = (
        load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")
        for name in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(k.startswith("transformer.vace_blocks.0.proj_in.") for k in ours)
    clip = "validation_res/step_6_prompt_0.safetensors"
    assert torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"],
        load_file(tmp_path / "reference" / clip)["frames"],
    )
    events = EventAccumulator(str(tmp_path / "reference" / "logs"), size_guidance={"images": 0})
    events.Reload()
    shown = events.Images("val/clip_0")
    assert [c.step for c in shown] == [0, 3, 6]
    with Image.open(io.BytesIO(shown[-1].encoded_image_string)) as gif:
        pixels = torch.from_numpy(np.array(gif.convert("RGB"))).float()
    expected = torch.from_numpy(np.array(Image.open(reference).convert("RGB").resize((32, 32)))).float()
    # the reference at the clip's left, held for every frame
    assert pixels.shape == (32, 64, 3) and (pixels[:, :32] - expected).abs().mean() < 4
    comfy = load_file(next((lora_dir / "comfy").glob("*.safetensors")))
    assert "diffusion_model.vace_blocks.0.before_proj.lora_A.weight" in comfy
    assert len([k for k in comfy if k.endswith("lora_A.weight")]) == len([k for k in ours if "lora_A" in k])

    cfg = load_config(str(configs["reference"]))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(
            cfg, adapter, d, None, str(lora_dir / "pytorch_lora_weights.safetensors")
        ).eval()
    pipe = WanVACEPipeline.from_pretrained(str(wan_models("vace")))
    pipe.load_lora_weights(str(lora_dir / "pytorch_lora_weights.safetensors"))
    loaded = {n.rsplit(".lora_A", 1)[0] for n, _ in pipe.transformer.named_modules() if n.endswith(".lora_A")}
    assert loaded == {k.removeprefix("transformer.").rsplit(".lora_A", 1)[0] for k in ours if "lora_A" in k}
    gen = torch.Generator().manual_seed(0)
    x, embeds = torch.randn(2, 16, 3, 4, 4, generator=gen), torch.randn(2, 512, 32, generator=gen)
    control = torch.randn(2, 96, 3, 4, 4, generator=gen)
    with torch.no_grad():
        t = torch.tensor([10, 900])
        torch.testing.assert_close(
            adapter._predict(pipe.transformer, x, t, embeds, None, control),
            adapter._predict(model, x, t, embeds, None, control),
            rtol=0,
            atol=1e-5,
        )


def test_validate_renders_with_a_reference(
    wan_models, base_settings, tiny_data, tmp_path, caplog, monkeypatch
):
    """render.py --reference renders the base model's clip of each prompt with its reference
    image, under a name that tells references apart (another reference writes another clip: here two
    references, "|" between them, with --control and --mask); --mask without --control is refused
    before any model is read."""
    settings = vace_settings(
        wan_models, base_settings, tmp_path / "out", **{"validation.num_inference_steps": 2}
    )
    config = str(write_toml(tmp_path / "c.toml", settings))
    control, mask = tmp_path / "control.mp4", tiny_data / "images" / "00003.png"
    ramp_video(control, 20, 32, 32, 16, 10)
    images = [str(tiny_data / "images" / name) for name in ("00000.png", "00001.png", "00002.png")]
    given, condition = [], WanAdapter._vace_sampling_condition  # what each render conditions on
    monkeypatch.setattr(
        WanAdapter,
        "_vace_sampling_condition",
        lambda self, control, mask, references, resolution: (
            given.append((control is not None, mask is not None and mask.shape, len(references)))
            or condition(self, control, mask, references, resolution)
        ),
    )
    for arguments in (
        ["--reference", images[0]],
        ["--reference", "|".join(images[1:]), "--control", str(control), "--mask", str(mask)],
    ):
        render.main(["--cfg", config, "--prompt", PROMPT, *arguments])
    clips = sorted((tmp_path / "out" / "validation_res").glob("render_base_prompt_0_*.mp4"))
    assert len(clips) == 2 and given == [(False, False, 1), (True, (9, 32, 32, 3), 2)]
    with caplog.at_level(logging.ERROR, logger="vidtrain"), pytest.raises(SystemExit):
        render.main(["--cfg", config, "--prompt", PROMPT, "--mask", str(mask)])
    assert "validation.masks has 1 for 0 validation.control_videos" in caplog.text


@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
def test_vace_fun_a14b_trains_each_expert_on_its_range_and_samples_as_the_pipeline(wan_models):
    """Wan2.2-VACE-Fun-A14B's layout (two VACE experts, boundary_ratio 0.875): each expert trains
    only on its timesteps, as the other A14B models; our loop samples with both experts what
    WanVACEPipeline (transformer_2, boundary_ratio) samples from a control video, its mask and two
    references, within 1e-4 in fp32, each step by the same expert (2 steps: one each)."""
    path = wan_models("a14b-vace")
    for folder in ("transformer", "transformer_2"):
        config = json.loads((path / folder / "config.json").read_text())
        assert set(config) - {"_class_name", "_diffusers_version"} == WAN_VACE_KEYS
        assert config["_class_name"] == "WanVACETransformer3DModel"
    index = json.loads((path / "model_index.json").read_text())
    assert (index["_class_name"], index["boundary_ratio"]) == ("WanVACEPipeline", 0.875)
    control, mask, references = conditions()
    experts, drawn = {}, {}
    for expert in ("high_noise", "low_noise"):
        adapter = load_adapter(
            ModelConfig(family="wan", path=str(path), dtype="fp32", type="vace", expert=expert),
            torch.device("cpu"),
        )
        transformer = adapter.load_transformer().train()
        experts[adapter.transformer_folder] = transformer.eval()
        seen = []
        hook = transformer.register_forward_pre_hook(
            lambda m, a, kw: seen.extend(kw["timestep"].flatten().tolist()), with_kwargs=True
        )
        mean = torch.zeros(2, 16, 3, 4, 4)
        batch = {
            "latent_mean": mean,
            "latent_logvar": torch.full_like(mean, -30.0),
            "prompt_embeds": torch.zeros(2, 512, 32),
            "control_latents": torch.zeros(2, 96, 3, 4, 4),
        }
        with torch.no_grad():
            for step in range(2):
                adapter.train_loss(transformer, batch, [data.keyed_generator(step, i) for i in range(2)])
        hook.remove()
        drawn[expert] = seen
    assert all(t >= 875 for t in drawn["high_noise"]) and all(t < 875 for t in drawn["low_noise"]), drawn
    assert len(drawn["high_noise"]) == len(drawn["low_noise"]) == 4
    calls = []
    for folder, module in experts.items():
        module.register_forward_pre_hook(
            lambda m, a, kw, folder=folder: calls.append((folder, float(kw["timestep"].flatten()[0]))),
            with_kwargs=True,
        )
    cfg = ValidationConfig(prompts=[PROMPT], num_inference_steps=2, guidance_scale=5.0)
    embeds = adapter.encode_text(["", PROMPT])
    state = validate.sample_latents(
        adapter,
        experts,
        adapter.sampler(""),
        embeds[1:],
        embeds[:1],
        data.keyed_generator(cfg.seed, 0),
        cfg,
        [9, 32, 32],
        contextlib.nullcontext(),
        control=control,
        mask=mask,
        references=references,
    )
    ours = validate.to_frames(adapter.decode_latents(adapter.sampled(state))[0])
    pipe = WanVACEPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    theirs_calls = []
    for folder in ("transformer", "transformer_2"):
        getattr(pipe, folder).register_forward_pre_hook(
            lambda m, a, kw, folder=folder: theirs_calls.append((folder, float(kw["timestep"].flatten()[0]))),
            with_kwargs=True,
        )
    theirs = pipeline_frames(pipe, cfg, video=control, mask=mask, reference_images=references)
    assert (ours - theirs).abs().max() <= 1e-4, (ours - theirs).abs().max()
    # one forward per step (cond and uncond batched) against the pipeline's two
    assert calls == theirs_calls[::2] and {folder for folder, _ in calls} == {"transformer", "transformer_2"}


# Condition randomisation (train.vace_*_p), as VideoX-Fun's VACE trainer draws it.


def videox_fun_get_random_mask(shape, np_random=np.random, py_random=random, torch_randint=torch.randint):
    """VideoX-Fun's get_random_mask (aigc-apps/VideoX-Fun, videox_fun/data/utils.py:16-97 at
    804a4258), copied as it is but for its image_start_only branch (the VACE trainer leaves it off:
    scripts/wan2.2_vace_fun/train.py:1352), its comments, and its sources of randomness passed in:
    by default numpy's, Python's and torch's global generators, as VideoX-Fun draws it."""
    f, c, h, w = shape
    mask = torch.zeros((f, 1, h, w), dtype=torch.uint8)
    if f != 1:
        mask_index = np_random.choice(
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], p=[0.05, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.1, 0.05, 0.05]
        )
    else:
        mask_index = np_random.choice([0, 1, 7, 8], p=[0.2, 0.7, 0.05, 0.05])
    if mask_index == 0:
        center_x = torch_randint(0, w, (1,)).item()
        center_y = torch_randint(0, h, (1,)).item()
        block_size_x = torch_randint(w // 4, w // 4 * 3, (1,)).item()
        block_size_y = torch_randint(h // 4, h // 4 * 3, (1,)).item()
        start_x = max(center_x - block_size_x // 2, 0)
        end_x = min(center_x + block_size_x // 2, w)
        start_y = max(center_y - block_size_y // 2, 0)
        end_y = min(center_y + block_size_y // 2, h)
        mask[:, :, start_y:end_y, start_x:end_x] = 1
    elif mask_index == 1:
        mask[:, :, :, :] = 1
    elif mask_index == 2:
        mask_frame_index = np_random.randint(1, 5)
        mask[mask_frame_index:, :, :, :] = 1
    elif mask_index == 3:
        mask_frame_index = np_random.randint(1, 5)
        mask[mask_frame_index:-mask_frame_index, :, :, :] = 1
    elif mask_index == 4:
        center_x = torch_randint(0, w, (1,)).item()
        center_y = torch_randint(0, h, (1,)).item()
        block_size_x = torch_randint(w // 4, w // 4 * 3, (1,)).item()
        block_size_y = torch_randint(h // 4, h // 4 * 3, (1,)).item()
        start_x = max(center_x - block_size_x // 2, 0)
        end_x = min(center_x + block_size_x // 2, w)
        start_y = max(center_y - block_size_y // 2, 0)
        end_y = min(center_y + block_size_y // 2, h)
        mask_frame_before = np_random.randint(0, f // 2)
        mask_frame_after = np_random.randint(f // 2, f)
        mask[mask_frame_before:mask_frame_after, :, start_y:end_y, start_x:end_x] = 1
    elif mask_index == 5:
        mask = torch_randint(0, 2, (f, 1, h, w), dtype=torch.uint8)
    elif mask_index == 6:
        num_frames_to_mask = py_random.randint(1, max(f // 2, 1))
        frames_to_mask = py_random.sample(range(f), num_frames_to_mask)
        for i in frames_to_mask:
            block_height = py_random.randint(1, h // 4)
            block_width = py_random.randint(1, w // 4)
            top_left_y = py_random.randint(0, h - block_height)
            top_left_x = py_random.randint(0, w - block_width)
            mask[i, 0, top_left_y : top_left_y + block_height, top_left_x : top_left_x + block_width] = 1
    elif mask_index == 7:
        center_x = torch_randint(0, w, (1,)).item()
        center_y = torch_randint(0, h, (1,)).item()
        a = torch_randint(min(w, h) // 8, min(w, h) // 4, (1,)).item()
        b = torch_randint(min(h, w) // 8, min(h, w) // 4, (1,)).item()
        y_grid, x_grid = torch.meshgrid(
            torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
        )
        mask[0, 0, :, :] = (((y_grid - center_y) ** 2) / (b**2) + ((x_grid - center_x) ** 2) / (a**2) < 1).to(
            torch.uint8
        )
    elif mask_index == 8:
        center_x = torch_randint(0, w, (1,)).item()
        center_y = torch_randint(0, h, (1,)).item()
        radius = torch_randint(min(h, w) // 8, min(h, w) // 4, (1,)).item()
        y_grid, x_grid = torch.meshgrid(
            torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
        )
        mask[0, 0, :, :] = ((y_grid - center_y) ** 2 + (x_grid - center_x) ** 2 < radius**2).to(torch.uint8)
    elif mask_index == 9:
        for idx in range(f):
            if np_random.rand() > 0.5:
                mask[idx, :, :, :] = 1
    return mask


class KeyedNumpy:
    """numpy.random's calls in get_random_mask, drawn from a torch generator as inpaint_mask draws:
    choice(options, p) one of options at its chance, randint(low, high) from low to high - 1 (as
    numpy's), rand() uniform in [0, 1)."""

    def __init__(self, g: torch.Generator):
        self.g = g

    def choice(self, options, p):
        return options[int(torch.multinomial(torch.tensor(p, dtype=torch.float64), 1, generator=self.g))]

    def randint(self, low, high):
        return int(torch.randint(low, high, (), generator=self.g))

    def rand(self):
        return torch.rand((), generator=self.g)


class KeyedPython(KeyedNumpy):
    """random's calls: randint(a, b) from a to b, both included (Python's), sample(range(n), k) k
    of them without repeats."""

    def randint(self, a, b):
        return int(torch.randint(a, b + 1, (), generator=self.g))

    def sample(self, population, k):
        return [population[i] for i in torch.randperm(len(population), generator=self.g)[:k].tolist()]


def mask_features(mask: torch.Tensor) -> list[float]:
    """What tells get_random_mask's kinds of mask [F, H, W] apart: everything masked; the masked
    share; whole frames only (kinds 1, 2, 3, 9); the first frame alone (7, 8); the same on every
    frame (0, 1); the frames touched."""
    frames = mask.flatten(1).float().mean(1)
    touched = frames > 0
    return [
        float(mask.all()),
        float(mask.float().mean()),
        float(bool(((frames == 0) | (frames == 1)).all())),
        float(touched[0] and not touched[1:].any()),
        float(bool((mask == mask[:1]).all())),
        float(touched.float().mean()),
    ]


def test_our_inpainting_masks_are_drawn_as_videox_funs():
    """wan_vace.inpaint_mask equals VideoX-Fun's get_random_mask (above) bitwise when that draws its
    numbers as inpaint_mask does (KeyedNumpy, KeyedPython, torch.randint with the generator), over
    every kind of mask at several clip shapes; and with VideoX-Fun's own global generators the
    masks' features have the means ours have, to 4.5 standard errors of the difference (3000 masks
    over 9 frames, 600 over one)."""
    for key in range(1500):
        frames, height, width = ((9, 16, 16), (1, 16, 16), (5, 24, 40))[key % 3]
        ours = wan_vace.inpaint_mask(frames, height, width, data.keyed_generator(0, "mask", key))
        g = data.keyed_generator(0, "mask", key)
        theirs = videox_fun_get_random_mask(
            (frames, 3, height, width),
            KeyedNumpy(g),
            KeyedPython(g),
            lambda low, high, size, dtype=None, g=g: torch.randint(low, high, size, generator=g, dtype=dtype),
        )
        assert torch.equal(ours, theirs[:, 0]), key
    np.random.seed(0)
    random.seed(0)
    torch.manual_seed(0)
    for frames, n in ((9, 3000), (1, 600)):
        theirs = torch.tensor(
            [mask_features(videox_fun_get_random_mask((frames, 3, 16, 16))[:, 0]) for _ in range(n)]
        )
        ours = torch.tensor(
            [
                mask_features(wan_vace.inpaint_mask(frames, 16, 16, data.keyed_generator(1, "mask", i)))
                for i in range(n)
            ]
        )
        error = ((theirs.var(0) + ours.var(0)) / n).sqrt()
        gap = (theirs.mean(0) - ours.mean(0)).abs()
        assert (gap <= 4.5 * error + 1e-9).all(), (frames, theirs.mean(0), ours.mean(0), error)


def test_the_reference_frame_is_drawn_as_videox_funs_random_control_reference():
    """wan_vace.reference_frame's chances are those of VideoX-Fun's --control_ref_image "random"
    (its train.sh's setting; scripts/wan2.2_vace_fun/train.py:1249-1260 at 804a4258, copied below):
    each frame's share of 4000 draws over 9 frames within 4.5 standard errors of its chance."""

    def _create_special_list(length):
        if length == 1:
            return [1.0]
        if length >= 2:
            first_element = 0.40
            remaining_sum = 1.0 - first_element
            other_elements_value = remaining_sum / (length - 1)
            special_list = [first_element] + [other_elements_value] * (length - 1)
            return special_list

    n, chances = 4000, torch.tensor(_create_special_list(9), dtype=torch.float64)
    drawn = [wan_vace.reference_frame(9, data.keyed_generator(0, "vace_frame", i)) for i in range(n)]
    shares = torch.bincount(torch.tensor(drawn), minlength=9).double() / n
    assert ((shares - chances).abs() <= 4.5 * (chances * (1 - chances) / n).sqrt()).all(), shares
    assert wan_vace.reference_frame(1, data.keyed_generator(0, "vace_frame", 0)) == 0


def videox_fun_inpaint_context(encode, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VideoX-Fun's VACE context of an inpainting sample without references
    (scripts/wan2.2_vace_fun/train.py at 804a4258): 1352-1353 `mask_pixel_values =
    pixel_values * (1 - mask)`; 1831 the mask tiled over 3 channels; vace_encode_frames (1700-1728:
    the mask thresholded at 0.5, inactive = i * (1 - m), reactive = i * m, each through the VAE's
    mode, concatenated), vace_encode_masks (1730-1762: the first channel's 8 x 8 blocks folded into
    channels, nearest-exact to the latent frames) and vace_latent (1764: the two concatenated).
    pixels [3, F, H, W] in [-1, 1], mask [F, H, W] (1: generate); encode: the VAE's mode."""
    mask = mask[None].float().repeat(3, 1, 1, 1)
    frames = pixels * (1 - mask)
    m = torch.where(mask > 0.5, 1.0, 0.0)
    inactive, reactive = frames * (1 - m) + 0 * m, frames * m + 0 * (1 - m)
    latent = torch.cat([encode(inactive[None])[0], encode(reactive[None])[0]], dim=0)
    c, depth, height, width = mask.shape
    new_depth = int((depth + 3) // 4)
    height, width = 2 * (int(height) // (8 * 2)), 2 * (int(width) // (8 * 2))
    folded = mask[0].view(depth, height, 8, width, 8).permute(2, 4, 0, 1, 3).reshape(64, depth, height, width)
    folded = F.interpolate(folded[None], size=(new_depth, height, width), mode="nearest-exact")[0]
    return torch.cat([latent, folded], dim=0)


def test_condition_randomisation_as_videox_funs_vace_trainer(
    wan_models, base_settings, tiny_data, tmp_path, write_config
):
    """train.vace_inpaint_p and train.vace_frame_reference_p cache each clip's variants beside its
    own condition: the clip masked by its keyed mask, encoded as VideoX-Fun encodes an inpainting
    sample, and one frame of the window encoded as a reference image. At 1 the transformer reads
    them in place of the clip's own control and references; train.vace_drop_references_p at 1 gives
    it none (and the noisy sequence none in front); at 0 every loss is bitwise today's; draws
    repeat for a key. Other families and Wan without VACE refuse the keys."""
    root = vace_data(tmp_path / "data", tiny_data)
    probabilities = {"train.vace_inpaint_p": 1.0, "train.vace_frame_reference_p": 1.0}
    settings = vace_settings(
        wan_models,
        base_settings,
        tmp_path / "out",
        **{"data.data_root": str(root), "data.cache_dir": str(tmp_path / "cache"), "data.held_out": 0},
        **probabilities,
    )
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with one_rank_group() as d:
        adapter, entries, items, _ = prepare_run(cfg, d)
    item = items[1]
    cached = load_file(entries.path(item, "control"))
    assert cached.keys() == {
        "control_latents",
        "reference_latents",
        "inpaint_control_latents",
        "frame_reference_latents",
    }
    window = data.decode_clip(item)  # uint8 [9, 32, 32, 3]
    pixels = window.permute(3, 0, 1, 2).float() / 127.5 - 1.0
    # the reference is one frame of the window, encoded alone (VideoX-Fun's padding_image of a frame
    # of the clip's own size is the frame: train.py:1263-1266)
    frames = [adapter._vae_mode(pixels[None, :, i : i + 1])[0] for i in range(9)]
    matches = [
        i for i, f in enumerate(frames) if torch.allclose(f, cached["frame_reference_latents"], atol=1e-5)
    ]
    assert len(matches) == 1
    # the inpainting condition: the mask keyed by (run.seed, clip), the rest as VideoX-Fun builds it
    mask = wan_vace.inpaint_mask(9, 32, 32, data.keyed_generator(cfg.run.seed, "vace_inpaint", item.content))
    torch.testing.assert_close(
        cached["inpaint_control_latents"],
        videox_fun_inpaint_context(adapter._vae_mode, pixels, mask),
        rtol=0,
        atol=1e-5,
    )
    assert not torch.allclose(cached["inpaint_control_latents"], cached["control_latents"], atol=1e-3)

    # the training forward under each setting, on a batch of two clips
    batch = entries.load_batch(items[:2])
    transformer = adapter.load_transformer().train()
    seen = {}
    transformer.register_forward_hook(lambda m, a, kw, out: seen.update(kw), with_kwargs=True)

    def loss(vace_condition, batch=batch, step=1):
        run_adapter = load_adapter(cfg.model, torch.device("cpu"), RunSettings(vace_condition=vace_condition))
        with torch.no_grad():
            value = run_adapter.train_loss(
                transformer, batch, [data.keyed_generator(0, step, p) for p in range(2)]
            )
        return value, seen["control_hidden_states"], seen["hidden_states"]

    _, control, x_t = loss((0.0, 1.0, 1.0))
    assert control.shape == (2, 96, 4, 4, 4) and x_t.shape == (2, 16, 4, 4, 4)
    expected = wan_vace.context(batch["inpaint_control_latents"], batch["frame_reference_latents"])
    torch.testing.assert_close(control, expected, rtol=0, atol=0)
    _, control, x_t = loss((1.0, 0.0, 0.0))
    assert x_t.shape == (2, 16, 3, 4, 4)
    torch.testing.assert_close(control, batch["control_latents"], rtol=0, atol=0)

    # at 0: today's loss, bitwise, whatever the entries hold
    today = {
        k: v for k, v in batch.items() if k not in ("inpaint_control_latents", "frame_reference_latents")
    }
    baseline, control, x_today = loss((0.0, 0.0, 0.0), today)
    assert torch.equal(loss((0.0, 0.0, 0.0))[0], baseline)
    torch.testing.assert_close(
        control, wan_vace.context(batch["control_latents"], batch["reference_latents"]), rtol=0, atol=0
    )
    # the condition's draws leave the latent sample, timestep and noise as they were
    assert torch.equal(loss((0.0, 0.0, 1.0))[2], x_today)

    # halfway: the draws repeat for their keys, and differ between steps
    half = (0.3, 0.3, 0.5)
    choices = {}
    for step in range(12):
        drawn = wan_vace.drawn_condition(batch, [data.keyed_generator(0, step, p) for p in range(2)], *half)
        again = wan_vace.drawn_condition(batch, [data.keyed_generator(0, step, p) for p in range(2)], *half)
        assert all(torch.equal(drawn[k], again[k]) for k in drawn) and drawn.keys() == again.keys()
        references = drawn.get("reference_latents")
        framed = references is not None and torch.equal(references, batch["frame_reference_latents"])
        kind = "none" if references is None else "frame" if framed else "own"
        inpainted = tuple(
            torch.equal(drawn["control_latents"][i], batch["inpaint_control_latents"][i]) for i in range(2)
        )
        choices[step] = (kind, inpainted)
    assert {kind for kind, _ in choices.values()} == {"none", "frame", "own"}
    assert {i for _, inpainted in choices.values() for i in inpainted} == {True, False}

    wan = {"model.family": "wan", "model.type": "vace", "model.path": "/nowhere"}  # the config alone
    for settings, message in (
        (
            {"train.vace_inpaint_p": 0.5},  # the session's tiny CogVideoX
            r'train.vace_inpaint_p randomises Wan VACE\'s condition \(model.family = "wan", model.type = '
            r'"vace"\); cogvideox has no VACE condition: remove it',
        ),
        (
            {**wan, "train.vace_frame_reference_p": 1.5},
            r"train.vace_frame_reference_p = 1.5 is out of range: a probability, 0 to 1",
        ),
        (
            {**wan, "train.vace_frame_reference_p": 0.6, "train.vace_drop_references_p": 0.6},
            r"train.vace_drop_references_p = 0.6 and train.vace_frame_reference_p = 0.6 add up to more than 1",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check_config(load_config(str(write_config("keys", **settings))))
    with pytest.raises(
        ConfigError,
        match=r"train.vace_drop_references_p randomises Wan VACE's condition, and .* is not a VACE model: "
        r'remove it, or train a VACE model \(model.type = "vace"\)',
    ):
        load_adapter(
            ModelConfig(family="wan", path=str(wan_models("t2v")), dtype="fp32", type="t2v"),
            torch.device("cpu"),
            RunSettings(vace_condition=(0.5, 0.0, 0.0)),
        )
