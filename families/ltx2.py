"""LTX-2, LTX-2.3 and LTX-2.5: one transformer with a video and an audio stream.

LTX-2, LTX-2.3 and LTX-2.5 (docs/models/ltx2.md): one transformer with a video and an audio
stream, text- and image-to-video from the same folder.

Flow matching per stream: x_t = (1 - s) x0 + s e, the target e - x0, the loss in fp32. Each stream
draws its own s (LTX-2's trainer, ltx-trainer, samples every generated modality separately) from the
shifted logit-normal sampler of ltx-trainer, its shift set by the stream's token count; model
timesteps are 1000 s. The clean latents are the cached posteriors' means, as ltx-trainer trains; the
audio-video cross-attention is modulated as ltx-core modulates it (_cross_gates). A batch without
audio latents trains the video alone, as ltx-trainer does with no audio modality: the audio stream
gets no tokens and the audio-video cross-attention is off (isolate_modalities), so the video stream
computes exactly what ltx-core computes without audio; with audio latents the loss is the video loss
plus audio_loss_weight times the audio loss. Video latents are normalised with the VAE's
latents_mean/std and scaling_factor, audio latents per token feature with the audio VAE's; text is
Gemma's hidden states of every layer (Gemma 3; Gemma 4 for 2.5) through the connectors, whose
learnable registers fill every padded position, so the cache holds the video and audio text
embeddings side by side (no mask). The sampling pieces are LTX2Pipeline's and
LTX2ImageToVideoPipeline's loops with their guidance: classifier-free (the sound at its own scale),
STG, modality isolation and the rescale, each at validation's setting.
"""

