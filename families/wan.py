"""Wan 2.1 and 2.2: text-, image-, first-last-frame- and control-to-video.

Wan 2.1 and 2.2 (docs/models/wan.md): T2V, 2.1 I2V (CLIP image tokens), 2.1 FLF2V (first and last
frame: two images' CLIP tokens, pos_embed_seq_len), 2.1 VACE (context blocks reading a control
video, its mask and reference images: families/wan_vace.py), 2.2 TI2V-5B (expand_timesteps) and 2.2
A14B (two experts split at boundary_ratio).

Flow matching: x_t = (1 - s) x0 + s e, the target e - x0, the loss in fp32; u uniform from the keyed
generator (within the trained expert's range), s = shift u / (1 + (shift - 1) u), model timestep
1000 s. Latents are normalised with the VAE config's latents_mean and latents_std; text embeddings
are trimmed to the attention mask and zero-padded to 512 tokens, as WanPipeline does. The sampling
pieces are WanPipeline's, WanImageToVideoPipeline's and WanVACEPipeline's loops.
"""

import contextlib
import json
from types import SimpleNamespace

import diffusers
import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor
from PIL import Image
from transformers import AutoImageProcessor, CLIPVisionModel, UMT5EncoderModel

import data
from config import Config, ConfigError, ModelConfig
from families import wan_vace
from model_adapter import TIMESTEP_KEYS, Adapter, RunSettings, log, masked_mean, sample_posterior, to_device
from parallel import SequenceSplit, split_blocks, stack_qkv
from weights import rename_key, rename_module, resolved_config

