"""HunyuanVideo 1.5: key sets, training, sampling as the pipelines, exports diffusers loads.

The tiny models carry the published key sets; T2V and I2V train (LoRA and sft) and sample exactly as
HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline do, with and without our exported LoRA
loaded by the transformer's load_lora_adapter (the pipelines have no LoRA loader); the training
follows the makers' train.py (docs/models/hunyuanvideo15.md)."""

import contextlib
import inspect
import json
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import (
    assert_loads_lean,
    fsdp_frozen_weights,
    hv_batch,
    one_rank_group,
    read_metrics,
    run_cmd,
    run_ok,
    run_worker,
    train_losses,
    write_toml,
)
from diffusers import (
    ClassifierFreeGuidance,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from PIL import Image
from safetensors.torch import load_file, save_file

import data
import lora
import parallel
import ranks
import render
import trainer
import validate
from config import ConfigError, LoraConfig, ModelConfig, ParallelConfig, TrainConfig, load_config
from model import build_model
from model_adapter import RunSettings, check_config, load_adapter, padded_text
from tools.make_synthetic_dataset import make_synthetic_dataset
from tools.to_single_file import to_single_file

PIPELINES = {"t2v": HunyuanVideo15Pipeline, "i2v": HunyuanVideo15ImageToVideoPipeline}
# Every argument of the class, as diffusers' conversion script writes the published folders
# (scripts/convert_hunyuan_video1_5_to_diffusers.py, TRANSFORMER_CONFIGS).
PUBLISHED_KEYS = set(inspect.signature(HunyuanVideo15Transformer3DModel.__init__).parameters) - {"self"}
# the second prompt's quoted text reaches ByT5 (the glyph encoder); the first's leaves it empty
PROMPTS = ["a red circle moves right", 'a blue square shows the word "go"']


def predict_inputs(adapter) -> tuple:
    """Two samples' noisy latents, timesteps, texts (through the batch's padding and cut) and image
    tokens, drawn from seed 0, for comparing two transformers' predictions."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, 2, 2, generator=gen)
    text = adapter._text_inputs(
        {
            k: v[None].expand(2, *v.shape)
            for k, v in padded_text(
                {
                    "prompt_embeds": torch.randn(5, 32, generator=gen),
                    "prompt_embeds_2": torch.randn(3, 16, generator=gen),
                },
                adapter.text_length,
            ).items()
        },
        2,
    )
    image = torch.randn(2, 16, 16, generator=gen)
    t = torch.tensor([10.0, 900.0])
    return x, t, text, image


@pytest.fixture(scope="module")
def hv_data(tmp_path_factory):
    """Six clips of its own: the cache pass reads 1108 Qwen tokens per prompt."""
    path = tmp_path_factory.mktemp("hv_data") / "shapes"
    make_synthetic_dataset(str(path), num_videos=6, frames=17, height=40, width=48, seed=0)
    return path


@pytest.fixture(scope="module")
def hv_models(family_models):
    return family_models("hunyuanvideo15")


def hv_settings(variant, hv_models, base_settings, hv_data, output_dir, **extra) -> dict:
    settings = {
        **base_settings,
        "run.output_dir": str(output_dir),
        "model.path": str(hv_models(variant)),
        "model.type": variant,
        "data.data_root": str(hv_data),
        "data.held_out": 2,
        "train.steps": 2,
        "train.learning_rate": 1e-2,
        "train.lr_warmup_steps": 1,
        "validation.do_validation": False,
        "validation.prompts": PROMPTS,
        "validation.num_inference_steps": 3,
        **extra,
    }
    if variant == "i2v":
        prompts = range(len(settings["validation.prompts"]))
        settings.setdefault("validation.images", [str(hv_data / "images" / f"0000{i}.png") for i in prompts])
    return settings


def test_tiny_models_carry_the_published_key_sets(hv_models):
    """Every argument of the class, as diffusers' conversion script writes the published folders;
    the I2V folder adds SigLIP and its processor."""
    for variant in PIPELINES:
        path = hv_models(variant)
        saved = json.loads((path / "transformer" / "config.json").read_text())
        assert set(saved) - {"_class_name", "_diffusers_version"} == PUBLISHED_KEYS
        assert saved["task_type"] == variant
        assert (path / "image_encoder").is_dir() == (variant == "i2v")


@pytest.mark.parametrize("variant", list(PIPELINES))
def test_loading_builds_on_meta_and_equals_from_pretrained(variant, hv_models, monkeypatch):
    adapter = load_adapter(
        ModelConfig(path=str(hv_models(variant)), dtype="bf16", type=variant), torch.device("cpu")
    )
    assert adapter.FAMILY == "hunyuanvideo15"
    assert_loads_lean(adapter, monkeypatch, "transformer")


def test_refusals_name_the_fix(hv_models, base_settings, hv_data, tmp_path):
    """I2V on a text-to-video folder, a folder without ByT5 and another image than the clip's first
    frame stop before any compute."""
    with pytest.raises(ConfigError, match=r'model.type = "i2v", but .* has no image_encoder/'):
        load_adapter(ModelConfig(path=str(hv_models("t2v")), type="i2v"), torch.device("cpu"))
    copy = tmp_path / "no_byt5"
    shutil.copytree(hv_models("t2v"), copy)
    shutil.rmtree(copy / "tokenizer_2")
    with pytest.raises(ConfigError, match=r"has no tokenizer_2/ folder \(ByT5"):
        load_adapter(ModelConfig(path=str(copy)), torch.device("cpu"))
    settings = hv_settings(
        "i2v", hv_models, base_settings, hv_data, tmp_path, **{"data.image_column": "images.txt"}
    )
    with pytest.raises(ConfigError, match=r"conditions on each clip's own first frame"):
        check_config(load_config(str(write_toml(tmp_path / "image.toml", settings))))


def test_training_draws_the_makers_shifted_logit_normal(hv_models):
    """s = shift t / (1 + (shift - 1) t), t the sigmoid of a standard normal in [1e-5, 1 - 1e-5], at
    the makers' train_timestep_shift 3 (train.flow_shift replaces it)."""
    folder = ModelConfig(path=str(hv_models("t2v")))
    assert load_adapter(folder, torch.device("cpu")).shift == 3.0
    shifted = load_adapter(folder, torch.device("cpu"), RunSettings(flow_shift=5.0))
    v = torch.rand((), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t = 1e-5 + (1 - 2e-5) * torch.sigmoid(torch.erfinv(2 * v - 1) * 2**0.5).float()
    torch.testing.assert_close(
        shifted._sigmas([torch.Generator().manual_seed(3)]), (5 * t / (1 + 4 * t))[None]
    )


def test_a_batch_of_clips_encodes_as_each_alone(hv_models):
    """diffusers 0.42.1's AutoencoderKLHunyuanVideo15 fails on a batch of two clips (its mid-block
    attention mask does not broadcast); encode_video gives each clip's own posterior."""
    adapter = load_adapter(ModelConfig(path=str(hv_models("t2v"))), torch.device("cpu"))
    clips = torch.randint(0, 256, (2, 9, 32, 32, 3), generator=torch.Generator().manual_seed(0)).byte()
    with pytest.raises(RuntimeError, match="broadcast"):
        adapter._load_vae().encode(adapter._pixels(clips))
    mean, logvar = adapter.encode_video(clips)
    for i in range(2):
        alone = adapter.encode_video(clips[i : i + 1])
        assert torch.equal(mean[i : i + 1], alone[0]) and torch.equal(logvar[i : i + 1], alone[1])


def test_text_is_the_pipelines_and_trimming_keeps_the_prediction(hv_models):
    """encode_text equals the pipeline's encode_prompt (both encoders, rows past the masks aside);
    cut to the batch's longest prompt, the transformer predicts what it predicts padded."""
    adapter = load_adapter(ModelConfig(path=str(hv_models("t2v")), dtype="fp32"), torch.device("cpu"))
    pipe = HunyuanVideo15Pipeline.from_pretrained(str(hv_models("t2v")), dtype=torch.float32)
    ours = adapter.encode_text(PROMPTS)
    theirs = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"), batch_size=2)
    for name, (embeds, mask) in (("prompt_embeds", theirs[:2]), ("prompt_embeds_2", theirs[2:])):
        torch.testing.assert_close(ours[name], embeds * mask[:, :, None], rtol=0, atol=1e-5)
    assert theirs[3][0].sum() == 0 and theirs[3][1].sum() > 0  # only the quoted text reaches ByT5
    rows = [
        padded_text({n: validate.model_adapter.unpadded(e[i]) for n, e in ours.items()}, adapter.text_length)
        for i in range(2)
    ]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    transformer = adapter.load_transformer().eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, 2, 2, generator=gen)
    image = torch.zeros(2, 729, 16)
    with torch.no_grad():
        full = adapter._predict(transformer, x, torch.tensor([10.0, 900.0]), batch, image)
        cut = adapter._predict(
            transformer, x, torch.tensor([10.0, 900.0]), adapter._text_inputs(batch, 2), image[:, :0]
        )
    torch.testing.assert_close(cut, full, rtol=0, atol=1e-5)


def test_the_keys_mask_predicts_and_trains_as_diffusers_pairs_mask(hv_models):
    """JointAttention's mask of the keys alone against diffusers' own processor (its mask of every
    pair of tokens), on a batch with padding (prompts of 5 and 2 rows, and text-to-video's 729 image
    tokens of zeros, masked): the same prediction and the same gradient of every weight."""
    adapter = load_adapter(ModelConfig(path=str(hv_models("t2v")), dtype="fp32"), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    rows = [
        padded_text(
            {
                "prompt_embeds": torch.randn(n, 32, generator=gen),
                "prompt_embeds_2": torch.randn(m, 16, generator=gen),
            },
            adapter.text_length,
        )
        for n, m in ((5, 3), (2, 1))
    ]
    text = adapter._text_inputs({k: torch.stack([r[k] for r in rows]) for k in rows[0]}, 2)
    x, t, image = (
        torch.randn(2, 9, 3, 2, 2, generator=gen),
        torch.tensor([10.0, 900.0]),
        torch.zeros(2, 729, 16),
    )
    results = []
    for processor in (None, HunyuanVideo15AttnProcessor2_0):
        transformer = adapter.load_transformer().train()
        assert {type(b.attn.processor).__name__ for b in transformer.transformer_blocks} == {"JointAttention"}
        for block in transformer.transformer_blocks if processor else []:
            block.attn.set_processor(processor())
        prediction = adapter._predict(transformer, x, t, text, image)
        prediction.square().mean().backward()
        results.append((prediction.detach(), {n: p.grad for n, p in transformer.named_parameters()}))
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def assert_comfy_file_is_ours(lora_dir, adapter):
    """Our ComfyUI file: only diffusion_model.* keys, in ComfyUI's module names with q, k and v
    fused (double_blocks.N.img_attn.qkv); every update ComfyUI applies, alpha / rank x up @ down
    (comfy/lora.py, calculate_weight), is our modules' stacked, none lost; and lora.load_lora reads
    it back to our weights."""
    comfy_file = next((lora_dir / "comfy").glob("*.safetensors"))
    comfy = load_file(comfy_file)
    assert comfy and all(k.startswith("diffusion_model.") for k in comfy)
    ours, info = lora.load_lora(str(lora_dir / "pytorch_lora_weights.safetensors"))
    scale = info["alpha"] / info["rank"]
    modules = {
        k.removeprefix("diffusion_model.").rsplit(".", 2)[0] for k in comfy if k.endswith("lora_A.weight")
    }
    assert any(m.endswith("img_attn.qkv") for m in modules) and any(
        m.endswith("self_attn.qkv") for m in modules
    )
    covered = []
    for module in modules:
        down, up = (comfy[f"diffusion_model.{module}.lora_{p}.weight"] for p in "AB")
        theirs = float(comfy[f"diffusion_model.{module}.alpha"]) / down.shape[0] * up @ down
        names = adapter.diffusers_key(module)
        names = names if isinstance(names, list) else [names]
        expected = torch.cat([scale * ours[f"{n}.lora_B.weight"] @ ours[f"{n}.lora_A.weight"] for n in names])
        torch.testing.assert_close(theirs, expected, rtol=1e-5, atol=1e-7)
        covered += names
    assert sorted(covered) == sorted({lora.module_of(k) for k in ours})
    back, back_info = lora.load_lora(str(comfy_file), adapter.diffusers_key)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert (back_info["rank"], back_info["alpha"]) == (info["rank"], info["alpha"])


def lora_scales(path, lora_dir, folder_form: bool) -> set[float]:
    """The scales PEFT gives our exported LoRA in the transformer, by load_lora_adapter's folder
    form (weight_name=) or given the file's path."""
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(path / "transformer")
    file = "pytorch_lora_weights.safetensors"
    if folder_form:
        transformer.load_lora_adapter(str(lora_dir), weight_name=file, prefix="transformer")
    else:
        transformer.load_lora_adapter(str(lora_dir / file), prefix="transformer")
    return {s for m in transformer.modules() if hasattr(m, "scaling") for s in m.scaling.values()}


def pipeline_frames(variant, path, cfg, lora_dir=None):
    """The pipeline's float frames [F, H, W, 3] per prompt, with our LoRA loaded into its
    transformer by the folder form of load_adapter (the form that reads the file's alpha)."""
    pipe = PIPELINES[variant].from_pretrained(str(path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=cfg.guidance_scale)
    if lora_dir:
        pipe.transformer.load_lora_adapter(
            str(lora_dir), weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
        )
    frames = []
    for i, prompt in enumerate(cfg.prompts):
        size = {"image": Image.open(cfg.images[i])} if cfg.images else {"height": 32, "width": 32}
        frames.append(
            pipe(
                prompt=prompt,
                num_frames=9,
                num_inference_steps=cfg.num_inference_steps,
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                **size,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
        )
    return frames


# Each variant renders one prompt: text-to-video the one whose quoted text reaches ByT5.
RENDERED = {"t2v": PROMPTS[1:], "i2v": PROMPTS[:1]}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PIPELINES))
def test_variant_trains_exports_and_samples_as_its_pipeline(
    variant, hv_models, base_settings, hv_data, tmp_path
):
    """Two LoRA steps and two sft steps; our loop's frames equal the pipeline's within 1e-4 in fp32
    with our exported LoRA loaded by load_lora_adapter's folder form (text-to-video also with the
    base model, with guidance and without); the sft export loads with from_pretrained and computes
    what the checkpoint's weights compute."""
    settings = hv_settings(
        variant,
        hv_models,
        base_settings,
        hv_data,
        tmp_path / "lora",
        **{"validation.prompts": RENDERED[variant], "validation.num_inference_steps": 2},
    )
    trainer.main(["--cfg", str(write_toml(tmp_path / "lora.toml", settings))])
    sft = {
        **settings,
        "run.output_dir": str(tmp_path / "sft"),
        "train.training_type": "sft",
        "train.learning_rate": 1e-3,
    }
    trainer.main(["--cfg", str(write_toml(tmp_path / "sft.toml", sft))])
    lora_dir = tmp_path / "lora" / "lora"
    # The folder form loads at the trained alpha / rank (2 / 4); the file's path alone, at 1.0
    # (diffusers 0.42.1: the doc shows the folder form).
    assert lora_scales(hv_models(variant), lora_dir, folder_form=True) == {0.5}
    assert lora_scales(hv_models(variant), lora_dir, folder_form=False) == {1.0}
    assert_comfy_file_is_ours(
        lora_dir, load_adapter(load_config(str(tmp_path / "lora.toml")).model, torch.device("cpu"))
    )

    cfg = load_config(str(tmp_path / "lora.toml"))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    sources = [None, lora_dir / "pytorch_lora_weights.safetensors"][variant == "i2v" :]
    with one_rank_group() as d:
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        base = None
        for source in sources:
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None).eval()
            ours = renderer.frames(model, 0, adapter.sampler(""), contextlib.nullcontext())
            theirs = pipeline_frames(variant, hv_models(variant), cfg.validation, source and lora_dir)[0]
            assert ours.shape == theirs.shape == (9, 32, 32, 3)
            assert (ours - theirs).abs().max() <= 1e-4, (variant, source, (ours - theirs).abs().max())
            if base is not None:
                assert (ours - base).abs().max() > 1e-3  # the LoRA shows
            base = ours
        sft_cfg = load_config(str(tmp_path / "sft.toml"))
        ours = render.load_model(sft_cfg, adapter, d, str(tmp_path / "sft" / "checkpoint-2"), None).eval()
    exported = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path / "sft" / "transformer").eval()
    x, t, text, image = predict_inputs(adapter)
    with torch.no_grad():
        torch.testing.assert_close(
            adapter._predict(exported, x, t, text, image),
            adapter._predict(ours, x, t, text, image),
            rtol=0,
            atol=1e-5,
        )


