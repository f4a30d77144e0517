"""LTX-2, 2.3 and 2.5: key sets, training, sampling as the pipelines, exports diffusers loads.

LTX-2, LTX-2.3 and LTX-2.5: the tiny models carry the published key sets; every variant trains
video-only (LoRA and sft), samples exactly as LTX2Pipeline / LTX2ImageToVideoPipeline do (with and
without our exported LoRA), and exports what diffusers loads, in diffusers' layout and in ComfyUI's
(the original checkpoint's names, inside the blocks and out)."""

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch
from conftest import LTX2_PROMPTS as PROMPTS
from conftest import (
    PIPELINE_GUIDANCE,
    assert_loads_lean,
    lora_and_sft_runs,
    ltx2_settings,
    ltx_core_cross_modulation,
    one_rank_group,
    original_top_level_linears,
    pipeline_guidance,
    prepare_run,
    run_cmd,
    run_ok,
    train_losses,
    write_toml,
)
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers
from diffusers.pipelines.ltx2.utils import resolve_default_image_crf
from PIL import Image
from safetensors.torch import load_file

import ckpt
import data
import lora
import render
import validate
from config import ConfigError, ModelConfig, ValidationConfig, load_config
from families.ltx2 import TEXT_LENGTH, AudioStream, LTX2Adapter, VideoStream
from model_adapter import RunSettings, check_config, load_adapter
from ranks import StopRun
from tools.make_tiny_model import LTX2_KEYS, LTX25_KEYS

