"""Kandinsky 5: key sets, training, sampling as the pipelines, exports diffusers and ComfyUI load.

The tiny models carry the published key sets; both variants train (LoRA and sft), sample exactly as
Kandinsky5T2VPipeline / Kandinsky5I2VPipeline do (with and without our exported LoRA loaded by
load_lora_weights), and export what diffusers loads, in diffusers' layout and in ComfyUI's."""

import contextlib
import json
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import (
    K5_TARGETS,
    assert_loads_lean,
    k5_batch,
    lora_and_sft_runs,
    one_rank_group,
    read_metrics,
    run_cmd,
    run_ok,
    run_worker,
    train_losses,
    write_toml,
)
from diffusers import Kandinsky5I2VPipeline, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import data
import lora
import parallel
import ranks
import render
import validate
from config import ConfigError, LoraConfig, ModelConfig, ParallelConfig, TrainConfig, load_config
from families.kandinsky5 import Kandinsky5Adapter
from model import build_model
from model_adapter import RunSettings, load_adapter
from tools.make_tiny_model import HUNYUAN_VAE_KEYS, KANDINSKY5_KEYS
from tools.to_single_file import to_single_file

VARIANTS = {"t2v": Kandinsky5T2VPipeline, "i2v": Kandinsky5I2VPipeline}
PROMPTS = ["a red circle moves right", "a blue square moves up"]
# Image-to-video's pipeline matches the first 4 latent frames' statistics to the next: 17 frames
# (5 latent frames) leave it one to match.
FRAMES = {"t2v": 9, "i2v": 17}


def k5_settings(variant, k5_models, base_settings, tiny_data, output_dir, **extra) -> dict:
    settings = {
        **base_settings,
        "run.output_dir": str(output_dir),
        "model.path": str(k5_models(variant)),
        "model.family": "kandinsky5",
        "model.type": variant,
        "data.train_resolution": [FRAMES[variant], 32, 32],
        "train.steps": 2,
        "train.learning_rate": 1e-2,
        "train.lr_warmup_steps": 1,
        "lora.target_modules": K5_TARGETS,
        "validation.do_validation": False,
        "validation.prompts": PROMPTS,
        "validation.num_inference_steps": 4,
        "validation.guidance_scale": 5.0,
    }
    if variant == "i2v":
        settings["validation.images"] = [str(tiny_data / "images" / f"0000{i}.png") for i in range(2)]
    return {**settings, **extra}


@pytest.fixture(scope="session")
def k5_models(family_models):
    return family_models("kandinsky5")


def test_tiny_models_carry_the_published_key_sets(k5_models):
    for variant, pipeline in VARIANTS.items():
        path = k5_models(variant)
        for folder, keys in (("transformer", KANDINSKY5_KEYS), ("vae", HUNYUAN_VAE_KEYS)):
            saved = json.loads((path / folder / "config.json").read_text())
            assert set(saved) - {"_class_name", "_diffusers_version"} == keys
        assert json.loads((path / "model_index.json").read_text())["_class_name"] == pipeline.__name__


@pytest.mark.parametrize("variant", VARIANTS)
def test_loading_builds_on_meta_and_equals_from_pretrained(variant, k5_models, monkeypatch):
    """bf16, with the class's fp32 modules (time embeddings, modulations)."""
    adapter = load_adapter(
        ModelConfig(family="kandinsky5", path=str(k5_models(variant)), dtype="bf16", type=variant),
        torch.device("cpu"),
    )
    assert_loads_lean(adapter, monkeypatch)


def test_the_type_follows_the_folders_pipeline(k5_models):
    with pytest.raises(ConfigError, match='is a Kandinsky5T2VPipeline model: set model.type = "t2v"'):
        load_adapter(
            ModelConfig(family="kandinsky5", path=str(k5_models("t2v")), type="i2v"), torch.device("cpu")
        )


def test_an_image_to_video_render_shorter_than_5_latent_frames_is_refused(k5_models):
    adapter = load_adapter(
        ModelConfig(family="kandinsky5", path=str(k5_models("i2v")), type="i2v"), torch.device("cpu")
    )
    with pytest.raises(ConfigError, match="validation.resolution frames = 13: .* use at least 17 frames"):
        adapter.check_resolution([13, 32, 32], "validation.resolution")
    adapter.check_resolution([17, 32, 32], "validation.resolution")


