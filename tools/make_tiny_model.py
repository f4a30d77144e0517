"""Write a tiny random video model in the exact diffusers layout.

Write a tiny random video model in the exact diffusers layout, with the published config key
sets.

tokenizer/ text_encoder/ transformer/ vae/ scheduler/ model_index.json, loadable by the family's
diffusers pipeline (`CogVideoXPipeline.from_pretrained(DIR)`, or the image-to-video one), so tests
and the demo exercise the real loading code without any hub download. Sizes are shrunk; the
transformer's config.json carries exactly the keys the published checkpoint's file carries (a key
diffusers added later is absent, and the class fills its default, as it does for the real file).

    python tools/make_tiny_model.py --out DIR [--family NAME] [--variant NAME] [--seed N]

--family: a registered family (TINY: cogvideox, wan, ltx2, kandinsky5, hunyuanvideo15).
CogVideoX variants: 2b, 5b (default), 5b-i2v, 1.5-5b, 1.5-5b-i2v. Wan variants: t2v (2.1 T2V
1.3B/14B), i2v (2.1 I2V 14B, with a CLIP image encoder), flf2v (2.1 FLF2V 14B), vace (2.1 VACE
1.3B/14B: control, mask and reference images through context blocks), ti2v-5b (2.2, its 4x16x16
VAE), a14b-t2v and a14b-i2v (2.2, two experts), a14b-vace (2.2 VACE-Fun A14B: two VACE experts).
LTX-2 variants: 2.0 (LTX-2 19B), 2.3 (LTX-2.3 22B), 2.5 (LTX-2.5 22B: Gemma 4, a duration head),
each text- and image-to-video (the same folder serves both pipelines). Kandinsky 5 variants: t2v
(Video Lite and Pro T2V, 5 s and 10 s), i2v (Video Lite and Pro I2V): Qwen2.5-VL and CLIP text
encoders, the HunyuanVideo VAE. HunyuanVideo 1.5 variants: t2v, i2v (480p and 720p: a SigLIP image
encoder for I2V): Qwen2.5-VL and ByT5 text encoders, its own VAE. docs/models/<family>.md list the
published key sets.
"""

import argparse
import json
import logging
import shutil
import string
from pathlib import Path

import torch

# diffusers' Wan image-to-video pipeline imports transformers' CLIPImageProcessor, and transformers
# then notes that torchvision (its default image backend) is missing: the PIL processor the tiny
# models use needs none, so that one notice is noise.
logging.getLogger("transformers.utils.import_utils").addFilter(
    lambda record: "requires torchvision" not in record.getMessage()
)
from diffusers import (
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLWan,
    ClassifierFreeGuidance,
    CogVideoXDPMScheduler,
    CogVideoXImageToVideoPipeline,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    WanVACEPipeline,
    WanVACETransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    ByT5Tokenizer,
    CLIPImageProcessorPil,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
    GemmaTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    Qwen2TokenizerFast,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

LATENT_CHANNELS = 4
TEXT_DIM = 32
TEXT_LENGTH = 16
WORDS = (
    "a red green blue yellow white purple orange cyan square circle triangle ball box "
    "moves left right up down slowly quickly across the on black background bounces "
    "drifts toward from to of and in video shape small large"
).split()
# The keys of every published CogVideoX transformer/config.json (docs/models/cogvideox.md).
COGVIDEOX_KEYS = {
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
ROTARY = {"use_rotary_positional_embeddings": True}
# Per variant: its model type, the transformer settings beyond the common ones (each also a key of
# its published file), the VAE's scaling and the scheduler's SNR shift. The 1.5 rotary grid is
# capped by sample_height/width (in latents): 12 lets tests train at 32x32 and refuse 64x64.
COGVIDEOX_VARIANTS = {
    "2b": ("t2v", {}, 1.15258426, 3.0),
    "5b": ("t2v", ROTARY, 0.7, 1.0),
    "5b-i2v": ("i2v", {**ROTARY, "use_learned_positional_embeddings": True}, 0.7, 1.0),
    "1.5-5b": (
        "t2v",
        {
            **ROTARY,
            "use_learned_positional_embeddings": False,
            "patch_size_t": 2,
            "patch_bias": False,
            "sample_height": 12,
            "sample_width": 12,
        },
        0.7,
        1.0,
    ),
    "1.5-5b-i2v": (
        "i2v",
        {
            **ROTARY,
            "use_learned_positional_embeddings": False,
            "patch_size_t": 2,
            "patch_bias": False,
            "ofs_embed_dim": 32,
            "sample_height": 12,
            "sample_width": 12,
        },
        0.7,
        1.0,
    ),
}
# Added to diffusers with CogVideoX 1.5: absent from the 1.0 VAE configs.
VAE_KEYS_SINCE_15 = {"invert_scale_latents"}


def make_tokenizer() -> T5Tokenizer:
    """A unigram vocabulary of our prompt words plus single characters as a fallback."""
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    words = [(f"\u2581{w}", -1.0) for w in WORDS]
    chars = [(c, -5.0) for c in string.ascii_lowercase + string.digits + ".,'-"]
    chars += [(f"\u2581{c}", -4.0) for c in string.ascii_lowercase + string.digits]
    return T5Tokenizer(vocab=specials + words + chars + [("\u2581", -3.0)], extra_ids=0)


def make_transformer(model_type: str, settings: dict) -> CogVideoXTransformer3DModel:
    return CogVideoXTransformer3DModel(
        **{
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "in_channels": LATENT_CHANNELS * (2 if model_type == "i2v" else 1),
            "out_channels": LATENT_CHANNELS,
            "time_embed_dim": 32,
            "text_embed_dim": TEXT_DIM,
            "num_layers": 2,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 9,
            "patch_size": 2,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": TEXT_LENGTH,
            **settings,
        }
    )


def make_vae(scaling_factor: float, invert_scale_latents: bool) -> AutoencoderKLCogVideoX:
    # Three levels give the real 4x temporal compression (two levels only give 2x).
    return AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3,
        block_out_channels=(8, 16, 16),
        latent_channels=LATENT_CHANNELS,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        sample_height=32,
        sample_width=32,
        scaling_factor=scaling_factor,
        invert_scale_latents=invert_scale_latents,
    )


def make_scheduler(snr_shift_scale: float) -> CogVideoXDPMScheduler:
    """The CogVideoX schedulers' configuration (snr_shift_scale 3.0 for 2b, 1.0 for the 5B models)."""
    return CogVideoXDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=snr_shift_scale,
        steps_offset=0,
        timestep_spacing="trailing",
    )