@pytest.mark.slow
def test_full_lifecycle(hv_models, base_settings, hv_data, tmp_path):
    """HunyuanVideo 1.5 I2V's whole lifecycle on 2 FSDP ranks: kill, resume bitwise, export.

    2 FSDP ranks with a validation clip: SIGKILL after step 4, the next launch resumes from step 3
    and ends bitwise equal to the run never stopped, clip included; the held-out loss falls; the
    export, loaded by the transformer's load_lora_adapter (folder form), computes what our model
    with it computes. Image-to-video: its path holds text-to-video's and the image's besides."""
    lifecycle = {
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 6,
        "train.learning_rate": 3e-2,
        "checkpoint.checkpointing_steps": 3,
        "validation.do_validation": True,
        # before the first step and after the last: the held-out loss and the clip at both
        "validation.validation_steps": 6,
        "validation.num_inference_steps": 2,
        "validation.save_frames": True,
        "validation.prompts": PROMPTS[:1],
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            hv_settings("i2v", hv_models, base_settings, hv_data, tmp_path / name, **lifecycle),
        )
        for name in ("reference", "killed")
    }
    run_ok(["--cfg", str(configs["reference"])], nproc=2)
    held_out = {m["step"]: m["val/loss"] for m in read_metrics(tmp_path / "reference") if "val/loss" in m}
    assert sorted(held_out) == [0, 6] and held_out[6] < held_out[0], held_out
    assert (
        run_cmd(["--cfg", str(configs["killed"])], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:4"}).returncode
        != 0
    )
    resumed = run_ok(["--cfg", str(configs["killed"])], nproc=2)
    assert f"resumed from step 3 ({tmp_path / 'killed' / 'checkpoint-3'})" in resumed.stderr
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "reference")
    ours, theirs = (
        load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")
        for name in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    clip = "validation_res/step_6_prompt_0.safetensors"
    assert torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"], load_file(tmp_path / "reference" / clip)["frames"]
    )
    lora_dir = tmp_path / "reference" / "lora"
    cfg = load_config(str(configs["reference"]))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(
            cfg, adapter, d, None, str(lora_dir / "pytorch_lora_weights.safetensors")
        ).eval()
    theirs = HunyuanVideo15Transformer3DModel.from_pretrained(hv_models("i2v") / "transformer").eval()
    theirs.load_lora_adapter(
        str(lora_dir), weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )
    x, t, text, image = predict_inputs(adapter)
    with torch.no_grad():
        torch.testing.assert_close(
            adapter._predict(theirs, x, t, text, image),
            adapter._predict(model, x, t, text, image),
            rtol=0,
            atol=1e-5,
        )


