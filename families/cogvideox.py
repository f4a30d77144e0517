"""CogVideoX 1.0 and 1.5, text-to-video and image-to-video (docs/models/cogvideox.md).

v-prediction with the model's own DPM scheduler, t uniform in [0, 1000), the loss mean((v_hat -
v)^2) computed in fp32; rotary embeddings from the pipeline's own function, so training and
inference agree; 1.5's latent frames padded to patch_size_t as the pipeline pads them;
image-to-video conditioned as CogVideoXImageToVideoPipeline conditions it. The sampling pieces are
CogVideoXPipeline's loop.
"""

import contextlib
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
)
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.video_processor import VideoProcessor
from transformers import T5EncoderModel

import lora
import memory
from config import ConfigError, ModelConfig
from model_adapter import Adapter, RunSettings, log, masked_mean, sample_posterior, to_device
from parallel import SequenceSplit, split_blocks, stack_qkv
from weights import parameters_on_meta, rename_key, rename_module, resolved_config

SAMPLERS = {"dpm": CogVideoXDPMScheduler, "ddim": CogVideoXDDIMScheduler}
# The published folders without weights (Adapter.PUBLISHED; docs/models/cogvideox.md): 2B's
# transformer is the class defaults, 5B's these and the defaults; T5 v1.1 XXL's encoder; the 5B
# models' scheduler (2B's differs in snr_shift_scale only, which memory does not depend on).
T5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64}
PUBLISHED_FOLDERS = {
    name: {
        "model_index.json": {"_class_name": "CogVideoXPipeline"},
        "transformer": {"_class_name": "CogVideoXTransformer3DModel", **transformer},
        "vae": {"_class_name": "AutoencoderKLCogVideoX"},
        "text_encoder": {**T5_XXL, "feed_forward_proj": "gated-gelu", "vocab_size": 32128},
        "tokenizer": {},
        "scheduler": {
            "_class_name": "CogVideoXDPMScheduler",
            "clip_sample": False,
            "snr_shift_scale": 1.0,
            "beta_schedule": "scaled_linear",
            "prediction_type": "v_prediction",
            "rescale_betas_zero_snr": True,
            "timestep_spacing": "trailing",
        },
    }
    for name, transformer in (
        ("cogvideox-2b", {"num_attention_heads": 30, "num_layers": 30}),
        (
            "cogvideox-5b",
            {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True},
        ),
    )
}
# diffusers module names -> ComfyUI's native ones (comfy/ldm/cogvideo/model.py;
# docs/models/cogvideox.md): inside a block (transformer_blocks.N -> blocks.N), and outside. Every
# nn.Linear of diffusers' model has one.
COMFY_BLOCK = {
    "norm1.linear": "norm1.linear",
    "attn1.to_q": "q",
    "attn1.to_k": "k",
    "attn1.to_v": "v",
    "attn1.to_out.0": "attn_out",
    "norm2.linear": "norm2.linear",
    "ff.net.0.proj": "ff_proj",
    "ff.net.2": "ff_out",
}
COMFY_OTHER = {
    "patch_embed.proj": "patch_embed.proj",
    "patch_embed.text_proj": "patch_embed.text_proj",
    "time_embedding.linear_1": "time_embedding_linear_1",
    "time_embedding.linear_2": "time_embedding_linear_2",
    "ofs_embedding.linear_1": "ofs_embedding_linear_1",
    "ofs_embedding.linear_2": "ofs_embedding_linear_2",
    "norm_out.linear": "norm_out.linear",
    "proj_out": "proj_out",
}
# With the norms and the learned positions, the whole state dict: ComfyUI's single files
# (model.transformer_file).
COMFY_WEIGHTS_BLOCK = COMFY_BLOCK | {
    "norm1.norm": "norm1.norm",
    "attn1.norm_q": "norm_q",
    "attn1.norm_k": "norm_k",
    "norm2.norm": "norm2.norm",
}
COMFY_WEIGHTS_OTHER = COMFY_OTHER | {
    "norm_final": "norm_final",
    "norm_out.norm": "norm_out.norm",
    "patch_embed.pos_embedding": "patch_embed.pos_embedding",
}