# the pipelines' max_sequence_length; 2.1 I2V's attention assumes exactly 512 text tokens
TEXT_LENGTH = 512
# diffusers module names -> the original checkpoint's (ComfyUI's), inside a block.
COMFY_NAMES = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
# The rest of the state dict in the original checkpoint's names (single files,
# model.transformer_file): the inverse of diffusers' convert_wan_transformer_to_diffusers, which
# reads them (docs/models/wan.md).
ORIGINAL_BLOCK = COMFY_NAMES | {
    "attn1.norm_q": "self_attn.norm_q",
    "attn1.norm_k": "self_attn.norm_k",
    "attn2.norm_q": "cross_attn.norm_q",
    "attn2.norm_k": "cross_attn.norm_k",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3",
    "scale_shift_table": "modulation",
}
ORIGINAL_OTHER = {
    "patch_embedding": "patch_embedding",
    "vace_patch_embedding": "vace_patch_embedding",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    # FLF2V: the position table of the two images' CLIP tokens (a parameter, renamed whole)
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",
}
# Names diffusers 0.42.1's single-file converter leaves as they are, renamed as its conversion
# script (scripts/convert_wan_to_diffusers.py, TRANSFORMER_KEYS_RENAME_DICT) renames them.
CONVERTER_MISSES = {"img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}
# The published folders without weights (Adapter.PUBLISHED; docs/models/wan.md): the 14B and 1.3B
# transformers, VACE's context blocks beside every 5th (14B) or 2nd (1.3B) block
# (convert_wan_to_diffusers.py), 2.2 A14B's two experts of 2.1 14B's config; UMT5-XXL's encoder.
WAN_14B = {
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
}
WAN_1_3B = {**WAN_14B, "num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960}
VACE_14B = {"vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96}
VACE_1_3B = {"vace_layers": list(range(0, 30, 2)), "vace_in_channels": 96}
UMT5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64}


def published_folders(pipeline: str, transformer: dict, experts=("transformer",), **model_index) -> dict:
    """One published Wan folder without weights: its pipeline, transformer(s), VAE, UMT5 and scheduler."""
    transformer_class = (
        "WanVACETransformer3DModel" if "vace_layers" in transformer else "WanTransformer3DModel"
    )
    return {
        "model_index.json": {"_class_name": pipeline, **model_index},
        **{folder: {"_class_name": transformer_class, **transformer} for folder in experts},
        "vae": {"_class_name": "AutoencoderKLWan"},
        "text_encoder": {**UMT5_XXL, "feed_forward_proj": "gated-gelu", "vocab_size": 256384},
        "tokenizer": {},
        "scheduler": {
            "_class_name": "UniPCMultistepScheduler",
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": 3.0,
        },
    }


PUBLISHED_FOLDERS = {
    "wan2.1-t2v-14b": published_folders("WanPipeline", WAN_14B),
    "wan2.1-t2v-1.3b": published_folders("WanPipeline", WAN_1_3B),
    "wan2.1-vace-14b": published_folders("WanVACEPipeline", {**WAN_14B, **VACE_14B}),
    "wan2.1-vace-1.3b": published_folders("WanVACEPipeline", {**WAN_1_3B, **VACE_1_3B}),
    "wan2.2-t2v-a14b": published_folders(
        "WanPipeline", WAN_14B, ("transformer", "transformer_2"), boundary_ratio=0.875
    ),
}


# Wan VACE's condition randomisation (wan_vace.drawn_condition), in RunSettings.vace_condition's order.
CONDITION_KEYS = ("train.vace_drop_references_p", "train.vace_frame_reference_p", "train.vace_inpaint_p")


class WanAdapter(Adapter):
    FAMILY = "wan"
    OWN_KEYS = {
        "model.expert": 'model.expert is for Wan 2.2 A14B (model.family = "wan"): remove it'
    } | dict.fromkeys(
        CONDITION_KEYS,
        '{key} randomises Wan VACE\'s condition (model.family = "wan", model.type = "vace"); {family} '
        "has no VACE condition: remove it",
    )
    READS = ("train.flow_shift",) + TIMESTEP_KEYS
    ENCODERS = {
        "video": ("vae",),
        "image": ("vae", "image_encoder", "image_processor"),
        "text": ("text_encoder", "tokenizer"),
    }
    TRANSFORMER, VAE, TEXT_ENCODER = WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel
    # As the original code and diffusers' examples run it: in bf16 the tiny VAE's latents move by 1%
    # (L2), BENCHMARKS.md; the real one is deeper.
    VAE_DTYPE = torch.float32
    PUBLISHED = PUBLISHED_FOLDERS
    COMFY = True
    TYPES = ("t2v", "i2v", "vace")
    SINGLE_FILE_KEY = "head.modulation"  # what diffusers' single-file loader detects Wan by

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        super().__init__(cfg, device, run)
        pipeline = resolved_config(WanPipeline, self.path, None)
        self.boundary, self.expand = pipeline["boundary_ratio"], pipeline["expand_timesteps"]
        if (self.boundary is None) != (not cfg.expert):
            raise ConfigError(
                f'model.expert = "{cfg.expert}", but {cfg.path} '
                + (
                    f'has two experts (boundary_ratio {self.boundary}): set model.expert to "high_noise" or "low_noise"'
                    if self.boundary is not None
                    else "has one transformer: remove model.expert"
                )
            )
        self.transformer_folder = EXPERTS.get(cfg.expert, "transformer")
        # VACE: the folder's transformer is WanVACETransformer3DModel (its config names its context
        # layers).
        saved = WanTransformer3DModel.load_config(self.path, subfolder=self.transformer_folder)
        self.vace = "vace_layers" in saved
        if self.vace != (cfg.type == "vace"):
            fix = (
                ' is a VACE model (its transformer has vace_layers): set model.type = "vace"'
                if self.vace
                else " is not a VACE model (its transformer has no vace_layers): set "
                'model.type = "t2v" or "i2v"'
            )
            raise ConfigError(f'model.type = "{cfg.type}", but {cfg.path}' + fix)
        if self.vace:
            self.TRANSFORMER = WanVACETransformer3DModel
            # each clip's control entry: its VACE condition (encode_control)
            self.takes_control = True
        # VACE: the chances of no references, of a frame of the clip as the reference and of an
        # inpainting condition (wan_vace.drawn_condition); the variants the control entries hold for
        # them, drawn keyed by run.seed.
        self.drop_references_p, self.frame_reference_p, self.inpaint_p = run.vace_condition
        if not self.vace and any(run.vace_condition):
            key = CONDITION_KEYS[next(i for i, p in enumerate(run.vace_condition) if p)]
            raise ConfigError(
                f"{key} randomises Wan VACE's condition, and {cfg.path} is not a VACE model: remove "
                'it, or train a VACE model (model.type = "vace")'
            )
        self.condition_variants = tuple(
            name
            for name, p in (("inpaint", self.inpaint_p), ("frame_reference", self.frame_reference_p))
            if p
        )
        self.seed = run.seed
        self.transformer_config = resolved_config(self.TRANSFORMER, self.path, self.transformer_folder)
        self.vae_config = resolved_config(AutoencoderKLWan, self.path, "vae")
        z, in_channels = self.vae_config["z_dim"], self.transformer_config["in_channels"]
        # noisy, mask, image latents
        takes_image = in_channels == 2 * z + self.vae_config["scale_factor_temporal"]
        if not self.expand and takes_image != (cfg.type == "i2v"):
            kind = "an image-to-video" if takes_image else "a text-to-video"
            raise ConfigError(
                f'model.type = "{cfg.type}", but {cfg.path} is {kind} model (its transformer takes '
                f'{in_channels} input channels): set model.type = "{"i2v" if takes_image else "t2v"}"'
            )
        # The class the folder names (2.1-T2V-14B's copies differ: FlowMatchEuler or UniPC), never a
        # fixed one.
        self.scheduler_class = getattr(
            diffusers,
            json.loads((self.path / "scheduler" / "scheduler_config.json").read_text())["_class_name"],
        )
        scheduler = resolved_config(self.scheduler_class, self.path, "scheduler")
        # train.flow_shift replaces it for training; sampling keeps the folder's.
        self.shift = run.flow_shift or scheduler.get("flow_shift") or scheduler.get("shift") or 1.0
        # On the device once: every micro-step normalises with them, and a copy from the host would
        # wait.
        self.latents_mean = torch.tensor(self.vae_config["latents_mean"], device=device).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae_config["latents_std"], device=device).view(1, z, 1, 1, 1)
        # FLF2V: the image embedder's position table spans two images' CLIP tokens (first, then last
        # frame).
        self.first_last = self.transformer_config.get("pos_embed_seq_len") is not None and takes_image
        self._image_encoder = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Weights in bf16 or fp16 need autocast."""
        super().check_config(cfg)
        dtype = cfg.model.dtype
        if dtype != "fp32" and cfg.train.mixed_precision == "no":
            # Without autocast Wan's first forward meets fp32 inputs with model.dtype's weights and
            # stops with a dtype mismatch, after the cache pass: refused before it.
            raise ConfigError(
                f'model.dtype = "{dtype}" with train.mixed_precision = "no": Wan\'s '
                "forward needs autocast to run weights in that dtype; set "
                f'train.mixed_precision = "{dtype}", or model.dtype = "fp32"'
            )
        t = cfg.train
        for key in CONDITION_KEYS:
            p = getattr(t, key.removeprefix("train."))
            if not 0 <= p <= 1:
                raise ConfigError(f"{key} = {p} is out of range: a probability, 0 to 1")
        if t.vace_drop_references_p + t.vace_frame_reference_p > 1:
            raise ConfigError(
                f"train.vace_drop_references_p = {t.vace_drop_references_p} and "
                f"train.vace_frame_reference_p = {t.vace_frame_reference_p} add up to more than 1: a step "
                "takes one of no references, a frame reference or the clips' own; lower them"
            )

    # Shape rules read from the model's own config.
    @property
    def temporal_ratio(self) -> int:
        return self.vae_config["scale_factor_temporal"]

    @property
    def spatial_ratio(self) -> int:
        return self.vae_config["scale_factor_spatial"]

    @property
    def latent_channels(self) -> int:
        return self.vae_config["z_dim"]

    @property
    def frame_multiple(self) -> int:
        # 4k+1 frames: the VAE encodes [0], [1:5], [5:9], ...
        return self.vae_config["scale_factor_temporal"]

    @property
    def size_multiple(self) -> int:
        return self.vae_config["scale_factor_spatial"] * self.transformer_config["patch_size"][1]

    def check_resolution(self, resolution, key: str) -> None:
        """The rotary embedding's table too: WanRotaryPosEmbed holds rope_max_seq_len positions per
        axis (the transformer's config), so more latent frames, rows or columns than that have none
        (its forward slices the table short and fails on the shape)."""
        super().check_resolution(resolution, key)
        limit = self.transformer_config["rope_max_seq_len"]
        patch = self.transformer_config["patch_size"]
        frames, height, width = resolution
        latent = {
            "frames": (frames, ((frames - 1) // self.temporal_ratio + 1) // patch[0], self.temporal_ratio),
            "height": (height, height // self.size_multiple, self.size_multiple),
            "width": (width, width // self.size_multiple, self.size_multiple),
        }
        for name, (value, positions, ratio) in latent.items():
            if positions > limit:
                raise ConfigError(
                    f"{key} {name} = {value} gives {positions} latent positions, more than the "
                    f"transformer's rotary table holds (rope_max_seq_len = {limit}): use at most "
                    f"{limit * ratio if name != 'frames' else (limit - 1) * ratio + 1}"
                )

    @property
    def text_length(self) -> int:
        return TEXT_LENGTH

    @property
    def text_width(self) -> int:
        return self.transformer_config["text_dim"]

    @property
    def published_fps(self) -> int:
        return 24 if self.expand else 16  # TI2V-5B: 24 fps; the others 16 (docs/models/wan.md)

    def other_experts(self) -> list[str]:
        return (
            [folder for folder in EXPERTS.values() if folder != self.transformer_folder]
            if self.boundary
            else []
        )

    def comfy_key(self, module: str) -> str | None:
        """blocks.N.attn1.to_q -> blocks.N.self_attn.q (diffusers' converter's inverse); None
        outside the blocks, where the converter takes no alpha."""
        return rename_module(module, "blocks", "blocks", COMFY_NAMES, {}) or wan_vace.comfy_key(
            module, COMFY_NAMES
        )

    def diffusers_key(self, original: str) -> str | None:
        inverse = {v: k for k, v in (COMFY_NAMES | wan_vace.PROJECTIONS).items()}
        return rename_module(original, "blocks", "blocks", inverse, {}) or rename_module(
            original, "vace_blocks", "vace_blocks", inverse, {}
        )

    @staticmethod
    def single_file_key(key: str) -> str | None:
        """A state-dict key's name in the original checkpoint: blocks.N.attn1.to_q.weight ->
        blocks.N.self_attn.q.weight; VACE's context blocks as the base blocks, their proj_in and
        proj_out as before_proj and after_proj (vace_blocks.N.before_proj.weight)."""
        return rename_key(key, "blocks", "blocks", ORIGINAL_BLOCK, ORIGINAL_OTHER) or rename_key(
            key, "vace_blocks", "vace_blocks", ORIGINAL_BLOCK | wan_vace.PROJECTIONS, {}
        )

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str]:
        """A single file's keys (the original names) -> diffusers', by diffusers' own converter
        (and, for FLF2V's img_emb.emb_pos, which it does not rename, by its conversion script)."""
        return {
            original: CONVERTER_MISSES.get(key, key)
            for key, original in convert_wan_transformer_to_diffusers({k: k for k in keys}).items()
        }

    # Encoding.
    def _normalise(self, latents: torch.Tensor) -> torch.Tensor:
        """(x - mean) * (1 / std), the pipeline's form (x / std differs in the last bits)."""
        return (latents - self.latents_mean.to(latents)) * (1.0 / self.latents_std.to(latents))

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (not
        normalised)."""
        posterior = self._load_vae().encode(self._pixels(video)).latent_dist
        return posterior.mean, posterior.logvar

    def _image_tower(self):
        if self._image_encoder is None:
            log.info("loading image encoder from %s", self.path)
            self._image_encoder = CLIPVisionModel.from_pretrained(
                self.path, subfolder="image_encoder", dtype=self.dtype
            ).eval()
            self._image_processor = AutoImageProcessor.from_pretrained(self.path, subfolder="image_processor")
        return self._image_encoder.to(self.device), self._image_processor

    def park_vae(self) -> None:
        """The VAE and 2.1 I2V's CLIP image encoder (validation's image condition) wait on the CPU."""
        super().park_vae()
        if self._image_encoder is not None:
            self._image_encoder.to("cpu")

    def release_encoders(self) -> None:
        self._image_encoder = self._image_processor = None
        super().release_encoders()

    @torch.no_grad()
    def _condition(
        self, pixels: torch.Tensor, frames: int, images, last_pixels=None, last_images=None
    ) -> dict:
        """Image pixels [B, 3, H, W] in [-1, 1] (fp32) -> what conditions the transformer, as the
        I2V pipeline's prepare_latents and encode_image build it: the VAE's mode of the image (TI2V)
        or of the image followed by frames - 1 grey frames, normalised; 2.1 I2V also the CLIP image
        tokens. FLF2V (last_pixels): frames - 2 grey frames, then the last image; the CLIP tokens of
        both images, [B, 2 x tokens, D] (first image's, then the last's)."""
        video = pixels[:, :, None]
        if last_pixels is not None:
            grey = video.new_zeros(*pixels.shape[:2], frames - 2, *pixels.shape[2:])
            video = torch.cat([video, grey, last_pixels[:, :, None]], dim=2)
        elif not self.expand:
            video = torch.cat(
                [video, video.new_zeros(*pixels.shape[:2], frames - 1, *pixels.shape[2:])], dim=2
            )
        latents = self._load_vae().encode(video.to(self.vae_dtype)).latent_dist.mode().float()
        condition = {"image_latents": self._normalise(latents)}
        if self.transformer_config["image_dim"] is not None:
            encoder, processor = self._image_tower()
            pairs = (
                list(images)
                if last_images is None
                else [x for pair in zip(images, last_images) for x in pair]
            )
            inputs = processor(images=pairs, return_tensors="pt").to(self.device)
            embeds = encoder(**inputs, output_hidden_states=True).hidden_states[-2]
            # pairs side by side
            condition["image_embeds"] = embeds.reshape(len(pixels), -1, embeds.shape[-1])
        return condition

    def encode_image(
        self, images: torch.Tensor, generators, frames: int, last_images: torch.Tensor | None = None
    ) -> dict:
        """I2V conditioning images, uint8 [B, H, W, 3] (and FLF2V's last images) -> the cached
        condition (no noise augmentation: the pipelines add none)."""
        pixels, last_pixels, last = (
            images.to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0,
            None,
            None,
        )
        if last_images is not None:
            last_pixels = last_images.to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            last = [np.asarray(image.cpu()) for image in last_images]
        return self._condition(
            pixels, frames, [np.asarray(image.cpu()) for image in images], last_pixels, last
        )

    def _vae_mode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> the VAE's mode, normalised: how the VACE pipeline
        encodes."""
        latents = self._load_vae().encode(pixels.to(self.device, self.vae_dtype)).latent_dist.mode()
        return self._normalise(latents)

    def vace_condition(
        self,
        control: torch.Tensor | None,
        mask: torch.Tensor | None,
        references: torch.Tensor | None,
        frames: int,
        height: int,
        width: int,
    ) -> dict:
        """VACE's condition of one or more clips, as WanVACEPipeline encodes it: `control_latents`
        [B, 96, F', h, w] and, with references, `reference_latents` [B, C, R, h, w] (wan_vace.py).
        control: float pixels [B, 3, F, H, W] in [-1, 1] (None: zeros, the pipeline's without a
        video); mask [B, 3, F, H, W] in [0, 1] (None: all ones, the pipeline's default); references:
        canvases [B, R, 3, H, W]."""
        if control is None:
            control = torch.zeros(1, 3, frames, height, width, device=self.device)
        control = control.to(self.device, torch.float32)
        mask = torch.ones_like(control) if mask is None else mask.to(self.device, torch.float32)
        patch = self.transformer_config["patch_size"][1]
        condition = {
            "control_latents": wan_vace.control_latents(
                self._vae_mode, control, mask, self.temporal_ratio, self.spatial_ratio, patch
            )
        }
        if references is not None and references.shape[1]:
            condition["reference_latents"] = wan_vace.reference_latents(
                self._vae_mode, references.to(self.device)
            )
        return condition

    def control_key(self) -> dict:
        """VACE with condition variants: which the control entries hold, and the seed of their draws
        (none without, so those entries keep their keys)."""
        return (
            {"variants": list(self.condition_variants), "seed": self.seed} if self.condition_variants else {}
        )

    def encode_control(
        self, videos, masks, references, resolution, clips=None, keys=None
    ) -> dict[str, torch.Tensor]:
        """VACE: the control entries of a batch of clips of `resolution` (frames, height, width):
        each clip's control frames (uint8 [F, H, W, 3], or None: the pipeline's zeros without a
        video), mask frames (uint8 [F, H, W, 3], or None: all white) and reference images (uint8 [H,
        W, 3] each, as many for every clip: cache.check_controls), encoded as the pipeline encodes
        them (vace_condition).

        With condition variants (train.vace_inpaint_p, train.vace_frame_reference_p), from each
        clip's own window (clips, uint8 [F, H, W, 3]) and draws keyed by (run.seed, its key):
        inpaint_control_latents, the clip masked as VideoX-Fun masks it (wan_vace.inpaint_mask,
        inpaint_pixels) encoded as a control video with that mask, and frame_reference_latents, one
        of its frames (wan_vace.reference_frame) encoded as a reference image."""
        frames, height, width = resolution
        zeros = torch.zeros(3, frames, height, width, device=self.device)
        pixels = torch.stack(
            [
                zeros if v is None else v.to(self.device).permute(3, 0, 1, 2).float() / 127.5 - 1.0
                for v in videos
            ]
        )
        masks = torch.stack(
            [
                torch.ones_like(zeros) if m is None else m.to(self.device).permute(3, 0, 1, 2) / 255.0
                for m in masks
            ]
        )
        canvases = None
        if references[0]:
            canvases = torch.stack(
                [
                    torch.stack(
                        [wan_vace.reference_canvas(r, height, width, self.spatial_ratio) for r in clip]
                    )
                    for clip in references
                ]
            )
        condition = self.vace_condition(pixels, masks, canvases, frames, height, width)
        return condition | self._condition_variants(clips, keys, resolution)

    def _condition_variants(self, clips, keys, resolution) -> dict[str, torch.Tensor]:
        """encode_control's inpainting and frame-reference entries of the clips (none without
        variants)."""
        if not self.condition_variants:
            return {}
        frames, height, width = resolution
        own = [c.to(self.device).permute(3, 0, 1, 2).float() / 127.5 - 1.0 for c in clips]
        variants = {}
        if "inpaint" in self.condition_variants:
            drawn = [
                wan_vace.inpaint_pixels(
                    clip,
                    wan_vace.inpaint_mask(
                        frames, height, width, data.keyed_generator(self.seed, "vace_inpaint", key)
                    ),
                )
                for clip, key in zip(own, keys)
            ]
            pixels, masks = (torch.stack(x) for x in zip(*drawn))
            variants["inpaint_control_latents"] = self.vace_condition(
                pixels, masks, None, frames, height, width
            )["control_latents"]
        if "frame_reference" in self.condition_variants:
            chosen = [
                clip[wan_vace.reference_frame(frames, data.keyed_generator(self.seed, "vace_frame", key))]
                for clip, key in zip(clips, keys)
            ]
            canvases = torch.stack(
                [wan_vace.reference_canvas(f.cpu(), height, width, self.spatial_ratio) for f in chosen]
            )
            variants["frame_reference_latents"] = wan_vace.reference_latents(
                self._vae_mode, canvases[:, None].to(self.device)
            )
        return variants

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 embeddings [B, 512, D] as WanPipeline computes them: its prompt cleaning, the rows
        past the attention mask zeroed (the cache stores the rows before them)."""
        text_encoder, tokenizer = self._text()
        inputs = tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=TEXT_LENGTH,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        embeds = text_encoder(
            inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        ).last_hidden_state
        return embeds * inputs.attention_mask.to(self.device)[:, :, None].to(embeds.dtype)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, C, F', h, w] -> pixels [B, C, F, H, W] in [-1, 1], as the pipeline
        decodes."""
        latents = latents.to(self.vae_dtype) / (
            1.0 / self.latents_std.to(self.vae_dtype)
        ) + self.latents_mean.to(self.vae_dtype)
        vae = self._load_vae()
        return torch.cat([vae.decode(clip, return_dict=False)[0] for clip in latents.split(1)])

    # Training.
    def _sigmas(self, generators) -> torch.Tensor:
        """s per sample: u uniform over the trained expert's share of [0, 1), then shifted; or
        train.timestep_sampling's draw within the expert's share of s."""
        low, high = 0.0, 1.0
        if self.timestep_sampling.sampling:  # train.timestep_sampling's, within the expert's share
            if self.boundary is not None:
                low, high = (self.boundary, 1.0) if self.expert == "high_noise" else (0.0, self.boundary)
            return self.timestep_sampling.draw(generators, low, high)
        # s >= boundary is the high-noise expert's: invert the shift there
        if self.boundary is not None:
            u_boundary = self.boundary / (self.shift - (self.shift - 1) * self.boundary)
            low, high = (u_boundary, 1.0) if self.expert == "high_noise" else (0.0, u_boundary)
        u = torch.stack([low + (high - low) * torch.rand((), generator=g) for g in generators])
        return self.shift * u / (1 + (self.shift - 1) * u)

    def held_out_timesteps(self, timesteps: list[int]) -> list[int]:
        if self.boundary is None:
            return timesteps
        high = self.expert == "high_noise"
        return [t for t in timesteps if (t >= self.boundary * 1000) == high]

    def _inputs(self, x_t, t, batch, n):
        """The transformer's input, timesteps, image tokens, VACE context and the loss mask for
        noisy latents x_t (n rows) at model timesteps t [n] of a cached batch or a sampling state's
        condition."""
        mask = torch.ones_like(x_t[:, :1])
        image_embeds = control = None
        # VACE: the reference frames in front are in the loss, as the makers train them
        # (docs/models/wan.md, VACE)
        if self.vace:
            references = batch.get("reference_latents")
            control = wan_vace.context(
                batch["control_latents"].to(self.device).float(),
                None if references is None else references.to(self.device).float(),
            )
            control = control.expand(n, *control.shape[1:])
        if self.type == "i2v":
            condition = batch["image_latents"].to(self.device).float().expand(n, -1, -1, -1, -1)
            # TI2V: the first latent frame is the image's, at timestep 0, and not in the loss
            if self.expand:
                mask[:, :, 0] = 0
                x_t = (1 - mask) * condition + mask * x_t
            else:
                x_t = torch.cat([x_t, self._frame_mask(condition), condition], dim=1)
            if "image_embeds" in batch:
                image_embeds = batch["image_embeds"].to(self.device).expand(n, -1, -1)
                # [n, 2 x tokens, D] -> [2n, tokens, D]: the image embedder pairs them again
                if self.first_last:
                    image_embeds = image_embeds.reshape(2 * n, -1, image_embeds.shape[-1])
        if self.expand:
            t = (mask[:, 0, :, ::2, ::2] * t.view(-1, 1, 1, 1)).flatten(1)
        return x_t, t, image_embeds, control, mask

    def _frame_mask(self, condition: torch.Tensor) -> torch.Tensor:
        """The pipeline's mask of known frames [B, temporal ratio, F', h, w], built as its
        prepare_latents builds it: per pixel frame 1 for the first (and FLF2V's last) frame, the
        first repeated to fill its latent frame, folded into channels."""
        ratio, latent_frames = self.vae_config["scale_factor_temporal"], condition.shape[2]
        frames = (latent_frames - 1) * ratio + 1
        known = torch.zeros(frames, device=condition.device, dtype=condition.dtype)
        # slices fill on the device; an element assignment copies a host scalar (a wait)
        known[:1] = 1
        if self.first_last:
            known[-1:] = 1
        per_frame = torch.cat([known[:1].repeat(ratio), known[1:]]).view(latent_frames, ratio).T
        return per_frame[None, :, :, None, None].expand(len(condition), -1, -1, *condition.shape[3:])

    def _predict(self, transformer, x, t, embeds, image_embeds, control=None):
        dtype = next(transformer.parameters()).dtype
        # conditioning scale 1
        vace = {} if control is None else {"control_hidden_states": control.to(dtype)}
        return transformer(
            hidden_states=x.to(dtype),
            timestep=t,
            encoder_hidden_states=embeds.to(dtype),
            encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
            return_dict=False,
            **vace,
        )[0].float()

    def _loss(self, transformer, x0, noise, sigmas, batch, embeds):
        s = sigmas.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        x, t, image_embeds, control, mask = self._inputs(x_t, 1000 * sigmas, batch, len(x0))
        if "loss_mask" in batch:  # data.loss_mask_column: on the clip's frames, after VACE's references
            weights = batch["loss_mask"].to(self.device).float()
            mask = mask * F.pad(weights, (0, 0, 0, 0, mask.shape[2] - weights.shape[2], 0), value=1.0)
        error = (self._predict(transformer, x, t, embeds, image_embeds, control) - (noise - x0)).pow(2)
        return masked_mean(error, mask, (1, 2, 3, 4))

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch; the latent sample, u and the noise come from each
        sample's own generator, keyed by (seed, step, position in the global batch). VACE: the
        condition randomised by train.vace_*_p (wan_vace.drawn_condition)."""
        if self.drop_references_p or self.frame_reference_p or self.inpaint_p:
            batch = wan_vace.drawn_condition(
                batch, generators, self.drop_references_p, self.frame_reference_p, self.inpaint_p
            )
        x0 = self._with_references(
            self._normalise(
                sample_posterior(
                    batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators
                )
            ),
            batch,
        )
        sigmas = to_device(self._sigmas(generators), self.device)
        noise = to_device(
            torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)]), self.device
        )
        loss = self._loss(transformer, x0, noise, sigmas, batch, batch["prompt_embeds"].to(self.device))
        if self.timestep_sampling.weighting == "none":
            return loss
        return self.timestep_sampling.weight(sigmas) * loss

    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The loss of one cached clip (its posterior mean) at each of `timesteps`, with the same
        noise."""
        x0 = self._with_references(self._normalise(batch["latent_mean"].to(self.device).float()), batch)
        noise = torch.randn(x0.shape[1:], generator=generator).to(self.device)
        n = len(timesteps)
        return self._loss(
            transformer,
            x0.expand(n, -1, -1, -1, -1),
            noise.expand(n, *noise.shape),
            torch.tensor(timesteps, device=self.device) / 1000,
            batch,
            batch["prompt_embeds"].to(self.device).expand(n, -1, -1),
        )

    def _with_references(self, x0: torch.Tensor, batch) -> torch.Tensor:
        """VACE: the reference images' latents in front of the clip's, the sequence the pipeline
        denoises (their noise is drawn with the clip's, and they are in the loss)."""
        if "reference_latents" not in batch:
            return x0
        references = batch["reference_latents"].to(self.device).float()
        return torch.cat([references.expand(len(x0), *references.shape[1:]), x0], dim=2)

    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        """VACE's context blocks first: the forward runs them all before the base blocks."""
        return list(getattr(transformer, "vace_blocks", [])) + list(transformer.blocks)

    @property
    def block_count(self) -> int:
        """VACE: the context blocks with the base blocks (parallel.offload_blocks counts both)."""
        return self.transformer_config["num_layers"] + (
            len(self.transformer_config["vace_layers"]) if self.vace else 0
        )

    def split_sequence(self, transformer, split: SequenceSplit) -> None:
        """Sequence parallelism: the video tokens, their rotary embeddings and (TI2V) their
        per-token timestep embeddings split at the first block; self-attention through an
        all-to-all, the cross-attention to the text (and image) local.

        VACE: the context tokens (the VACE patch embedding's, padded to the video's length as the
        forward pads them, reference frames included) split with the video's, in the same slices,
        at the first context block; the video, which the forward hands every context block whole
        (the first adds it to the context), is sliced at each: a view, and what checkpointing keeps
        (activation offload copies) per block is this rank's slice. Each context block's hint stays split and is added to the base blocks'
        split tokens, and the sequence is gathered where it leaves the blocks, at the output norm
        (a hint may follow the last base block)."""

        def per_token_inputs(arguments: dict) -> dict[str, int]:
            # temb [B, tokens, 6, D] with expand_timesteps (TI2V), [B, 6, D] otherwise
            return {"rotary_emb": 1} | ({"temb": 1} if arguments["temb"].ndim == 4 else {})

        self.sequence = split
        if self.vace:
            split_blocks(
                list(transformer.vace_blocks),
                split,
                lambda arguments: per_token_inputs(arguments) | {"hidden_states": 1},
                first=("control_hidden_states",),
                gather=False,
            )
            split_blocks(list(transformer.blocks), split, per_token_inputs, gather=False)
            transformer.norm_out.register_forward_pre_hook(lambda module, args: (split.gather(args[0], 1),))
        else:
            split_blocks(self.blocks(transformer), split, per_token_inputs)
        for block in self.blocks(transformer):
            block.attn1.set_processor(SequenceParallelSelfAttention(split))

    # Sampling: WanPipeline's (WanImageToVideoPipeline's) loop, run by validate.sample_latents.
    def sampler(self, name: str):
        return self.scheduler_class.from_pretrained(self.path, subfolder="scheduler")

    def sampling_start(
        self,
        scheduler,
        steps: int,
        resolution,
        generator: torch.Generator,
        image=None,
        last_image=None,
        control=None,
        mask=None,
        references=(),
    ):
        """Initial latents [1, C, F', h, w] (fp32) from `generator`, and the image's (FLF2V: and the
        last image's) condition, as the pipelines' prepare_latents. VACE: the control video's frames
        and the mask's (PIL images, or validation's uint8 [F, H, W, 3]), or None, and the
        reference images (PIL), encoded as WanVACEPipeline does; a latent frame per reference in front
        of the clip's."""
        frames, height, width = resolution
        ratio = self.vae_config["scale_factor_spatial"]
        scheduler.set_timesteps(steps, device=self.device)
        condition = self._vace_sampling_condition(control, mask, references, resolution) if self.vace else {}
        shape = (
            1,
            self.vae_config["z_dim"],
            (frames - 1) // self.frame_multiple + 1 + len(references),
            height // ratio,
            width // ratio,
        )
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        if image is not None:
            processor = VideoProcessor(vae_scale_factor=ratio)
            pixels = processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
            last_pixels = (
                None
                if last_image is None
                else processor.preprocess(last_image, height=height, width=width).to(
                    self.device, torch.float32
                )
            )
            condition = self._condition(
                pixels, frames, [image], last_pixels, None if last_image is None else [last_image]
            )
        boundary = None if self.boundary is None else self.boundary * scheduler.config.num_train_timesteps
        return SimpleNamespace(
            scheduler=scheduler,
            latents=latents,
            condition=condition,
            boundary=boundary,
            references=len(references),
        )

    def _vace_sampling_condition(self, control, mask, references, resolution) -> dict:
        """The pipeline's preprocess_conditions on validation's inputs: frames to [-1, 1] at the
        clip's size, the mask to [0, 1], each reference centred on a white canvas."""
        frames, height, width = resolution
        processor = VideoProcessor(vae_scale_factor=self.spatial_ratio)
        # validate.load_control's uint8 frames (the control's, the mask's):
        # the pipeline's images
        control, mask = (
            [Image.fromarray(frame) for frame in x.numpy()] if isinstance(x, torch.Tensor) else x
            for x in (control, mask)
        )
        if control is not None:
            control = processor.preprocess_video(control, height, width).float()
        if mask is not None:
            mask = processor.preprocess_video(mask, height, width).float()
            mask = torch.clamp((mask + 1) / 2, min=0, max=1)
        canvases = None
        if references:
            canvases = torch.stack(
                [wan_vace.reference_canvas(r, height, width, self.spatial_ratio) for r in references]
            )[None]
        return self.vace_condition(control, mask, canvases, frames, height, width)

    def denoise(
        self, models: dict, state, t: torch.Tensor, embeds: torch.Tensor, guided: bool
    ) -> torch.Tensor:
        """The flow prediction at step t, by the expert whose range holds t; with guidance, of the
        latents twice (uncond, cond) in one forward."""
        folder = "transformer" if state.boundary is None or t >= state.boundary else "transformer_2"
        n = 2 if guided else 1
        x, timesteps, image_embeds, control, _ = self._inputs(state.latents, t.view(1), state.condition, 1)
        return self._predict(
            models[folder],
            x.expand(n, *x.shape[1:]),
            timesteps.expand(n, *timesteps.shape[1:]),
            # FLF2V
            embeds,
            None if image_embeds is None else image_embeds.repeat(n, 1, 1),
            None if control is None else control.expand(n, *control.shape[1:]),
        )

    def guidance_scale(self, cfg, state, t: torch.Tensor) -> float:
        """A14B: the low-noise expert's steps (t < boundary) take guidance_scale_2, as the
        pipeline's."""
        if state.boundary is not None and t < state.boundary:
            return cfg.guidance_scale_2 or cfg.guidance_scale
        return cfg.guidance_scale

    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        state.latents = state.scheduler.step(prediction, t, state.latents, return_dict=False)[0]

    def sampled(self, state) -> torch.Tensor:
        # the image's latent frame, as the pipeline restores it
        if self.expand and self.type == "i2v":
            return torch.cat([state.condition["image_latents"], state.latents[:, :, 1:]], dim=2)
        # VACE: without the reference frames, as the pipeline
        return state.latents[:, :, state.references :]

    def sampling_attention(self, model: torch.nn.Module):
        return contextlib.nullcontext()


class SequenceParallelSelfAttention:
    """diffusers' WanAttnProcessor for self-attention (attn1), step for step, with this rank's slice
    of the video tokens: Q, K and V (normalised and rotated per token) go through one all-to-all to
    the whole sequence with 1/sp of the heads, and the attention's output back."""

    def __init__(self, split: SequenceSplit):
        self.split = split

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        # [3, B, tokens, heads, D]
        qkv = self.split.seq_to_heads(stack_qkv(query, key, value), 2, 3)
        query, key, value = qkv.transpose(2, 3).unbind(0)
        out = F.scaled_dot_product_attention(query, key, value).transpose(1, 2)
        out = self.split.heads_to_seq(out, 1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """WanAttnProcessor's rotary embedding (a function inside its __call__), [B, tokens, heads, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