def test_train_flow_shift_reaches_the_training_timesteps(k5_models):
    """s = shift u / (1 + (shift - 1) u) of u = sigmoid(n), n normal (musubi-tuner's "shift"
    sampling), shift 5 unless train.flow_shift says otherwise."""
    cfg = ModelConfig(family="kandinsky5", path=str(k5_models("t2v")))
    for shift, expected in ((0.0, 5.0), (2.0, 2.0)):
        adapter = load_adapter(cfg, torch.device("cpu"), RunSettings(flow_shift=shift))
        u = torch.sigmoid(torch.randn((), generator=torch.Generator().manual_seed(3)))
        drawn = adapter._sigmas([torch.Generator().manual_seed(3)])
        torch.testing.assert_close(drawn, (expected * u / (1 + (expected - 1) * u)).view(1))


def pipeline_frames(variant, path, cfg, lora_file=None):
    """The pipeline's float frames [F, H, W, 3] per prompt."""
    pipe = VARIANTS[variant].from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora_file:
        pipe.load_lora_weights(str(lora_file))
    frames = []
    for i, prompt in enumerate(cfg.prompts):
        extra = {"image": Image.open(cfg.images[i]).convert("RGB")} if cfg.images else {}
        frames.append(
            pipe(
                prompt=prompt,
                negative_prompt=cfg.negative_prompt,
                num_frames=FRAMES[variant],
                height=32,
                width=32,
                num_inference_steps=cfg.num_inference_steps,
                guidance_scale=cfg.guidance_scale,
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                **extra,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
        )
    return frames


def transformer_output(transformer, seed: int = 0) -> torch.Tensor:
    """The transformer's velocity on random inputs (the pipelines' call)."""
    config = transformer.config
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * config.in_visual_dim + 1 if config.visual_cond else config.in_visual_dim
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, 3, 4, 4, channels, generator=gen),
            encoder_hidden_states=torch.randn(1, 7, config.in_text_dim, generator=gen),
            pooled_projections=torch.randn(1, config.in_text_dim2, generator=gen),
            timestep=torch.tensor([300.0]),
            visual_rope_pos=[torch.arange(3), torch.arange(2), torch.arange(2)],
            text_rope_pos=torch.arange(7),
            return_dict=False,
        )


def assert_comfy_file_matches(lora_dir, transformer):
    """Our ComfyUI file: only diffusion_model.* keys, each a module of ComfyUI's Kandinsky 5 model
    (comfy/ldm/kandinsky5/model.py names them as diffusers does), every module of the diffusers file
    (0 lost), with the alpha."""
    comfy = next((lora_dir / "comfy").glob("*.safetensors"))
    with safe_open(str(comfy), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("diffusion_model.") for k in keys)
    ours = load_file(lora_dir / "pytorch_lora_weights.safetensors")
    modules = {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in ours}
    comfy_modules = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] for k in keys if "lora_" in k}
    assert comfy_modules == modules
    names = dict(transformer.named_modules())
    assert all(isinstance(names[m], torch.nn.Linear) for m in comfy_modules)
    assert {k for k in keys if k.endswith(".alpha")} == {f"diffusion_model.{m}.alpha" for m in modules}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_trains_exports_and_samples_as_its_pipeline(
    variant, k5_models, base_settings, tiny_data, tmp_path
):
    """Two LoRA steps and two sft steps; our loop's frames equal the pipeline's within 1e-4 in fp32
    with the base model and with our exported LoRA loaded by load_lora_weights (which changes them);
    the ComfyUI file carries every module; the sft export loads with from_pretrained and computes
    what the checkpoint's weights compute."""
    settings = k5_settings(variant, k5_models, base_settings, tiny_data, tmp_path / "lora")
    lora_file, cfg, adapter = lora_and_sft_runs(settings, tmp_path)
    base_transformer = Kandinsky5Transformer3DModel.from_pretrained(
        k5_models(variant), subfolder="transformer"
    )
    assert_comfy_file_matches(lora_file.parent, base_transformer)
    comfy_weights, comfy_info = lora.load_lora(
        str(next((lora_file.parent / "comfy").glob("*"))), adapter.diffusers_key
    )
    weights, info = lora.load_lora(str(lora_file))
    assert comfy_weights.keys() == weights.keys() and all(
        torch.equal(comfy_weights[k], weights[k]) for k in weights
    )
    assert (comfy_info["rank"], comfy_info["alpha"]) == (info["rank"], info["alpha"])
    with one_rank_group() as d:
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        base = None
        for source in (None, lora_file):
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None).eval()
            scheduler = adapter.sampler("")
            ours = [
                renderer.frames(model, i, scheduler, contextlib.nullcontext()) for i in range(len(PROMPTS))
            ]
            theirs = pipeline_frames(variant, k5_models(variant), cfg.validation, source)
            for a, b in zip(ours, theirs):
                assert a.shape == b.shape == (FRAMES[variant], 32, 32, 3)
                assert (a - b).abs().max() <= 1e-4, (variant, source, (a - b).abs().max())
            if source is not None:
                assert max((a - b).abs().max() for a, b in zip(ours, base)) > 1e-3  # the LoRA shows
            base = ours
        sft_cfg = load_config(str(tmp_path / "sft.toml"))
        ours = render.load_model(sft_cfg, adapter, d, str(tmp_path / "sft" / "checkpoint-2"), None).eval()
    exported = Kandinsky5Transformer3DModel.from_pretrained(tmp_path / "sft" / "transformer").eval()
    expected = transformer_output(ours)
    torch.testing.assert_close(transformer_output(exported), expected, rtol=0, atol=1e-5)
    assert (expected - transformer_output(base_transformer)).abs().max() > 1e-4  # sft trained


