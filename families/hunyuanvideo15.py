"""HunyuanVideo 1.5: text- and image-to-video, 480p and 720p.

HunyuanVideo 1.5 (docs/models/hunyuanvideo15.md): one 8.3B dual-stream transformer, two text
encoders (Qwen2.5-VL's hidden states and ByT5's for the quoted glyph text), a SigLIP image encoder
for image-to-video, a 16x spatial, 4x temporal VAE. T2V and I2V checkpoints share the architecture:
the transformer always reads the noisy latents beside a condition (the image's latent frame and its
mask channel; zeros for text-to-video) and the image's SigLIP tokens (none for text-to-video,
where the pipeline's 729 zeros are masked out).

Training is the makers' train.py: flow matching, x_t = (1 - s) x0 + s e, the target e - x0, the
mean squared error over every latent (the image's frame included); s a logit-normal draw shifted by
3 (train.flow_shift); the image's condition is the clip's own first latent frame, its SigLIP tokens
those of the clip's first frame. Sampling is HunyuanVideo15Pipeline's and
HunyuanVideo15ImageToVideoPipeline's loop.
"""

import contextlib
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Qwen2_5_VLTextModel,
    SiglipVisionModel,
    T5EncoderModel,
)

from config import Config, ConfigError, ModelConfig
from model_adapter import (
    TIMESTEP_KEYS,
    Adapter,
    RunSettings,
    TimestepSampling,
    log,
    masked_mean,
    sample_posterior,
    to_device,
)
from parallel import SequenceSplit, split_blocks, stack_qkv
from weights import resolved_config