def keep_keys(config_file: Path, keys: set[str]) -> None:
    """Rewrite a saved config.json with only `keys` (and diffusers' own _class_name,
    _diffusers_version)."""
    config = json.loads(config_file.read_text())
    config_file.write_text(
        json.dumps(
            {k: v for k, v in config.items() if k.startswith("_") or k in keys}, indent=2, sort_keys=True
        )
        + "\n"
    )


def make_tiny_model(
    out: str, variant: str = "5b", seed: int = 0, transformer_settings: dict | None = None
) -> None:
    """`transformer_settings` override the tiny transformer's (a wider or deeper one for
    benchmarks)."""
    model_type, settings, scaling_factor, snr_shift_scale = COGVIDEOX_VARIANTS[variant]
    settings = {**settings, **(transformer_settings or {})}
    is_15 = variant.startswith("1.5")
    tokenizer = make_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The T5 vocabulary must also cover the 100 <extra_id_*> tokens T5Tokenizer adds on load.
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer) + 128, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4
            )
        )
        transformer = make_transformer(model_type, settings)
        vae = make_vae(scaling_factor, invert_scale_latents=is_15 and model_type == "i2v")
    pipeline_cls = CogVideoXImageToVideoPipeline if model_type == "i2v" else CogVideoXPipeline
    pipe = pipeline_cls(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=make_scheduler(snr_shift_scale),
    )
    pipe.save_pretrained(out)
    keep_keys(Path(out) / "transformer" / "config.json", COGVIDEOX_KEYS | settings.keys())
    if not is_15:
        vae_keys = set(json.loads((Path(out) / "vae" / "config.json").read_text())) - VAE_KEYS_SINCE_15
        keep_keys(Path(out) / "vae" / "config.json", vae_keys)
    # The class's defaults must rebuild what was saved: a dropped key held its default.
    loaded = CogVideoXTransformer3DModel.from_config(
        CogVideoXTransformer3DModel.load_config(out, subfolder="transformer")
    )
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == {
        k: v for k, v in transformer.config.items() if not k.startswith("_")
    }, variant