# variant: (model.type, pipeline)
VARIANTS = {
    "2.0": ("t2v", LTX2Pipeline),
    "2.3-i2v": ("i2v", LTX2ImageToVideoPipeline),
    "2.5": ("t2v", LTX2Pipeline),
}
# 2.5's run also trains LoRAs outside the blocks (the video patch embedding and timestep
# modulation), which the ComfyUI file names as the original checkpoint does (patchify_proj,
# adaln_single.linear).
EXTRA = {"2.5": {"lora.target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "time_embed.linear"]}}
# STG on 2.3 only (2.0 has no perturbed attention), at the tiny model's last block (the published
# models' 28 is past its 2).
STG = {"stg_scale": 1.0, "stg_blocks": [1]}


def model_of(variant: str) -> str:
    return variant.split("-")[0]


def test_tiny_models_carry_the_published_key_sets(ltx2_models):
    """The tiny 2.5 carries the published key set of diffusers' conversion script.

    2.5 (diffusers' conversion script, version "2.5"): ff_bias and use_keyframes_abs_pos_embedding
    added, a Gemma 4 text encoder (the script refuses another), its connectors sized by Gemma's
    hidden size and layer count, the duration head among the components."""
    for variant in ("2.0", "2.3", "2.5"):
        path = ltx2_models(variant)
        keys = set(json.loads((path / "transformer" / "config.json").read_text())) - {
            "_class_name",
            "_diffusers_version",
        }
        assert keys == (LTX25_KEYS if variant == "2.5" else LTX2_KEYS)
        index = json.loads((path / "model_index.json").read_text())
        assert {"duration_head"} & set(index) == ({"duration_head"} if variant == "2.5" else set())
        assert not {"processor", "prompt_enhancer"} & set(index)
        text = json.loads((path / "text_encoder" / "config.json").read_text())
        assert text["model_type"] == ("gemma4_unified" if variant == "2.5" else "gemma3")
        connectors = json.loads((path / "connectors" / "config.json").read_text())
        assert (connectors["caption_channels"], connectors["text_proj_in_factor"]) == (
            text["text_config"]["hidden_size"],
            text["text_config"]["num_hidden_layers"] + 1,
        )


@pytest.mark.parametrize("variant", ["2.0", "2.3", "2.5"])
def test_loading_builds_on_meta_and_equals_from_pretrained(variant, ltx2_models, monkeypatch):
    """Loading builds the transformer as from_pretrained does, with the right text encoder and CRF.

    The transformer as from_pretrained builds it; the text encoder of model_index.json, and the
    image CRF the I2V pipeline picks for it (33 for Gemma 3, 18 for 2.5's Gemma 4)."""
    adapter = load_adapter(
        ModelConfig(family="ltx2", path=str(ltx2_models(variant)), dtype="bf16"), torch.device("cpu")
    )
    assert_loads_lean(adapter, monkeypatch)
    text_encoder = LTX2Pipeline.from_pretrained(
        adapter.path, transformer=None, vae=None, audio_vae=None, vocoder=None, connectors=None
    ).text_encoder
    assert isinstance(text_encoder, adapter.TEXT_ENCODER)
    assert adapter.image_crf == resolve_default_image_crf(text_encoder) == (18 if variant == "2.5" else 33)


@pytest.mark.parametrize("variant", ["2.0", "2.5"])
def test_comfy_names_outside_the_blocks_are_the_original_checkpoints(variant, ltx2_models, tmp_path):
    """The ComfyUI file names modules outside the blocks as the original checkpoint does.

    A LoRA on every nn.Linear outside the blocks: the ComfyUI file names each module as the original
    checkpoint does, so ComfyUI's loader finds it (comfy/lora.py model_lora_keys_unet maps the
    generic key `diffusion_model.<name>` to each weight `diffusion_model.<name>.weight` of the
    model) and so does ltx-pipelines' (ltx_core/loader/sd_ops.py LTXV_LORA_COMFY_RENAMING_MAP drops
    `diffusion_model.`; a key naming no weight of the model is skipped, fuse_loras.py); diffusers'
    converter of such files (_convert_non_diffusers_ltx2_lora_to_diffusers, what load_lora_weights
    runs) gives back our modules, and lora.init_from reads the file to our weights."""
    adapter = load_adapter(ModelConfig(family="ltx2", path=str(ltx2_models(variant))), torch.device("cpu"))
    with torch.device("meta"):
        transformer = LTX2VideoTransformer3DModel.from_config(adapter.transformer_config)
    outside = [
        n
        for n, m in transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.startswith("transformer_blocks.")
    ]
    names = lora.inject_lora(transformer, outside, 2, 3.0, 0.0, 0, torch.device("cpu"))
    assert {adapter.comfy_key(n) for n in names} == original_top_level_linears(adapter.transformer_config)
    weights = {k: torch.randn(v.shape) for k, v in lora.lora_state_dict(transformer).items()}
    ckpt._export_comfy(weights, 2.0, adapter, tmp_path / "lora", "run")
    comfy = load_file(tmp_path / "lora" / "comfy" / "run.safetensors")
    comfyui_model = {
        f"diffusion_model.{name}.weight" for name in original_top_level_linears(adapter.transformer_config)
    }
    comfyui_key_map = {weight[: -len(".weight")]: weight for weight in comfyui_model}
    assert {k.rsplit(".lora_", 1)[0] for k in comfy} <= comfyui_key_map.keys()
    converted = _convert_non_diffusers_ltx2_lora_to_diffusers(comfy)
    assert converted.keys() == {f"transformer.{k}" for k in weights}
    read, info = lora.load_lora(str(tmp_path / "lora" / "comfy" / "run.safetensors"), adapter.diffusers_key)
    assert read.keys() == weights.keys() and (info["rank"], info["alpha"]) == (2, 2)


def test_a_folder_with_another_text_encoder_is_refused(ltx2_models, tmp_path):
    """A folder with another text encoder is refused before any cache pass.

    LTX2Pipeline takes Gemma 3 (2.0, 2.3) or Gemma 4 (2.5)."""
    folder = shutil.copytree(ltx2_models("2.5"), tmp_path / "model")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "text_encoder": ["transformers", "T5EncoderModel"]})
    )
    with pytest.raises(
        ConfigError,
        match=r"model_index.json: text_encoder is T5EncoderModel, which LTX2Pipeline does "
        r"not load: .* Gemma3ForConditionalGeneration or Gemma4Unified",
    ):
        load_adapter(ModelConfig(family="ltx2", path=str(folder)), torch.device("cpu"))