def test_blocks_stream_offload_activations_and_store_fp8(hv_models):
    """The generic machinery serves the family's dual-stream blocks: streamed from the host (a
    1-rank FSDP mesh, block 0 of 2 offloaded) with checkpointing and activation offload, the
    blocks' frozen linears stored in fp8; loss and LoRA gradients equal the resident model's
    (image-to-video, both texts, padding cut)."""
    adapter = load_adapter(
        ModelConfig(path=str(hv_models("i2v")), type="i2v", dtype="fp32", storage_dtype="fp8"),
        torch.device("cpu"),
    )
    batch = hv_batch()
    results = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        for name, strategy, train in (
            ("resident", ParallelConfig(), TrainConfig(mixed_precision="no")),
            (
                "streamed",
                ParallelConfig(strategy="fsdp", cpu_offload=True, offload_blocks=1),
                TrainConfig(mixed_precision="no", gradient_checkpointing=True, activation_offload=True),
            ),
        ):
            model = build_model(adapter, train, LoraConfig(rank=4), strategy, 0, d)
            loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(1)])
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
    assert {name for name, p in model.named_parameters() if id(p) in host} == {
        name for name in frozen if name.startswith("transformer_blocks.0.")
    }
    assert "transformer_blocks.1.attn.add_q_proj.weight" in {
        name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn
    }
    (loss, grads), (streamed_loss, streamed_grads) = results["resident"], results["streamed"]
    assert any(n.startswith("transformer_blocks.0.") for n in grads) and grads.keys() == streamed_grads.keys()
    torch.testing.assert_close(streamed_loss, loss, rtol=1e-6, atol=0)
    for n in grads:
        torch.testing.assert_close(streamed_grads[n], grads[n], rtol=1e-5, atol=1e-7, msg=n)