# Wan (docs/models/wan.md). The 2.1 T2V and I2V transformer files predate pos_embed_seq_len; the 2.1
# VAE files predate the 2.2 VAE's keys; 2.1's model_index has no boundary_ratio or expand_timesteps.
WAN21_KEYS = {
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
WAN21_VAE_KEYS = {
    "attn_scales",
    "base_dim",
    "dim_mult",
    "dropout",
    "latents_mean",
    "latents_std",
    "num_res_blocks",
    "temperal_downsample",
    "z_dim",
}
WAN22_VAE_KEYS = WAN21_VAE_KEYS | {
    "decoder_base_dim",
    "in_channels",
    "is_residual",
    "out_channels",
    "patch_size",
    "scale_factor_spatial",
    "scale_factor_temporal",
}
# The published 2.2 VAE's latent statistics (48 channels).
WAN22_LATENTS_MEAN = [
    -0.2289,
    -0.0052,
    -0.1323,
    -0.2339,
    -0.2799,
    0.0174,
    0.1838,
    0.1557,
    -0.1382,
    0.0542,
    0.2813,
    0.0891,
    0.157,
    -0.0098,
    0.0375,
    -0.1825,
    -0.2246,
    -0.1207,
    -0.0698,
    0.5109,
    0.2665,
    -0.2108,
    -0.2158,
    0.2502,
    -0.2055,
    -0.0322,
    0.1109,
    0.1567,
    -0.0729,
    0.0899,
    -0.2799,
    -0.123,
    -0.0313,
    -0.1649,
    0.0117,
    0.0723,
    -0.2839,
    -0.2083,
    -0.052,
    0.3748,
    0.0152,
    0.1957,
    0.1433,
    -0.2944,
    0.3573,
    -0.0548,
    -0.1681,
    -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765,
    1.0364,
    0.4514,
    1.1677,
    0.5313,
    0.499,
    0.4818,
    0.5013,
    0.8158,
    1.0344,
    0.5894,
    1.0901,
    0.6885,
    0.6165,
    0.8454,
    0.4978,
    0.5759,
    0.3523,
    0.7135,
    0.6804,
    0.5833,
    1.4146,
    0.8986,
    0.5659,
    0.7069,
    0.5338,
    0.4889,
    0.4917,
    0.4069,
    0.4999,
    0.6866,
    0.4093,
    0.5709,
    0.6065,
    0.6415,
    0.4944,
    0.5726,
    1.2042,
    0.5458,
    1.6887,
    0.3971,
    1.06,
    0.3943,
    0.5537,
    0.5444,
    0.4089,
    0.7468,
    0.7744,
]
# variant: (pipeline, transformer in/out channels, image encoder, 2.2 VAE, boundary_ratio,
# expand_timesteps, flow_shift)
WAN_VARIANTS = {
    "t2v": (WanPipeline, (16, 16), False, False, None, None, 3.0),
    "i2v": (WanImageToVideoPipeline, (36, 16), True, False, None, None, 3.0),
    "flf2v": (WanImageToVideoPipeline, (36, 16), True, False, None, None, 3.0),
    "vace": (WanVACEPipeline, (16, 16), False, False, None, None, 3.0),
    "ti2v-5b": (WanPipeline, (48, 48), False, True, None, True, 5.0),
    "a14b-t2v": (WanPipeline, (16, 16), False, False, 0.875, False, 3.0),
    "a14b-i2v": (WanImageToVideoPipeline, (36, 16), False, False, 0.9, False, 3.0),
    # Wan2.2-VACE-Fun-A14B: diffusers' convert_wan_to_diffusers ("Wan2.2-VACE-Fun-14B", from
    # alibaba-pai/Wan2.2-VACE-Fun-A14B) writes two experts of Wan-VACE-14B's config (40 blocks,
    # vace_layers every fifth, 96 context channels), the 2.1 VAE, UniPC at shift 3 and
    # WanVACEPipeline's boundary_ratio 0.875 (its diffusers copy, linoyts/Wan2.2-VACE-Fun-14B-diffusers,
    # holds the same).
    "a14b-vace": (WanVACEPipeline, (16, 16), False, False, 0.875, False, 3.0),
}


# The tiny CLIP's tokens per image: (32 / 8)^2 patches and its class token (the published one's
# 257).
CLIP_TOKENS = 17


# VACE: context blocks beside base blocks 0 and 2 of 3 (the published 1.3B's every second of 30, the
# 14B's every fifth of 40, diffusers' convert_wan_to_diffusers); 96 context channels: the inactive
# and reactive latents (2 x z_dim = 32) and the 8 x 8 mask pixels of each latent pixel (64), as the
# published ones.
VACE = {"num_layers": 3, "vace_layers": [0, 2], "vace_in_channels": 96}
WAN_VACE_KEYS = {"vace_layers", "vace_in_channels"}


def make_wan_transformer(
    channels: tuple[int, int], image: bool, first_last: bool = False, vace: bool = False
) -> WanTransformer3DModel:
    # FLF2V: the image embedder's position table covers two images' tokens, as diffusers'
    # convert_wan_to_diffusers writes for Wan-FLF2V-14B-720P ("pos_embed_seq_len": 257 * 2).
    settings = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=channels[0],
        out_channels=channels[1],
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=16 if image else None,
        added_kv_proj_dim=32 if image else None,
        rope_max_seq_len=1024,
        pos_embed_seq_len=2 * CLIP_TOKENS if first_last else None,
    )
    if vace:
        return WanVACETransformer3DModel(**settings | VACE)
    transformer = WanTransformer3DModel(**settings)
    if first_last:
        # diffusers starts the table at zeros; the published one is learned: a tiny model whose
        # table were zeros would read the same with it lost or misplaced (its own generator: the
        # other weights stay as they were drawn)
        with torch.no_grad():
            table = transformer.condition_embedder.image_embedder.pos_embed
            table.normal_(std=0.5, generator=torch.Generator().manual_seed(1))
    return transformer