@pytest.mark.slow
def test_full_lifecycle(k5_models, base_settings, tiny_data, tmp_path):
    """Kandinsky 5's whole lifecycle on 2 FSDP ranks with activation checkpointing, image-to-video
    (its first-frame condition besides text-to-video's every input): validation, SIGKILL after step 4, the next launch resumes
    from step 3 and ends bitwise equal to the run never stopped, clips included; the exported LoRA
    loads in Kandinsky5I2VPipeline and computes what our model with it computes. The held-out loss
    falls (1.47 to 1.34 over the 6 steps at learning rate 1e-2, when written)."""
    lifecycle = {
        "parallel.strategy": "fsdp",
        "train.gradient_checkpointing": True,
        "train.batch_size": 1,
        "train.steps": 6,
        "checkpoint.checkpointing_steps": 3,
        "validation.do_validation": True,
        "validation.validation_steps": 3,
        "validation.num_inference_steps": 3,
        "validation.save_frames": True,
        "validation.prompts": PROMPTS[:1],
        "validation.images": [str(tiny_data / "images" / "00000.png")],
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            k5_settings("i2v", k5_models, base_settings, tiny_data, tmp_path / name, **lifecycle),
        )
        for name in ("reference", "killed")
    }
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    held_out = {m["step"]: m["val/loss"] for m in read_metrics(tmp_path / "reference") if "val/loss" in m}
    assert sorted(held_out) == [0, 3, 6] and held_out[6] < 0.95 * held_out[0], held_out
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
    cfg = load_config(str(configs["reference"]))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(
            cfg, adapter, d, None, str(lora_dir / "pytorch_lora_weights.safetensors")
        ).eval()
    pipe = Kandinsky5I2VPipeline.from_pretrained(str(k5_models("i2v")))
    pipe.load_lora_weights(str(lora_dir / "pytorch_lora_weights.safetensors"))
    torch.testing.assert_close(
        transformer_output(pipe.transformer), transformer_output(model), rtol=0, atol=1e-5
    )
    base = Kandinsky5Transformer3DModel.from_pretrained(k5_models("i2v"), subfolder="transformer")
    assert (transformer_output(pipe.transformer) - transformer_output(base)).abs().max() > 1e-4