def cache_text(pipe, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's prompt_embeds and attention mask over the tokens ltx-core gives the prompt
    (the cache's: LTX2Adapter._tokens, held to ltx-core's layout in test_ltx2_training): with Gemma
    4 they start with the <bos> LTX2Pipeline's own tokenization leaves out."""
    inputs = LTX2Adapter._tokens(pipe.tokenizer, [prompt])
    with torch.no_grad():
        hidden = pipe.text_encoder(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, output_hidden_states=True
        ).hidden_states
    return torch.stack(hidden, dim=-1).flatten(2, 3), inputs.attention_mask


def pipeline_frames(pipe, cfg, ltx_core_text: bool = False):
    """The pipeline's float frames [F, H, W, 3] per prompt, guided as validation's settings say;
    `ltx_core_text`: given the text the cache holds (LTX-2.5), not its own encoding."""
    frames = []
    for i, prompt in enumerate(cfg.prompts):
        extra = {"image": Image.open(cfg.images[i]).convert("RGB")} if cfg.images else {}
        text = {"prompt": prompt, "negative_prompt": cfg.negative_prompt}
        if ltx_core_text:
            (embeds, mask), (negative, negative_mask) = (
                cache_text(pipe, p) for p in (prompt, cfg.negative_prompt)
            )
            text = {
                "prompt_embeds": embeds,
                "prompt_attention_mask": mask,
                "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": negative_mask,
            }
        frames.append(
            pipe(
                **text,
                num_frames=9,
                height=32,
                width=32,
                num_inference_steps=cfg.num_inference_steps,
                **pipeline_guidance(cfg),
                generator=data.keyed_generator(cfg.seed, i),
                output_type="pt",
                **extra,
            )
            .frames[0]
            .permute(0, 2, 3, 1)
        )
    return frames


def transformer_output(transformer, adapter):
    gen = torch.Generator().manual_seed(0)
    c = adapter.transformer_config
    video = torch.randn(2, 2 * 4 * 4, c["in_channels"], generator=gen)
    audio = torch.randn(2, 9, c["audio_in_channels"], generator=gen)
    embeds = torch.randn(2, TEXT_LENGTH, 16 + (8 if not c["use_prompt_embeddings"] else 16), generator=gen)
    t = torch.tensor([10.0, 900.0])
    with torch.no_grad():
        outputs = adapter._predict(
            transformer, VideoStream(video, t, t, (2, 4, 4)), AudioStream(audio, t, 9), embeds
        )
        return torch.cat([x.flatten(1) for x in outputs], 1)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_trains_exports_and_samples_as_its_pipeline(
    variant, ltx2_models, base_settings, ltx2_data, tmp_path
):
    """Every variant trains, exports, and samples as its pipeline does.

    Two video-only LoRA steps and two sft steps; our loop's frames equal the pipeline's within 1e-4
    in fp32 with the base model and with our exported LoRA loaded by load_lora_weights, with plain
    classifier-free guidance and with the pipelines' own terms (STG on 2.3, modality isolation,
    rescale, the sound's scale); the ComfyUI file loads through the same loader's conversion to the
    same transformer; the sft export loads with from_pretrained and computes what the checkpoint's
    weights compute. LTX-2.5: the pipeline takes the cache's text (ltx-core's tokens, the <bos> its
    own tokenization leaves out with Gemma 4). Image-to-video: the pipeline's transformer takes ltx-core's audio-video
    cross-attention modulation (the image tokens' scale/shift at their own timestep 0, as ours;
    diffusers' use_cross_timestep gives them the audio's sigma: test_ltx2_training)."""
    path = ltx2_models(model_of(variant))
    lora_file, cfg, adapter = lora_and_sft_runs(
        ltx2_settings(
            variant, ltx2_models, base_settings, ltx2_data, tmp_path / "lora", **EXTRA.get(variant, {})
        ),
        tmp_path,
    )
    # lora.init_from (and render.py --lora) read the ComfyUI file back: its alpha / rank is baked
    # into lora_B.
    comfy_file = next((lora_file.parent / "comfy").glob("*.safetensors"))
    comfy_weights, comfy_info = lora.load_lora(str(comfy_file), adapter.diffusers_key)
    weights, info = lora.load_lora(str(lora_file))
    assert (
        comfy_weights.keys() == weights.keys() and comfy_info["alpha"] == comfy_info["rank"] == info["rank"]
    )
    scale = info["alpha"] / info["rank"]
    assert all(torch.equal(comfy_weights[k], weights[k] * (scale if ".lora_B." in k else 1)) for k in weights)
    if variant in EXTRA:  # outside the blocks, the original checkpoint's names
        assert {
            "diffusion_model.patchify_proj.lora_A.weight",
            "diffusion_model.adaln_single.linear.lora_B.weight",
        } <= set(load_file(comfy_file))

    pipe = VARIANTS[variant][1].from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    i2v = VARIANTS[variant][0] == "i2v"
    modulation = ltx_core_cross_modulation if i2v else lambda transformer: contextlib.nullcontext()
    with one_rank_group() as d, modulation(pipe.transformer):
        renderer = validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), d)
        base = None  # the base model's frames, from the first pass
        for source in (None, lora_file):
            model = render.load_model(cfg, adapter, d, None, str(source) if source else None).eval()
            ours = [
                renderer.frames(model, i, adapter.sampler(""), contextlib.nullcontext())
                for i in range(len(PROMPTS))
            ]
            if source:
                pipe.load_lora_weights(str(source))
            for a, b in zip(ours, pipeline_frames(pipe, cfg.validation, variant == "2.5")):
                assert a.shape == b.shape == (9, 32, 32, 3)
                assert (a - b).abs().max() <= 1e-4, (variant, source, (a - b).abs().max())
            if source is not None:
                assert max((a - b).abs().max() for a, b in zip(ours, base)) > 1e-3  # the LoRA shows
            base = ours
        # With the LoRA, the pipelines' own guidance terms: ours equal theirs, and the terms show.
        guided = dataclasses.replace(cfg.validation, **PIPELINE_GUIDANCE, **(STG if variant != "2.0" else {}))
        renderer = validate.ClipRenderer(adapter, guided, cfg.data, str(tmp_path), d)
        ours = [
            renderer.frames(model, i, adapter.sampler(""), contextlib.nullcontext())
            for i in range(len(PROMPTS))
        ]
        for a, b, plain in zip(ours, pipeline_frames(pipe, guided, variant == "2.5"), base):
            assert (a - b).abs().max() <= 1e-4, (variant, "guided", (a - b).abs().max())
            assert (a - plain).abs().max() > 1e-3
        # The ComfyUI file through the loader's conversion of diffusion_model. keys: the same
        # transformer.
        ours = transformer_output(pipe.transformer, adapter)
        pipe.unload_lora_weights()
        pipe.load_lora_weights(str(comfy_file))
        torch.testing.assert_close(transformer_output(pipe.transformer, adapter), ours, rtol=0, atol=1e-5)

        sft_cfg = load_config(str(tmp_path / "sft.toml"))
        ours = render.load_model(sft_cfg, adapter, d, str(tmp_path / "sft" / "checkpoint-2"), None).eval()
    exported = LTX2VideoTransformer3DModel.from_pretrained(tmp_path / "sft" / "transformer").eval()
    torch.testing.assert_close(
        transformer_output(exported, adapter), transformer_output(ours, adapter), rtol=0, atol=1e-5
    )


