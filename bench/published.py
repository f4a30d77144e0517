"""Published transformer and text encoder configs, and a model folder holding only configs.

The published transformer and text encoder configs, and a model folder holding only configs, for the
benchmarks that build full-size models without their weights (bench_memory.py --arch, bench_gpu.py).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from diffusers import (
    CogVideoXTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    LTX2VideoTransformer3DModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
)
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import ConfigError  # noqa: E402
from model_adapter import load_adapter  # noqa: E402
from tools.make_tiny_model import make_scheduler  # noqa: E402

TRANSFORMERS = {
    "cogvideox": CogVideoXTransformer3DModel,
    "wan": WanTransformer3DModel,
    "ltx2": LTX2VideoTransformer3DModel,
}
# LTX-2's published configs (docs/models/ltx2.md: diffusers' convert_ltx2_to_diffusers.py, versions
# "2.0" and "2.3"; the keys LTX-2.5 added to the class are absent, as in the published folders).
LTX2_19B = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": [8, 32, 32],
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "gated_attn": False,
    "cross_attn_mod": False,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "audio_gated_attn": False,
    "audio_cross_attn_mod": False,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split",
    "use_prompt_embeddings": True,
    "perturbed_attn": False,
}
LTX2_23 = {
    **LTX2_19B,
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
}
LTX2_CONNECTORS_20 = {
    "caption_channels": 3840,
    "text_proj_in_factor": 49,
    "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128,
    "video_gated_attn": False,
    "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128,
    "audio_gated_attn": False,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
    "rope_type": "split",
    "per_modality_projections": False,
    "proj_bias": False,
}
# 2.0's video VAE: these and the class defaults.
LTX2_VAE_20 = {"decoder_causal": False, "spatial_compression_ratio": 32, "temporal_compression_ratio": 8}
# The video VAE and text connectors per published model (the audio VAE's config is the class
# defaults for both).
LTX2_PARTS = {
    "ltx2-19b": {"vae": LTX2_VAE_20, "connectors": LTX2_CONNECTORS_20, "vocoder": "LTX2Vocoder"},
    "ltx2.3-22b": {
        "vocoder": "LTX2VocoderWithBWE",  # its bandwidth extension to 48 kHz
        "vae": {
            **LTX2_VAE_20,
            "block_out_channels": [256, 512, 1024, 1024],
            "decoder_block_out_channels": [256, 512, 512, 1024],
            "layers_per_block": [4, 6, 4, 2, 2],
            "decoder_layers_per_block": [4, 6, 4, 2, 2],
            "decoder_spatio_temporal_scaling": [True] * 4,
            "decoder_inject_noise": [False] * 5,
            "upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
            "upsample_residual": [False] * 4,
            "upsample_factor": [2, 2, 1, 2],
            "decoder_spatial_padding_mode": "zeros",
        },
        "connectors": {
            **LTX2_CONNECTORS_20,
            "video_connector_num_attention_heads": 32,
            "video_connector_num_layers": 8,
            "video_gated_attn": True,
            "audio_connector_num_attention_heads": 32,
            "audio_connector_attention_head_dim": 64,
            "audio_connector_num_layers": 8,
            "audio_gated_attn": True,
            "per_modality_projections": True,
            "video_hidden_dim": 4096,
            "audio_hidden_dim": 2048,
            "proj_bias": True,
        },
    },
}
# Published transformer configs (docs/models/cogvideox.md: 5B's values besides these are the class
# defaults; docs/models/wan.md and docs/models/ltx2.md).
PUBLISHED = {
    # the class defaults, spelled out
    "cogvideox-2b": ("cogvideox", {"num_attention_heads": 30, "num_layers": 30}),
    "cogvideox-5b": (
        "cogvideox",
        {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True},
    ),
    "wan2.1-t2v-14b": (
        "wan",
        WAN_14B := {
            "num_attention_heads": 40,
            "attention_head_dim": 128,
            "num_layers": 40,
            "ffn_dim": 13824,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "eps": 1e-6,
            "patch_size": [1, 2, 2],
            "cross_attn_norm": True,
            "rope_max_seq_len": 1024,
        },
    ),
    "wan2.1-t2v-1.3b": ("wan", {**WAN_14B, "num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960}),
    # VACE: context blocks beside every 5th (14B) or 2nd (1.3B) base block
    # (convert_wan_to_diffusers.py)
    "wan2.1-vace-14b": ("wan", {**WAN_14B, "vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96}),
    "wan2.1-vace-1.3b": (
        "wan",
        {
            **WAN_14B,
            "num_attention_heads": 12,
            "num_layers": 30,
            "ffn_dim": 8960,
            "vace_layers": list(range(0, 30, 2)),
            "vace_in_channels": 96,
        },
    ),
    # two experts of 2.1-14B's config, transformer/ and transformer_2/
    "wan2.2-t2v-a14b": ("wan", WAN_14B),
    "ltx2-19b": ("ltx2", LTX2_19B),
    "ltx2.3-22b": ("ltx2", LTX2_23),
}
PIPELINE_EXTRAS = {"wan2.2-t2v-a14b": {"boundary_ratio": 0.875}}
# The text encoders' published configs (T5 v1.1 XXL's and UMT5-XXL's encoders, docs/models/), for
# --arch.
T5_XXL = {
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
}
# LTX-2's Gemma 3 12B (google/gemma-3-12b-it's config.json: its language model and SigLIP vision
# tower): 11.77B + 0.43B parameters (keras-hub's gemma3_12b_text preset lists 11,765,788,416 for a
# vocabulary 64 tokens shorter).
GEMMA3_12B = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
    },
    "vision_config": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
    },
}
TEXT_ENCODERS = {
    "cogvideox": {**T5_XXL, "vocab_size": 32128},
    "wan": {**T5_XXL, "vocab_size": 256384},
    "ltx2": GEMMA3_12B,
}


def make_adapter(cfg, arch: str | None, root: Path, device: torch.device):
    """(family, adapter) of model.path, or of a folder holding only the published configs.

    (family, adapter): model.path's, or the adapter of a folder holding only the published configs.
    """
    if arch is None:
        if not Path(cfg.model.path, "model_index.json").is_file():
            raise ConfigError(
                f"model.path = {cfg.model.path} is not here: pass --arch ({', '.join(PUBLISHED)})"
            )
        adapter = load_adapter(cfg.model, device)
        return adapter.FAMILY, adapter
    family, published = PUBLISHED[arch]
    transformer, vae, pipeline = {
        "cogvideox": ("CogVideoXTransformer3DModel", "AutoencoderKLCogVideoX", "CogVideoXPipeline"),
        "wan": ("WanTransformer3DModel", "AutoencoderKLWan", "WanPipeline"),
        "ltx2": ("LTX2VideoTransformer3DModel", "AutoencoderKLLTX2Video", "LTX2Pipeline"),
    }[family]
    extras = PIPELINE_EXTRAS.get(arch, {})
    experts = ("transformer", "transformer_2") if "boundary_ratio" in extras else ("transformer",)
    if "vace_layers" in published:
        transformer, pipeline = "WanVACETransformer3DModel", "WanVACEPipeline"
    configs = {
        **{folder: {"_class_name": transformer, **published} for folder in experts},
        "vae": {"_class_name": vae},
        "text_encoder": TEXT_ENCODERS[family],
        "tokenizer": {},
    }
    if family == "ltx2":
        configs |= {
            "vae": {"_class_name": vae, **LTX2_PARTS[arch]["vae"]},
            "audio_vae": {"_class_name": "AutoencoderKLLTX2Audio"},
            "connectors": {"_class_name": "LTX2TextConnectors", **LTX2_PARTS[arch]["connectors"]},
            "vocoder": {"_class_name": LTX2_PARTS[arch]["vocoder"]},
        }
        # which vocoder and text encoder the adapter builds
        extras = {
            **extras,
            "vocoder": ["ltx2", LTX2_PARTS[arch]["vocoder"]],
            "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        }
    # the other VAEs, schedulers: class defaults (memory does not depend on them)
    for name, config in configs.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **extras}))
    # latent statistics, buffers the adapter reads from the weights: zeros and ones
    if family == "ltx2":
        # per latent channel; per packed audio feature
        for name, channels in (("vae", 128), ("audio_vae", 128)):
            save_file(
                {"latents_mean": torch.zeros(channels), "latents_std": torch.ones(channels)},
                root / name / "diffusion_pytorch_model.safetensors",
            )
    scheduler = {
        "cogvideox": lambda: make_scheduler(1.0),
        "ltx2": FlowMatchEulerDiscreteScheduler,
        "wan": lambda: UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    }[family]()
    scheduler.save_pretrained(root / "scheduler")
    model_cfg = dataclasses.replace(cfg.model, path=str(root), family=family)
    return family, load_adapter(model_cfg, device)


def meta_transformer(cls, config: dict, dtype: torch.dtype):
    """The transformer as from_pretrained(dtype=...) loads it, on the meta device.

    Parameters in dtype but the class's keep-in-fp32 modules; buffers in the dtype they are made in.
    """
    with torch.device("meta"):
        transformer = cls.from_config(config)
    for name, p in transformer.named_parameters():
        p.data = p.data.to(
            torch.float32 if set(name.split(".")) & set(cls._keep_in_fp32_modules or []) else dtype
        )
    return transformer