SPLIT_WORKER = r"""
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import parallel
from config import ModelConfig
from model_adapter import load_adapter

dist.init_process_group("gloo")
rank = dist.get_rank()
adapter = load_adapter(
    ModelConfig(family="kandinsky5", path=sys.argv[2], type="i2v", dtype="fp32"), torch.device("cpu")
)
g = torch.Generator().manual_seed(0)
# 3 x 1 x 3 = 9 visual tokens, split 5 + 4; two prompts of 7 and 5 Qwen rows
qwen = torch.randn(2, 512, 32, generator=g)
mask = torch.arange(512)[None] < torch.tensor([[7], [5]])
batch = {
    "latent_mean": torch.randn(2, 4, 3, 2, 6, generator=g),
    "latent_logvar": torch.randn(2, 4, 3, 2, 6, generator=g) - 3,
    "prompt_embeds_qwen": qwen * mask[..., None],
    "prompt_embeds_qwen_mask": mask,
    "prompt_embeds_clip": torch.randn(2, 1, 32, generator=g),
    "prompt_embeds_clip_mask": torch.ones(2, 1, dtype=torch.bool),
}
results = []
for split in (None, parallel.new_split(2, rank)):
    model = adapter.load_transformer()
    if split is not None:
        adapter.split_sequence(model, split)
    loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(i) for i in (1, 2)])
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if split is not None:
        for grad in grads.values():  # the group's sum: sp times the sample's
            dist.all_reduce(grad)
            grad /= 2
    results.append((loss.detach(), grads))
(whole, whole_grads), (split_loss, split_grads) = results
report = {
    "loss": torch.allclose(split_loss, whole, rtol=1e-5, atol=1e-6),
    # diffusers' processor rounds the rotated Q and K to bf16, and so their gradients: the text
    # stream's (whole on each rank, its gradient summed over the group from each rank's slice of
    # the visual tokens) agree to within a few bf16 steps of their norm; the rest (the time
    # embeddings feed the text stream too) to 1e-4
    "grads": [
        n for n in whole_grads
        if (split_grads[n] - whole_grads[n]).norm()
        > (1e-2 if n.startswith(("text_", "pooled_text_")) else 1e-4) * whole_grads[n].norm() + 1e-9
    ],
    "visual": all(
        type(b.self_attention.processor).__name__ == "SequenceParallelSelfAttention"
        for b in model.visual_transformer_blocks
    ),
}
if rank == 0:
    print("REPORT " + json.dumps(report))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_sequence_split_gives_one_process_loss_and_gradients(k5_models, tmp_path):
    """Sequence parallelism on 2 ranks, image-to-video, 9 visual tokens split unevenly, two prompts
    of different lengths: the loss and every weight's gradient (the group's sum over sp, as the
    training's reduction makes it) equal one process's."""
    result = run_worker(SPLIT_WORKER, tmp_path, k5_models("i2v"))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1].splitlines()[0])
    assert report == {"loss": True, "grads": [], "visual": True}


def test_both_streams_blocks_stream_and_store_fp8(k5_models):
    """Streaming (a 1-rank FSDP mesh, 2 of the 3 blocks on the host: the text block and the first
    visual block, with checkpointing and activation offload) and fp8 storage reach both streams'
    blocks through the generic machinery: their
    frozen linear weights in fp8, the streamed ones on the host; the streamed model's loss and LoRA
    gradients equal the resident one's."""
    adapter = load_adapter(
        ModelConfig(
            path=str(k5_models("i2v")), family="kandinsky5", type="i2v", dtype="fp32", storage_dtype="fp8"
        ),
        torch.device("cpu"),
    )
    assert adapter.block_count == 3
    results = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        for name, strategy, train in (
            ("resident", ParallelConfig(), TrainConfig(mixed_precision="no")),
            (
                "streamed",
                ParallelConfig(strategy="fsdp", cpu_offload=True, offload_blocks=2),
                TrainConfig(mixed_precision="no", gradient_checkpointing=True, activation_offload=True),
            ),
        ):
            model = build_model(
                adapter,
                train,
                LoraConfig(rank=4, target_modules=K5_TARGETS),
                strategy,
                0,
                d,
            )
            loss = adapter.train_loss(model, k5_batch(), [torch.Generator().manual_seed(i) for i in (1, 2)])
            loss.sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results[name] = (
                loss.detach(),
                {n: getattr(grad, "full_tensor", lambda g=grad: g)() for n, grad in grads.items()},
            )
    finally:
        dist.destroy_process_group()
    host = parallel.offloaded(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    streamed = ("text_transformer_blocks.0.", "visual_transformer_blocks.0.")
    assert {name for name, p in model.named_parameters() if id(p) in host} == {
        name for name in frozen if name.startswith(streamed)
    }
    assert {
        "text_transformer_blocks.0.feed_forward.in_layer.weight",
        "visual_transformer_blocks.1.cross_attention.to_key.weight",
    } <= {name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    (loss, grads), (streamed_loss, streamed_grads) = results["resident"], results["streamed"]
    assert (
        any(n.startswith("text_transformer_blocks.") for n in grads) and grads.keys() == streamed_grads.keys()
    )
    torch.testing.assert_close(streamed_loss, loss, rtol=1e-6, atol=0)
    for n in grads:
        torch.testing.assert_close(streamed_grads[n], grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_a_single_file_reads_as_the_folder(k5_models, tmp_path):
    """A bf16 file in ComfyUI's form (every key under model.diffusion_model., the diffusers names
    the makers' and ComfyUI's Kandinsky 5 models use) read as model.transformer_file beside a folder
    without the transformer's weights gives the folder's weights bit for bit, and its loss."""
    whole = tmp_path / "whole.safetensors"
    to_single_file(str(k5_models("t2v")), str(whole), prefix=True)
    weights = load_file(whole)
    assert all(k.startswith("model.diffusion_model.") for k in weights)
    assert f"model.diffusion_model.{Kandinsky5Adapter.SINGLE_FILE_KEY}" in weights
    configs_only = shutil.copytree(k5_models("t2v"), tmp_path / "model")
    (configs_only / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    folder, single = (
        load_adapter(
            ModelConfig(path=str(path), family="kandinsky5", dtype="bf16", transformer_file=file),
            torch.device("cpu"),
        )
        for path, file in ((k5_models("t2v"), ""), (configs_only, str(whole)))
    )
    theirs, ours = folder.load_transformer(), single.load_transformer()
    expected, got = dict(theirs.state_dict()), dict(ours.state_dict())
    assert got.keys() == expected.keys()
    assert [
        k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])
    ] == []
    batch, gens = k5_batch(), [torch.Generator().manual_seed(i) for i in (1, 2)]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        loss = folder.train_loss(theirs, batch, gens)
        gens = [torch.Generator().manual_seed(i) for i in (1, 2)]
        assert torch.equal(single.train_loss(ours, batch, gens), loss)


def test_lite_i2v_trains_from_the_t2v_folder_and_the_makers_file(k5_models, tmp_path):
    """Video Lite I2V's workaround (docs/models/kandinsky5.md): the makers publish it as a single file
    only. A copy of the T2V folder with model_index.json's pipeline set to Kandinsky5I2VPipeline and
    the I2V file as model.transformer_file loads as image-to-video with the I2V weights bit for bit (bf16, as the file holds them),
    and gives the I2V folder's image-to-video loss."""
    i2v_file = tmp_path / "kandinsky5lite_i2v_5s.safetensors"
    to_single_file(str(k5_models("i2v")), str(i2v_file), prefix=False)
    folder = shutil.copytree(k5_models("t2v"), tmp_path / "lite-i2v")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index | {"_class_name": "Kandinsky5I2VPipeline"}))
    made, published = (
        load_adapter(
            ModelConfig(path=str(path), family="kandinsky5", type="i2v", dtype="bf16", transformer_file=file),
            torch.device("cpu"),
        )
        for path, file in ((folder, str(i2v_file)), (k5_models("i2v"), ""))
    )
    ours, theirs = made.load_transformer(), published.load_transformer()
    expected, got = dict(theirs.state_dict()), dict(ours.state_dict())
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(
        got["out_layer.out_layer.weight"],
        load_file(k5_models("t2v") / "transformer" / "diffusion_pytorch_model.safetensors")[
            "out_layer.out_layer.weight"
        ],
    )
    batch = k5_batch()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        losses = [
            adapter.train_loss(transformer, batch, [torch.Generator().manual_seed(i) for i in (1, 2)])
            for adapter, transformer in ((made, ours), (published, theirs))
        ]
    assert torch.equal(*losses)