def test_keyframe_marker_marks_the_first_latent_frame_as_ltx_pipelines(ltx2_models, write_config):
    """validation.keyframe_marker marks the clip's first latent frame as ltx-pipelines do.

    Off by default: as LTX2Pipeline and ltx-trainer's training, no marker. On (LTX-2.5), each
    sampling forward marks the first latent frame's tokens as ltx-core's VideoLatentTools marks them
    for ltx-pipelines and ltx-trainer's validation (Lightricks/LTX-2 400fd31, packages/ltx-core/src/
    ltx_core/tools.py:184-196: the first tokens_per_latent_frame tokens 1, the rest 0; a reference's
    tokens appended unmarked, conditioning/types/reference_video_cond.py:104), and those tokens get
    keyframes_abs_pos_embedding added after the patch embedding (model/transformer/
    transformer_args.py:37-43, :269), written here as a hook on proj_in. Refused for a transformer
    without the embedding (2.0) and for another family."""
    adapter = load_adapter(
        ModelConfig(family="ltx2", path=str(ltx2_models("2.5")), dtype="fp32"),
        torch.device("cpu"),
        RunSettings(keyframe_marker=True),
    )
    adapter.check_guidance(ValidationConfig(keyframe_marker=True))
    transformer = adapter.load_transformer().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        transformer.keyframes_abs_pos_embedding.normal_(generator=gen)
    c = adapter.transformer_config
    embeds = torch.randn(
        1, TEXT_LENGTH, c["cross_attention_dim"] + c["audio_cross_attention_dim"], generator=gen
    )
    seen = []
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["video_keyframes_mask"]), with_kwargs=True
    )
    t = torch.tensor(700.0)
    outputs = {}
    try:
        for reference in (0, 8):  # text-to-video, and an IC-LoRA reference
            state = adapter.sampling_start(
                adapter.sampler(""), 2, [9, 32, 32], torch.Generator().manual_seed(0)
            )
            if reference:
                state.latents = torch.cat([state.latents, torch.randn(1, reference, 8, generator=gen)], dim=1)
                state.reference, state.downscale = reference, 2  # 2 x 2 x 2 tokens at half the size
            for marker in (True, False):
                adapter.keyframe_marker = marker
                with torch.no_grad():
                    outputs[reference, marker] = adapter.denoise(
                        {"transformer": transformer}, state, t, embeds, False
                    )
                expected = torch.zeros(1, 32 + reference, 1)
                expected[:, :16] = 1  # 2 latent frames of 4 x 4
                assert torch.equal(seen[-1], expected) if marker else seen[-1] is None
            # ltx-core's formula: the embedding added to the marked tokens after proj_in, no marker
            added = transformer.proj_in.register_forward_hook(
                lambda module, args, out: torch.cat(
                    [out[:, :16] + transformer.keyframes_abs_pos_embedding, out[:, 16:]], dim=1
                )
            )
            adapter.keyframe_marker = False
            with torch.no_grad():
                theirs = adapter.denoise({"transformer": transformer}, state, t, embeds, False)
            added.remove()
            torch.testing.assert_close(outputs[reference, True], theirs, rtol=0, atol=1e-6)
            assert (outputs[reference, True] - outputs[reference, False]).abs().max() > 1e-3
    finally:
        hook.remove()
    old = load_adapter(ModelConfig(family="ltx2", path=str(ltx2_models("2.0"))), torch.device("cpu"))
    with pytest.raises(
        ConfigError,
        match=r"validation.keyframe_marker = true: .*'s transformer has no keyframe embedding "
        r"\(use_keyframes_abs_pos_embedding = false: LTX-2.0 and 2.3\), so there is nothing to mark: "
        r"remove it",
    ):
        old.check_guidance(ValidationConfig(keyframe_marker=True))
    with pytest.raises(
        ConfigError,
        match="validation.keyframe_marker marks LTX-2.5's first latent frame as ltx-pipelines do; "
        "cogvideox has no keyframe embedding: remove it",
    ):
        check_config(load_config(str(write_config("marker", **{"validation.keyframe_marker": True}))))