class CogVideoXAdapter(Adapter):
    FAMILY = "cogvideox"
    OWN_KEYS = {
        "validation.use_dynamic_cfg": "validation.use_dynamic_cfg is CogVideoX's pipeline option; "
        "Wan's and LTX-2's pipelines have none: remove it",
        "validation.scheduler": "validation.scheduler chooses between CogVideoX's samplers: Wan and "
        "LTX-2 sample with their folder's scheduler; remove it",
    }
    ENCODERS = {"video": ("vae",), "image": ("vae",), "text": ("text_encoder", "tokenizer")}
    TRANSFORMER, VAE, TEXT_ENCODER = CogVideoXTransformer3DModel, AutoencoderKLCogVideoX, T5EncoderModel
    COMFY = True
    # what ComfyUI's model detection knows CogVideoX by
    SINGLE_FILE_KEY = "blocks.0.norm1.linear.weight"
    PUBLISHED = PUBLISHED_FOLDERS

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        super().__init__(cfg, device, run)
        self.transformer_config = resolved_config(CogVideoXTransformer3DModel, self.path, "transformer")
        self.vae_config = resolved_config(AutoencoderKLCogVideoX, self.path, "vae")
        takes_image = self.transformer_config["in_channels"] == 2 * self.vae_config["latent_channels"]
        if takes_image != (cfg.type == "i2v"):
            kind = "an image-to-video" if takes_image else "a text-to-video"
            raise ConfigError(
                f'model.type = "{cfg.type}", but {cfg.path} is {kind} model (its transformer takes '
                f"{self.transformer_config['in_channels']} input channels): set model.type = "
                f'"{"i2v" if takes_image else "t2v"}"'
            )
        self.scheduler = CogVideoXDPMScheduler.from_pretrained(self.path, subfolder="scheduler")
        # indexed on the device every step
        self.alphas_cumprod = self.scheduler.alphas_cumprod.to(device, torch.float32)

    # Shape rules read from the model's own config.
    @property
    def temporal_ratio(self) -> int:
        return int(self.vae_config["temporal_compression_ratio"])

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    @property
    def latent_channels(self) -> int:
        return self.vae_config["latent_channels"]

    @property
    def frame_multiple(self) -> int:
        # The VAE decodes latents in pairs: 8k+1 frames for a 4x temporal ratio.
        return 2 * self.temporal_ratio

    @property
    def size_multiple(self) -> int:
        return self.spatial_ratio * self.transformer_config["patch_size"]

    @property
    def text_length(self) -> int:
        return self.transformer_config["max_text_seq_length"]

    @property
    def text_width(self) -> int:
        return self.transformer_config["text_embed_dim"]

    @property
    def published_fps(self) -> int:
        # 1.5: 16 fps; 1.0: 8 (docs/models/cogvideox.md)
        return 16 if self.transformer_config["patch_size_t"] else 8

    def check_resolution(self, resolution, key: str) -> None:
        super().check_resolution(resolution, key)
        c, ratio = self.transformer_config, self.spatial_ratio
        frames, height, width = resolution
        if c["use_learned_positional_embeddings"]:
            native = [c["sample_frames"], c["sample_height"] * ratio, c["sample_width"] * ratio]
            if list(resolution) != native:
                # diffusers refuses another height or width, but silently swaps in other embeddings
                # for another frame count.
                raise ConfigError(
                    f"{key} = {list(resolution)}, but this model's learned positional embeddings "
                    f"(CogVideoX-5b-I2V) are sized for {native} only: use {native}"
                )
        if c["patch_size_t"] and (height > c["sample_height"] * ratio or width > c["sample_width"] * ratio):
            raise ConfigError(
                f"{key} = {list(resolution)}, but CogVideoX 1.5's rotary grid covers at most "
                f"{c['sample_height'] * ratio}x{c['sample_width'] * ratio} (the transformer config's "
                "sample_height and sample_width): use a smaller height or width"
            )

    def comfy_key(self, module: str) -> str | None:
        """Our module name in ComfyUI's model.

        transformer_blocks.N.attn1.to_q -> blocks.N.q, time_embedding.linear_1 ->
        time_embedding_linear_1."""
        return rename_module(module, "transformer_blocks", "blocks", COMFY_BLOCK, COMFY_OTHER)

    def diffusers_key(self, original: str) -> str | None:
        return rename_module(
            original,
            "blocks",
            "transformer_blocks",
            {v: k for k, v in COMFY_BLOCK.items()},
            {v: k for k, v in COMFY_OTHER.items()},
        )

    @staticmethod
    def single_file_key(key: str) -> str | None:
        """A state-dict key's name in ComfyUI's model.

        transformer_blocks.N.attn1.to_q.weight -> blocks.N.q.weight."""
        return rename_key(key, "transformer_blocks", "blocks", COMFY_WEIGHTS_BLOCK, COMFY_WEIGHTS_OTHER)

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str]:
        """A single file's keys (ComfyUI's names) -> diffusers'.

        A key ComfyUI's model lacks keeps its name."""
        block, other = (
            {v: k for k, v in names.items()} for names in (COMFY_WEIGHTS_BLOCK, COMFY_WEIGHTS_OTHER)
        )
        return {k: rename_key(k, "blocks", "transformer_blocks", block, other) or k for k in keys}

    @classmethod
    def single_file_tables(cls, config: dict) -> dict[str, torch.Tensor]:
        """Add 2b's sincos positions, so that ComfyUI detects the right model.

        2b's sincos positions as patch_embed.pos_embedding (diffusers' non-persistent buffer, as its
        from_config computes it): ComfyUI's model detection takes a CogVideoX file without that key
        for a rotary model and builds 2b as the wrong one; with it, as a model with sincos positions
        (which ComfyUI's forward computes anew: the table marks the file)."""
        if config["use_rotary_positional_embeddings"] or config["use_learned_positional_embeddings"]:
            return {}
        with parameters_on_meta():
            transformer = CogVideoXTransformer3DModel.from_config(config)
        return {"patch_embed.pos_embedding": transformer.patch_embed.pos_embedding}

    def single_file_extra(self, key: str) -> bool:
        """2b's sincos table (single_file_tables): the model computes its own."""
        c = self.transformer_config
        return key == "patch_embed.pos_embedding" and not (
            c["use_rotary_positional_embeddings"] or c["use_learned_positional_embeddings"]
        )

    # Encoding.
    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (unscaled)."""
        posterior = self._load_vae().encode(self._pixels(video)).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def encode_image(self, images: torch.Tensor, generators: list[torch.Generator], frames: int) -> dict:
        """Encode I2V conditioning images with CogVideo's noise augmentation into posteriors.

        I2V conditioning images, uint8 [B, H, W, 3] -> posterior mean and log-variance [B, C, 1, h,
        w] of the image with CogVideo's pixel-space noise augmentation, sigma = exp(N(-3, 0.5)),
        drawn from each clip's generator keyed by (run.seed, clip): the entry is cached once, and a
        run's every epoch sees the same augmented image (CogVideo draws a new sigma and re-encodes
        at every step)."""
        pixels = self._pixels(images[:, None]).float()
        for image, generator in zip(pixels, generators):
            sigma = math.exp(-3.0 + 0.5 * torch.randn((), generator=generator).item())
            image += sigma * torch.randn(image.shape, generator=generator).to(image.device)
        posterior = self._load_vae().encode(pixels.to(self.dtype)).latent_dist
        return {"image_mean": posterior.mean, "image_logvar": posterior.logvar}

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """T5 embeddings [B, L, D] exactly as the pipeline computes them.

        L comes from the transformer config."""
        text_encoder, tokenizer = self._text()
        ids = tokenizer(
            prompts, padding="max_length", max_length=self.text_length, truncation=True, return_tensors="pt"
        ).input_ids
        for prompt in prompts:
            if len(tokenizer(prompt).input_ids) > self.text_length:
                log.warning("prompt truncated to %d tokens: %r", self.text_length, prompt)
        return text_encoder(ids.to(self.device))[0]

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode scaled latents [B, F', C, h, w] to pixels [B, C, F, H, W] in [-1, 1].

        Scaled latents [B, F', C, h, w] -> pixels [B, C, F, H, W] in [-1, 1], as the pipeline's
        decode_latents. One clip at a time, in the VAE's own spatial tiles (which the VAE would use
        for encoding too, so they are switched on only here): memory stays bounded at any
        resolution."""
        vae = self._load_vae()
        # diffusers stitches tiles into a frame of the wrong size when its tile stride does not come
        # out whole, as with most tiny VAEs; the real models' default tiles do, and those decode
        # tiled.
        tiles_exactly = all(
            int(latent * (1 - overlap)) * self.spatial_ratio == sample - int(sample * overlap)
            for sample, latent, overlap in (
                (vae.tile_sample_min_height, vae.tile_latent_min_height, vae.tile_overlap_factor_height),
                (vae.tile_sample_min_width, vae.tile_latent_min_width, vae.tile_overlap_factor_width),
            )
        )
        if tiles_exactly:
            vae.enable_tiling()
        try:
            # (1 / s) * x, not x / s: the pipeline's rounding.
            scaled = (1 / self.vae_config["scaling_factor"]) * latents.permute(0, 2, 1, 3, 4).to(self.dtype)
            return torch.cat([vae.decode(clip).sample for clip in scaled.split(1)])
        finally:
            vae.disable_tiling()

    # Image-to-video conditioning.
    def image_condition(self, image_latents: torch.Tensor, frames: int) -> torch.Tensor:
        """Build the transformer's image condition [B, frames, C, h, w] from image latents.

        Unscaled image latents [B, C, 1, h, w] -> the transformer's conditioning input [B, frames,
        C, h, w], as CogVideoXImageToVideoPipeline.prepare_latents builds it: scaled (divided by the
        scaling factor where the VAE config says invert_scale_latents, as for 1.5-I2V), at latent
        frame 0, zeros after it up to the (padded) latent frame count."""
        image_latents = image_latents.permute(0, 2, 1, 3, 4)
        s = self.vae_config["scaling_factor"]
        image_latents = (1 / s if self.vae_config["invert_scale_latents"] else s) * image_latents
        padding = image_latents.new_zeros(image_latents.shape[0], frames - 1, *image_latents.shape[2:])
        return torch.cat([image_latents, padding], dim=1)

    def batch_condition(self, batch: dict[str, torch.Tensor], frames: int, generators) -> torch.Tensor | None:
        """I2V: the cached image posterior as the condition.

        Sampled, or its mean without generators."""
        if self.type != "i2v":
            return None
        image = sample_posterior(
            batch["image_mean"].to(self.device), batch["image_logvar"].to(self.device), generators
        )
        return self.image_condition(image, frames)

    # Diffusion.
    def rotary_embeddings(self, latent_frames: int, latent_height: int, latent_width: int):
        """The pipeline's own function, given the pixel size it would be called with."""
        if not self.transformer_config["use_rotary_positional_embeddings"]:
            return None
        fake_pipeline = SimpleNamespace(
            transformer=SimpleNamespace(config=SimpleNamespace(**self.transformer_config)),
            vae_scale_factor_spatial=self.spatial_ratio,
        )
        return CogVideoXPipeline._prepare_rotary_positional_embeddings(
            fake_pipeline,
            latent_height * self.spatial_ratio,
            latent_width * self.spatial_ratio,
            latent_frames,
            self.device,
        )

    def extra_frames(self, latent_frames: int) -> int:
        """CogVideoX 1.5: latent frames added in front up to a multiple of patch_size_t."""
        return -latent_frames % (self.transformer_config["patch_size_t"] or 1)

    def pad_frames(self, latents: torch.Tensor) -> torch.Tensor:
        """CogVideoX 1.5: repeat the first latent frame in front up to a multiple of patch_size_t."""
        extra = self.extra_frames(latents.shape[1])
        return torch.cat([latents[:, :1].expand(-1, extra, -1, -1, -1), latents], dim=1) if extra else latents

    def predict_v(
        self,
        transformer,
        x_t: torch.Tensor,
        t: torch.Tensor,
        prompt_embeds: torch.Tensor,
        rotary,
        condition: torch.Tensor | None = None,
    ):
        """The denoiser call [B, F, C, H, W] -> v prediction in fp32; used by training and sampling.

        I2V: the image condition follows the noisy latents on channels, as in the pipeline."""
        if condition is not None:
            x_t = torch.cat([x_t, condition.to(x_t.dtype)], dim=2)
        ofs = x_t.new_full((x_t.shape[0],), 2.0) if self.transformer_config["ofs_embed_dim"] else None
        weight_dtype = next(transformer.parameters()).dtype
        out = transformer(
            hidden_states=x_t.to(weight_dtype),
            encoder_hidden_states=prompt_embeds.to(weight_dtype),
            timestep=t,
            ofs=ofs,
            image_rotary_emb=rotary,
            return_dict=False,
        )[0]
        return out.float()

    def clean_latents(
        self, mean: torch.Tensor, logvar: torch.Tensor, generators: list[torch.Generator] | None
    ):
        """Turn a [B, C, F', h, w] posterior into scaled, padded latents [B, F', C, h, w] in fp32.

        [B, C, F', h, w] posterior -> scaled, padded latents [B, F', C, h, w] in fp32; sampled when
        generators are given, the posterior mean otherwise (the held-out loss)."""
        latents = sample_posterior(mean, logvar, generators) * self.vae_config["scaling_factor"]
        return self.pad_frames(latents.permute(0, 2, 1, 3, 4))

    def loss(
        self,
        transformer,
        x0: torch.Tensor,
        prompt_embeds,
        timesteps: torch.Tensor,
        noise: torch.Tensor,
        condition: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ):
        """Per-sample v-prediction loss in fp32. x0 and noise [B, F, C, h, w]; timesteps [B] ints;
        weights: a loss mask on the latent grid [B, 1, F', h, w] (data.loss_mask_column)."""
        a = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        v = a.sqrt() * noise - (1 - a).sqrt() * x0
        rotary = self.rotary_embeddings(x0.shape[1], x0.shape[3], x0.shape[4])
        v_hat = self.predict_v(transformer, x_t, timesteps, prompt_embeds, rotary, condition)
        if weights is None:
            return (v_hat - v).pow(2).mean(dim=(1, 2, 3, 4))
        # [B, F, 1, h, w], CogVideoX 1.5's padded frames in front weighted as the first
        weights = self.pad_frames(weights.to(v.device).float().permute(0, 2, 1, 3, 4))
        return masked_mean((v_hat - v).pow(2), weights, (1, 2, 3, 4))

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch, every draw from the sample's own generator.

        Latent sample, timestep and noise come from each sample's own generator, keyed by (seed,
        step, position in the global batch)."""
        x0 = self.clean_latents(
            batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators
        )
        timesteps = torch.stack(
            [torch.randint(0, len(self.alphas_cumprod), (), generator=g) for g in generators]
        )
        noise = to_device(
            torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)]), x0.device
        )
        condition = self.batch_condition(batch, x0.shape[1], generators)
        return self.loss(
            transformer,
            x0,
            batch["prompt_embeds"].to(self.device),
            to_device(timesteps, x0.device),
            noise,
            condition,
            batch.get("loss_mask"),
        )

    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The loss of one cached clip (its posterior mean) at each of `timesteps`.

        Every timestep gets the same noise."""
        x0 = self.clean_latents(
            batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), None
        )
        condition = self.batch_condition(batch, x0.shape[1], None)
        noise = torch.randn(x0.shape[1:], generator=generator).to(x0.device)
        n = len(timesteps)
        return self.loss(
            transformer,
            x0.expand(n, -1, -1, -1, -1),
            batch["prompt_embeds"].to(self.device).expand(n, -1, -1),
            torch.tensor(timesteps, device=x0.device),
            noise.expand(n, *noise.shape),
            None if condition is None else condition.expand(n, -1, -1, -1, -1),
            None if "loss_mask" not in batch else batch["loss_mask"].expand(n, -1, -1, -1, -1),
        )

    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    def split_sequence(self, transformer, split: SequenceSplit) -> None:
        """Split the video tokens across the sequence-parallel group; the text tokens stay whole.

        Sequence parallelism: the video tokens and their rotary embeddings split at the first block,
        the text tokens replicated; joint attention through FusedQKVAttention's all-to-all."""

        def per_token_inputs(arguments: dict) -> dict[str, int]:
            return {} if arguments.get("image_rotary_emb") is None else {"image_rotary_emb": 0}

        self.sequence = split
        split_blocks(self.blocks(transformer), split, per_token_inputs)
        for layer in transformer.modules():
            if isinstance(layer, Attention):
                layer.set_processor(FusedQKVAttention(split))

    # Sampling: CogVideoXPipeline's (CogVideoXImageToVideoPipeline's) loop, run by
    # validate.sample_latents.
    def sampler(self, name: str):
        """The validation sampler, by validation.scheduler.

        "" is the folder's own (5b: DPM, 2b: DDIM), or CogVideoX's "dpm" or "ddim"."""
        folder = self.scheduler.load_config(self.path, subfolder="scheduler")["_class_name"]
        return SAMPLERS[name or ("ddim" if folder == "CogVideoXDDIMScheduler" else "dpm")].from_config(
            self.scheduler.config
        )

    def sampling_start(self, scheduler, steps: int, resolution, generator: torch.Generator, image=None):
        """Draw one clip's sampling state: initial latents and the image's condition.

        The sampling state of one clip: initial latents [1, F', C, h, w] (fp32) and, image-to-video,
        the image's condition, drawn from `generator` in the pipeline's order (the image's posterior
        sample first). 1.5: noise for extra leading frames up to a multiple of patch_size_t, dropped
        at the end."""
        frames, height, width = resolution
        latent_frames = (frames - 1) // self.temporal_ratio + 1
        extra = self.extra_frames(latent_frames)
        shape = (
            1,
            latent_frames + extra,
            self.vae_config["latent_channels"],
            height // self.spatial_ratio,
            width // self.spatial_ratio,
        )
        condition = (
            None if image is None else self._sampling_condition(image, resolution, shape[1], generator)
        )
        latents = torch.randn(shape, generator=generator).to(self.device) * scheduler.init_noise_sigma
        scheduler.set_timesteps(steps, device=self.device)
        return SimpleNamespace(
            scheduler=scheduler,
            generator=generator,
            steps=steps,
            latents=latents,
            condition=condition,
            extra=extra,
            previous_x0=None,
            rotary=self.rotary_embeddings(shape[1], shape[3], shape[4]),
        )

    @torch.no_grad()
    def _sampling_condition(self, image, resolution, frames: int, generator: torch.Generator):
        """Turn a validation image into its condition [1, frames, C, h, w], as the pipeline does.

        A validation image (PIL) -> its condition [1, frames, C, h, w], as the pipeline: its own
        resize and normalisation, a sample of the VAE posterior from the clip's generator."""
        processor = VideoProcessor(vae_scale_factor=self.spatial_ratio)
        pixels = processor.preprocess(image, height=resolution[1], width=resolution[2])
        posterior = self._load_vae().encode(pixels.to(self.device, self.dtype).unsqueeze(2)).latent_dist
        return self.image_condition(posterior.sample(generator).to(self.dtype), frames)

    def denoise(
        self, models: dict, state, t: torch.Tensor, embeds: torch.Tensor, guided: bool
    ) -> torch.Tensor:
        """The v prediction at step t.

        With guidance, of the latents twice (uncond, cond) in one forward."""
        x = state.scheduler.scale_model_input(torch.cat([state.latents] * 2) if guided else state.latents, t)
        condition = state.condition
        if condition is not None and guided:
            condition = torch.cat([condition] * 2)
        return self.predict_v(models["transformer"], x, t.expand(x.shape[0]), embeds, state.rotary, condition)

    def guidance_scale(self, cfg, state, t: torch.Tensor) -> float:
        scale = cfg.guidance_scale
        # the pipeline's use_dynamic_cfg, which uses the timestep t, not the step index
        if cfg.use_dynamic_cfg:
            return 1 + scale * (1 - math.cos(math.pi * ((state.steps - t.item()) / state.steps) ** 5.0)) / 2
        return scale

    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        scheduler = state.scheduler
        if isinstance(scheduler, CogVideoXDPMScheduler):
            t_back = scheduler.timesteps[i - 1] if i > 0 else None
            state.latents, state.previous_x0 = scheduler.step(
                prediction,
                state.previous_x0,
                t,
                t_back,
                state.latents,
                generator=state.generator,
                return_dict=False,
            )
        else:
            state.latents = scheduler.step(
                prediction, t, state.latents, generator=state.generator, return_dict=False
            )[0]

    def sampled(self, state) -> torch.Tensor:
        return state.latents[:, state.extra :]

    @contextlib.contextmanager
    def sampling_attention(self, model: torch.nn.Module):
        """FusedQKVAttention on every attention layer while sampling; the original processors after."""
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        originals = [m.processor for m in layers]
        for layer in layers:
            layer.set_processor(FusedQKVAttention(self.sequence))
        try:
            yield
        finally:
            for layer, processor in zip(layers, originals):
                layer.set_processor(processor)