@pytest.mark.parametrize("form", ["cast", "scaled"])
def test_an_fp8_file_dequantizes_as_comfyui_does(form, k5_models, tmp_path):
    """An fp8 file of Kandinsky 5 (its blocks' linear weights in float8_e4m3fn, plain or with
    ComfyUI's per-tensor scale) reads as ComfyUI dequantizes it: weight.float() * scale. The tool
    stores the linear weights of both streams' blocks (Adapter.blocks) in fp8, nothing else."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(k5_models("t2v")), str(path), fp8=True, scaled=form == "scaled")
    adapter = load_adapter(
        ModelConfig(
            path=str(k5_models("t2v")), family="kandinsky5", dtype="bf16", transformer_file=str(path)
        ),
        torch.device("cpu"),
    )
    ours = adapter.load_transformer()
    stored = load_file(path)
    fp8 = {k: v for k, v in stored.items() if v.dtype == torch.float8_e4m3fn and v.numel()}
    # the linear weights of both streams' blocks, but the modulations, which the class keeps in fp32
    streams = ("text_transformer_blocks.", "visual_transformer_blocks.")
    linear = {k for k, v in stored.items() if k.startswith(streams) and k.endswith(".weight") and v.ndim == 2}
    assert fp8.keys() == {k for k in linear if "_modulation." not in k}
    assert "visual_transformer_blocks.1.feed_forward.out_layer.weight" in fp8
    assert "text_transformer_blocks.0.self_attention.to_query.weight" in fp8
    assert ("scaled_fp8" in stored) == (form == "scaled")
    params = dict(ours.named_parameters())
    for key, name in adapter.single_file.file_keys.items():
        if name in fp8:
            scale = stored.get(name.removesuffix("weight") + "scale_weight", torch.tensor(1.0)).float()
            assert (form == "cast") == (scale == 1.0)
            assert torch.equal(params[key], (fp8[name].float() * scale).to(params[key].dtype)), key