SEQUENCE_WORKER = r"""
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import parallel
from config import ModelConfig
from model_adapter import load_adapter, padded_text

dist.init_process_group("gloo")
rank = dist.get_rank()
split = parallel.new_split(2, rank)
adapter = load_adapter(ModelConfig(path=sys.argv[2], type="i2v", dtype="fp32"), torch.device("cpu"))
g = torch.Generator().manual_seed(7)
rows = [
    padded_text({"prompt_embeds": torch.randn(n, 32, generator=g), "prompt_embeds_2": torch.randn(m, 16, generator=g)},
                adapter.text_length)
    for n, m in ((9, 0), (5, 3))
]
batch = {"latent_mean": torch.randn(2, 4, 3, 3, 3, generator=g),
         "latent_logvar": torch.randn(2, 4, 3, 3, 3, generator=g) - 3,
         "image_embeds": torch.randn(2, 16, 16, generator=g),
         **{k: torch.stack([r[k] for r in rows]) for k in rows[0]}}
results, seen = [], []
for split_it in (False, True):
    model = adapter.load_transformer().requires_grad_(True)
    if split_it:
        for block in model.transformer_blocks:
            block.attn.register_forward_pre_hook(
                lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
        adapter.split_sequence(model, split)
    loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(3 + i) for i in range(2)])
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if split_it:
        for grad in grads.values():  # the group's sum: sp times the sample's
            dist.all_reduce(grad)
            grad /= 2
    results.append((loss.detach(), grads))
(loss, grads), (split_loss, split_grads) = results
report = {"loss_equal": torch.allclose(split_loss, loss, rtol=1e-5, atol=1e-6),
          "same_grads": grads.keys() == split_grads.keys() and len(grads) > 0,
          "grads_differ": [n for n in grads if not torch.allclose(split_grads[n], grads[n], rtol=1e-5, atol=1e-6)],
          "seen": sorted(set(seen))}
(open(sys.argv[3] + f"/rank{rank}.json", "w")).write(json.dumps(report))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_sequence_split_gives_one_process_loss_and_gradients(hv_models, tmp_path):
    """Sequence parallelism on 2 ranks: the video tokens split (27: 14 + 13), the texts (two
    prompts of different lengths, one with glyph text) and the image tokens whole on every rank;
    train_loss and every weight's gradient equal one process's."""
    result = run_worker(SEQUENCE_WORKER, tmp_path, hv_models("i2v"), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["loss_equal"] and report["same_grads"] and not report["grads_differ"], report
        assert report["seen"] == [[14, 13][rank]]


def test_a_half_white_loss_mask_gives_the_loss_of_that_half(hv_models, monkeypatch):
    """data.loss_mask_column: with the transformer's prediction replaced by zeros, the training and
    held-out losses are the squared target (e - x0) over the mask's white half alone, recovered by
    hand from the noisy latents the transformer was given."""
    adapter = load_adapter(
        ModelConfig(path=str(hv_models("i2v")), type="i2v", dtype="fp32"), torch.device("cpu")
    )
    g = torch.Generator().manual_seed(0)
    half = torch.zeros(1, 1, 3, 2, 2)
    half[..., 0] = 1
    text = padded_text(
        {"prompt_embeds": torch.randn(4, 32, generator=g), "prompt_embeds_2": torch.randn(0, 16)},
        adapter.text_length,
    )
    batch = {
        "latent_mean": torch.randn(2, 4, 3, 2, 2, generator=g),
        "latent_logvar": torch.full((2, 4, 3, 2, 2), -30.0),
        "image_embeds": torch.randn(2, 16, 16, generator=g),
        "loss_mask": half.expand(2, -1, -1, -1, -1),
        **{k: v[None].expand(2, *v.shape) for k, v in text.items()},
    }
    calls = []
    monkeypatch.setattr(
        adapter,
        "_predict",
        lambda model, x, t, text, image: calls.append((x, t)) or torch.zeros_like(x[:, :4]),
    )

    def by_hand(clip):
        x, t = calls[-1]
        s = (t / 1000).view(-1, 1, 1, 1, 1)
        x0 = 1.03682 * clip["latent_mean"].expand(len(x), -1, -1, -1, -1)
        # the I2V condition: the sample's own first latent frame (a posterior of deviation 3e-7)
        torch.testing.assert_close(x[:, 4:8, :1], x0[:, :, :1], rtol=0, atol=1e-5)
        assert x[:, 8, :1].eq(1).all() and x[:, 4:, 1:].eq(0).all()
        target = (x[:, :4] - (1 - s) * x0) / s - x0
        return target.pow(2)[..., 0].mean(dim=(1, 2, 3))

    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    torch.testing.assert_close(
        adapter.train_loss(None, batch, generators), by_hand(batch), rtol=1e-4, atol=1e-6
    )
    clip = {k: v[:1] for k, v in batch.items()}
    held_out = adapter.fixed_losses(None, clip, [300, 800], torch.Generator().manual_seed(1))
    torch.testing.assert_close(held_out, by_hand(clip), rtol=1e-4, atol=1e-6)


# diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, convert_hyvideo15_transformer_to_diffusers
# (lines 140-419 at huggingface/diffusers 671149e), transcribed section by section: the makers'
# name -> diffusers' for each module, popped as the script pops them. The script's loops count the
# published 2 refiner and 54 dual-stream blocks; here the config's.
SCRIPT_OUTSIDE = {  # sections 1-4, 6-9 and 11 (lines 146-204, 232-286, 409-417)
    "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_embed.timestep_embedder.linear_2",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "vision_in.proj.0": "image_embedder.norm_in",
    "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2",
    "vision_in.proj.4": "image_embedder.norm_out",
    "img_in.proj": "x_embedder.proj",
    "final_layer.linear": "proj_out",
}
SCRIPT_REFINER = {  # section 5 (lines 206-240), but self_attn_qkv
    "norm1": "norm1",
    "self_attn_proj": "attn.to_out.0",
    "norm2": "norm2",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm_out.linear",
}
SCRIPT_DOUBLE = {  # section 10 (lines 291-407); the q and k norms have a weight only
    "img_mod.linear": "norm1.linear",
    "txt_mod.linear": "norm1_context.linear",
    "img_attn_q": "attn.to_q",
    "img_attn_k": "attn.to_k",
    "img_attn_v": "attn.to_v",
    "img_attn_proj": "attn.to_out.0",
    "txt_attn_q": "attn.add_q_proj",
    "txt_attn_k": "attn.add_k_proj",
    "txt_attn_v": "attn.add_v_proj",
    "txt_attn_proj": "attn.to_add_out",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
}
SCRIPT_DOUBLE_NORMS = {
    "img_attn_q_norm": "attn.norm_q",
    "img_attn_k_norm": "attn.norm_k",
    "txt_attn_q_norm": "attn.norm_added_q",
    "txt_attn_k_norm": "attn.norm_added_k",
}


def makers_to_diffusers(original: dict, config: dict) -> dict:
    """The script's conversion of the makers' state dict (consumed: what is left was not read)."""
    out = {"cond_type_embed.weight": original.pop("cond_type_embedding.weight")}  # section 9
    pairs = list(SCRIPT_OUTSIDE.items())
    for i in range(config["num_refiner_layers"]):
        refiner, ours = (
            f"txt_in.individual_token_refiner.blocks.{i}",
            f"context_embedder.token_refiner.refiner_blocks.{i}",
        )
        pairs += [(f"{refiner}.{a}", f"{ours}.{b}") for a, b in SCRIPT_REFINER.items()]
        for leaf in ("weight", "bias"):  # "Split self_attn_qkv into to_q, to_k, to_v" (lines 212-223)
            q, k, v = torch.chunk(original.pop(f"{refiner}.self_attn_qkv.{leaf}"), 3, dim=0)
            out |= {f"{ours}.attn.to_{n}.{leaf}": t for n, t in zip("qkv", (q, k, v))}
    for i in range(config["num_layers"]):
        pairs += [(f"double_blocks.{i}.{a}", f"transformer_blocks.{i}.{b}") for a, b in SCRIPT_DOUBLE.items()]
        out |= {
            f"transformer_blocks.{i}.{b}.weight": original.pop(f"double_blocks.{i}.{a}.weight")
            for a, b in SCRIPT_DOUBLE_NORMS.items()
        }
    for a, b in pairs:
        out |= {f"{b}.{leaf}": original.pop(f"{a}.{leaf}") for leaf in ("weight", "bias")}
    for leaf in ("weight", "bias"):  # swap_scale_shift (lines 134-137, 410-415)
        shift, scale = original.pop(f"final_layer.adaLN_modulation.1.{leaf}").chunk(2, dim=0)
        out[f"norm_out.linear.{leaf}"] = torch.cat([scale, shift], dim=0)
    return out


def single_file_adapter(path, transformer_file, dtype="bf16"):
    return load_adapter(
        ModelConfig(path=str(path), dtype=dtype, type="t2v", transformer_file=str(transformer_file)),
        torch.device("cpu"),
    )


@pytest.mark.parametrize("prefix", [False, True])
def test_a_makers_single_file_reads_as_the_folder(prefix, hv_models, tmp_path):
    """A single file in the makers' layout (bare, or under ComfyUI's model.diffusion_model.) is what
    diffusers' conversion script reads: converted, it is the folder's state dict (in bf16) bit for
    bit, every key consumed. Read as model.transformer_file, it gives the folder's weights bit for
    bit, and each weight's rows (any range: an FSDP rank's) are its rows of the file's tensor."""
    folder, path = hv_models("t2v"), tmp_path / "hv15.safetensors"
    to_single_file(str(folder), str(path), prefix=prefix)
    stored = load_file(path)
    assert all(k.startswith("model.diffusion_model.") == prefix for k in stored)
    original = {k.removeprefix("model.diffusion_model."): v for k, v in stored.items()}
    config = json.loads((folder / "transformer" / "config.json").read_text())
    converted = makers_to_diffusers(dict(original), config)
    expected = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert converted.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(converted[k], expected[k].bfloat16())] == []
    file_adapter = single_file_adapter(folder, path)
    folder_adapter = load_adapter(
        ModelConfig(path=str(folder), dtype="bf16", type="t2v"), torch.device("cpu")
    )
    ours, theirs = (
        file_adapter.load_transformer().state_dict(),
        folder_adapter.load_transformer().state_dict(),
    )
    assert ours.keys() == theirs.keys()
    assert [
        k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])
    ] == []
    single = file_adapter.single_file
    assert single.file_keys["context_embedder.token_refiner.refiner_blocks.0.attn.to_k.weight"] == (
        "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"
    )
    with single.opened():
        for key, whole in converted.items():
            rows = len(whole) if whole.ndim else 1
            for start, count in ((0, rows), (1, rows - 2), (rows // 2, rows - rows // 2), (rows - 1, 1)):
                if whole.ndim and count > 0:
                    assert torch.equal(single._rows(key, start, count), whole[start : start + count]), key


def test_comfy_orgs_repackaged_file_with_packed_qkv_reads_as_the_folder(hv_models, tmp_path):
    """Comfy-Org's repackaged files are the makers' layout with each dual-stream block's q, k and v
    packed into img_attn_qkv and txt_attn_qkv, which musubi-tuner's loader splits back with
    torch.chunk(value, 3) (hunyuan_video_1_5_models.py, comfyui_hunyuan_video_1_5_weight_split_hook):
    such a file, packed here from the makers' one, gives the folder's weights bit for bit."""
    folder, makers, packed = hv_models("t2v"), tmp_path / "makers.safetensors", tmp_path / "comfy.safetensors"
    to_single_file(str(folder), str(makers))
    original = load_file(makers)
    repackaged = {}
    for key, tensor in original.items():
        stream = re.fullmatch(r"(double_blocks\.\d+\.(?:img|txt)_attn)_([qkv])\.(weight|bias)", key)
        if stream is None:
            repackaged[key] = tensor
        elif stream[2] == "q":
            parts = [original[f"{stream[1]}_{p}.{stream[3]}"] for p in "qkv"]
            repackaged[f"{stream[1]}_qkv.{stream[3]}"] = torch.cat(parts)
    assert (
        "double_blocks.0.img_attn_qkv.weight" in repackaged
        and "double_blocks.0.img_attn_q.weight" not in repackaged
    )
    save_file(repackaged, packed)
    ours = single_file_adapter(folder, packed).load_transformer().state_dict()
    theirs = load_adapter(ModelConfig(path=str(folder), dtype="bf16", type="t2v"), torch.device("cpu"))
    theirs = theirs.load_transformer().state_dict()
    assert ours.keys() == theirs.keys() and [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


def test_a_scaled_fp8_makers_file_keeps_each_tensors_scale_in_its_parts(hv_models, tmp_path):
    """A scaled fp8 file (ComfyUI's old form: X.scale_weight beside every fp8 weight, the scaled_fp8
    marker), every 2-D weight quantized, the fused qkv and the swapped modulation too: each weight
    is ComfyUI's dequantization of the file (stored value x its tensor's scale, in fp32) converted by
    diffusers' script, under FSDP (one rank) as without."""
    folder = hv_models("t2v")
    bf16, path = tmp_path / "bf16.safetensors", tmp_path / "fp8.safetensors"
    to_single_file(str(folder), str(bf16))
    quantized, dequantized = {}, {}
    for key, tensor in load_file(bf16).items():
        if tensor.ndim == 2:
            scale = tensor.float().abs().max() / torch.finfo(torch.float8_e4m3fn).max
            quantized[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            quantized[key.removesuffix("weight") + "scale_weight"] = scale.reshape(())
            dequantized[key] = quantized[key].float() * scale
        else:
            quantized[key] = dequantized[key] = tensor
    save_file(quantized | {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, path)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    expected = makers_to_diffusers(dequantized, config)
    adapter = single_file_adapter(folder, path, dtype="fp32")
    whole = adapter.load_transformer().state_dict()
    assert [k for k in expected if not torch.equal(whole[k], expected[k].float())] == []
    sharded = fsdp_frozen_weights(adapter)
    assert sharded and [k for k, v in sharded.items() if not torch.equal(v, expected[k].float())] == []


def test_a_makers_file_of_another_shape_or_incomplete_is_named(hv_models, tmp_path):
    """A fused qkv whose rows do not split in three, one of another width, a missing tensor: each is
    named before the cache pass, with the file's key."""
    folder, path = hv_models("t2v"), tmp_path / "hv15.safetensors"
    to_single_file(str(folder), str(path))
    stored = load_file(path)
    qkv = "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"
    cases = {
        "do not split into the 3 weights": {**stored, qkv: stored[qkv][:-1]},
        r"is \[96, 31\] there \(its rows for .*attn.to_q.weight: \[32, 31\]\)": {
            **stored,
            qkv: stored[qkv][:, :-1].contiguous(),
        },
        "lacks 1 weights": {k: v for k, v in stored.items() if k != "final_layer.linear.bias"},
    }
    for message, tensors in cases.items():
        save_file(tensors, path)
        with pytest.raises(ConfigError, match=message):
            single_file_adapter(folder, path)