def test_audio_latents_add_their_own_loss(ltx2_models):
    """The hook the soundtrack's cache entries plug into: the audio VAE's posterior of a mel
    spectrogram (encode_audio) in the batch adds audio_loss_weight x the audio loss, from its own
    timestep draw; without it the video trains alone, its stream cut off from the audio (the audio
    latents change nothing)."""
    model_cfg = ModelConfig(family="ltx2", path=str(ltx2_models("2.0")), dtype="fp32")
    # train.audio_loss_weight as a run hands it over: one adapter per weight
    weighted = {
        weight: load_adapter(model_cfg, torch.device("cpu"), RunSettings(audio_loss_weight=weight))
        for weight in (0.5, 1.0)
    }
    adapter = weighted[1.0]
    transformer = adapter.load_transformer().eval()
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(2, 2, 36, adapter.audio_config["mel_bins"], generator=gen)
    audio_mean, audio_logvar = adapter.encode_mel(mel)
    assert audio_mean.shape == (
        2,
        adapter.audio_config["latent_channels"],
        9,
        adapter.audio_config["mel_bins"] // 4,
    )
    batch = {
        "latent_mean": torch.randn(2, 8, 2, 4, 4, generator=gen),
        "latent_logvar": torch.full((2, 8, 2, 4, 4), -4.0),
        "prompt_embeds": torch.randn(2, TEXT_LENGTH, 32, generator=gen),
    }
    sound = {**batch, "audio_latent_mean": audio_mean, "audio_latent_logvar": audio_logvar}

    def losses(batch, weight):
        with torch.no_grad():
            total = weighted[weight].train_loss(
                transformer, batch, [data.keyed_generator(0, 1, i) for i in range(2)]
            )
        sums, counts = weighted[weight].losses.T
        return total, {"loss_video": sums[0] / counts[0], "loss_audio": sums[1] / counts[1].clamp(min=1)}

    silent, parts = losses(batch, 1.0)
    assert torch.equal(silent.mean(), parts["loss_video"]) and parts["loss_audio"] == 0
    # Without sound the video stream sees nothing of the audio one: every audio weight changed, the
    # same loss.
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "audio" in name:
                param.add_(torch.randn(param.shape, generator=gen))
    assert torch.equal(losses(batch, 1.0)[0], silent)
    half, half_parts = losses(sound, 0.5)
    full, full_parts = losses(sound, 1.0)
    assert full_parts["loss_audio"] > 0 and torch.equal(full_parts["loss_video"], half_parts["loss_video"])
    torch.testing.assert_close((full - half).mean() * 2, full_parts["loss_audio"])
    torch.testing.assert_close(full.mean(), full_parts["loss_video"] + full_parts["loss_audio"])
    # the video attends to the sound
    assert not torch.allclose(full_parts["loss_video"], parts["loss_video"])


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            {"train.flow_shift": 3.0},
            r"train.flow_shift is read by the wan, kandinsky5 and hunyuanvideo15 families' training; ltx2 does not",
        ),
        ({"validation.use_dynamic_cfg": True}, r"validation.use_dynamic_cfg is CogVideoX's pipeline option"),
        ({}, r"data.audio = true with data.target_fps = 0: LTX-2's sound needs every clip at one rate"),
    ],
)
def test_options_ltx2_cannot_serve_are_refused(setting, message, tmp_path):
    """Named by the family's config check, before anything loads (model.path is an empty folder; the
    adapter ignores a flow shift: its timestep sampler sets its own)."""
    cfg = load_config(
        str(
            write_toml(
                tmp_path / "c.toml",
                {
                    "model.family": "ltx2",
                    "model.path": str(tmp_path),
                    "run.output_dir": str(tmp_path),
                    "data.data_root": str(tmp_path),
                    "parallel.strategy": "fsdp",
                    **setting,
                },
            )
        )
    )
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