def make_wan_vae(is_22: bool) -> AutoencoderKLWan:
    if not is_22:
        return AutoencoderKLWan(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=WAN22_LATENTS_MEAN,
        latents_std=WAN22_LATENTS_STD,
    )


def make_tiny_wan(out: str, variant: str = "t2v", seed: int = 0) -> None:
    pipeline_cls, channels, image, is_22, boundary, expand, shift = WAN_VARIANTS[variant]
    tokenizer = make_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer) + 128,
                d_model=TEXT_DIM,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu",
                dense_act_fn="gelu_new",
                is_gated_act=True,
                dropout_rate=0.1,
                layer_norm_epsilon=1e-6,
                scalable_attention=True,
                tie_word_embeddings=False,
            )
        )
        components = {
            "tokenizer": tokenizer,
            "text_encoder": text_encoder,
            "vae": make_wan_vae(is_22),
            "transformer": make_wan_transformer(channels, image, variant == "flf2v", "vace" in variant),
            "scheduler": UniPCMultistepScheduler(
                prediction_type="flow_prediction",
                use_flow_sigmas=True,
                num_train_timesteps=1000,
                flow_shift=shift,
            ),
        }
        # A14B: transformer is the high-noise expert, transformer_2 the low-noise one
        if boundary is not None:
            components["transformer_2"] = make_wan_transformer(channels, image, vace="vace" in variant)
        if pipeline_cls is WanImageToVideoPipeline:
            # The published 2.1 I2V folders hold a CLIPVisionModel (no projection), the class the
            # pipeline declares; the PIL image processor saves as CLIPImageProcessor, as theirs, and
            # needs no torchvision.
            components["image_encoder"] = (
                CLIPVisionModel(
                    CLIPVisionConfig(
                        hidden_size=16,
                        projection_dim=16,
                        num_hidden_layers=2,
                        num_attention_heads=2,
                        image_size=32,
                        intermediate_size=32,
                        patch_size=8,
                    )
                )
                if image
                else None
            )
            components["image_processor"] = (
                CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
                if image
                else None
            )
    # WanVACEPipeline takes no expand_timesteps.
    arguments = {} if pipeline_cls is WanVACEPipeline else {"expand_timesteps": bool(expand)}
    pipe = pipeline_cls(**components, boundary_ratio=boundary, **arguments)
    pipe.save_pretrained(out)
    root = Path(out)
    # 2.1 T2V and I2V predate pos_embed_seq_len; FLF2V's config holds it (set), 2.2's and VACE's too
    # (null); VACE's adds its context layers and channels (diffusers' convert_wan_to_diffusers,
    # Wan-VACE-1.3B/14B).
    transformer_keys = WAN21_KEYS if variant in ("t2v", "i2v") else WAN21_KEYS | {"pos_embed_seq_len"}
    transformer_keys |= WAN_VACE_KEYS if "vace" in variant else set()
    for folder in ("transformer", "transformer_2"):
        if (root / folder).is_dir():
            keep_keys(root / folder / "config.json", transformer_keys)
    keep_keys(root / "vae" / "config.json", WAN22_VAE_KEYS if is_22 else WAN21_VAE_KEYS)
    index = json.loads((root / "model_index.json").read_text())
    # 2.1's folders predate the 2.2 pipeline arguments
    if variant in ("t2v", "i2v", "flf2v", "vace"):
        index = {
            k: v for k, v in index.items() if k not in ("boundary_ratio", "expand_timesteps", "transformer_2")
        }
    # the published class name, whichever backend saved it
    if index.get("image_processor", [None])[0]:
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# LTX-2 (docs/models/ltx2.md): the transformer/config.json keys of the published folders, as
# diffusers' conversion script writes them for 2.0 and 2.3 (the four keys LTX-2.5 added later are
# absent); 2.5's adds two (LTX25_KEYS).
LTX2_KEYS = {
    "activation_fn",
    "attention_bias",
    "attention_head_dim",
    "attention_out_bias",
    "audio_attention_head_dim",
    "audio_cross_attention_dim",
    "audio_cross_attn_mod",
    "audio_gated_attn",
    "audio_hop_length",
    "audio_in_channels",
    "audio_num_attention_heads",
    "audio_out_channels",
    "audio_patch_size",
    "audio_patch_size_t",
    "audio_pos_embed_max_pos",
    "audio_sampling_rate",
    "audio_scale_factor",
    "base_height",
    "base_width",
    "caption_channels",
    "causal_offset",
    "cross_attention_dim",
    "cross_attn_mod",
    "cross_attn_timestep_scale_multiplier",
    "gated_attn",
    "in_channels",
    "norm_elementwise_affine",
    "norm_eps",
    "num_attention_heads",
    "num_layers",
    "out_channels",
    "patch_size",
    "patch_size_t",
    "perturbed_attn",
    "pos_embed_max_pos",
    "qk_norm",
    "rope_double_precision",
    "rope_theta",
    "rope_type",
    "timestep_scale_multiplier",
    "use_prompt_embeddings",
    "vae_scale_factors",
}
LTX25_KEYS = LTX2_KEYS | {"ff_bias", "use_keyframes_abs_pos_embedding"}
# The tiny Gemma's layers: the connectors read every layer's hidden states and the embeddings'
LTX2_TEXT_LAYERS = 2
LTX2_LATENT_CHANNELS = 8
# The audio VAE: mel_bins 16 and its 4x mel compression give 4 latent mel bins, x 2 latent channels
# = 8 features per audio token, which must equal base_channels (its latents_mean/std hold one value
# per token feature).
LTX2_AUDIO = {"base_channels": 8, "latent_channels": 2, "mel_bins": 16}
# variant: (LTX-2.3's changes: gated attention, cross-attention modulation, per-modality text
# projections, STG's perturbed attention, the vocoder with bandwidth extension; LTX-2.5's: Gemma 4,
# a video feed-forward without bias, the keyframe position embedding, the duration head)
LTX2_VARIANTS = {"2.0": (False, False), "2.3": (True, False), "2.5": (True, True)}


