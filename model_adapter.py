"""What every model family's adapter provides, and the machinery they share.

An adapter knows one family's diffusers classes (cogvideox.py, wan.py; nothing else imports them):
loading the components from a local diffusers folder (the VAE and text encoder lazily: training from
a complete cache never builds them), encoding video, images and text for the cache, the noise and
the loss, the pieces of the sampling loop (validate.py runs the loop), the transformer blocks (FSDP
and checkpointing units), the exported LoRA's other layouts. Every config value comes from the model
classes' resolved configs: the file's values over the class's defaults, since published files predate
keys newer diffusers versions add.
"""

import inspect
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer

from config import ConfigError, ModelConfig, check_resolution

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
log = logging.getLogger("vidtrain")


def resolved_config(model_class, path: Path, subfolder: str) -> dict:
    """The config the class builds from a folder: its config.json over the class's own defaults."""
    defaults = {name: p.default for name, p in inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    saved = model_class.load_config(path, subfolder=subfolder)
    return {**defaults, **{k: v for k, v in saved.items() if not k.startswith("_")}}


def sample_posterior(mean, logvar, generators: list[torch.Generator] | None) -> torch.Tensor:
    """A diagonal Gaussian's sample in fp32 (each row from its own keyed generator), or its mean."""
    mean, logvar = mean.float(), logvar.float()
    if generators is None:
        return mean
    # Drawn on the CPU (keyed generators), copied without blocking: a blocking copy waits for the queued step.
    eps = torch.stack([torch.randn(m.shape, generator=g) for m, g in zip(mean, generators)])
    eps = eps.to(mean.device, non_blocking=True)
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps


class Adapter:
    """The machinery every family shares. A family sets the class attributes and provides, besides:
    frame_multiple, size_multiple, text_length and transformer_config (the shape rules and configs);
    encode_video, encode_image, encode_text and decode_latents (the cache and the clips); train_loss and
    fixed_losses (training and the held-out loss); sampler, sampling_start, denoise, guidance_scale,
    sampling_step, sampled and sampling_attention (validate.py's sampling loop); blocks (the FSDP and
    activation-checkpointing units); split_sequence (sequence parallelism, sequence.py). cogvideox.py and wan.py are the two, and the tests of each are the
    template for a third."""

    FAMILY = ""
    # The model folders whose files shape each kind of cache entry.
    ENCODERS: dict[str, tuple[str, ...]] = {}
    TRANSFORMER = VAE = TEXT_ENCODER = None  # diffusers / transformers classes
    COMFY = False  # whether exports also write ComfyUI's layout (comfy_key, diffusers_key)

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.path = Path(cfg.path)
        if not (self.path / "model_index.json").is_file():
            raise ConfigError(
                f"model.path = {cfg.path} is not a diffusers model folder (no model_index.json): "
                "point it at a local copy, e.g. one written by tools/make_tiny_model.py"
            )
        for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
            if not (self.path / name).is_dir():
                raise ConfigError(f"model.path = {cfg.path} has no {name}/ folder: the model copy is incomplete")
        self.device, self.dtype, self.type, self.expert = device, DTYPES[cfg.dtype], cfg.type, cfg.expert
        self.transformer_folder = "transformer"
        self.sequence = None  # the SequenceSplit under sequence parallelism (split_sequence)
        self._vae = self._text_encoder = self._tokenizer = None

    def check_resolution(self, resolution, key: str) -> None:
        """[frames, height, width] against the model's rules, or a ConfigError naming the key."""
        check_resolution(resolution, self.frame_multiple, self.size_multiple, key)

    # Loading.
    def load_transformer(self, trainable_dtype: torch.dtype | None = None, folder: str = ""):
        """The transformer this run trains (or another expert's folder), in trainable_dtype or model.dtype."""
        transformer = self.TRANSFORMER.from_pretrained(self.path, subfolder=folder or self.transformer_folder,
                                                       dtype=trainable_dtype or self.dtype)
        return transformer.to(self.device)

    def transformer_from_state_dict(self, state: dict[str, torch.Tensor]):
        """A CPU transformer in model.dtype holding a full state dict, for export. Built on the meta device
        and given the tensors themselves, so rank 0 holds the weights once, not twice."""
        with torch.device("meta"):
            transformer = self.TRANSFORMER.from_config(self.transformer_config)
        transformer.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, assign=True)
        return transformer

    def _load_vae(self):
        if self._vae is None:
            log.info("loading VAE from %s", self.path)
            self._vae = self.VAE.from_pretrained(self.path, subfolder="vae", dtype=self.dtype)
            self._vae.requires_grad_(False).eval()
        return self._vae.to(self.device)

    def _text(self):
        if self._text_encoder is None:
            log.info("loading text encoder from %s", self.path)
            self._text_encoder = self.TEXT_ENCODER.from_pretrained(self.path, subfolder="text_encoder",
                                                                   dtype=self.dtype)
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

    def _pixels(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [B, F, H, W, 3] -> [B, 3, F, H, W] in [-1, 1], model.dtype, on the device."""
        return frames.to(self.device).permute(0, 4, 1, 2, 3).to(self.dtype) / 127.5 - 1.0

    def held_out_timesteps(self, timesteps: list[int]) -> list[int]:
        """The held-out loss's timesteps this run's transformer is trained on (all, but for an expert)."""
        return timesteps

    def other_experts(self) -> list[str]:
        """Folders of the transformers that sampling needs besides the trained one (Wan 2.2 A14B)."""
        return []

    def comfy_key(self, module: str) -> str | None:
        """A LoRA module's name in the original checkpoint's layout (ComfyUI's), or None if the family has none."""
        return None

    def diffusers_key(self, original: str) -> str | None:
        """The inverse of comfy_key: an original module name's diffusers name, or None."""
        return None