@pytest.mark.parametrize(
    "family, setting, message",
    [
        (
            "wan",
            {"validation.stg_scale": 1.0},
            r"validation.stg_scale is an option of LTX-2's pipelines; wan's pipeline",
        ),
        (
            "cogvideox",
            {"validation.audio_guidance_scale": 7.0},
            r"validation.audio_guidance_scale is an option of LTX-2's",
        ),
        (
            "ltx2",
            {"validation.guidance_rescale": 1.5},
            r"validation.guidance_rescale must be between 0 and 1, got 1.5",
        ),
        (
            "ltx2",
            {"validation.stg_blocks": [3]},
            r"validation.stg_blocks names the blocks STG skips, but validation.stg_scale = 0",
        ),
        (
            "ltx2",
            {"validation.modality_scale": 3.0, "validation.guidance_scale": 1.0},
            r"validation.modality_scale adds to classifier-free guidance, which is off \(validation.guidance_scale = 1.0\)",
        ),
    ],
)
def test_guidance_terms_are_checked_before_anything_loads(family, setting, message, tmp_path):
    cfg = load_config(
        str(
            write_toml(
                tmp_path / "c.toml",
                {
                    "model.family": family,
                    "model.path": str(tmp_path),
                    "run.output_dir": str(tmp_path),
                    "data.data_root": str(tmp_path),
                    **setting,
                },
            )
        )
    )
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_stg_needs_perturbed_attention_and_blocks_the_model_has(
    ltx2_models, base_settings, ltx2_data, tmp_path
):
    """STG needs perturbed attention and blocks the model has.

    LTX-2.0's blocks ignore STG (diffusers passes its perturbation to LTX-2.3's only): refused
    before the cache pass, not a wasted forward; a block past the model's would perturb nothing."""
    settings = ltx2_settings(
        "2.0", ltx2_models, base_settings, ltx2_data, tmp_path, **{"validation.stg_scale": 1.0}
    )
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with (
        one_rank_group() as d,
        pytest.raises(
            StopRun,
            match=r"transformer has no perturbed attention \(LTX-2.0; "
            r"perturbed_attn = false\)",
        ),
    ):
        prepare_run(cfg, d)
    v = ValidationConfig(stg_scale=1.0)
    adapter = load_adapter(ModelConfig(path=str(ltx2_models("2.3")), family="ltx2"), torch.device("cpu"))
    with pytest.raises(
        ConfigError,
        match=r"validation.stg_blocks = \[28\] names a block the transformer of .* lacks \(it has 2\)",
    ):
        adapter.check_guidance(v)
    adapter.check_guidance(dataclasses.replace(v, stg_blocks=[1]))