def make_gemma_tokenizer(bos: bool = True) -> GemmaTokenizer:
    """A character-level BPE vocabulary (no merges): Gemma's special tokens, then letters, digits
    and the word boundary; the pipeline pads it on the left, as Gemma's. `bos`: it starts each text
    with <bos>, as Gemma 3's does; Gemma 4's does not (ltx-core's LTXGemmaTokenizer: "Gemma 3
    already emits it via post_processor; Gemma 4 does not, so we prepend")."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for c in string.ascii_lowercase + string.digits + ".,'-\u2581":
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=bos)


def make_tiny_gemma(vocab_size: int, is_25: bool):
    """A 2-layer Gemma of hidden size 16: Gemma 3 with a 1-layer SigLIP vision tower (2.0, 2.3), or
    a Gemma 4 (`gemma4_unified`, 2.5: the class diffusers' conversion script requires) with a
    1-layer vision tower; the last layer full attention, as both families' configs require."""
    text = {
        "vocab_size": vocab_size,
        "hidden_size": TEXT_DIM // 2,
        "intermediate_size": 32,
        "num_hidden_layers": LTX2_TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 64,
    }
    if not is_25:
        return Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config=text,
                vision_config={
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 16,
                    "patch_size": 4,
                },
                mm_tokens_per_image=4,
            )
        )
    return Gemma4UnifiedForConditionalGeneration(
        Gemma4UnifiedConfig(
            text_config={
                **text,
                "global_head_dim": 8,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            vision_config={
                "patch_size": 4,
                "pooling_kernel_size": 2,
                "mm_embed_dim": 16,
                "mm_posemb_size": 16,
                "output_proj_dims": TEXT_DIM // 2,
            },
        )
    )


def make_tiny_ltx2(out: str, variant: str = "2.0", seed: int = 0) -> None:
    is_23, is_25 = LTX2_VARIANTS[variant]
    tokenizer = make_gemma_tokenizer(bos=not is_25)
    video_dim, audio_dim = 16, 8  # the transformer's streams: 2 heads of 8, 2 heads of 4
    audio_features = LTX2_AUDIO["latent_channels"] * LTX2_AUDIO["mel_bins"] // 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = make_tiny_gemma(len(tokenizer) + 8, is_25)
        caption = TEXT_DIM // 2
        transformer = LTX2VideoTransformer3DModel(
            in_channels=LTX2_LATENT_CHANNELS,
            out_channels=LTX2_LATENT_CHANNELS,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=video_dim,
            vae_scale_factors=(8, 8, 8),
            gated_attn=is_23,
            cross_attn_mod=is_23,
            audio_in_channels=audio_features,
            audio_out_channels=audio_features,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=audio_dim,
            audio_gated_attn=is_23,
            audio_cross_attn_mod=is_23,
            num_layers=2,
            caption_channels=caption,
            rope_type="split",
            use_prompt_embeddings=not is_23,
            perturbed_attn=is_23,
            **({"ff_bias": False, "use_keyframes_abs_pos_embedding": True} if is_25 else {}),
        )
        connectors = LTX2TextConnectors(
            caption_channels=caption,
            text_proj_in_factor=LTX2_TEXT_LAYERS + 1,
            video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=8,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=128,
            video_gated_attn=is_23,
            audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=4 if is_23 else 8,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=128,
            audio_gated_attn=is_23,
            rope_type="split",
            per_modality_projections=is_23,
            video_hidden_dim=video_dim,
            audio_hidden_dim=audio_dim,
            proj_bias=is_23,
        )
        # The published layout (a spatial, a temporal and two spatio-temporal downsamplings: 8x in
        # time, 8x in space before the patch) with patch_size 1 where the published VAE has 4: 8x8
        # in space, not 32x32.
        vae = AutoencoderKLLTX2Video(
            latent_channels=LTX2_LATENT_CHANNELS,
            block_out_channels=(8, 16, 32, 64),
            decoder_block_out_channels=(8, 16, 32),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1),
            patch_size=1,
            decoder_causal=False,
            spatial_compression_ratio=8,
            temporal_compression_ratio=8,
        )
        vae.register_buffer("latents_mean", torch.randn(LTX2_LATENT_CHANNELS) * 0.1)
        vae.register_buffer("latents_std", 1.0 + torch.rand(LTX2_LATENT_CHANNELS))
        audio_vae = AutoencoderKLLTX2Audio(**LTX2_AUDIO, ch_mult=(1, 2, 4), num_res_blocks=1, resolution=32)
        audio_vae.register_buffer("latents_mean", torch.randn(LTX2_AUDIO["base_channels"]) * 0.1)
        audio_vae.register_buffer("latents_std", 1.0 + torch.rand(LTX2_AUDIO["base_channels"]))
        # The vocoders upsample mel frames (hop 160 at 16 kHz) by the published totals, in two
        # layers: x120 to 24 kHz (2.0); x160 to 16 kHz, then the bandwidth extension's x240 over hop
        # 80 to 48 kHz (2.3, 2.5).
        mel_features = 2 * LTX2_AUDIO["mel_bins"]  # the decoder's stereo mel spectrogram, flattened
        if is_23:
            vocoder = LTX2VocoderWithBWE(
                in_channels=mel_features,
                hidden_channels=8,
                upsample_kernel_sizes=[20, 32],
                upsample_factors=[10, 16],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1]],
                bwe_in_channels=mel_features,
                bwe_hidden_channels=8,
                bwe_upsample_kernel_sizes=[12, 80],
                bwe_upsample_factors=[6, 40],
                bwe_resnet_kernel_sizes=[3],
                bwe_resnet_dilations=[[1]],
                num_mel_channels=LTX2_AUDIO["mel_bins"],
            )
        else:
            vocoder = LTX2Vocoder(
                in_channels=mel_features,
                hidden_channels=8,
                upsample_kernel_sizes=[24, 20],
                upsample_factors=[12, 10],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1]],
            )
        # 2.5's duration head (inference only: it predicts num_frames when a pipeline call omits
        # it), its published structure (one query, 4 pooler heads) on the tiny streams' widths.
        duration_head = (
            LTX2DurationHead(
                video_cross_attention_dim=video_dim,
                audio_cross_attention_dim=audio_dim,
                pooler_hidden_dim=16,
                mlp_hidden_dim=16,
            )
            if is_25
            else None
        )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
        duration_head=duration_head,
    )
    pipe.save_pretrained(out)
    root = Path(out)
    keep_keys(root / "transformer" / "config.json", LTX25_KEYS if is_25 else LTX2_KEYS)
    # The optional components LTX-2.5 added: absent from the 2.0 and 2.3 folders; 2.5's has its
    # duration head (the prompt enhancer and its processor are a separate download, not part of
    # training).
    index = json.loads((root / "model_index.json").read_text())
    dropped = ("processor", "prompt_enhancer") if is_25 else ("duration_head", "processor", "prompt_enhancer")
    index = {k: v for k, v in index.items() if k not in dropped}
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# Kandinsky 5 (docs/models/kandinsky5.md): the transformer's config.json keys of the published
# Diffusers folders (kandinskylab/Kandinsky-5.0-*-Diffusers: every argument of
# Kandinsky5Transformer3DModel, the NABLA attention's included) and the HunyuanVideo VAE's.
KANDINSKY5_KEYS = {
    "attention_P",
    "attention_add_sta",
    "attention_causal",
    "attention_glob",
    "attention_local",
    "attention_method",
    "attention_type",
    "attention_wH",
    "attention_wT",
    "attention_wW",
    "attention_window",
    "axes_dims",
    "ff_dim",
    "in_text_dim",
    "in_text_dim2",
    "in_visual_dim",
    "model_dim",
    "num_text_blocks",
    "num_visual_blocks",
    "out_visual_dim",
    "patch_size",
    "time_dim",
    "visual_cond",
}
HUNYUAN_VAE_KEYS = {
    "act_fn",
    "block_out_channels",
    "down_block_types",
    "in_channels",
    "latent_channels",
    "layers_per_block",
    "mid_block_add_attention",
    "norm_num_groups",
    "out_channels",
    "scaling_factor",
    "spatial_compression_ratio",
    "temporal_compression_ratio",
    "up_block_types",
}
KANDINSKY5_VARIANTS = {"t2v": Kandinsky5T2VPipeline, "i2v": Kandinsky5I2VPipeline}


