"""One adapter per model family: load components from a local diffusers folder, encode video, images
and text, noise and loss, the denoiser call used by sampling, and the transformer blocks.

CogVideoX facts (../shared/reference/cogvideox.md): v-prediction with the model's own DPM scheduler,
t uniform in [0, 1000), the loss mean((v_hat - v)^2) computed in fp32, rotary embeddings from the
pipeline's own function so that training and inference agree. Every config value comes from the
model classes' resolved configs (the file over the class's defaults): the published files predate
keys that newer diffusers adds (`patch_size_t`, `use_rotary_positional_embeddings` on 2b, ...).
"""

import inspect
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, T5EncoderModel

from config import ConfigError, ModelConfig, check_resolution

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
log = logging.getLogger("vidtrain")


def resolved_config(model_class, path: Path, subfolder: str) -> dict:
    """The config the class builds from a folder: its config.json over the class's own defaults."""
    defaults = {name: p.default for name, p in inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    saved = model_class.load_config(path, subfolder=subfolder)
    return {**defaults, **{k: v for k, v in saved.items() if not k.startswith("_")}}


class CogVideoXAdapter:
    """CogVideoX 1.0 and 1.5, text-to-video and image-to-video. The VAE and T5 load lazily: training
    from a complete cache never constructs them."""

    # The model folders whose files shape each kind of cache entry.
    ENCODERS = {"video": ("vae",), "image": ("vae",), "text": ("text_encoder", "tokenizer")}

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.path = Path(cfg.path)
        if not (self.path / "model_index.json").is_file():
            raise ConfigError(
                f"model.path = {cfg.path} is not a diffusers model folder (no model_index.json): "
                "point it at a local copy, e.g. one written by tools/make_tiny_model.py"
            )
        for name in COMPONENTS:
            if not (self.path / name).is_dir():
                raise ConfigError(f"model.path = {cfg.path} has no {name}/ folder: the model copy is incomplete")
        self.device, self.dtype, self.type = device, DTYPES[cfg.dtype], cfg.type
        self.transformer_config = resolved_config(CogVideoXTransformer3DModel, self.path, "transformer")
        self.vae_config = resolved_config(AutoencoderKLCogVideoX, self.path, "vae")
        takes_image = self.transformer_config["in_channels"] == 2 * self.vae_config["latent_channels"]
        if takes_image != (cfg.type == "i2v"):
            kind = "an image-to-video" if takes_image else "a text-to-video"
            raise ConfigError(f"model.type = \"{cfg.type}\", but {cfg.path} is {kind} model (its transformer takes "
                              f"{self.transformer_config['in_channels']} input channels): set model.type = "
                              f"\"{'i2v' if takes_image else 't2v'}\"")
        self.scheduler = CogVideoXDPMScheduler.from_pretrained(self.path, subfolder="scheduler")
        self.alphas_cumprod = self.scheduler.alphas_cumprod.to(torch.float32)
        self._vae = self._text_encoder = self._tokenizer = None

    # Shape rules read from the model's own config.
    @property
    def temporal_ratio(self) -> int:
        return int(self.vae_config["temporal_compression_ratio"])

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    @property
    def frame_multiple(self) -> int:
        # The VAE decodes latents in pairs: 8k+1 frames for a 4x temporal ratio.
        return 2 * self.temporal_ratio

    @property
    def text_length(self) -> int:
        return self.transformer_config["max_text_seq_length"]

    def check_resolution(self, resolution, key: str) -> None:
        """[frames, height, width] against the model's rules, or a ConfigError naming the key."""
        c, ratio = self.transformer_config, self.spatial_ratio
        check_resolution(resolution, self.frame_multiple, ratio * c["patch_size"], key)
        frames, height, width = resolution
        if c["use_learned_positional_embeddings"]:
            native = [c["sample_frames"], c["sample_height"] * ratio, c["sample_width"] * ratio]
            if list(resolution) != native:
                # diffusers refuses another height or width, but silently swaps in other embeddings for
                # another frame count.
                raise ConfigError(f"{key} = {list(resolution)}, but this model's learned positional embeddings "
                                  f"(CogVideoX-5b-I2V) are sized for {native} only: use {native}")
        if c["patch_size_t"] and (height > c["sample_height"] * ratio or width > c["sample_width"] * ratio):
            raise ConfigError(f"{key} = {list(resolution)}, but CogVideoX 1.5's rotary grid covers at most "
                              f"{c['sample_height'] * ratio}x{c['sample_width'] * ratio} (the transformer config's "
                              "sample_height and sample_width): use a smaller height or width")

    # Loading.
    def load_transformer(self, trainable_dtype: torch.dtype | None = None) -> CogVideoXTransformer3DModel:
        transformer = CogVideoXTransformer3DModel.from_pretrained(
            self.path, subfolder="transformer", dtype=trainable_dtype or self.dtype
        )
        return transformer.to(self.device)

    def transformer_from_state_dict(self, state: dict[str, torch.Tensor]) -> CogVideoXTransformer3DModel:
        """A CPU transformer in model.dtype holding a full state dict, for export. Built on the meta device
        and given the tensors themselves, so rank 0 holds the weights once, not twice."""
        with torch.device("meta"):
            transformer = CogVideoXTransformer3DModel.from_config(self.transformer_config)
        transformer.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, assign=True)
        return transformer

    def _load_vae(self) -> AutoencoderKLCogVideoX:
        if self._vae is None:
            log.info("loading VAE from %s", self.path)
            self._vae = AutoencoderKLCogVideoX.from_pretrained(self.path, subfolder="vae", dtype=self.dtype)
            self._vae.requires_grad_(False).eval()
        return self._vae.to(self.device)

    def _text(self):
        if self._text_encoder is None:
            log.info("loading text encoder from %s", self.path)
            self._text_encoder = T5EncoderModel.from_pretrained(self.path, subfolder="text_encoder", dtype=self.dtype)
            self._text_encoder.to(self.device).requires_grad_(False).eval()
            self._tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer")
        return self._text_encoder, self._tokenizer

    def release_text_encoder(self) -> None:
        self._text_encoder = self._tokenizer = None

    def park_vae(self) -> None:
        """Move the VAE to the CPU between validations: the next decode moves it back, not reloads it."""
        if self._vae is not None:
            self._vae.to("cpu")

    def release_encoders(self) -> None:
        self._vae = self._text_encoder = self._tokenizer = None

    # Encoding.
    def _pixels(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [B, F, H, W, 3] -> [B, 3, F, H, W] in [-1, 1], model.dtype, on the device."""
        return frames.to(self.device).permute(0, 4, 1, 2, 3).to(self.dtype) / 127.5 - 1.0

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (unscaled)."""
        posterior = self._load_vae().encode(self._pixels(video)).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def encode_image(self, images: torch.Tensor, generators: list[torch.Generator]):
        """I2V conditioning images, uint8 [B, H, W, 3] -> posterior mean and log-variance [B, C, 1, h, w] of
        the image with CogVideo's pixel-space noise augmentation, sigma = exp(N(-3, 0.5)), drawn from each
        clip's generator keyed by (run.seed, clip): the entry is cached once, and a run's every epoch sees
        the same augmented image (CogVideo draws a new sigma and re-encodes at every step)."""
        pixels = self._pixels(images[:, None]).float()
        for image, generator in zip(pixels, generators):
            sigma = math.exp(-3.0 + 0.5 * torch.randn((), generator=generator).item())
            image += sigma * torch.randn(image.shape, generator=generator).to(image.device)
        posterior = self._load_vae().encode(pixels.to(self.dtype)).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """T5 embeddings [B, L, D] exactly as the pipeline computes them, L from the transformer config."""
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
        """Scaled latents [B, F', C, h, w] -> pixels [B, C, F, H, W] in [-1, 1], as the pipeline's
        decode_latents. One clip at a time, in the VAE's own spatial tiles (which the VAE would use for
        encoding too, so they are switched on only here): memory stays bounded at any resolution."""
        vae = self._load_vae()
        # diffusers stitches tiles into a frame of the wrong size when its tile stride does not come out
        # whole, as with most tiny VAEs; the real models' default tiles do, and those decode tiled.
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
        """Unscaled image latents [B, C, 1, h, w] -> the transformer's conditioning input [B, frames, C, h,
        w], as CogVideoXImageToVideoPipeline.prepare_latents builds it: scaled (divided by the scaling
        factor where the VAE config says invert_scale_latents, as for 1.5-I2V), at latent frame 0,
        zeros after it up to the (padded) latent frame count."""
        image_latents = image_latents.permute(0, 2, 1, 3, 4)
        s = self.vae_config["scaling_factor"]
        image_latents = (1 / s if self.vae_config["invert_scale_latents"] else s) * image_latents
        padding = image_latents.new_zeros(image_latents.shape[0], frames - 1, *image_latents.shape[2:])
        return torch.cat([image_latents, padding], dim=1)

    @torch.no_grad()
    def sampling_image_condition(self, image, resolution, frames: int, generator: torch.Generator):
        """A validation image (PIL) -> its conditioning input [1, frames, C, h, w], drawn from `generator`
        before the initial noise, exactly as the pipeline: its own resize and normalisation, a sample of
        the VAE posterior."""
        processor = VideoProcessor(vae_scale_factor=self.spatial_ratio)
        pixels = processor.preprocess(image, height=resolution[1], width=resolution[2])
        posterior = self._load_vae().encode(pixels.to(self.device, self.dtype).unsqueeze(2)).latent_dist
        return self.image_condition(posterior.sample(generator).to(self.dtype), frames)

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

    def predict_v(self, transformer, x_t: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor, rotary,
                  condition: torch.Tensor | None = None):
        """The denoiser call [B, F, C, H, W] -> v prediction in fp32; used by training and sampling. I2V:
        the image condition follows the noisy latents on channels, as in the pipeline."""
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

    def clean_latents(self, mean: torch.Tensor, logvar: torch.Tensor, generators: list[torch.Generator] | None,
                      scale: bool = True):
        """[B, C, F', h, w] posterior -> latents [B, C, F', h, w] in fp32 (scaled, and the video's padded
        to [B, F', C, h, w] unless scale=False); sampled when generators are given, the mean otherwise."""
        mean, logvar = mean.float(), logvar.float()
        if generators is not None:
            eps = torch.stack([torch.randn(m.shape, generator=g) for m, g in zip(mean, generators)])
            eps = eps.to(mean.device, non_blocking=True)  # a blocking copy would wait for the queued step
            mean = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps
        if not scale:
            return mean
        return self.pad_frames((mean * self.vae_config["scaling_factor"]).permute(0, 2, 1, 3, 4))

    def loss(self, transformer, x0: torch.Tensor, prompt_embeds, timesteps: torch.Tensor, noise: torch.Tensor,
             condition: torch.Tensor | None = None):
        """Per-sample v-prediction loss in fp32. x0 and noise [B, F, C, h, w]; timesteps [B] ints."""
        a = self.alphas_cumprod.to(x0.device, non_blocking=True)[timesteps].view(-1, 1, 1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        v = a.sqrt() * noise - (1 - a).sqrt() * x0
        rotary = self.rotary_embeddings(x0.shape[1], x0.shape[3], x0.shape[4])
        v_hat = self.predict_v(transformer, x_t, timesteps, prompt_embeds, rotary, condition)
        return (v_hat - v).pow(2).mean(dim=(1, 2, 3, 4))

    def draw_noise(self, x0: torch.Tensor, generators: list[torch.Generator]):
        """Timestep and noise per sample, each from its own keyed generator."""
        timesteps = torch.stack([torch.randint(0, len(self.alphas_cumprod), (), generator=g) for g in generators])
        noise = torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)])
        return timesteps.to(x0.device, non_blocking=True), noise.to(x0.device, non_blocking=True)

    def batch_condition(self, batch: dict[str, torch.Tensor], frames: int, generators) -> torch.Tensor | None:
        """I2V: the cached image posterior, sampled (or its mean without generators), as the condition."""
        if self.type != "i2v":
            return None
        latents = self.clean_latents(batch["image_mean"].to(self.device), batch["image_logvar"].to(self.device),
                                     generators, scale=False)
        return self.image_condition(latents, frames)

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch; latent sample, timestep and noise come from each sample's
        own generator, keyed by (seed, step, position in the global batch)."""
        x0 = self.clean_latents(batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators)
        timesteps, noise = self.draw_noise(x0, generators)
        condition = self.batch_condition(batch, x0.shape[1], generators)
        return self.loss(transformer, x0, batch["prompt_embeds"].to(self.device), timesteps, noise, condition)

    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        """The FSDP units and activation-checkpointing units."""
        return list(transformer.transformer_blocks)


def load_adapter(cfg: ModelConfig, device: torch.device) -> CogVideoXAdapter:
    return CogVideoXAdapter(cfg, device)