@pytest.mark.slow
def test_full_lifecycle(ltx2_models, base_settings, ltx2_data, tmp_path):
    """LTX-2's whole lifecycle on 2 FSDP ranks: kill, resume bitwise, export to the pipeline.

    2 FSDP ranks with validation: SIGKILL after step 3, the next launch resumes from step 2 and ends
    bitwise equal to the run never stopped, clips included; the export loads in LTX2Pipeline and
    computes what our model with it computes."""
    lifecycle = {
        "parallel.strategy": "fsdp",
        "train.batch_size": 1,
        "train.steps": 4,
        "checkpoint.checkpointing_steps": 2,
        "validation.do_validation": True,
        "validation.validation_steps": 2,
        "validation.save_frames": True,
    }
    configs = {
        name: write_toml(
            tmp_path / f"{name}.toml",
            ltx2_settings("2.0", ltx2_models, base_settings, ltx2_data, tmp_path / name, **lifecycle),
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
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "reference")
    ours, theirs = (
        load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")
        for name in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    clip = "validation_res/step_4_prompt_0.safetensors"
    assert torch.equal(
        load_file(tmp_path / "killed" / clip)["frames"], load_file(tmp_path / "reference" / clip)["frames"]
    )
    lora_file = tmp_path / "reference" / "lora" / "pytorch_lora_weights.safetensors"
    cfg = load_config(str(configs["reference"]))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with one_rank_group() as d:
        model = render.load_model(cfg, adapter, d, None, str(lora_file)).eval()
    pipe = LTX2Pipeline.from_pretrained(str(ltx2_models("2.0")))
    pipe.load_lora_weights(str(lora_file))
    torch.testing.assert_close(
        transformer_output(pipe.transformer, adapter), transformer_output(model, adapter), rtol=0, atol=1e-5
    )