import contextlib
import copy
import json
import math
import re
from fractions import Fraction
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.models.transformers.transformer_ltx2 import (
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import (
    apply_image_conditioning_crf,
    resolve_default_image_crf,
)
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from diffusers.video_processor import VideoProcessor
from transformers import (
    AutoTokenizer,
    Gemma3ForConditionalGeneration,
    Gemma4UnifiedForConditionalGeneration,
)

import data
from config import Config, ConfigError, ModelConfig
from model_adapter import (
    DTYPES,
    TIMESTEP_KEYS,
    Adapter,
    RunSettings,
    config_sets,
    log,
    masked_mean,
    to_device,
)
from parallel import SequenceSplit, split_blocks, stack_qkv
from weights import PREFIX, Weights, resolved_config

TEXT_LENGTH = 1024  # the pipelines' max_sequence_length
# the pipelines' frame_rate: positions in seconds for the rotary embeddings, and the audio's length
FRAME_RATE = 24.0
MEL_FFT = 1024  # the audio VAE's STFT size: ltx-core's AudioProcessor (not in diffusers' config)
# the pipelines' spatio_temporal_guidance_blocks: the blocks whose self-attention STG skips
STG_BLOCKS = [28]
# Lightricks' single files (ltx-2-19b-dev.safetensors, LTX-2.3's): ltx-core's transformer under
# model.diffusion_model., named as diffusers' but for these substrings, replaced in this order
# (diffusers' scripts/convert_ltx2_to_diffusers.py, LTX_2_3_TRANSFORMER_KEYS_RENAME_DICT: LTX_2_0_'s
# and 2.3's prompt AdaLNs), and for a leading adaln_single. or audio_adaln_single.
# (convert_ltx2_transformer_adaln_single, applied after them). docs/models/ltx2.md, "Single files".
SINGLE_FILE_NAMES = {
    "patchify_proj": "proj_in",
    "audio_patchify_proj": "audio_proj_in",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
    "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
    "audio_prompt_adaln_single": "audio_prompt_adaln",
    "prompt_adaln_single": "prompt_adaln",
}
SINGLE_FILE_STARTS = {"adaln_single.": "time_embed.", "audio_adaln_single.": "audio_time_embed."}
# The text connectors the same file holds beside the transformer, which diffusers keeps in another
# folder (split_transformer_and_connector_state_dict's prefixes); the VAEs and the vocoder are
# outside the prefix.
CONNECTOR_PREFIXES = (
    "video_embeddings_connector",
    "audio_embeddings_connector",
    "transformer_1d_blocks",
    "text_embedding_projection",
    "connectors.",
    "video_connector",
    "audio_connector",
    "text_proj_in",
)
# connectors/' names in Lightricks' single files, as ltx-core reads them (EMBEDDINGS_PROCESSOR_KEY_OPS,
# text_encoders/gemma/encoders/encoder_configurator.py) and ComfyUI's LTXAV model holds them
# (video_embeddings_connector, audio_embeddings_connector): diffusers' LTX_2_0_ /
# LTX_2_3_CONNECTORS_KEYS_RENAME_DICT read backwards, the text projection outside
# model.diffusion_model. (docs/models/ltx2.md, "Single files").
CONNECTOR_NAMES = {
    "video_text_proj_in": "text_embedding_projection.video_aggregate_embed",
    "audio_text_proj_in": "text_embedding_projection.audio_aggregate_embed",
    "text_proj_in": "text_embedding_projection.aggregate_embed",
    "video_connector": "video_embeddings_connector",
    "audio_connector": "audio_embeddings_connector",
    "transformer_blocks": "transformer_1d_blocks",
    "norm_q": "q_norm",
    "norm_k": "k_norm",
}
# ltx-trainer's shifted logit-normal timestep sampler: its shift is the line through these (tokens,
# shift) points, extrapolated both ways (timestep_samplers.py's _get_shift_for_sequence_length
# clamps neither end).
SHIFT_TOKENS, SHIFTS = (1024, 4096), (0.95, 2.05)
# the trainings model.type names (check_config's messages)
TRAININGS = {"i2v": "image-to-video", "ic": "IC-LoRA"}
# model_index.json's text encoder: Gemma 3 (2.0, 2.3) or Gemma 4 (2.5); the pipelines accept these
# two.
TEXT_ENCODERS = {
    c.__name__: c for c in (Gemma3ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration)
}
# The original checkpoint's (Lightricks', ComfyUI's) names of the modules outside the blocks whose
# diffusers names differ (proj_out, audio_proj_out and the caption projections keep theirs): the
# tables above, reversed.
ORIGINAL_NAMES = {ours: original for original, ours in SINGLE_FILE_NAMES.items()} | {
    ours.rstrip("."): original.rstrip(".") for original, ours in SINGLE_FILE_STARTS.items()
}
DIFFUSERS_NAMES = {original: name for name, original in ORIGINAL_NAMES.items()}
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
# The published folders without weights (Adapter.PUBLISHED): the audio VAE's config is the class
# defaults; the latent statistics the adapter reads from the VAEs' weights, per latent channel and
# per packed audio feature.
PUBLISHED_FOLDERS = {
    name: {
        "model_index.json": {
            "_class_name": "LTX2Pipeline",
            "vocoder": ["ltx2", parts["vocoder"]],
            "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        },
        "transformer": {"_class_name": "LTX2VideoTransformer3DModel", **transformer},
        "vae": {"_class_name": "AutoencoderKLLTX2Video", **parts["vae"]},
        "vae.weights": {"latents_mean": [128], "latents_std": [128]},
        "audio_vae": {"_class_name": "AutoencoderKLLTX2Audio"},
        "audio_vae.weights": {"latents_mean": [128], "latents_std": [128]},
        "connectors": {"_class_name": "LTX2TextConnectors", **parts["connectors"]},
        "vocoder": {"_class_name": parts["vocoder"]},
        "text_encoder": GEMMA3_12B,
        "tokenizer": {},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler"},
    }
    for name, transformer, parts in (
        ("ltx2-19b", LTX2_19B, LTX2_PARTS["ltx2-19b"]),
        ("ltx2.3-22b", LTX2_23, LTX2_PARTS["ltx2.3-22b"]),
    )
}


class VideoStream(NamedTuple):
    """The video stream of one transformer call (_predict)."""

    latents: torch.Tensor  # packed noisy latents [B, tokens, C]
    timesteps: torch.Tensor  # [B], or per token [B, tokens] (I2V: the image's at 0)
    # [B]: its noise level (LTX-2.3's prompt modulation; the audio's cross gate)
    sigma: torch.Tensor
    shape: tuple[int, int, int]  # the latent (frames, height, width)
    # IC-LoRA: the reference's spatial downscale factor k (model.reference_downscale_factor; 0
    # without one): the tokens after the clip's are a reference clip of latent shape (frames,
    # height / k, width / k)
    reference: int = 0
    # the leading tokens LTX-2.5's keyframe marker marks (validation.keyframe_marker: the first
    # latent frame's); 0: none
    marked: int = 0


class AudioStream(NamedTuple):
    """The audio stream of one transformer call (_predict)."""

    latents: torch.Tensor  # packed noisy audio latents [B, audio tokens, C'] (maybe no tokens)
    timesteps: torch.Tensor  # [B], its sigma too (the video's cross gate)
    frames: int  # audio latent frames


def shifted_logit_normal(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """One s in [0, 1]: sigmoid(N(mu, 1)) stretched between its 0.5th and 99.9th percentiles
    (reflected at 1e-3), or, one draw in ten, uniform in [1e-3, 1); mu grows linearly with the token
    count, uncapped (2.78 at the shipped 121 x 512 x 768's 6,144 tokens)."""
    mu = SHIFTS[0] + (SHIFTS[1] - SHIFTS[0]) * (tokens - SHIFT_TOKENS[0]) / (
        SHIFT_TOKENS[1] - SHIFT_TOKENS[0]
    )
    normal, uniform, choice = (
        torch.randn((), generator=generator),
        torch.rand((), generator=generator),
        torch.rand((), generator=generator),
    )
    low, high = torch.sigmoid(torch.tensor(mu - 2.5758)), torch.sigmoid(torch.tensor(mu + 3.0902))
    stretched = (torch.sigmoid(normal + mu) - low) / (high - low)
    stretched = torch.where(stretched >= 1e-3, stretched, 2e-3 - stretched).clamp(0, 1)
    return torch.where(choice > 0.1, stretched, (1 - 1e-3) * uniform + 1e-3)


class LTX2Adapter(Adapter):
    FAMILY = "ltx2"
    PUBLISHED = PUBLISHED_FOLDERS
    # The pipelines' terms added to classifier-free guidance; the other families' pipelines have
    # none.
    OWN_KEYS = dict.fromkeys(
        (
            "validation.audio_guidance_scale",
            "validation.stg_scale",
            "validation.stg_blocks",
            "validation.modality_scale",
            "validation.guidance_rescale",
        ),
        "{key} is an option of LTX-2's pipelines; {family}'s pipeline has no such guidance term: remove it",
    ) | {
        "model.reference_downscale_factor": "{key} is an option of LTX-2's IC-LoRA (model.family = "
        '"ltx2", model.type = "ic"); {family} has no in-context reference: remove it',
        "train.first_frame_conditioning_p": "{key} is an option of LTX-2's image-to-video and IC-LoRA "
        "training (ltx-trainer's first_frame condition); {family} has no such draw: remove it",
        "validation.keyframe_marker": "{key} marks LTX-2.5's first latent frame as ltx-pipelines do; "
        "{family} has no keyframe embedding: remove it",
    }
    # "audio": the soundtrack's entries (audio_latent_mean, audio_latent_logvar), keyed by the audio
    # VAE's files. No "image": image-to-video conditions on the clip's own first latent frame.
    ENCODERS = {
        "video": ("vae",),
        "text": ("text_encoder", "tokenizer", "connectors"),
        "audio": ("audio_vae",),
    }
    TRANSFORMER, VAE = LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video
    COMFY = True
    # what ComfyUI's detection knows LTX-2 by ("ltxav")
    SINGLE_FILE_KEY = "audio_adaln_single.linear.weight"
    # Lightricks' files carry the text connectors: without them ComfyUI's LTXAV model keeps its
    # connector weights uninitialised and samples from garbage text conditioning.
    SINGLE_FILE_PARTS = ("connectors",)
    # LTX2Pipeline.load_lora_weights refuses .alpha keys (every key must name "lora")
    COMFY_ALPHA = False
    LOSS_PARTS = ("loss_video", "loss_audio")
    # The audio VAE's precision, whatever model.dtype: ltx-trainer's process_videos.py encodes in
    # float32 ("Audio VAE needs float32 for quality"). It names the cache's audio entries.
    AUDIO_DTYPE = "fp32"
    # a batch without sound runs the video alone: the audio stream's weights get no gradient
    GRAPH_VARIES = True
    # "ic": IC-LoRA, the control clip's tokens appended clean (docs/control.md)
    TYPES = ("t2v", "i2v", "ic")
    READS = TIMESTEP_KEYS

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        super().__init__(cfg, device, run)
        self.transformer_config = resolved_config(LTX2VideoTransformer3DModel, self.path, "transformer")
        self.vae_config = resolved_config(AutoencoderKLLTX2Video, self.path, "vae")
        connectors = resolved_config(LTX2TextConnectors, self.path, "connectors")
        for stream in ("video", "audio"):
            registers = connectors[f"{stream}_connector_num_learnable_registers"]
            if not registers or TEXT_LENGTH % registers:
                raise ConfigError(
                    f"{self.path}/connectors/config.json: {stream}_connector_num_learnable_registers = "
                    f"{registers}, but the cache keeps no text mask and needs registers filling the "
                    f"padding of {TEXT_LENGTH} tokens (the published 128 do)"
                )
        self.audio_config = resolved_config(AutoencoderKLLTX2Audio, self.path, "audio_vae")
        # Latent statistics live in the VAEs' weights (buffers): read those few values, not the
        # VAEs.
        with (video := Weights(self.path / "vae")).opened():
            mean, std = (video.read(f"latents_{n}", torch.float32).to(device) for n in ("mean", "std"))
        self.latents_mean, self.latents_std = mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)
        with (audio := Weights(self.path / "audio_vae")).opened():
            self.audio_mean, self.audio_std = (
                audio.read(f"latents_{n}", torch.float32).to(device) for n in ("mean", "std")
            )
        index = json.loads((self.path / "model_index.json").read_text())
        text_encoder = index["text_encoder"][1]
        if text_encoder not in TEXT_ENCODERS:
            raise ConfigError(
                f"{self.path}/model_index.json: text_encoder is {text_encoder}, which "
                f"LTX2Pipeline does not load: model.path must be an LTX-2 folder with "
                f"{' or '.join(TEXT_ENCODERS)}"
            )
        self.TEXT_ENCODER = TEXT_ENCODERS[text_encoder]
        # The H.264 CRF the I2V pipeline compresses its image with, by the text encoder's generation
        # (33 for Gemma 3, 18 for Gemma 4).
        text_config = json.loads((self.path / "text_encoder" / "config.json").read_text())
        self.image_crf = resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(**text_config)))
        self.audio_loss_weight = run.audio_loss_weight
        self.takes_control = cfg.type == "ic"
        # IC-LoRA: the control read at 1/k of the clip's size (ltx-trainer's
        # reference_downscale_factor)
        self.reference_downscale = cfg.reference_downscale_factor
        # I2V and IC-LoRA: a sample's chance of a clean first latent frame (ltx-trainer's
        # first_frame condition); by default every I2V sample, as a first_frame condition without a
        # probability (flexible.py, IntrinsicConditionBase.probability = 1.0), none for IC-LoRA
        p = run.first_frame_p
        self.first_frame_p = p if p >= 0 else float(cfg.type == "i2v")
        # sampling marks the first latent frame for LTX-2.5's keyframe embedding (check_guidance)
        self.keyframe_marker = run.keyframe_marker
        # The rate the video's rotary positions count seconds in: data.target_fps (every clip's
        # rate) when set.
        self.frame_rate = run.frame_rate or FRAME_RATE
        # the last loss's per stream: (sum, samples), detached
        self.losses = torch.zeros(len(self.LOSS_PARTS), 2)
        self._audio_vae = self._connectors = self._vocoder = None
        vocoder = index["vocoder"][1]  # 2.3's and 2.5's extend the band
        self.vocoder_class = {c.__name__: c for c in (LTX2Vocoder, LTX2VocoderWithBWE)}[vocoder]
        self.sound_rate = resolved_config(self.vocoder_class, self.path, "vocoder")["output_sampling_rate"]

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """The pipelines' guidance terms in their ranges, and sound at one frame rate."""
        super().check_config(cfg)
        v = cfg.validation
        if min(v.audio_guidance_scale, v.stg_scale, v.modality_scale, *v.stg_blocks) < 0:
            raise ConfigError(
                "validation.audio_guidance_scale, stg_scale, modality_scale and stg_blocks cannot be negative"
            )
        if not 0 <= v.guidance_rescale <= 1:
            raise ConfigError(
                f"validation.guidance_rescale must be between 0 and 1, got {v.guidance_rescale}"
            )
        if v.stg_blocks and not v.stg_scale:
            raise ConfigError(
                "validation.stg_blocks names the blocks STG skips, but "
                "validation.stg_scale = 0 turns STG off: set stg_scale, or remove "
                "stg_blocks"
            )
        guided = v.guidance_scale > 1 or v.audio_guidance_scale > 1
        added = [
            key
            for key in ("stg_scale", "modality_scale", "guidance_rescale")
            if config_sets(cfg, f"validation.{key}")
        ]
        if added and not guided:
            raise ConfigError(
                f"validation.{added[0]} adds to classifier-free guidance, which is off "
                f"(validation.guidance_scale = {v.guidance_scale}): set "
                f"validation.guidance_scale above 1, or remove {added[0]}"
            )
        k, p = cfg.model.reference_downscale_factor, cfg.train.first_frame_conditioning_p
        for key, value, valid, what, types in (
            ("model.reference_downscale_factor", k, k >= 1, "a whole factor, 1 or more", ("ic",)),
            # -1, the default: the type's own
            (
                "train.first_frame_conditioning_p",
                p,
                0 <= p <= 1 or p == -1,
                "a probability, 0 to 1",
                ("i2v", "ic"),
            ),
        ):
            if not valid:
                raise ConfigError(f"{key} = {value} is out of range: {what}")
            if cfg.model.type not in types and config_sets(cfg, key):
                named = " or ".join(f'"{t}"' for t in types)
                raise ConfigError(
                    f"{key} = {value} shapes {' and '.join(TRAININGS[t] for t in types)} training "
                    f'(model.type = {named}), and model.type is "{cfg.model.type}": remove it, or set '
                    f"model.type = {named}"
                )
        if cfg.model.type == "i2v" and cfg.data.image_column:
            raise ConfigError(
                f"data.image_column = {cfg.data.image_column}: LTX-2's image-to-video trains on each "
                "clip's own first latent frame, as ltx-trainer's first_frame condition, and reads no "
                "image: remove data.image_column"
            )
        if cfg.data.audio and not cfg.data.target_fps:
            raise ConfigError(
                "data.audio = true with data.target_fps = 0: LTX-2's sound needs every "
                "clip at one rate (the clips of a batch then have sound of one length, "
                "and the video's positions count seconds at that rate): set "
                "data.target_fps (24, as LTX-2 was published), or data.audio = false to "
                "train video only"
            )

    def check_resolution(self, resolution, key: str) -> None:
        """IC-LoRA with a downscaled reference: the reference's height and width, 1/k of the clip's,
        are whole multiples of the model's size multiple too (ltx-trainer's
        compute_scaled_resolution_buckets' rule)."""
        super().check_resolution(resolution, key)
        k = self.reference_downscale if self.takes_control else 1
        for name, value in zip(("height", "width"), resolution[1:]):
            if value % (k * self.size_multiple):
                raise ConfigError(
                    f"{key} {name} = {value}, but model.reference_downscale_factor = {k} reads the "
                    f"control at 1/{k} of it, which must be a multiple of {self.size_multiple} too: "
                    f"use a multiple of {k * self.size_multiple}, or another factor"
                )

    def text_key(self) -> dict:
        """Text entries made with the <bos> ltx-core prepends (_tokens) where the tokenizer does not
        start with it (Gemma 4) are keyed apart from those vidtrain made before without it; with
        Gemma 3 the tokens, and so the keys, are unchanged."""
        tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer")
        return {} if tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id] else {"bos": "ltx-core"}

    def lora_metadata(self) -> dict[str, str]:
        """IC-LoRA: the exported files' reference_downscale_factor, as ltx-trainer writes it
        (VideoToVideoStrategy.get_checkpoint_metadata) and ComfyUI-LTXVideo's IC-LoRA loader and
        ltx-pipelines read it."""
        return {"reference_downscale_factor": str(self.reference_downscale)} if self.takes_control else {}

    def control_key(self) -> dict:
        """The control entry's key beyond the clip's and the control's: a downscaled reference's
        factor (none at 1, so those entries keep their keys)."""
        k = self.reference_downscale
        return {"reference_downscale_factor": k} if self.takes_control and k != 1 else {}

    # Shape rules read from the model's own config.
    @property
    def frame_multiple(self) -> int:
        return self.temporal_ratio  # 8k+1 frames: the causal VAE encodes the first frame alone

    @property
    def size_multiple(self) -> int:
        return self.spatial_ratio * self.transformer_config["patch_size"]

    @property
    def text_length(self) -> int:
        return TEXT_LENGTH

    @property
    def text_width(self) -> int:
        # the video and audio streams' embeddings side by side (encode_text): 2.0's connectors give
        # caption_channels each, 2.3's each stream's own width
        c = self.transformer_config
        if c["use_prompt_embeddings"]:
            return 2 * c["caption_channels"]
        return c["cross_attention_dim"] + c["audio_cross_attention_dim"]

    @property
    def published_fps(self) -> int:
        return int(FRAME_RATE)

    def clip_rate(self, gen_fps: int) -> Fraction:
        """The rate the sound was generated for, frame_rate (data.target_fps, else the pipelines'
        24): the pipeline makes frames / frame_rate seconds of sound (sampling_start's
        audio_frames), so a clip written at another rate plays out of step with it; such a
        validation.gen_fps is refused."""
        rate = Fraction(self.frame_rate).limit_denominator(1001)
        if gen_fps and gen_fps != rate:
            raise ConfigError(
                f"validation.gen_fps = {gen_fps}, but LTX-2 generates each clip's sound for its "
                f"frames at {float(rate):g} fps (data.target_fps, else the published 24): at another "
                f"rate picture and sound would disagree; set validation.gen_fps = 0 (that rate)"
            )
        return rate

    @property
    def audio_sample_rate(self) -> int:
        return self.audio_config["sample_rate"]

    @property
    def audio_channels(self) -> int:
        return self.audio_config["in_channels"]  # stereo mel spectrograms

    @property
    def audio_latents_per_second(self) -> float:
        """The audio VAE's latent frames per second: 16000 Hz / hop 160 / 4 = 25 for the published
        one."""
        return self.audio_config["sample_rate"] / self.audio_config["mel_hop_length"] / 4

    def comfy_key(self, module: str) -> str:
        """The original checkpoint's name (Lightricks' and ComfyUI's): the blocks' modules as
        diffusers names them, the top-level modules by ORIGINAL_NAMES."""
        top, _, rest = module.partition(".")
        return ".".join(filter(None, (ORIGINAL_NAMES.get(top, top), rest)))

    def diffusers_key(self, original: str) -> str:
        top, _, rest = original.partition(".")
        return ".".join(filter(None, (DIFFUSERS_NAMES.get(top, top), rest)))

    @staticmethod
    def single_file_key(key: str) -> str:
        """A state-dict key's name in Lightricks' single files: SINGLE_FILE_NAMES and
        SINGLE_FILE_STARTS undone."""
        for original, ours in SINGLE_FILE_STARTS.items():
            if key.startswith(ours):
                key = original + key.removeprefix(ours)
        # One pass, the longest name first where two start at one place: replaced one by one,
        # prompt_adaln's inverse would find audio_prompt_adaln_single's "audio_prompt_adaln" again.
        inverse = {ours: original for original, ours in SINGLE_FILE_NAMES.items()}
        longest_first = "|".join(sorted(map(re.escape, inverse), key=len, reverse=True))
        return re.sub(longest_first, lambda m: inverse[m[0]], key)

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str]:
        """Lightricks' names -> diffusers', as diffusers' conversion script renames them."""

        def renamed(key: str) -> str:
            for original, ours in SINGLE_FILE_NAMES.items():
                key = key.replace(original, ours)
            for original, ours in SINGLE_FILE_STARTS.items():
                if key.startswith(original) and key.endswith((".weight", ".bias")):
                    key = ours + key.removeprefix(original)
            return key

        return {k: renamed(k) for k in keys}

    @staticmethod
    def single_file_part_key(key: str) -> str:
        """A connectors/ key's name in Lightricks' files (CONNECTOR_NAMES, in one pass, the longest
        name first: text_proj_in is inside video_text_proj_in)."""
        longest_first = "|".join(sorted(map(re.escape, CONNECTOR_NAMES), key=len, reverse=True))
        name = re.sub(longest_first, lambda m: CONNECTOR_NAMES[m[0]], key)
        return name if name.startswith("text_embedding_projection.") else PREFIX + name

    def single_file_extra(self, key: str) -> bool:
        """Lightricks' files hold the text connectors beside the transformer, under the same prefix."""
        return key.startswith(CONNECTOR_PREFIXES)

    # Encoding.
    def _normalise(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipelines' (x - mean) * scaling_factor / std, [B, C, F, h, w]."""
        return (
            (latents - self.latents_mean.to(latents))
            * self.vae_config["scaling_factor"]
            / self.latents_std.to(latents)
        )

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (not
        normalised)."""
        posterior = self._load_vae().encode(self._pixels(video)).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def _image_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image pixels [B, 3, H, W] in [-1, 1] -> the VAE's mode of the one-frame video, normalised
        as the I2V pipeline's prepare_latents does (without the scaling factor), [B, C, 1, h, w]."""
        latents = self._load_vae().encode(pixels[:, :, None].to(self.vae_dtype)).latent_dist.mode().float()
        return (latents - self.latents_mean.to(latents)) / self.latents_std.to(latents)

    def reference_frames(self, video: torch.Tensor) -> torch.Tensor:
        """IC-LoRA: control frames uint8 [B, F, H, W, 3] at the clip's size -> the reference's, at
        1/k of it (model.reference_downscale_factor): each frame resized as LTX2InContextPipeline
        resizes a reference condition's frames (VideoProcessor: PIL's bilinear filter)."""
        k = self.reference_downscale
        if k == 1:
            return video
        height, width = video.shape[2] // k, video.shape[3] // k
        frames = [
            np.asarray(PIL.Image.fromarray(frame).resize((width, height), PIL.Image.BILINEAR))
            for frame in video.flatten(0, 1).cpu().numpy()
        ]
        return torch.from_numpy(np.stack(frames)).unflatten(0, video.shape[:2])

    def encode_control(self, video: torch.Tensor) -> dict[str, torch.Tensor]:
        """IC-LoRA's control entry: the VAE posterior of the reference frames (reference_frames)."""
        return super().encode_control(self.reference_frames(video))

    def mel(self, waveforms: torch.Tensor) -> torch.Tensor:
        """Waveforms [B, channels, samples] at audio_sample_rate -> the audio VAE's input, the
        log-mel spectrogram [B, channels, samples // hop + 1, mel bins] (data.log_mel: ltx-core's
        AudioProcessor), in fp32."""
        c = self.audio_config
        mel = data.log_mel(
            waveforms.flatten(0, 1).float(), c["sample_rate"], MEL_FFT, c["mel_hop_length"], c["mel_bins"]
        )
        return mel.unflatten(0, waveforms.shape[:2])

    def encode_audio(self, waveforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A window's sound -> the audio VAE's posterior of its mel spectrogram.

        A window's sound, [B, audio_channels, samples] at audio_sample_rate (data.decode_audio)
        -> the audio VAE's posterior mean and log-variance of its mel spectrogram, [B, C', L, M']
        (not normalised): the cache's audio_latent_mean and audio_latent_logvar. L is what the VAE
        gives (1 + (mel frames - 1) // 4: 127 for 121 frames at 24 fps, where the pipeline generates
        round(121 / 24 x 25) = 126), kept as ltx-trainer keeps it: the audio tokens' positions come
        from their own count."""
        return self.encode_mel(self.mel(waveforms))

    def _load_audio_vae(self):
        if self._audio_vae is None:
            log.info("loading audio VAE from %s", self.path)
            self._audio_vae = AutoencoderKLLTX2Audio.from_pretrained(
                self.path, subfolder="audio_vae", dtype=DTYPES[self.AUDIO_DTYPE]
            )
            self._audio_vae.requires_grad_(False).eval()
        return self._audio_vae.to(self.device)

    @torch.no_grad()
    def encode_mel(self, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The audio VAE's posterior of a log-mel spectrogram [B, channels, mel frames, mel bins],
        in fp32."""
        posterior = self._load_audio_vae().encode(mel.to(self.device, DTYPES[self.AUDIO_DTYPE])).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Audio latents [1, C', L, M'] (sampled_audio) -> the waveform [channels, samples] at
        sound_rate, fp32, as the pipeline decodes them: the audio VAE's mel spectrogram through the
        vocoder."""
        if self._vocoder is None:
            self._vocoder = self.vocoder_class.from_pretrained(
                self.path, subfolder="vocoder", dtype=self.vae_dtype
            )
            self._vocoder.requires_grad_(False).eval()
        mel = self._load_audio_vae().decode(latents.to(DTYPES[self.AUDIO_DTYPE]), return_dict=False)[0]
        return self._vocoder.to(self.device)(mel.to(self.vae_dtype))[0].float()

    def _text(self):
        if self._text_encoder is None:
            super()._text()
            self._connectors = LTX2TextConnectors.from_pretrained(
                self.path, subfolder="connectors", dtype=self.dtype
            )
            self._connectors.to(self.device).requires_grad_(False).eval()
        return self._text_encoder, self._tokenizer

    def release_text_encoder(self) -> None:
        super().release_text_encoder()
        self._connectors = None

    def park_vae(self) -> None:
        super().park_vae()
        for module in (self._audio_vae, self._vocoder):
            if module is not None:
                module.to("cpu")

    def release_encoders(self) -> None:
        self._connectors = self._audio_vae = None  # the vocoder is never loaded before validation
        super().release_encoders()

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[B, 1024, video dim + audio dim]: ltx-trainer's encoding (Gemma's every hidden state of
        ltx-core's tokens, left padding, the connectors), the video stream's text and the audio
        stream's side by side; LTX2Pipeline's where the tokenizer starts with <bos> (Gemma 3)."""
        text_encoder, tokenizer = self._text()
        inputs = self._tokens(tokenizer, prompts).to(self.device)
        hidden = text_encoder(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, output_hidden_states=True
        ).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.dtype)
        video, audio, _ = self._connectors(embeds, inputs.attention_mask, padding_side="left")
        return torch.cat([video, audio], dim=-1)

    @staticmethod
    def _tokens(tokenizer, prompts: list[str]):
        """The prompts' input_ids and attention_mask [B, 1024] as ltx-core's LTXGemmaTokenizer
        (text_encoders/gemma/tokenizer.py:31-56) makes them: stripped, truncated to 1024 tokens,
        <bos> prepended where the tokenizer did not start with it (Gemma 4) and the 1024 kept, then
        left-padded (the eos token where there is no pad token). With Gemma 3, which starts with
        <bos>, the tokens LTX2Pipeline's _get_gemma_prompt_embeds makes; with Gemma 4, one more."""
        if tokenizer.bos_token_id is None:
            raise ConfigError(
                "the model's tokenizer/ has no bos_token, which ltx-core's encoding starts every prompt "
                "with: use the tokenizer the model was published with"
            )
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        bos = tokenizer.bos_token_id
        ids = tokenizer([p.strip() for p in prompts], truncation=True, max_length=TEXT_LENGTH).input_ids
        ids = [x if x[:1] == [bos] else [bos, *x][:TEXT_LENGTH] for x in ids]
        return tokenizer.pad(
            {"input_ids": ids},
            padding="max_length",
            max_length=TEXT_LENGTH,
            return_tensors="pt",
            return_attention_mask=True,
        )

    def _split_text(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached text's two halves: the connectors give 2.0's streams caption_channels each
        (the transformer projects them), 2.3's the streams' own widths."""
        c = self.transformer_config
        video_dim = c["caption_channels"] if c["use_prompt_embeddings"] else c["cross_attention_dim"]
        return embeds[..., :video_dim], embeds[..., video_dim:]

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, C, F', h, w] -> pixels [B, 3, F, H, W] in [-1, 1], as the pipeline
        decodes (a timestep-conditioned VAE at the pipeline's decode_timestep 0)."""
        latents = latents * self.latents_std.to(latents) / self.vae_config[
            "scaling_factor"
        ] + self.latents_mean.to(latents)
        vae = self._load_vae()
        timestep = torch.zeros(1, device=self.device) if self.vae_config["timestep_conditioning"] else None
        return torch.cat(
            [vae.decode(clip.to(self.vae_dtype), timestep, return_dict=False)[0] for clip in latents.split(1)]
        )

    # Training.
    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        c = self.transformer_config
        return LTX2Pipeline._pack_latents(latents, c["patch_size"], c["patch_size_t"])

    def _normalise_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens - self.audio_mean.to(tokens)) / self.audio_std.to(tokens)

    def _predict(
        self,
        transformer,
        video: VideoStream,
        audio: AudioStream,
        embeds: torch.Tensor,
        isolate: bool = False,
        stg_blocks: list[int] | None = None,
    ):
        """(video, audio) velocities [B, tokens, C] in fp32 of the two streams' noisy latents.

        isolate turns off the audio-video cross-attention (the pipelines' modality guidance),
        stg_blocks skips those blocks' self-attention (their STG). No audio tokens: the video stream
        alone, isolated (the audio stream, which the video then never sees, runs on one zero token:
        the rotary tables refuse none). video.reference = k: the video tokens after the clip's are an
        IC-LoRA reference clip of 1/k of its latent height and width, at the positions ltx-trainer
        gives it. video.marked: LTX-2.5's keyframe marker on that many leading tokens."""
        dtype = next(transformer.parameters()).dtype
        video_text, audio_text = self._split_text(embeds.to(dtype))
        frames, height, width = video.shape
        n, audio_latents, audio_frames = len(video.latents), audio.latents, audio.frames
        if audio_latents.shape[1] == 0:
            audio_latents, audio_frames = audio_latents.new_zeros(n, 1, audio_latents.shape[2]), 1
            isolate = True
        coords = None
        # the positions ltx-trainer's video_to_video (and the pipeline) give a reference of 1/k of
        # the clip's size: its own grid's, the spatial ones times k (a same-size one's: the clip's)
        if video.reference:
            model = getattr(transformer, "module", transformer)  # DDP's wrapper
            k, device = video.reference, video.latents.device
            coords = model.rope.prepare_video_coords(n, *video.shape, device, fps=self.frame_rate)
            reference = model.rope.prepare_video_coords(
                n, frames, height // k, width // k, device, fps=self.frame_rate
            )
            reference[:, 1:3] = reference[:, 1:3] * k
            coords = torch.cat([coords, reference], dim=2)
        marker = None
        if video.marked:  # [B, tokens, 1], as ltx-core's keyframes_mask
            marker = torch.zeros(n, video.latents.shape[1], 1, device=video.latents.device)
            marker[:, : video.marked] = 1
        with self._cross_gates(transformer, video.sigma, audio.timesteps):
            out = transformer(
                hidden_states=video.latents.to(dtype),
                audio_hidden_states=audio_latents.to(dtype),
                encoder_hidden_states=video_text,
                audio_encoder_hidden_states=audio_text,
                timestep=video.timesteps,
                audio_timestep=audio.timesteps,
                sigma=video.sigma,
                audio_sigma=audio.timesteps,
                num_frames=frames,
                height=height,
                width=width,
                fps=self.frame_rate,
                audio_num_frames=audio_frames,
                isolate_modalities=isolate,
                spatio_temporal_guidance_blocks=stg_blocks,
                use_cross_timestep=False,
                video_coords=coords,
                video_keyframes_mask=marker,
                return_dict=False,
            )
        return (
            out[0].float().view(n, -1, video.latents.shape[-1]),
            out[1].float().view(n, -1, audio_latents.shape[-1]),
        )

    @contextlib.contextmanager
    def _cross_gates(self, transformer, sigma: torch.Tensor, audio_sigma: torch.Tensor):
        """Feed the audio-video cross-attention's AdaLN as ltx-core does, for one call.

        The audio-video cross-attention's AdaLN inputs as ltx-core computes them
        (transformer_args.py, _prepare_cross_attention_timestep): each stream's scale/shift from its
        own timesteps (per token: I2V's image tokens at 0), its gate from the other stream's sigma.
        diffusers takes both from one timestep, the other stream's sigma (use_cross_timestep) or the
        stream's own: run without use_cross_timestep and give the two gates the other stream's
        sigma. With one sigma for both streams (T2V sampling) this equals use_cross_timestep; with a
        sigma per stream (training with sound) or I2V's image tokens, not."""
        c = self.transformer_config
        factor = c["cross_attn_timestep_scale_multiplier"] / c["timestep_scale_multiplier"]
        model = getattr(transformer, "module", transformer)  # DDP's wrapper

        def other(sigma):
            # The gate's AdaLN is called with (timestep x factor, batch_size=..., hidden_dtype=...).
            return lambda module, args, kwargs: ((sigma.flatten().to(args[0]) * factor, *args[1:]), kwargs)

        gates = {model.av_cross_attn_video_a2v_gate: audio_sigma, model.av_cross_attn_audio_v2a_gate: sigma}
        hooks = [gate.register_forward_pre_hook(other(s), with_kwargs=True) for gate, s in gates.items()]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _loss(
        self,
        transformer,
        x0,
        noise,
        sigmas,
        a0,
        audio_noise,
        audio_sigmas,
        sound,
        batch,
        embeds,
        keep=None,
    ):
        """Per-sample fp32 losses (total, video, audio) of clean latents at their noise levels.

        Per-sample fp32 losses (total, video, audio) of packed clean latents x0 [B, tokens, C] at
        sigmas [B], and audio latents a0 [B, audio tokens, C'] (maybe no tokens) at audio_sigmas
        [B]; sound [B] says which samples have sound (the others have no audio loss). keep [B,
        tokens] (the first-frame condition of I2V and IC-LoRA, _first_frame's) gives the tokens at 0
        their clean latents, timestep 0 and no part in their sample's loss, as ltx-trainer's
        first_frame condition (flexible.py, _apply_intrinsic_condition with clean_latents = latents):
        I2V trains on the clip's own first latent frame. IC-LoRA: the control clip's latents
        (control_latent_mean) follow the clip's tokens, clean, at timestep 0, at the clip's
        positions and outside the loss, as ltx-trainer's video_to_video strategy has its reference
        (a downscaled one at its own grid's positions, scaled to the clip's). Sets self.losses."""
        n, shape = len(x0), batch["shape"]
        s, sa = sigmas.view(-1, 1, 1), audio_sigmas.view(-1, 1, 1)
        x_t, a_t = (1 - s) * x0 + s * noise, (1 - sa) * a0 + sa * audio_noise
        video_t = 1000 * sigmas
        if keep is not None:
            x_t = torch.where(keep[..., None] > 0, x_t, x0)
            video_t = video_t[:, None] * keep
        tokens = x0.shape[1]
        downscale = 0
        if self.takes_control:  # model.type = "ic"
            control = self._normalise(batch["control_latent_mean"].to(self.device).float())
            downscale = self.reference_downscale
            if control.shape[2:] != (shape[0], shape[1] // downscale, shape[2] // downscale):
                raise ValueError(
                    f"control latents {tuple(control.shape[2:])} are not 1/{downscale} of the clip's "
                    f"{shape} (model.reference_downscale_factor)"
                )
            reference = self._pack(control).expand(n, -1, -1)
            x_t = torch.cat([x_t, reference], dim=1)
            video_t = torch.cat(
                [video_t if keep is not None else video_t[:, None].expand(n, tokens)]
                + [video_t.new_zeros(n, reference.shape[1])],
                dim=1,
            )
        video, audio = self._predict(
            transformer,
            VideoStream(x_t, video_t, 1000 * sigmas, shape, downscale),
            AudioStream(a_t, 1000 * audio_sigmas, a0.shape[1]),
            embeds,
        )
        video = video[:, :tokens]
        errors = (video - (noise - x0)).pow(2)
        weights = keep  # ltx-trainer's masked mean: over the tokens in the loss
        if "loss_mask" in batch:  # data.loss_mask_column, packed as the clip's latents
            packed = self._pack(batch["loss_mask"].to(self.device).float())[..., 0]
            weights = packed if weights is None else weights * packed
        if weights is None:
            video_loss = errors.mean(dim=(1, 2))
        else:
            video_loss = masked_mean(errors, weights[:, :, None], (1, 2))
        audio_loss = torch.zeros_like(video_loss)
        if a0.shape[1]:
            audio_loss = (audio - (audio_noise - a0)).pow(2).mean(dim=(1, 2)) * sound
        self.losses = torch.stack(
            [
                torch.stack([video_loss.sum(), video_loss.new_tensor(n)]),
                torch.stack([audio_loss.sum(), sound.sum().float()]),
            ]
        ).detach()
        return video_loss + self.audio_loss_weight * audio_loss, video_loss, audio_loss

    def _clean(self, batch):
        """Packed clean latents, video [B, tokens, C] and audio [B, audio tokens, C'] (none without
        the batch's audio entries): the posteriors' means, what ltx-trainer trains on (ltx-core's
        encoders return the normalised means; docs/models/ltx2.md); which samples have sound [B]
        (load_batch's audio_mask in a batch mixing clips with and without); the video's latent
        shape."""
        mean = batch["latent_mean"].to(self.device)
        x0 = self._pack(self._normalise(mean.float()))
        sound = torch.zeros(len(x0), device=self.device)
        if "audio_latent_mean" in batch:
            audio = batch["audio_latent_mean"].to(self.device).float()
            a0 = self._normalise_audio(LTX2Pipeline._pack_audio_latents(audio))
            sound = batch["audio_mask"].to(self.device).float() if "audio_mask" in batch else sound + 1
        else:
            a0 = x0.new_zeros(len(x0), 0, self.transformer_config["audio_in_channels"])
        return x0, a0, sound, tuple(mean.shape[2:])

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch, every draw from the samples' keyed generators.

        Per-sample loss of a cached batch. Each sample's generator (keyed by seed, step and
        position in the global batch) draws, in order: the video s, the audio s, the video noise,
        the audio noise, and (I2V and IC-LoRA with train.first_frame_conditioning_p > 0) one uniform
        number, below p for a sample whose first latent frame is given clean. Audio entries (the audio
        cache's audio_latent_mean and audio_latent_logvar, [B, C', L, M'], the audio VAE's
        posterior) add audio_loss_weight x the audio loss. A clip
        without sound in a batch with sound (audio_mask false) has an audio stream of pure noise at
        s = 1, where generation starts, and no audio loss; a batch without sound runs the video
        stream alone."""
        x0, a0, sound, shape = self._clean(batch)
        sigmas = to_device(self._sigmas(x0.shape[1], generators), self.device)
        audio_sigmas = to_device(self._sigmas(max(a0.shape[1], 1), generators), self.device)
        if a0.shape[1]:
            audio_sigmas = torch.where(sound > 0, audio_sigmas, 1.0)
        noise = to_device(
            torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)]), self.device
        )
        audio_noise = to_device(
            torch.stack([torch.randn(a.shape, generator=g) for a, g in zip(a0, generators)]), self.device
        )
        keep = None
        if self.first_frame_p > 0:
            clean = torch.stack([torch.rand((), generator=g) < self.first_frame_p for g in generators])
            keep = self._first_frame(clean, x0.shape[1], shape)
        loss, video, audio = self._loss(
            transformer,
            x0,
            noise,
            sigmas,
            a0,
            audio_noise,
            audio_sigmas,
            sound,
            {**batch, "shape": shape},
            batch["prompt_embeds"].to(self.device),
            keep,
        )
        if self.timestep_sampling.weighting == "none":
            return loss
        weight = self.timestep_sampling.weight  # each stream's loss at its own s
        return weight(sigmas) * video + self.audio_loss_weight * weight(audio_sigmas) * audio

    def _sigmas(self, tokens: int, generators: list[torch.Generator]) -> torch.Tensor:
        """s per sample of a stream of `tokens` tokens: ltx-trainer's shifted logit-normal, or
        train.timestep_sampling's draw."""
        if self.timestep_sampling.sampling:
            return self.timestep_sampling.draw(generators)
        return torch.stack([shifted_logit_normal(tokens, g) for g in generators])

    def _first_frame(self, clean: torch.Tensor, tokens: int, shape) -> torch.Tensor | None:
        """The first-frame condition's keep [B, tokens]: 0 on the first latent frame of the samples
        `clean` [B] names, built on the host (no device sync); None where none is. A clip of one
        latent frame keeps its frame (text_to_video.py's rule, first_frame_end_idx <
        sequence_length)."""
        if shape[0] == 1 or not bool(clean.any()):
            return None
        keep = torch.ones(len(clean), tokens)
        keep[clean, : tokens // shape[0]] = 0
        return to_device(keep, self.device)

    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The loss of one cached clip (its posterior means) at each of `timesteps` for both
        streams, the same noise; self.losses sums each stream's over the timesteps. I2V conditions
        the first latent frame (the task it is held to), IC-LoRA none."""
        x0, a0, sound, shape = self._clean(batch)
        noise = torch.randn(x0.shape[1:], generator=generator).to(self.device)
        audio_noise = torch.randn(a0.shape[1:], generator=generator).to(self.device)
        n = len(timesteps)
        sigmas = torch.tensor(timesteps, device=self.device) / 1000
        return self._loss(
            transformer,
            x0.expand(n, -1, -1),
            noise.expand(n, -1, -1),
            sigmas,
            a0.expand(n, -1, -1),
            audio_noise.expand(n, -1, -1),
            sigmas,
            sound.expand(n),
            {**batch, "shape": shape},
            batch["prompt_embeds"].to(self.device).expand(n, -1, -1),
            self._first_frame(torch.full((n,), self.type == "i2v"), x0.shape[1], shape),
        )[0]

    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    @property
    def sequence_heads(self) -> list[int]:
        """The video's heads and the audio's: the video-to-audio attention splits both."""
        return [self.transformer_config[key] for key in ("num_attention_heads", "audio_num_attention_heads")]

    def split_sequence(self, transformer, split: SequenceSplit) -> None:
        """Split the video tokens over the sequence-parallel ranks at the first block.

        Sequence parallelism: the video tokens split at the first block, with every per-token
        video input (the rotary embeddings of self-attention and of the audio-video cross-attention;
        I2V's per-token timestep embeddings); the audio tokens and both texts replicated. Video
        self-attention and the video-to-audio cross-attention (audio queries, video keys) exchange
        through all-to-alls (SequenceParallelAttention); the text cross-attentions, audio
        self-attention and the audio-to-video cross-attention (video queries, the whole audio's
        keys) stay local. The video-to-audio attention splits the audio heads too: sp must divide
        both counts (sequence_heads, checked by model.setup_adapter)."""

        def per_token_inputs(arguments: dict) -> dict[str, int]:
            # rotary (cos, sin): [B, tokens, D] interleaved, [B, heads, tokens, D / 2] split
            rotary = {
                name: 2 if arguments[name][0].ndim == 4 else 1
                for name in ("video_rotary_emb", "ca_video_rotary_emb")
            }
            # the video's timestep embeddings: [B, 1, n] for one timestep per sample, [B, tokens, n]
            # per token
            embeddings = ("temb", "temb_ca_scale_shift", "temb_ca_gate")
            return rotary | {name: 1 for name in embeddings if arguments[name].shape[1] > 1}

        self.sequence = split
        split_blocks(self.blocks(transformer), split, per_token_inputs)
        for block in self.blocks(transformer):
            for attention in (block.attn1, block.video_to_audio_attn):
                attention.set_processor(SequenceParallelAttention(split))

    # Sampling: LTX2Pipeline's (LTX2ImageToVideoPipeline's) loop, run by validate.sample_latents.
    # Both streams are denoised (the video attends to the audio); the denoiser returns the video and
    # audio velocities flattened side by side, so validate's guidance applies to both.
    def sampler(self, name: str):
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")

    def sampling_start(
        self, scheduler, steps: int, resolution, generator: torch.Generator, image=None, control=None
    ):
        """Initial video and audio latents (fp32, packed) from `generator`, the two schedulers, and
        I2V's image latent frame, as the pipelines' prepare_latents, prepare_audio_latents and
        timesteps. IC-LoRA: `control` (uint8 [F, H, W, 3] at the clip's size) appended as
        LTX2InContextPipeline appends a reference condition, and `image` (a PIL image, or None) as
        its first-frame condition."""
        frames, height, width = resolution
        shape = (
            (frames - 1) // self.temporal_ratio + 1,
            height // self.spatial_ratio,
            width // self.spatial_ratio,
        )
        if control is not None:
            return self._in_context_start(scheduler, steps, frames, shape, generator, control, image)
        noise = torch.randn((1, self.latent_channels, *shape), generator=generator, dtype=torch.float32).to(
            self.device
        )
        condition = None
        if image is not None:
            image = PIL.Image.fromarray(
                apply_image_conditioning_crf(np.array(image.convert("RGB")), self.image_crf)
            )
            pixels = VideoProcessor(vae_scale_factor=self.spatial_ratio, resample="bilinear").preprocess(
                image, height=height, width=width
            )
            condition = self._pack(self._image_latents(pixels.to(self.device, torch.float32)))
        latents = self._pack(noise)
        if condition is not None:
            latents = torch.cat([condition, latents[:, condition.shape[1] :]], dim=1)
        return self._start(
            scheduler,
            steps,
            frames,
            shape,
            generator,
            latents,
            0 if condition is None else condition.shape[1],
        )

    def _in_context_start(self, scheduler, steps: int, frames: int, shape, generator, control, image):
        """LTX2InContextPipeline's prepare_latents with one reference of full strength (and its
        reference_downscale_factor, model.reference_downscale_factor) and, given `image`, one
        first-frame condition (an LTX2VideoCondition at index 0, strength 1): the control's
        reference frames' VAE mean, normalised and packed, after the clip's tokens; the noise drawn
        over both (packed), the reference's kept clean, and the first latent frame's tokens the
        image's (_first_frame_latents)."""
        reference = self._normalise(self.encode_video(self.reference_frames(control[None]))[0].float())
        reference = self._pack(reference)
        tokens = self._pack(reference.new_zeros(1, 1, *shape)).shape[1]
        noise = torch.randn(
            (1, tokens + reference.shape[1], self.latent_channels), generator=generator, dtype=torch.float32
        ).to(self.device)
        first = None if image is None else self._pack(self._first_frame_latents(image, shape))
        latents = torch.cat([noise[:, :tokens], reference], dim=1)
        if first is not None:
            latents = torch.cat([first, latents[:, first.shape[1] :]], dim=1)
        start = 0 if first is None else first.shape[1]
        state = self._start(scheduler, steps, frames, shape, generator, latents, start, reference.shape[1])
        state.downscale = self.reference_downscale
        return state

    def _first_frame_latents(self, image, shape) -> torch.Tensor:
        """A first-frame image condition's latent frame [1, C, 1, h, w] as LTX2InContextPipeline's
        preprocess_conditions and prepare_latents make it: H.264 at the model's CRF, resized (no
        antialiasing: F.interpolate, bilinear) to cover the clip and centre-cropped, the VAE's mode,
        normalised."""
        pixels = apply_image_conditioning_crf(np.array(image.convert("RGB")), self.image_crf)
        height, width = shape[1] * self.spatial_ratio, shape[2] * self.spatial_ratio
        pixels = torch.from_numpy(pixels).permute(2, 0, 1)[None].float().to(self.device)
        scale = max(height / pixels.shape[2], width / pixels.shape[3])
        size = (math.ceil(pixels.shape[2] * scale), math.ceil(pixels.shape[3] * scale))
        pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        pixels = pixels[:, :, top : top + height, left : left + width]
        return self._image_latents(pixels / 127.5 - 1.0)

    def _start(
        self, scheduler, steps: int, frames: int, shape, generator, latents, first: int, reference: int = 0
    ):
        """The audio latents and the schedulers (the shift from every video token's count) after the
        video's."""
        audio_frames = round(frames / self.frame_rate * self.audio_latents_per_second)
        mel_bins, channels = self.audio_config["mel_bins"] // 4, self.audio_config["latent_channels"]
        # LTX2InContextPipeline draws the sound's noise packed, as the original LTX-2 code
        if reference:
            audio = torch.randn(
                (1, audio_frames, channels * mel_bins), generator=generator, dtype=torch.float32
            )
        else:
            audio = LTX2Pipeline._pack_audio_latents(
                torch.randn((1, channels, audio_frames, mel_bins), generator=generator, dtype=torch.float32)
            )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        c = scheduler.config
        mu = calculate_shift(
            latents.shape[1],
            c.get("base_image_seq_len", 1024),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.95),
            c.get("max_shift", 2.05),
        )
        scheduler.set_timesteps(sigmas=sigmas, mu=mu, device=self.device)
        audio_scheduler = copy.deepcopy(scheduler)
        scheduler.set_begin_index(0)
        audio_scheduler.set_begin_index(0)
        return SimpleNamespace(
            scheduler=scheduler,
            audio_scheduler=audio_scheduler,
            latents=latents,
            audio=audio.to(self.device),
            shape=shape,
            audio_frames=audio_frames,
            first=first,
            reference=reference,
            downscale=0,  # IC-LoRA's reference_downscale_factor (_in_context_start)
        )

    def denoise(
        self, models: dict, state, t: torch.Tensor, embeds: torch.Tensor, guided: bool, **perturbed
    ) -> torch.Tensor:
        """[n, video numbers + audio numbers]: both streams' velocities at step t, with guidance of
        the latents twice (uncond, cond) in one forward; `perturbed` (isolate, stg_blocks) as
        _predict's."""
        n = 2 if guided else 1
        video_t = t.expand(n)
        # I2V's image tokens and IC-LoRA's reference at timestep 0
        if state.first or state.reference:
            video_t = video_t[:, None].repeat(1, state.latents.shape[1])
            video_t[:, : state.first] = 0
            video_t[:, state.latents.shape[1] - state.reference :] = 0
        # LTX-2.5's keyframe marker on the clip's first latent frame (ltx-core's VideoLatentTools,
        # _first_frame_keyframes_mask); the reference's tokens unmarked (extend_keyframes_mask)
        marked = (state.latents.shape[1] - state.reference) // state.shape[0] if self.keyframe_marker else 0
        video, audio = self._predict(
            models["transformer"],
            VideoStream(
                state.latents.expand(n, -1, -1),
                video_t,
                t.expand(n),
                state.shape,
                state.downscale,
                marked,
            ),
            AudioStream(state.audio.expand(n, -1, -1), t.expand(n), state.audio_frames),
            embeds,
            **perturbed,
        )
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def check_guidance(self, cfg) -> None:
        super().check_guidance(cfg)
        if cfg.keyframe_marker and not self.transformer_config["use_keyframes_abs_pos_embedding"]:
            raise ConfigError(
                f"validation.keyframe_marker = true: {self.path}'s transformer has no keyframe embedding "
                "(use_keyframes_abs_pos_embedding = false: LTX-2.0 and 2.3), so there is nothing to "
                "mark: remove it"
            )
        if not cfg.stg_scale:
            return
        if not self.transformer_config["perturbed_attn"]:
            raise ConfigError(
                f"validation.stg_scale: {self.path}'s transformer has no perturbed attention (LTX-2.0; "
                "perturbed_attn = false), so its STG forward is the conditional one and adds nothing, as "
                "in the pipelines: remove stg_scale"
            )
        blocks = self.transformer_config["num_layers"]
        if any(block >= blocks for block in cfg.stg_blocks or STG_BLOCKS):
            raise ConfigError(
                f"validation.stg_blocks = {cfg.stg_blocks or STG_BLOCKS} names a block the transformer of "
                f"{self.path} lacks (it has {blocks}): name blocks below {blocks}"
            )

    def guide(
        self,
        cfg,
        models: dict,
        state,
        t: torch.Tensor,
        i: int,
        embeds: torch.Tensor,
        prediction: torch.Tensor,
    ) -> torch.Tensor:
        """The pipelines' guidance, in x0 space and per stream: classifier-free (the sound at
        audio_guidance_scale), then STG and modality isolation (one more forward each, with the
        prompt alone), summed in the pipelines' order, then rescaled toward the conditional
        prediction's spread; back to velocities for the step."""
        sigma = state.scheduler.sigmas[i]
        sample = torch.cat([state.latents.flatten(1), state.audio.flatten(1)], dim=1)
        uncond, cond = (sample - prediction * sigma).chunk(2)
        terms = [(uncond, cfg.guidance_scale - 1, (cfg.audio_guidance_scale or cfg.guidance_scale) - 1)]
        if cfg.stg_scale:
            stg = self.denoise(models, state, t, embeds[1:], False, stg_blocks=cfg.stg_blocks or STG_BLOCKS)
            terms.append((sample - stg * sigma, cfg.stg_scale, cfg.stg_scale))
        if cfg.modality_scale != 1:
            isolated = self.denoise(models, state, t, embeds[1:], False, isolate=True)
            terms.append((sample - isolated * sigma, cfg.modality_scale - 1, cfg.modality_scale - 1))
        split, streams = state.latents.numel(), []
        for stream, part in enumerate((slice(0, split), slice(split, None))):
            guided = cond[:, part]
            for other, *scales in terms:
                guided = guided + scales[stream] * (cond[:, part] - other[:, part])
            if cfg.guidance_rescale:
                guided = rescale_noise_cfg(guided, cond[:, part], guidance_rescale=cfg.guidance_rescale)
            streams.append(guided)
        return (sample - torch.cat(streams, dim=1)) / sigma

    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        split = state.latents.numel()
        video, audio = (
            prediction[:, :split].view_as(state.latents),
            prediction[:, split:].view_as(state.audio),
        )
        # The conditions stay clean: the pipelines' velocity there is 0 (their denoised value is the
        # condition).
        first, end = state.first, state.latents.shape[1] - state.reference
        stepped = state.scheduler.step(
            video[:, first:end], t, state.latents[:, first:end], return_dict=False
        )[0]
        state.latents = torch.cat([state.latents[:, :first], stepped, state.latents[:, end:]], dim=1)
        state.audio = state.audio_scheduler.step(audio, t, state.audio, return_dict=False)[0]

    def sampled(self, state) -> torch.Tensor:
        c = self.transformer_config
        latents = state.latents[:, : state.latents.shape[1] - state.reference]
        return LTX2Pipeline._unpack_latents(latents, *state.shape, c["patch_size"], c["patch_size_t"])

    def sampled_audio(self, state) -> torch.Tensor:
        """The audio latents [1, C', L, M'] as the pipeline hands them to the audio VAE
        (denormalised)."""
        audio = state.audio * self.audio_std.to(state.audio) + self.audio_mean.to(state.audio)
        return LTX2Pipeline._unpack_audio_latents(
            audio, state.audio_frames, self.audio_config["mel_bins"] // 4
        )

    def sampling_attention(self, model: torch.nn.Module):
        return contextlib.nullcontext()


class SequenceParallelAttention:
    """LTX-2's attention over this rank's slice of the video tokens (sequence parallelism).

    diffusers' LTX2AudioVideoAttnProcessor (and LTX-2.3's LTX2PerturbedAttnProcessor, whose STG
    passes the values of this rank's tokens through; no masks) step for step, with this rank's slice
    of the video tokens as keys and values: video self-attention (the queries the same slice) or the
    video-to-audio cross-attention (the queries the whole audio, replicated). Keys and values, with
    the video's queries, go through one all-to-all to the whole video with 1/sp of the heads, the
    audio's queries are cut to the same heads; the output goes back to the sequence split (video) or
    is gathered across the heads (audio)."""

    def __init__(self, split: SequenceSplit):
        self.split = split

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        video_queries = encoder_hidden_states is None
        keys = hidden_states if video_queries else encoder_hidden_states
        # STG (LTX-2.3's video self-attention): the values of this rank's tokens, no attention
        if all_perturbed:
            out = attn.to_v(keys)
        else:
            out = self.attention(attn, hidden_states, keys, video_queries, query_rotary_emb, key_rotary_emb)
        # LTX-2.3: a gate per query token and head, from the query's input
        if attn.to_gate_logits is not None:
            gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))

    def attention(self, attn, hidden_states, keys, video_queries: bool, query_rotary_emb, key_rotary_emb):
        query, key, value = attn.to_q(hidden_states), attn.to_k(keys), attn.to_v(keys)
        query, key = attn.norm_q(query), attn.norm_k(key)
        rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
        query = rotate(query, query_rotary_emb)
        key = rotate(key, query_rotary_emb if key_rotary_emb is None else key_rotary_emb)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if video_queries:  # [3, B, tokens, heads, D] -> the whole video, 1/sp of the heads
            query, key, value = self.split.seq_to_heads(stack_qkv(query, key, value), 2, 3).unbind(0)
        else:
            key, value = self.split.seq_to_heads(torch.stack([key.to(value.dtype), value]), 2, 3).unbind(0)
            query = self.split.heads(query, 2)
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query, key, value))).transpose(
            1, 2
        )
        out = self.split.heads_to_seq(out, 1, 2) if video_queries else self.split.gather_heads(out, 2)
        return out.flatten(2, 3).to(query.dtype)