class FusedQKVAttention:
    """CogVideoX attention with Q, K and V from one matmul, LoRA unmerged beside it.

    diffusers' CogVideoXAttnProcessor2_0 with Q, K and V from one matmul over the concatenated base
    weights, then F.scaled_dot_product_attention (FlashAttention/cuDNN on GPU). LoRA runs unmerged
    beside it, exactly as in training: merging it into a bf16 copy of the weights would round away
    the small deltas of early training (diffusers' own fuse_qkv_projections drops LoRA altogether).
    The fused weight is built on every call, inside the block's forward: under FSDP that is when the
    block's parameters are gathered, and it is freed with them, so no rank holds a second copy of
    the model.

    With sequence parallelism (`split`), this rank holds a slice of the video tokens and every text
    token: Q, K and V go through one all-to-all to the whole sequence with 1/sp of the heads (the
    text tokens' own slice of heads taken locally), and the output back; the text tokens' output
    heads are gathered, so every rank carries on with the whole text."""

    def __init__(self, split: SequenceSplit | None = None):
        self.split = split

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        if attention_mask is not None:
            raise ValueError(
                "FusedQKVAttention serves CogVideoX's joint attention, which takes no attention mask"
            )
        text_length = encoder_hidden_states.size(1)
        tokens = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, length, _ = tokens.shape
        projections = (attn.to_q, attn.to_k, attn.to_v)
        weight = torch.cat([memory.weight(p) for p in projections])  # fp8 storage: upcast
        bias = None if attn.to_q.bias is None else torch.cat([p.bias for p in projections])
        outputs = F.linear(tokens, weight, bias).chunk(3, dim=-1)
        outputs = [
            p.add_delta(out, tokens) if isinstance(p, lora.LoRALinear) else out
            for p, out in zip(projections, outputs)
        ]
        qkv = torch.cat(outputs, dim=-1).view(batch, length, 3, attn.heads, -1).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:  # video tokens only, as the diffusers processor does
            query = torch.cat(
                [query[:, :, :text_length], apply_rotary_emb(query[:, :, text_length:], image_rotary_emb)], 2
            )
            if not attn.is_cross_attention:
                key = torch.cat(
                    [key[:, :, :text_length], apply_rotary_emb(key[:, :, text_length:], image_rotary_emb)], 2
                )
        split = self.split
        if split is not None:  # [3, B, H, tokens, D]: one all-to-all for Q, K and V
            qkv = stack_qkv(query, key, value)
            text, video = qkv[..., :text_length, :], qkv[..., text_length:, :]
            qkv = torch.cat([split.heads(text, 2), split.seq_to_heads(video, 3, 2)], 3)
            query, key, value = qkv.unbind(0)
        out = F.scaled_dot_product_attention(query, key, value)
        if split is not None:
            text, video = out[:, :, :text_length], out[:, :, text_length:]
            out = torch.cat([split.gather_heads(text, 1), split.heads_to_seq(video, 2, 1)], 2)
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(batch, length, -1)))
        return out[:, text_length:], out[:, :text_length]