def make_qwen_tokenizer() -> Qwen2TokenizerFast:
    """A byte-level BPE trained on the pipeline's prompt template and our prompt words, so that the
    template's system part fills about the 128 tokens the pipeline cuts off
    (prompt_template_encode_start_idx) and prompts stay whole words, as with Qwen's own."""
    # the pipeline's own template (its __init__ sets it; no component is needed)
    template = Kandinsky5T2VPipeline(*[None] * 7).prompt_template
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([template, WORDS] * 20, trainer)
    return Qwen2TokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token=None
    )


def make_clip_tokenizer(folder: Path) -> CLIPTokenizer:
    """CLIP's BPE with no merges: single characters (and each with CLIP's word-end mark) and the
    start and end tokens, written to `folder` (CLIPTokenizer reads files)."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = string.ascii_lowercase + string.digits + ".,'-!?"
    vocab = {
        t: i for i, t in enumerate([*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"])
    }
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))


def make_tiny_kandinsky5(out: str, variant: str = "t2v", seed: int = 0) -> None:
    """Kandinsky 5 Video Lite's layout, shrunk: 1 text block and 2 visual blocks of 2 heads x 16
    (axes 4, 6, 6), visual_cond (33 input channels: the latents, the visual condition, its mask)
    as every published video model; a 2-layer Qwen2.5-VL and a 1-layer CLIP text tower of width 32;
    the HunyuanVideo VAE's 4 levels (4x time, 8x space). T2V and I2V share the transformer's
    layout: the folders differ in their pipeline."""
    qwen_tokenizer = make_qwen_tokenizer()
    root = Path(out)
    clip_tokenizer = make_clip_tokenizer(root / "clip_vocab")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        qwen = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": len(qwen_tokenizer) + 8,
                    "hidden_size": TEXT_DIM,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                    "bos_token_id": None,
                    "eos_token_id": qwen_tokenizer.eos_token_id,
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": TEXT_DIM,
                    "fullatt_block_indexes": [0],
                },
            )
        )
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer),
                hidden_size=TEXT_DIM,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=77,
                bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id,
            )
        )
        transformer = Kandinsky5Transformer3DModel(
            in_visual_dim=LATENT_CHANNELS,
            out_visual_dim=LATENT_CHANNELS,
            in_text_dim=TEXT_DIM,
            in_text_dim2=TEXT_DIM,
            time_dim=16,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(4, 6, 6),
            visual_cond=True,
        )
        # The published modulations are trained; zero (diffusers' init) they would switch every
        # block off.
        for name, parameter in transformer.named_parameters():
            if "modulation" in name:
                parameter.data.normal_(0, 0.1)
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=LATENT_CHANNELS,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            norm_num_groups=4,
        )
    pipe = KANDINSKY5_VARIANTS[variant](
        transformer=transformer,
        vae=vae,
        text_encoder=qwen,
        tokenizer=qwen_tokenizer,
        text_encoder_2=clip,
        tokenizer_2=clip_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    pipe.save_pretrained(out)
    shutil.rmtree(root / "clip_vocab")
    keep_keys(root / "transformer" / "config.json", KANDINSKY5_KEYS)
    keep_keys(root / "vae" / "config.json", HUNYUAN_VAE_KEYS)


# HunyuanVideo 1.5 (docs/models/hunyuanvideo15.md): the transformer/config.json keys of the published
# folders (hunyuanvideo-community/HunyuanVideo-1.5-*), as diffusers' conversion script writes them
# (scripts/convert_hunyuan_video1_5_to_diffusers.py, TRANSFORMER_CONFIGS: every argument of the class);
# the VAE's likewise. 480p and 720p differ only in target_size and the scheduler's shift; T2V and I2V
# in task_type and the I2V folder's SigLIP image encoder.
HUNYUANVIDEO15_KEYS = {
    "attention_head_dim",
    "image_embed_dim",
    "in_channels",
    "mlp_ratio",
    "num_attention_heads",
    "num_layers",
    "num_refiner_layers",
    "out_channels",
    "patch_size",
    "patch_size_t",
    "qk_norm",
    "rope_axes_dim",
    "rope_theta",
    "target_size",
    "task_type",
    "text_embed_2_dim",
    "text_embed_dim",
    "use_meanflow",
}
HUNYUANVIDEO15_VAE_KEYS = {
    "block_out_channels",
    "downsample_match_channel",
    "in_channels",
    "latent_channels",
    "layers_per_block",
    "out_channels",
    "scaling_factor",
    "spatial_compression_ratio",
    "temporal_compression_ratio",
    "upsample_match_channel",
}
HUNYUANVIDEO15_VARIANTS = {"t2v": HunyuanVideo15Pipeline, "i2v": HunyuanVideo15ImageToVideoPipeline}
# Qwen2.5-VL's chat template, its structure (the system message, the user's prompt, the assistant's
# turn opened), which the pipeline's 108-token crop assumes.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tiny transformer's width and the tiny SigLIP's image size: a 32 x 32 image is one bucket of
# target_size 32 (the I2V pipeline sizes its clip by target_size's buckets).
HUNYUANVIDEO15_SIZE = 32


def make_qwen_chat_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE vocabulary without merges (every byte one token), Qwen's special tokens and
    chat template; padding on the right, as Qwen2.5-VL's."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def make_tiny_hunyuanvideo15(out: str, variant: str = "t2v", seed: int = 0) -> None:
    pipeline_cls = HUNYUANVIDEO15_VARIANTS[variant]
    tokenizer, tokenizer_2 = make_qwen_chat_tokenizer(), ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = {
            "tokenizer": tokenizer,
            "text_encoder": Qwen2_5_VLTextModel(
                Qwen2_5_VLTextConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=TEXT_DIM,
                    intermediate_size=64,
                    num_hidden_layers=3,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    max_position_embeddings=2048,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                    bos_token_id=None,
                    eos_token_id=None,
                )
            ),
            "tokenizer_2": tokenizer_2,
            "text_encoder_2": T5EncoderModel(
                T5Config(
                    vocab_size=len(tokenizer_2),
                    d_model=16,
                    d_kv=8,
                    d_ff=32,
                    num_layers=1,
                    num_heads=2,
                    feed_forward_proj="gated-gelu",
                )
            ),
            "vae": AutoencoderKLHunyuanVideo15(
                latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1
            ),
            "transformer": HunyuanVideo15Transformer3DModel(
                in_channels=2 * LATENT_CHANNELS + 1,
                out_channels=LATENT_CHANNELS,
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=2,
                num_refiner_layers=1,
                text_embed_dim=TEXT_DIM,
                text_embed_2_dim=16,
                image_embed_dim=16,
                rope_axes_dim=(4, 6, 6),
                target_size=HUNYUANVIDEO15_SIZE,
                task_type=variant,
            ),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
            "guider": ClassifierFreeGuidance(guidance_scale=6.0),
        }
        if variant == "i2v":
            components["image_encoder"] = SiglipVisionModel(
                SiglipVisionConfig(
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=HUNYUANVIDEO15_SIZE,
                    patch_size=8,
                )
            )
            size = {"height": HUNYUANVIDEO15_SIZE, "width": HUNYUANVIDEO15_SIZE}
            components["feature_extractor"] = SiglipImageProcessorPil(size=size)
    pipeline_cls(**components).save_pretrained(out)
    root = Path(out)
    keep_keys(root / "transformer" / "config.json", HUNYUANVIDEO15_KEYS)
    keep_keys(root / "vae" / "config.json", HUNYUANVIDEO15_VAE_KEYS)
    index = json.loads((root / "model_index.json").read_text())
    # the published class name, whichever backend saved it
    if "feature_extractor" in index:
        index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# Each family's tiny models: its variants, the default one, and the function that writes one. The one
# place a family registers its maker: --family's choices and the tests' fixtures (tests/conftest.py)
# are read from it.
TINY = {
    "cogvideox": (COGVIDEOX_VARIANTS, "5b", make_tiny_model),
    "wan": (WAN_VARIANTS, "t2v", make_tiny_wan),
    "ltx2": (LTX2_VARIANTS, "2.0", make_tiny_ltx2),
    "kandinsky5": (KANDINSKY5_VARIANTS, "t2v", make_tiny_kandinsky5),
    "hunyuanvideo15": (HUNYUANVIDEO15_VARIANTS, "t2v", make_tiny_hunyuanvideo15),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=list(TINY), default="cogvideox")
    defaults = ", ".join(f"{default} ({family})" for family, (_, default, _) in TINY.items())
    parser.add_argument("--variant", help=f"default: {defaults}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    variants, default, make = TINY[args.family]
    variant = args.variant or default
    if variant not in variants:
        parser.error(f"--variant {variant} is not a {args.family} variant: one of {', '.join(variants)}")
    make(args.out, variant, args.seed)
    print(f"wrote tiny {args.family} {variant} to {args.out}")


if __name__ == "__main__":
    main()