# HunyuanVideo15Pipeline.__init__: Qwen2.5-VL reads 1000 tokens after the 108 of its template it
# crops; ByT5 256.
TEXT_LENGTH, TEMPLATE_TOKENS, GLYPH_LENGTH = 1000, 108, 256
# The published folders without weights (Adapter.PUBLISHED; docs/models/hunyuanvideo15.md, Published
# configs: diffusers' convert_hunyuan_video1_5_to_diffusers.py TRANSFORMER_CONFIGS and
# SCHEDULER_CONFIGS); the text encoders: Qwen2.5-VL 7B's text model, ByT5-small's encoder.
HUNYUANVIDEO15_TRANSFORMER = {
    "_class_name": "HunyuanVideo15Transformer3DModel",
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56],
    "use_meanflow": False,
    "task_type": "t2v",
}
PUBLISHED_FOLDERS = {
    name: {
        "model_index.json": {"_class_name": "HunyuanVideo15Pipeline"},
        "transformer": {**HUNYUANVIDEO15_TRANSFORMER, "target_size": target_size},
        "vae": {
            "_class_name": "AutoencoderKLHunyuanVideo15",
            "latent_channels": 32,
            "spatial_compression_ratio": 16,
            "temporal_compression_ratio": 4,
            "scaling_factor": 1.03682,
        },
        "text_encoder": {
            "model_type": "qwen2_5_vl_text",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
        "tokenizer": {},
        "text_encoder_2": {
            "model_type": "t5",
            "d_model": 1472,
            "d_ff": 3584,
            "num_layers": 12,
            "num_heads": 6,
        },
        "tokenizer_2": {},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": shift},
        "guider": {"_class_name": "ClassifierFreeGuidance", "guidance_scale": 6.0},
    }
    for name, target_size, shift in (
        ("hunyuanvideo1.5-480p-t2v", 640, 5.0),
        ("hunyuanvideo1.5-720p-t2v", 960, 9.0),
    )
}
# The makers' train.py: train_timestep_shift 3.0 (train.py:140); its timesteps stay in [1e-5, 1 -
# 1e-5] (TimestepSampler.TRAIN_EPS, train.py:206).
TRAIN_SHIFT, TRAIN_EPS = 3.0, 1e-5
LOGIT_NORMAL = TimestepSampling("logit_normal")
# diffusers module names -> ComfyUI's (the makers' checkpoint's as ComfyUI loads it: its dual-stream
# blocks fuse q, k and v into one qkv, a str is a whole module and (name, index, 3) a slice of a
# fused one; musubi-tuner's convert_hunyuan_video_1_5_lora_to_comfy.py:27-34 and 98-141 write
# exactly these names and the fused qkv), inside a dual-stream block (transformer_blocks.N ->
# double_blocks.N) and inside a text refiner block (context_embedder.token_refiner.refiner_blocks.N
# -> txt_in.individual_token_refiner.blocks.N).
COMFY_BLOCK = {
    "attn.to_q": ("img_attn.qkv", 0, 3),
    "attn.to_k": ("img_attn.qkv", 1, 3),
    "attn.to_v": ("img_attn.qkv", 2, 3),
    "attn.to_out.0": "img_attn.proj",
    "attn.add_q_proj": ("txt_attn.qkv", 0, 3),
    "attn.add_k_proj": ("txt_attn.qkv", 1, 3),
    "attn.add_v_proj": ("txt_attn.qkv", 2, 3),
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
}
COMFY_REFINER = {
    "attn.to_q": ("self_attn.qkv", 0, 3),
    "attn.to_k": ("self_attn.qkv", 1, 3),
    "attn.to_v": ("self_attn.qkv", 2, 3),
    "attn.to_out.0": "self_attn.proj",
    "ff.net.0.proj": "mlp.0",
    "ff.net.2": "mlp.2",
    "norm_out.linear": "adaLN_modulation.1",
}
BLOCKS = {
    "transformer_blocks": ("double_blocks", COMFY_BLOCK),
    "context_embedder.token_refiner.refiner_blocks": (
        "txt_in.individual_token_refiner.blocks",
        COMFY_REFINER,
    ),
}
# The makers' checkpoint (Tencent-Hunyuan/HunyuanVideo-1.5's transformer files; model.transformer_file)
# -> diffusers' module names, as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py renames
# them (convert_hyvideo15_transformer_to_diffusers, lines 140-419 at huggingface/diffusers 671149e):
# outside the blocks, inside a dual-stream block (double_blocks.N -> transformer_blocks.N, its q, k
# and v apart) and inside a text refiner block (txt_in.individual_token_refiner.blocks.N ->
# context_embedder.token_refiner.refiner_blocks.N), whose self_attn_qkv fuses q, k and v: a tuple is
# a fused module's parts, its rows in equal thirds (the script's torch.chunk(qkv, 3), lines 212-223).
# The final layer's modulation holds shift then scale, diffusers' norm_out scale then shift (the
# script's swap_scale_shift, lines 134-137 and 409-415): SWAPPED_HALVES.
MAKERS_OUTSIDE = {
    "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_embed.timestep_embedder.linear_2",
    "time_r_in.mlp.0": "time_embed.timestep_embedder_r.linear_1",  # use_meanflow
    "time_r_in.mlp.2": "time_embed.timestep_embedder_r.linear_2",
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
    "cond_type_embedding": "cond_type_embed",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "final_layer.linear": "proj_out",
}
MAKERS_BLOCK = {
    "img_mod.linear": "norm1.linear",
    "txt_mod.linear": "norm1_context.linear",
    "img_attn_q": "attn.to_q",
    "img_attn_k": "attn.to_k",
    "img_attn_v": "attn.to_v",
    "img_attn_q_norm": "attn.norm_q",
    "img_attn_k_norm": "attn.norm_k",
    "img_attn_proj": "attn.to_out.0",
    "txt_attn_q": "attn.add_q_proj",
    "txt_attn_k": "attn.add_k_proj",
    "txt_attn_v": "attn.add_v_proj",
    "txt_attn_q_norm": "attn.norm_added_q",
    "txt_attn_k_norm": "attn.norm_added_k",
    "txt_attn_proj": "attn.to_add_out",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
}
# Comfy-Org's repackaged files keep the makers' names but pack each stream's q, k and v into one
# tensor (musubi-tuner, src/musubi_tuner/hunyuan_video_1_5/hunyuan_video_1_5_models.py,
# load_hunyuan_video_1_5_model: "ComfyUI repackaged HunyuanVideo-1.5 uses packed QKV weights for
# double blocks", split by torch.chunk(value, 3); its dtype probe names double_blocks.0.img_attn_qkv
# "ComfyUI repackaged"). Read only: tools/to_single_file.py writes the makers' separate q, k and v.
COMFY_PACKED_BLOCK = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
MAKERS_REFINER = {
    "norm1": "norm1",
    "norm2": "norm2",
    "self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "self_attn_proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm_out.linear",
}
MAKERS_BLOCKS = {
    "double_blocks": ("transformer_blocks", MAKERS_BLOCK | COMFY_PACKED_BLOCK),
    "txt_in.individual_token_refiner.blocks": (
        "context_embedder.token_refiner.refiner_blocks",
        MAKERS_REFINER,
    ),
}


def in_block(module: str, blocks: str) -> tuple[str, str] | None:
    """blocks.N.rest -> (N, rest); None for a module outside those blocks."""
    index, _, rest = module.removeprefix(f"{blocks}.").partition(".")
    return (index, rest) if module.startswith(f"{blocks}.") and index.isdigit() else None


def makers_module(module: str) -> str | tuple[str, ...] | None:
    """A module of the makers' checkpoint -> diffusers' name (a fused one's parts, in row order),
    or None where diffusers has none."""
    for theirs, (ours, names) in MAKERS_BLOCKS.items():
        if (found := in_block(module, theirs)) and found[1] in names:
            index, name = found[0], names[found[1]]
            if isinstance(name, tuple):
                return tuple(f"{ours}.{index}.{part}" for part in name)
            return f"{ours}.{index}.{name}"
    return MAKERS_OUTSIDE.get(module)


def diffusers_module(module: str) -> str | None:
    """The inverse: a diffusers module's name in the makers' checkpoint (a fused one's for each of
    its parts), or None."""
    for theirs, (ours, names) in MAKERS_BLOCKS.items():
        if found := in_block(module, ours):
            index, rest = found
            for original, name in names.items():
                if rest == name or (isinstance(name, tuple) and rest in name):
                    return f"{theirs}.{index}.{original}"
    return next((original for original, name in MAKERS_OUTSIDE.items() if name == module), None)


class HunyuanVideo15Adapter(Adapter):
    FAMILY = "hunyuanvideo15"
    PUBLISHED = PUBLISHED_FOLDERS
    READS = ("train.flow_shift",) + TIMESTEP_KEYS
    ENCODERS = {
        "video": ("vae",),
        "image": ("image_encoder", "feature_extractor"),
        "text": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    }
    TRANSFORMER, VAE, TEXT_ENCODER = (
        HunyuanVideo15Transformer3DModel,
        AutoencoderKLHunyuanVideo15,
        Qwen2_5_VLTextModel,
    )
    COMFY = True
    # The makers' layout (MAKERS_BLOCKS), or Comfy-Org's repackaging of it (COMFY_PACKED_BLOCK):
    # bare, or under ComfyUI's model.diffusion_model.
    SINGLE_FILE_KEY = "vision_in.proj.0.weight"
    SWAPPED_HALVES = ("norm_out.linear.weight", "norm_out.linear.bias")

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        super().__init__(cfg, device, run)
        self.transformer_config = resolved_config(self.TRANSFORMER, self.path, "transformer")
        self.vae_config = resolved_config(self.VAE, self.path, "vae")
        channels, latent = self.transformer_config["in_channels"], self.vae_config["latent_channels"]
        if channels != 2 * latent + 1:
            raise ConfigError(
                f"model.path = {cfg.path}: its transformer takes {channels} input channels, not the "
                f"noisy latents, the condition and its mask ({2 * latent + 1} for the VAE's {latent}): "
                "the folder's transformer and VAE are not one HunyuanVideo 1.5 model"
            )
        for name in ("text_encoder_2", "tokenizer_2"):  # ByT5's, beside the base's text_encoder/
            if not (self.path / name).is_dir():
                raise ConfigError(
                    f"model.path = {cfg.path} has no {name}/ folder (ByT5, the glyph text's encoder): "
                    "the model copy is incomplete"
                )
        if cfg.type == "i2v" and not (self.path / "image_encoder").is_dir():
            raise ConfigError(
                f'model.type = "i2v", but {cfg.path} has no image_encoder/ (SigLIP): point model.path '
                'at an image-to-video folder (HunyuanVideo-1.5-*_i2v), or set model.type = "t2v"'
            )
        # train.flow_shift replaces the makers' training shift; sampling keeps the scheduler's.
        self.shift = run.flow_shift or TRAIN_SHIFT
        self._text_encoder_2 = self._tokenizer_2 = None
        self._image_encoder = self._feature_extractor = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Image-to-video conditions on the clip's own first frame: another image is refused before
        any compute."""
        super().check_config(cfg)
        if cfg.data.image_column:
            raise ConfigError(
                f'data.image_column = "{cfg.data.image_column}": HunyuanVideo 1.5 image-to-video '
                "conditions on each clip's own first frame, its latent frame and SigLIP's tokens of it "
                "(the makers' train.py): remove data.image_column"
            )

    # Shape rules.
    @property
    def frame_multiple(self) -> int:
        # 4k+1 frames: the causal VAE encodes [0], [1:5], [5:9], ...
        return self.temporal_ratio

    @property
    def size_multiple(self) -> int:
        return self.spatial_ratio * self.transformer_config["patch_size"]

    @property
    def text_length(self) -> dict[str, int]:
        return {"prompt_embeds": TEXT_LENGTH, "prompt_embeds_2": GLYPH_LENGTH}

    @property
    def text_width(self) -> dict[str, int]:
        c = self.transformer_config
        return {"prompt_embeds": c["text_embed_dim"], "prompt_embeds_2": c["text_embed_2_dim"]}

    @property
    def published_fps(self) -> int:
        return 24  # the makers' save_video (train.py:120) and the I2V pipeline's example

    def comfy_key(self, module: str) -> str | tuple[str, int, int] | None:
        """transformer_blocks.N.attn.to_q -> (double_blocks.N.img_attn.qkv, 0, 3): the q slice of
        ComfyUI's fused qkv; None outside the blocks and refiner blocks."""
        for ours, (theirs, names) in BLOCKS.items():
            if (found := in_block(module, ours)) and found[1] in names:
                index, name = found[0], names[found[1]]
                if isinstance(name, tuple):
                    return (f"{theirs}.{index}.{name[0]}", *name[1:])
                return f"{theirs}.{index}.{name}"
        return None

    def diffusers_key(self, original: str) -> str | list[str] | None:
        """The inverse: double_blocks.N.img_attn.qkv -> transformer_blocks.N.attn.to_q, to_k, to_v."""
        for ours, (theirs, names) in BLOCKS.items():
            if not (found := in_block(original, theirs)):
                continue
            index, rest = found
            whole = [key for key, name in names.items() if name == rest]
            slices = sorted(
                (name[1], key) for key, name in names.items() if isinstance(name, tuple) and name[0] == rest
            )
            if whole:
                return f"{ours}.{index}.{whole[0]}"
            if slices:
                return [f"{ours}.{index}.{key}" for _, key in slices]
        return None

    # Single files: the makers' layout.
    @staticmethod
    def single_file_key(key: str) -> str | None:
        """context_embedder.token_refiner.refiner_blocks.N.attn.to_q.weight ->
        txt_in.individual_token_refiner.blocks.N.self_attn_qkv.weight (to_k's and to_v's too)."""
        module, _, leaf = key.rpartition(".")
        original = diffusers_module(module)
        return f"{original}.{leaf}" if original else None

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str | list[str]]:
        """The makers' names -> diffusers' (a fused qkv's three, in row order); a key diffusers has
        no name for keeps its own, for the check to name."""
        names = {}
        for key in keys:
            module, _, leaf = key.rpartition(".")
            ours = makers_module(module)
            if isinstance(ours, tuple):
                names[key] = [f"{part}.{leaf}" for part in ours]
            else:
                names[key] = f"{ours}.{leaf}" if ours else key
        return names

    # Encoding.
    def _glyph_text(self):
        """ByT5 and its tokenizer (the glyph text's encoder), loaded with the Qwen2.5-VL one."""
        if self._text_encoder_2 is None:
            self._text_encoder_2 = T5EncoderModel.from_pretrained(
                self.path, subfolder="text_encoder_2", dtype=self.dtype
            )
            self._text_encoder_2.to(self.device).requires_grad_(False).eval()
            self._tokenizer_2 = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer_2")
        return self._text_encoder_2, self._tokenizer_2

    def release_text_encoder(self) -> None:
        self._text_encoder_2 = self._tokenizer_2 = None
        super().release_text_encoder()

    def release_encoders(self) -> None:
        self._text_encoder_2 = self._tokenizer_2 = None
        self._image_encoder = self._feature_extractor = None
        super().release_encoders()

    def park_vae(self) -> None:
        """The VAE and SigLIP (validation's image condition) wait on the CPU."""
        super().park_vae()
        if self._image_encoder is not None:
            self._image_encoder.to("cpu")

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL's [B, 1000, D] and ByT5's [B, 256, D2] as HunyuanVideo15Pipeline.encode_prompt
        computes them (its template, the third-last hidden state, the template's 108 tokens
        cropped; ByT5 over the prompt's quoted text, zeros without any), the rows past each mask
        zeroed."""
        text_encoder, tokenizer = self._text()
        qwen, qwen_mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text_encoder,
            tokenizer,
            prompts,
            self.device,
            tokenizer_max_length=TEXT_LENGTH,
            crop_start=TEMPLATE_TOKENS,
        )
        glyph_encoder, glyph_tokenizer = self._glyph_text()
        glyph, glyph_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            glyph_tokenizer, glyph_encoder, prompts, self.device, tokenizer_max_length=GLYPH_LENGTH
        )
        return {
            "prompt_embeds": qwen * qwen_mask[:, :, None].to(qwen.dtype),
            "prompt_embeds_2": glyph * glyph_mask[:, :, None].to(glyph.dtype),
        }

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (not scaled).
        Clip by clip: diffusers 0.42.1's VAE fails on a batch of more than one (its mid-block
        attention mask does not broadcast), and the pipelines only ever encode one."""
        vae = self._load_vae()
        posteriors = [vae.encode(clip).latent_dist for clip in self._pixels(video).split(1)]
        return torch.cat([p.mean for p in posteriors]), torch.cat([p.logvar for p in posteriors])

    def _siglip(self):
        if self._image_encoder is None:
            log.info("loading image encoder from %s", self.path)
            self._image_encoder = SiglipVisionModel.from_pretrained(
                self.path, subfolder="image_encoder", dtype=self.dtype
            ).eval()
            self._feature_extractor = AutoImageProcessor.from_pretrained(
                self.path, subfolder="feature_extractor"
            )
        return self._image_encoder.to(self.device), self._feature_extractor

    @torch.no_grad()
    def _image_embeds(self, images: list[Image.Image]) -> torch.Tensor:
        """SigLIP's last hidden state of each image, as the I2V pipeline's _get_image_embeds."""
        encoder, processor = self._siglip()
        inputs = processor.preprocess(images=images, do_resize=True, return_tensors="pt", do_convert_rgb=True)
        inputs = inputs.to(device=self.device, dtype=self.dtype)
        return encoder(**inputs).last_hidden_state

    def encode_image(self, images: torch.Tensor, generators, frames: int) -> dict:
        """The clips' first frames, uint8 [B, H, W, 3] -> their SigLIP tokens (the makers'
        encode_images of the first frame, train.py:741-748). The image's latent is the clip's own
        first latent frame, drawn with it each step (train.py:641-650): nothing else is cached."""
        return {"image_embeds": self._image_embeds([Image.fromarray(np.asarray(i.cpu())) for i in images])}

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents [B, C, F', h, w] -> pixels [B, 3, F, H, W] in [-1, 1], as the pipeline
        decodes (latents / scaling_factor), clip by clip."""
        vae = self._load_vae()
        latents = latents.to(self.vae_dtype) / self.vae_config["scaling_factor"]
        return torch.cat([vae.decode(clip, return_dict=False)[0] for clip in latents.split(1)])

    # Training.
    def _sigmas(self, generators) -> torch.Tensor:
        """s per sample: the makers' logit-normal draw in [eps, 1 - eps], shifted (train.py:236-239,
        751-752, 269-275); or train.timestep_sampling's draw."""
        if self.timestep_sampling.sampling:
            return self.timestep_sampling.draw(generators)
        t = TRAIN_EPS + (1 - 2 * TRAIN_EPS) * LOGIT_NORMAL.draw(generators)
        return self.shift * t / (1 + (self.shift - 1) * t)

    def _condition(self, x0: torch.Tensor, image: bool) -> torch.Tensor:
        """The condition channels [B, C + 1, F', h, w]: image-to-video the first latent frame of x0
        and a mask channel of 1 on it, zeros elsewhere (the makers' get_condition, train.py:641-650;
        the I2V pipeline's prepare_cond_latents_and_mask); zeros for text-to-video."""
        condition = x0.new_zeros(x0.shape[0], x0.shape[1] + 1, *x0.shape[2:])
        if image:
            condition[:, :-1, :1] = x0[:, :, :1]
            condition[:, -1:, :1] = 1
        return condition

    def _image_tokens(self, batch, n: int) -> torch.Tensor:
        """The I2V batch's SigLIP tokens; text-to-video none, as the makers' train.py passes none
        (vision_states None, train.py:741-748); the pipeline's 729 of zeros, which the transformer
        masks out, would leave the prediction as it is."""
        if self.type == "i2v":
            return batch["image_embeds"].to(self.device).expand(n, -1, -1)
        return torch.zeros(n, 0, self.transformer_config["image_embed_dim"], device=self.device)

    def _predict(self, transformer, x, t, text: dict, image_embeds) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        return transformer(
            hidden_states=x.to(dtype),
            timestep=t.to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(self.device, dtype),
            encoder_attention_mask=text["prompt_embeds_mask"].to(self.device),
            encoder_hidden_states_2=text["prompt_embeds_2"].to(self.device, dtype),
            encoder_attention_mask_2=text["prompt_embeds_2_mask"].to(self.device),
            image_embeds=image_embeds.to(dtype),
            return_dict=False,
        )[0].float()

    def _loss(self, transformer, x0, noise, sigmas, batch, text):
        s = sigmas.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        x = torch.cat([x_t, self._condition(x0, self.type == "i2v")], dim=1)
        prediction = self._predict(transformer, x, 1000 * sigmas, text, self._image_tokens(batch, len(x0)))
        weights = torch.ones_like(x0[:, :1])
        if "loss_mask" in batch:  # data.loss_mask_column
            weights = weights * batch["loss_mask"].to(self.device).float()
        return masked_mean((prediction - (noise - x0)).pow(2), weights, (1, 2, 3, 4))

    @staticmethod
    def _text_inputs(batch, n: int) -> dict:
        """The batch's two texts and their masks for n rows, cut to its longest prompt of each
        (musubi-tuner pads to the batch's longest, hv_1_5_train_network.py:408-427; the makers'
        attention skips the padding): every padding row is masked out of every attention, so the
        prediction is the padded one's, at a fraction of the cost (1000 + 256 rows padded)."""
        text = {}
        for name in ("prompt_embeds", "prompt_embeds_2"):
            mask = batch[f"{name}_mask"]
            # A host read (on a GPU, a wait for the batch's copy), beside the several of diffusers'
            # forward (its boolean-mask reordering of the texts, its all-zero image check).
            length = int(mask.sum(1).max())
            for key, tensor in ((name, batch[name]), (f"{name}_mask", mask)):
                cut = tensor[:, :length]
                text[key] = cut.expand(n, *cut.shape[1:])
        return text

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch; the latent sample, s and the noise come from each
        sample's own generator, keyed by (seed, step, position in the global batch)."""
        x0 = self.vae_config["scaling_factor"] * sample_posterior(
            batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators
        )
        sigmas = to_device(self._sigmas(generators), self.device)
        noise = to_device(
            torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)]), self.device
        )
        loss = self._loss(transformer, x0, noise, sigmas, batch, self._text_inputs(batch, len(x0)))
        if self.timestep_sampling.weighting == "none":
            return loss
        return self.timestep_sampling.weight(sigmas) * loss

    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The loss of one cached clip (its posterior mean) at each of `timesteps`, with the same
        noise."""
        x0 = self.vae_config["scaling_factor"] * batch["latent_mean"].to(self.device).float()
        noise = torch.randn(x0.shape[1:], generator=generator).to(self.device)
        n = len(timesteps)
        return self._loss(
            transformer,
            x0.expand(n, -1, -1, -1, -1),
            noise.expand(n, *noise.shape),
            torch.tensor(timesteps, device=self.device) / 1000,
            batch,
            self._text_inputs(batch, n),
        )

    # Parallelism.
    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    def split_sequence(self, transformer, split: SequenceSplit) -> None:
        """Sequence parallelism: the video tokens and their rotary embeddings split at the first
        block, the text and image tokens whole on every rank; the joint attention through
        JointAttention's all-to-all, the sequence gathered after the last block. The
        text refiner (text tokens only) runs whole on every rank."""
        self.sequence = split
        split_blocks(self.blocks(transformer), split, lambda arguments: {"freqs_cis": 0})
        for block in self.blocks(transformer):
            block.attn.set_processor(JointAttention(split))

    # Sampling: the pipelines' loop, run by validate.sample_latents.
    def sampler(self, name: str):
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")

    def sampling_start(self, scheduler, steps: int, resolution, generator: torch.Generator, image=None):
        """The pipelines' timesteps (sigmas linspace(1, 0, steps + 1)[:-1] through the scheduler's
        shift), initial latents [1, C, F', h, w] (fp32) from `generator`, and the condition: the
        image (PIL) resized and cropped to the clip's size, its VAE mode scaled in the first latent
        frame with the mask's 1, and its SigLIP tokens, as HunyuanVideo15ImageToVideoPipeline's
        prepare_cond_latents_and_mask and encode_image; without an image, a condition of zeros and no
        image tokens (the pipeline's 729 of zeros are masked out)."""
        frames, height, width = resolution
        ratio = self.vae_config["spatial_compression_ratio"]
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=self.device)
        shape = (
            1,
            self.vae_config["latent_channels"],
            (frames - 1) // self.frame_multiple + 1,
            height // ratio,
            width // ratio,
        )
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        condition = latents.new_zeros(1, shape[1] + 1, *shape[2:])
        if image is None:
            image_embeds = torch.zeros(1, 0, self.transformer_config["image_embed_dim"])
        else:
            processor = HunyuanVideo15ImageProcessor(vae_scale_factor=ratio, do_resize=False)
            image = processor.resize(image.convert("RGB"), height=height, width=width, resize_mode="crop")
            pixels = processor.preprocess(image, height=height, width=width)[:, :, None]
            vae = self._load_vae()
            first = vae.encode(pixels.to(self.device, self.vae_dtype)).latent_dist.mode().float()
            condition[:, :-1, :1] = first * self.vae_config["scaling_factor"]
            condition[:, -1:, :1] = 1
            image_embeds = self._image_embeds([image])
        return SimpleNamespace(
            scheduler=scheduler,
            latents=latents,
            condition=condition,
            image_embeds=image_embeds.to(self.device, torch.float32),
        )

    def denoise(self, models: dict, state, t: torch.Tensor, embeds: dict, guided: bool) -> torch.Tensor:
        """The flow prediction at step t; with guidance, of the latents twice (uncond, cond) in one
        forward. The texts cut to the longer prompt's rows, as in training: the pipeline's padding,
        and its 729 text-to-video image tokens of zeros, are masked out of every attention."""
        n = 2 if guided else 1
        x = torch.cat([state.latents, state.condition], dim=1).expand(n, -1, -1, -1, -1)
        return self._predict(
            models["transformer"],
            x,
            t.expand(n),
            self._text_inputs(embeds, n),
            state.image_embeds.expand(n, -1, -1),
        )

    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        state.latents = state.scheduler.step(prediction, t, state.latents, return_dict=False)[0]

    def sampled(self, state) -> torch.Tensor:
        return state.latents

    def sampling_attention(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def prepare_transformer(self, transformer: torch.nn.Module) -> None:
        """The joint attention through JointAttention: a mask of the keys alone, not of every pair."""
        for block in self.blocks(transformer):
            block.attn.set_processor(JointAttention())


class JointAttention:
    """diffusers' HunyuanVideo15AttnProcessor2_0, step for step, but for its mask, and with a
    sequence split where one is given.

    The mask is of the keys alone, [B, 1, 1, tokens], where diffusers' is of every pair of tokens,
    [B, 1, tokens, tokens] (transformer_hunyuan_video15.py:102-106): booleans twice and SDPA's bias
    of them, 4 bytes a pair while attention runs, 47 GiB at 720p. Every real token's output is the
    same, since a padded key is masked for every query either way; only the padded text tokens' own
    outputs differ (diffusers' rows of them are fully masked), and the forward drops the text tokens
    after the last block, so the prediction and every gradient are diffusers'.

    With a sequence split this rank holds a slice of the video tokens: their Q, K and V (normalised
    and rotated per token) go through one all-to-all to the whole sequence with 1/sp of the heads,
    the text's (every rank holds it whole) take their slice of the heads locally, and the outputs go
    back: the video's by the all-to-all, the text's heads gathered."""

    def __init__(self, split: SequenceSplit | None = None):
        self.split = split

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        query, key, value = (
            p(hidden_states).unflatten(2, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v)
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query, text_key, text_value = (
            p(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
        # [3, B, tokens, heads, D]: the video's whole sequence, the text's own heads
        video, text = stack_qkv(query, key, value), stack_qkv(text_query, text_key, text_value)
        if self.split:
            video, text = self.split.seq_to_heads(video, 2, 3), self.split.heads(text, 3)
        query, key, value = torch.cat([video, text], 2).unbind(0)
        batch, length, video_length = query.shape[0], query.shape[1], video.shape[2]
        keys = F.pad(attention_mask, (length - attention_mask.shape[1], 0), value=True).bool()
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=keys.view(batch, 1, 1, length),
        ).transpose(1, 2)
        video_out, text_out = out[:, :video_length], out[:, video_length:]
        if self.split:
            video_out, text_out = (
                self.split.heads_to_seq(video_out, 1, 2),
                self.split.gather_heads(text_out, 2),
            )
        video_out, text_out = video_out.flatten(2, 3).type_as(query), text_out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](video_out)), attn.to_add_out(text_out)
