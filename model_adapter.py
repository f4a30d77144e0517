"""One adapter per model family: load components from a local diffusers folder, encode video and
text, noise and loss, the denoiser call used by sampling, and the transformer blocks.

CogVideoX facts (../shared/reference/cogvideox.md): v-prediction with the model's own DPM scheduler,
t uniform in [0, 1000), the loss mean((v_hat - v)^2) computed in fp32, rotary embeddings from the
pipeline's own function so that training and inference agree.
"""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel
from transformers import AutoTokenizer, T5EncoderModel

from config import ConfigError, ModelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
log = logging.getLogger("vidtrain")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


class CogVideoXAdapter:
    """CogVideoX text-to-video, 1.0 and 1.5. The VAE and T5 load lazily: training from a complete
    cache never constructs them."""

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
        self.device = device
        self.dtype = DTYPES[cfg.dtype]
        self.transformer_config = _read_json(self.path / "transformer" / "config.json")
        self.vae_config = _read_json(self.path / "vae" / "config.json")
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
    def size_multiple(self) -> int:
        return self.spatial_ratio * self.transformer_config["patch_size"]

    @property
    def text_length(self) -> int:
        return self.transformer_config["max_text_seq_length"]

    def identity(self) -> dict:
        """What makes cached latents and checkpoints belong to this model: configs and weight file stats."""
        files = sorted(p for p in self.path.rglob("*") if p.is_file())
        return {
            "family": "cogvideox",
            "path": str(self.path.resolve()),
            "files": {str(p.relative_to(self.path)): [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        }

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

    def _encoders(self):
        # The VAE loads on its own too: decoding validation clips needs no T5.
        if self._text_encoder is None:
            log.info("loading text encoder from %s", self.path)
            self._text_encoder = T5EncoderModel.from_pretrained(
                self.path, subfolder="text_encoder", dtype=self.dtype
            )
            self._text_encoder.to(self.device).requires_grad_(False).eval()
            self._tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer")
        return self._load_vae(), self._text_encoder, self._tokenizer

    def release_text_encoder(self) -> None:
        self._text_encoder = self._tokenizer = None

    def park_vae(self) -> None:
        """Move the VAE to the CPU between validations: the next decode moves it back, not reloads it."""
        if self._vae is not None:
            self._vae.to("cpu")

    def release_encoders(self) -> None:
        self._vae = self._text_encoder = self._tokenizer = None

    # Encoding.
    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (unscaled)."""
        vae, _, _ = self._encoders()
        pixels = video.to(self.device).permute(0, 4, 1, 2, 3).to(self.dtype) / 127.5 - 1.0
        posterior = vae.encode(pixels).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """T5 embeddings [B, L, D] exactly as the pipeline computes them, L from the transformer config."""
        _, text_encoder, tokenizer = self._encoders()
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
        # whole, as with tiny VAEs; the real models' default tiles do, and those decode tiled.
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

    def pad_frames(self, latents: torch.Tensor) -> torch.Tensor:
        """CogVideoX 1.5: repeat the first latent frame in front up to a multiple of patch_size_t."""
        patch_t = self.transformer_config.get("patch_size_t")
        if not patch_t or latents.shape[1] % patch_t == 0:
            return latents
        extra = patch_t - latents.shape[1] % patch_t
        return torch.cat([latents[:, :1].expand(-1, extra, -1, -1, -1), latents], dim=1)

    def predict_v(self, transformer, x_t: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor, rotary):
        """The denoiser call [B, F, C, H, W] -> v prediction in fp32; used by training and sampling."""
        ofs = None
        if self.transformer_config.get("ofs_embed_dim"):
            ofs = x_t.new_full((x_t.shape[0],), 2.0)
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

    def clean_latents(self, mean: torch.Tensor, logvar: torch.Tensor, generators: list[torch.Generator] | None):
        """[B, C, F', h, w] posterior -> scaled latents [B, F', C, h, w] in fp32; sampled when generators
        are given, the posterior mean otherwise (held-out loss)."""
        mean, logvar = mean.float(), logvar.float()
        if generators is not None:
            eps = torch.stack([torch.randn(m.shape, generator=g) for m, g in zip(mean, generators)]).to(mean.device)
            mean = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps
        scaled = mean * self.vae_config["scaling_factor"]
        return self.pad_frames(scaled.permute(0, 2, 1, 3, 4))

    def loss(self, transformer, x0: torch.Tensor, prompt_embeds, timesteps: torch.Tensor, noise: torch.Tensor):
        """Per-sample v-prediction loss in fp32. x0 and noise [B, F, C, h, w]; timesteps [B] ints."""
        a = self.alphas_cumprod.to(x0.device)[timesteps].view(-1, 1, 1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        v = a.sqrt() * noise - (1 - a).sqrt() * x0
        rotary = self.rotary_embeddings(x0.shape[1], x0.shape[3], x0.shape[4])
        v_hat = self.predict_v(transformer, x_t, timesteps, prompt_embeds, rotary)
        return (v_hat - v).pow(2).mean(dim=(1, 2, 3, 4))

    def draw_noise(self, x0: torch.Tensor, generators: list[torch.Generator]):
        """Timestep and noise per sample, each from its own keyed generator."""
        timesteps = torch.stack([torch.randint(0, len(self.alphas_cumprod), (), generator=g) for g in generators])
        noise = torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)])
        return timesteps.to(x0.device), noise.to(x0.device)

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch; latent sample, timestep and noise come from each sample's
        own generator, keyed by (seed, step, position in the global batch)."""
        x0 = self.clean_latents(batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators)
        timesteps, noise = self.draw_noise(x0, generators)
        return self.loss(transformer, x0, batch["prompt_embeds"].to(self.device), timesteps, noise)

    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        """The FSDP units and activation-checkpointing units."""
        return list(transformer.transformer_blocks)


def load_adapter(cfg: ModelConfig, device: torch.device) -> CogVideoXAdapter:
    return CogVideoXAdapter(cfg, device)
