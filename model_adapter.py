"""The family contract and its registry: what a model family provides, and model.family -> its adapter.

Adapter declares everything a model family provides. Beside it, what the families share: DTYPES,
the log, to_device, sample_posterior, config_sets (for their check_config), RunSettings (what a run
hands their constructor), the text cache's padding (unpadded, padded_text) and not_a_model_folder,
the message both Adapter.__init__ and the registry give. Last, the registry of families (ADAPTERS),
which checks a family against this contract before it runs.

An adapter knows one family's diffusers classes (families/*.py; nothing else imports them): loading
the components from a local diffusers folder (the VAE and text encoder lazily: training from a
complete cache never builds them; the transformer through weights.py), encoding video,
images, text (and sound) for the cache, the noise and the loss, the pieces of the sampling loop
(validate.py runs the loop), the transformer blocks (FSDP and checkpointing units), the exported
LoRA's other layouts. Every config value comes from the model classes' resolved configs: the file's
values over the class's defaults, since published files predate keys newer diffusers versions add.
"""

import abc
import importlib
import json
import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from transformers import AutoTokenizer

import weights
from config import Config, ConfigError, ModelConfig, check_resolution
from weights import TransformerLoading

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
log = logging.getLogger("vidtrain")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device` that queues behind the running step instead of waiting for
    it: a blocking copy synchronises the stream, and so may a non-blocking one from pageable memory
    (CUDA stages it through a bounce buffer), hence pinned first on a GPU (a CPU-only torch has no
    pinning)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def sample_posterior(mean, logvar, generators: list[torch.Generator] | None) -> torch.Tensor:
    """A diagonal Gaussian's sample in fp32 (each row from its own keyed generator), or its mean."""
    mean, logvar = mean.float(), logvar.float()
    if generators is None:
        return mean
    # Drawn on the CPU (keyed generators), copied without waiting for the queued step.
    eps = to_device(
        torch.stack([torch.randn(m.shape, generator=g) for m, g in zip(mean, generators)]), mean.device
    )
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps


def config_sets(cfg: Config, key: str) -> bool:
    """Whether the config gives `key` ("section.name") another value than its default."""
    section, name = key.split(".")
    values = getattr(cfg, section)
    return getattr(values, name) != getattr(type(values)(), name)


def not_a_model_folder(path: str) -> str:
    """The message for a model.path without a model_index.json."""
    return (
        f"model.path = {path} is not a diffusers model folder (no model_index.json): "
        "point it at a local copy, e.g. one written by tools/make_tiny_model.py"
    )


def masked_mean(error: torch.Tensor, weights: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The mean of `error` over `dims` with each element weighted (weights broadcast over error's
    other axes: a latent-grid mask over the channels): a weighted mean, so a loss mask's area leaves
    the loss's scale as it was; a sample whose weights are all 0 has loss 0."""
    weights = weights.expand_as(error)
    return (error * weights).sum(dims) / weights.sum(dims).clamp_min(torch.finfo(error.dtype).tiny)


def latent_weights(frames: torch.Tensor, temporal: int, spatial: int) -> torch.Tensor:
    """A loss mask's frames, uint8 [F, H, W, 3], on the latent grid: weights [1, F', H / spatial,
    W / spatial] in [0, 1], white 1, black 0.

    As diffusion-pipe (models/base.py:186-187, models/wan/wan.py:347-350): the first channel over
    255, resized to the latent height and width by nearest-exact. Over time, the causal VAE's
    grouping: latent frame 0 is pixel frame 0 alone, latent frame k the mean of pixel frames
    (k - 1) temporal + 1 to k temporal (diffusion-pipe's masks are images, one for every frame)."""
    height, width = frames.shape[1] // spatial, frames.shape[2] // spatial
    weights = frames[..., :1].permute(0, 3, 1, 2).float() / 255
    weights = torch.nn.functional.interpolate(weights, size=(height, width), mode="nearest-exact")[:, 0]
    later = weights[1:].reshape(-1, temporal, height, width).mean(1)
    return torch.cat([weights[:1], later])[None]


# The shared training keys of the draw of s and of the loss's weight (TimestepSampling): the flow
# families list them in their READS.
TIMESTEP_KEYS = (
    "train.timestep_sampling",
    "train.logit_mean",
    "train.logit_std",
    "train.mode_scale",
    "train.loss_weighting",
)
# train.loss_weighting "bell"'s normaliser: the integral of exp(-2 (s - 1/2)^2) - exp(-1/2) over
# [0, 1], so that the weight's mean over s uniform in [0, 1] is 1.
BELL_MEAN = math.sqrt(math.pi / 2) * math.erf(math.sqrt(0.5)) - math.exp(-0.5)


@dataclass(frozen=True)
class TimestepSampling:
    """train.timestep_sampling and train.loss_weighting: a flow family's draw of each sample's noise
    level s from its keyed generator, and the loss's weight at s (docs/training.md)."""

    # "" keeps the family's own draw (the family calls draw only otherwise)
    sampling: str = ""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    weighting: str = "none"

    def quantile(self, v: torch.Tensor) -> torch.Tensor:
        """The draw's quantile function: s at probability v in [0, 1] (increasing in v), so that one
        uniform number per sample gives the distribution (diffusers' training_utils.py:382-389,
        compute_density_for_timestep_sampling, gives the same distributions from SD3's formulas)."""
        if self.sampling == "uniform":
            return v
        if self.sampling in ("logit_normal", "sigmoid"):
            mean = self.logit_mean if self.sampling == "logit_normal" else 0.0
            return torch.sigmoid(mean + self.logit_std * math.sqrt(2) * torch.erfinv(2 * v - 1))
        # "mode": SD3's f(u) = 1 - u - scale (cos^2(pi u / 2) - 1 + u), decreasing in u, at u = 1 - v
        u = 1 - v
        return 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)

    def draw(self, generators: list[torch.Generator], low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        """s per sample [B] in [low, high] (a Wan 2.2 expert's share), one uniform number from each
        sample's generator: the draw restricted to that range, by its quantiles."""
        ends = [self._probability(s) for s in (low, high)]
        v = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
        return self.quantile(ends[0] + (ends[1] - ends[0]) * v).float()

    def _probability(self, s: float) -> float:
        """The v whose quantile is s, by bisection (the quantile function increases)."""
        if s in (0.0, 1.0):
            return s
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (
                (middle, high)
                if self.quantile(torch.tensor(middle, dtype=torch.float64)) < s
                else (low, middle)
            )
        return (low + high) / 2

    def weight(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The loss's weight at each s: "bell", DiffSynth-Studio's (diffsynth/diffusion/flow_match.py,
        set_training_weight, over its 1000 training timesteps 1000 s; normalised here over s in [0,
        1] instead of its shifted schedule: a constant factor), or "cosmap", SD3's (diffusers'
        training_utils.py:403-405)."""
        if self.weighting == "bell":
            return (torch.exp(-2 * (sigmas - 0.5) ** 2) - math.exp(-0.5)) / BELL_MEAN
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))


@dataclass(frozen=True)
class RunSettings:
    """What a run sets on its family's adapter, handed to the family's constructor (load_adapter).

    The defaults serve whatever builds an adapter without a run (sampling tools, benchmarks, tests).
    """

    # train.flow_shift: flow matching's training timestep shift; 0 keeps the scheduler's.
    flow_shift: float = 0.0
    # train.audio_loss_weight: with sound, the loss is the video loss plus this times the audio's.
    audio_loss_weight: float = 1.0
    # data.audio: a family with sound trains each clip's soundtrack (batches may differ in sound).
    sound: bool = False
    # data.target_fps: every clip's frame rate, where positions count seconds; 0: the family's.
    frame_rate: float = 0.0
    # train.first_frame_conditioning_p: a sample's chance of a clean first frame (-1: the type's).
    first_frame_p: float = -1.0
    # train.timestep_sampling and its parameters, train.loss_weighting (the flow families').
    timesteps: TimestepSampling = TimestepSampling()
    # validation.keyframe_marker: sampling marks the first latent frame (LTX-2.5's keyframe marker).
    keyframe_marker: bool = False
    # train.vace_drop_references_p, vace_frame_reference_p, vace_inpaint_p: Wan VACE's condition
    # randomisation.
    vace_condition: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # run.seed: keys a family's draws at cache time (Wan VACE's inpainting masks and reference
    # frames).
    seed: int = 0

    @classmethod
    def of(cls, cfg: Config) -> "RunSettings":
        """The settings a run's config gives."""
        t, data = cfg.train, cfg.data
        timesteps = TimestepSampling(
            t.timestep_sampling, t.logit_mean, t.logit_std, t.mode_scale, t.loss_weighting
        )
        return cls(
            t.flow_shift,
            t.audio_loss_weight,
            data.audio,
            data.target_fps,
            t.first_frame_conditioning_p,
            timesteps,
            cfg.validation.keyframe_marker,
            (t.vace_drop_references_p, t.vace_frame_reference_p, t.vace_inpaint_p),
            cfg.run.seed,
        )


class Adapter(TransformerLoading, abc.ABC):
    """One model family: its diffusers classes, read through the shared machinery below.

    The contract a family fills comes first: its class attributes, the attributes its __init__ sets, the
    methods it must provide (abstract: load_adapter names any a family lacks) and the optional hooks
    with their default behaviour. A family with sound (ENCODERS has "audio") provides SOUND too; an
    image-to-video one with image entries (ENCODERS has "image"), IMAGE; one whose SINGLE_FILE_KEY is
    set, SINGLE_FILES. families/cogvideox.py, families/wan.py and families/ltx2.py are the three;
    the tests of each are the template for a fourth (docs/adding-a-family.md)."""

    FAMILY = ""  # model.family's value, and the registry's key (model_adapter.ADAPTERS)
    # The config keys only this family accepts, each with the message that a run of another family
    # setting it (to anything but the default) stops with; {key} is the key, {family} that run's
    # family. model_adapter.check_config refuses them there, before any model file is read.
    OWN_KEYS: dict[str, str] = {}
    # The shared training keys (config.py's, handed over in RunSettings) this family reads, such as
    # train.flow_shift for a flow-matching family whose loss takes it. Several families may read one;
    # a run of a family that does not list a key and sets it stops, naming the families that read it.
    READS: tuple[str, ...] = ()
    # The model folders whose files shape each kind of cache entry.
    ENCODERS: dict[str, tuple[str, ...]] = {}
    TRANSFORMER = VAE = TEXT_ENCODER = None  # diffusers / transformers classes
    # the VAE's own precision, where the family's reference keeps one
    VAE_DTYPE: torch.dtype | None = None
    TYPES = ("t2v", "i2v")  # the model.type values the family trains
    COMFY = False  # whether exports also write ComfyUI's layout (comfy_key, diffusers_key)
    # A key every single file of the family holds (model.transformer_file; single_file_key and
    # diffusers_names map the names); "" for a family whose single files vidtrain does not read.
    SINGLE_FILE_KEY = ""
    # Diffusers names whose two halves (dim 0) the family's single files store the other way round
    # (HunyuanVideo 1.5's norm_out: the makers' shift, scale; diffusers' scale, shift).
    SWAPPED_HALVES: tuple[str, ...] = ()
    # Other folders of the model whose weights the family's single files carry beside the
    # transformer's (LTX-2's connectors/), named by single_file_part_key; reading skips them
    # (single_file_extra), tools/to_single_file.py writes them.
    SINGLE_FILE_PARTS: tuple[str, ...] = ()
    # whether that file carries an .alpha per module (else alpha / rank is baked into lora_B)
    COMFY_ALPHA = True
    # Parts of the loss logged beside it (train/<part>, val/<part>): a family with several streams
    # (LTX-2's video and audio) names them, and its train_loss and fixed_losses leave `losses`,
    # [parts, 2]: each part's sum over the samples that have it, and their count (a clip without
    # sound has no audio loss to average in).
    LOSS_PARTS: tuple[str, ...] = ()
    # The published checkpoints' folders without their weights, by name (bench/published.py's --arch
    # builds full-size models from them on fake tensors): each folder's config ("model_index.json":
    # the pipeline's; "scheduler": its scheduler_config.json), and "<folder>.weights": the tensors
    # the adapter reads from a folder's weights (latent statistics) by shape, written as ones.
    PUBLISHED: dict[str, dict[str, dict]] = {}
    # Whether a step may leave trainable weights without a gradient (LTX-2's audio stream in a batch
    # without sound): DDP then looks for them every step instead of assuming one graph for the run.
    GRAPH_VARIES = False
    # with sound: the audio VAE's precision, as model.dtype names it (the audio entries')
    AUDIO_DTYPE = ""

    # Set by the family's __init__ (load_adapter names any missing): the transformer's resolved
    # config (the folder's config.json over the class's defaults); with LOSS_PARTS, `losses`; with
    # sound, `sound_rate` (the vocoder's samples per second) and `audio_loss_weight`
    # (RunSettings.audio_loss_weight).
    transformer_config: dict
    losses: torch.Tensor
    sound_rate: int
    audio_loss_weight: float
    # Read from RunSettings by the families that use them: `shift` (flow_shift, flow matching) and
    # `frame_rate` (positions counted in seconds); set for every family, read by the flow families
    # (their READS: TIMESTEP_KEYS), `timestep_sampling` (train.timestep_sampling, train.loss_weighting).
    shift: float
    frame_rate: float
    timestep_sampling: TimestepSampling
    SOUND = (
        "AUDIO_DTYPE",
        "audio_sample_rate",
        "audio_channels",
        "encode_audio",
        "sampled_audio",
        "decode_audio",
    )
    SINGLE_FILES = ("single_file_key", "diffusers_names")
    # what an image-to-video family that caches an image entry per clip (ENCODERS has "image")
    # provides; LTX-2 conditions on the clip's own first latent frame and caches none
    IMAGE = ("encode_image",)

    # Shape rules. The VAE's by default from its config's keys (vae_config, which __init__ sets), as
    # diffusers' video VAEs name them; a VAE without them (CogVideoX's, Wan's) overrides these.
    @property
    def temporal_ratio(self) -> int:
        """The VAE's temporal compression: latent frame k holds frames from k x ratio on."""
        return self.vae_config["temporal_compression_ratio"]

    @property
    def spatial_ratio(self) -> int:
        """The VAE's spatial compression (a loss mask's downsampling, a reference's size rule)."""
        return self.vae_config["spatial_compression_ratio"]

    @property
    def latent_channels(self) -> int:
        """The VAE latent's channels (bench/bench_memory.py builds its batches from them)."""
        return self.vae_config["latent_channels"]

    @property
    @abc.abstractmethod
    def frame_multiple(self) -> int:
        """Frames are k x frame_multiple + 1 (the VAE's temporal compression, the patching's)."""

    @property
    @abc.abstractmethod
    def size_multiple(self) -> int:
        """Height and width are multiples of it (the VAE's spatial compression times the patch
        size)."""

    @property
    @abc.abstractmethod
    def text_length(self) -> int | dict[str, int]:
        """The text embedding's length in tokens, as the pipeline pads prompts to it; with several
        text encoders, each named embedding's (as encode_text names them)."""

    @property
    @abc.abstractmethod
    def text_width(self) -> int | dict[str, int]:
        """The cached text embedding's features per token (one per named embedding, as text_length):
        bench/bench_memory.py builds its batches from it."""

    @property
    @abc.abstractmethod
    def published_fps(self) -> int:
        """The frame rate the model was released at (validation.gen_fps = 0)."""

    # Encoding, for the cache and the clips.
    @abc.abstractmethod
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> the VAE posterior's mean and log-variance."""

    def encode_image(self, images: torch.Tensor, generators, frames: int) -> dict:
        """Image-to-video (IMAGE, required once TYPES has "i2v" and ENCODERS has "image"): uint8 [B,
        H, W, 3] -> the tensors of the clip's image entry."""

    def control_key(self) -> dict:
        """What the control entries' cache key holds besides the clip's and the control file's (a
        family's setting that changes the entry); {} by default."""
        return {}

    def text_key(self) -> dict:
        """What the text entries' cache key holds besides the prompt's and the text encoder's files
        (a family's tokenization that changed, so entries made before are not reused); {} by
        default."""
        return {}

    def lora_metadata(self) -> dict[str, str]:
        """Strings the exported LoRA files carry in their safetensors metadata for the tools that
        load them (a family's setting they need); {} by default."""
        return {}

    def encode_control(self, video: torch.Tensor) -> dict[str, torch.Tensor]:
        """Control frames uint8 [B, F, H, W, 3] -> the tensors of each clip's control entry (the VAE
        posterior)."""
        mean, logvar = self.encode_video(video)
        return {"control_latent_mean": mean, "control_latent_logvar": logvar}

    @abc.abstractmethod
    def encode_text(self, prompts: list[str]) -> torch.Tensor | dict[str, torch.Tensor]:
        """Embeddings [B, L, D] as the pipeline computes them, padding rows zero; with several text
        encoders, a dict of them by name ([B, L_name, D_name] each).

        The cache stores each prompt's rows without the padding and gives them back padded to
        text_length: one encoder's as batch["prompt_embeds"], several encoders' under their names,
        each with its mask (name_mask [B, L_name], true on the prompt's rows: padded_text).
        Validation hands the family's denoise encode_text's own output, in the same form."""

    @abc.abstractmethod
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, F, H, W] in [-1, 1], as the pipeline decodes them."""

    # The loss.
    @abc.abstractmethod
    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample fp32 losses of a cached batch, every draw from the samples' keyed generators."""

    @abc.abstractmethod
    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The held-out loss of one clip at each of the fixed timesteps."""

    # Sampling: the pieces of the pipeline's loop that validate.sample_latents runs.
    @abc.abstractmethod
    def sampler(self, name: str):
        """A fresh scheduler for validation.sampler's `name`."""

    @abc.abstractmethod
    def sampling_start(self, scheduler, steps: int, resolution, generator: torch.Generator, image=None):
        """The loop's state: the timesteps, the first noise (and an I2V clip's condition)."""

    @abc.abstractmethod
    def denoise(self, models: dict, state, t: torch.Tensor, embeds: torch.Tensor, guided: bool):
        """The transformer's prediction at t, the (uncond, cond) pair side by side when guided."""

    @abc.abstractmethod
    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        """The scheduler's step from the guided prediction, in place on `state`."""

    @abc.abstractmethod
    def sampled(self, state) -> torch.Tensor:
        """The finished loop's video latents, ready for decode_latents."""

    @abc.abstractmethod
    def sampling_attention(self, model: torch.nn.Module):
        """A context in which `model` attends as the pipeline does while sampling."""

    def prepare_transformer(self, transformer: torch.nn.Module) -> None:
        """The family's change to the transformer as diffusers builds it, made wherever it is built
        (training, export, render, the benches) before its weights are read: none by default;
        HunyuanVideo 1.5's attention processors."""

    # Parallelism.
    @staticmethod
    @abc.abstractmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        """The transformer's blocks: the FSDP, activation-checkpointing and offload units."""

    @property
    def block_count(self) -> int:
        """len(blocks(transformer)), from the config (parallel.offload_blocks is checked against it
        before the model is built)."""
        return self.transformer_config["num_layers"]

    @property
    def sequence_heads(self) -> list[int]:
        """Every head count parallel.sp_size must divide, checked by model.setup_adapter before the
        cache pass: the transformer's num_attention_heads by default. A family that cannot split
        its sequence at all refuses parallel.sp_size > 1 in its check_config."""
        return [self.transformer_config["num_attention_heads"]]

    @abc.abstractmethod
    def split_sequence(self, transformer, split) -> None:
        """Install sequence parallelism (a parallel.SequenceSplit) in attention; keep it as
        self.sequence."""

    # Single files (SINGLE_FILES, required once SINGLE_FILE_KEY is set).
    @staticmethod
    def single_file_key(key: str) -> str | None:
        """A diffusers state-dict key's name in the family's single files (a fused tensor's name for
        each of its parts), or None where they have none."""

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str | list[str]]:
        """A single file's keys -> their diffusers names; a list where one tensor of the file holds
        several of diffusers' stacked along dim 0 in equal parts, in order (a fused qkv)."""

    # Sound (SOUND, required once ENCODERS has "audio").
    @property
    def audio_sample_rate(self) -> int:
        """The rate the audio VAE's waveforms are read at (cache.py's audio entries)."""

    @property
    def audio_channels(self) -> int:
        """The audio VAE's channel count (mono or stereo)."""

    def encode_audio(self, waveforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Waveforms -> the audio VAE posterior's mean and log-variance."""

    def sampled_audio(self, state) -> torch.Tensor:
        """The finished loop's audio latents, ready for decode_audio."""

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Audio latents -> waveforms at sound_rate."""

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        self.path = Path(cfg.path)
        if not (self.path / "model_index.json").is_file():
            raise ConfigError(not_a_model_folder(cfg.path))
        for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
            if not (self.path / name).is_dir():
                raise ConfigError(
                    f"model.path = {cfg.path} has no {name}/ folder: the model copy is incomplete"
                )
        if cfg.type == "ic" and "ic" not in self.TYPES:
            raise ConfigError(
                f'model.type = "ic" trains a model in context with a control clip, which vidtrain does for '
                f'LTX-2 (IC-LoRA), not for model.family = "{self.FAMILY}": set model.type = "t2v" or "i2v"'
            )
        if cfg.type not in self.TYPES:
            types = ", ".join(f'"{t}"' for t in self.TYPES)
            raise ConfigError(
                f'model.type = "{cfg.type}" is not a type of {self.FAMILY} models: set one of {types}'
            )
        self.device, self.dtype, self.type, self.expert = device, DTYPES[cfg.dtype], cfg.type, cfg.expert
        self.storage_dtype = cfg.storage_dtype
        self.vae_dtype = self.VAE_DTYPE or self.dtype
        self.transformer_folder = "transformer"
        # model.transformer_file's reader (weights.SingleFile), set by load_adapter
        self.single_file = None
        # Whether the model also conditions on each clip's last frame (first-last-frame, Wan FLF2V):
        # the cache and validation then need a last image per clip and per prompt.
        self.first_last = False
        # Whether the model reads a control video, its mask and reference images through context
        # blocks (Wan VACE): the cache and validation then encode them.
        self.vace = False
        # Whether the model follows a control video per clip (data.control_column;
        # validation.control_videos): the cache then holds each clip's control entry
        # (encode_control), its batches control_* tensors.
        self.takes_control = False
        self.sequence = None  # the SequenceSplit under sequence parallelism (split_sequence)
        # data.audio on a family with sound: the batches may differ in sound.
        self.trains_sound = run.sound and "audio" in self.ENCODERS
        # train.timestep_sampling and train.loss_weighting: the flow families' (their READS)
        self.timestep_sampling = run.timesteps
        self._vae = self._text_encoder = self._tokenizer = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """The config against this family's rules across keys, before any model file is read.

        None by default: model_adapter.check_config runs it once a key only another family accepts
        (its OWN_KEYS) has been refused with that family's message. A family adds its own rules
        (calling this first).
        """

    def check_resolution(self, resolution, key: str) -> None:
        """[frames, height, width] against the model's rules, or a ConfigError naming the key."""
        check_resolution(resolution, self.frame_multiple, self.size_multiple, key)

    def _load_vae(self):
        if self._vae is None:
            log.info("loading VAE from %s", self.path)
            self._vae = self.VAE.from_pretrained(self.path, subfolder="vae", dtype=self.vae_dtype)
            self._vae.requires_grad_(False).eval()
        return self._vae.to(self.device)

    def _text(self):
        if self._text_encoder is None:
            log.info("loading text encoder from %s", self.path)
            self._text_encoder = self.TEXT_ENCODER.from_pretrained(
                self.path, subfolder="text_encoder", dtype=self.dtype
            )
            self._text_encoder.to(self.device).requires_grad_(False).eval()
            self._tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer")
        return self._text_encoder, self._tokenizer

    def release_text_encoder(self) -> None:
        """Its memory back to the device (T5-XXL's 8.9 GiB, UMT5-XXL's 10.6 GiB in bf16), not to
        PyTorch's cache."""
        self._text_encoder = self._tokenizer = None
        torch.cuda.empty_cache()  # a no-op without CUDA

    def park_vae(self) -> None:
        """Move the VAE to the CPU between validations: the next decode moves it back, not reloads
        it."""
        if self._vae is not None:
            self._vae.to("cpu")

    def release_encoders(self) -> None:
        """After the cache pass: the encoders' memory goes back to the device, not to PyTorch's
        cache (T5-XXL's 9.5 GB would stay reserved otherwise, where training cannot reach them under
        fragmentation)."""
        self._vae = self._text_encoder = self._tokenizer = None
        torch.cuda.empty_cache()  # a no-op without CUDA

    def _pixels(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [B, F, H, W, 3] -> [B, 3, F, H, W] in [-1, 1], in the VAE's dtype, on the device."""
        return frames.to(self.device).permute(0, 4, 1, 2, 3).to(self.vae_dtype) / 127.5 - 1.0

    def encoding_precision(self, dtype: str) -> str:
        """What the cache's keys name as the encoders' precision: model.dtype, and the VAE's where
        it differs."""
        return dtype if self.vae_dtype == self.dtype else f"{dtype}, VAE {self.vae_dtype}"

    def held_out_timesteps(self, timesteps: list[int]) -> list[int]:
        """The held-out loss's timesteps this run's transformer is trained on (all, but for an
        expert)."""
        return timesteps

    def other_experts(self) -> list[str]:
        """Folders of the transformers that sampling needs besides the trained one (Wan 2.2 A14B)."""
        return []

    def clip_rate(self, gen_fps: int) -> Fraction:
        """The frame rate validation's mp4s are written at: validation.gen_fps, or the published
        rate for 0. A family with sound (LTX-2) writes at the rate its sound was generated for."""
        return Fraction(gen_fps or self.published_fps)

    def check_guidance(self, cfg) -> None:
        """validation's guidance options against this model, before any compute (LTX-2 adds its STG
        blocks')."""
        if cfg.guidance_scale_2 and not self.other_experts():
            raise ConfigError(
                f"validation.guidance_scale_2 guides Wan 2.2 A14B's low-noise expert, but {self.path} "
                "has one transformer: remove it"
            )

    def guidance_scale(self, cfg, state, t: torch.Tensor) -> float:
        """The classifier-free guidance scale at step t: validation.guidance_scale throughout,
        unless the family's pipeline varies it (CogVideoX's use_dynamic_cfg, Wan 2.2 A14B's second
        expert)."""
        return cfg.guidance_scale

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
        """The guided prediction from denoise's (uncond, cond) pair: classifier-free guidance at
        guidance_scale. A family whose pipeline adds terms (LTX-2) overrides it; models and embeds
        serve its extra forwards."""
        uncond, cond = prediction.chunk(2)
        return uncond + self.guidance_scale(cfg, state, t) * (cond - uncond)

    @classmethod
    def single_file_tables(cls, config: dict) -> dict[str, torch.Tensor]:
        """Tensors tools/to_single_file.py writes beside the weights of a transformer built from
        `config`, under their diffusers names, for other readers' sake (CogVideoX 2b's sincos table,
        for ComfyUI's model detection)."""
        return {}

    @staticmethod
    def single_file_part_key(key: str) -> str:
        """A key of a SINGLE_FILE_PARTS folder -> its name in the family's single files, under
        ComfyUI's prefix (model.diffusion_model.) where those files put it there."""
        return key

    def single_file_extra(self, key: str) -> bool:
        """Whether a single file's key (its own name, without ComfyUI's prefix) holds something
        besides the transformer's weights, which reading skips (LTX-2's text connectors; CogVideoX
        2b's sincos table)."""
        return False

    def comfy_key(self, module: str) -> str | tuple[str, int, int] | None:
        """A LoRA module's name in the original checkpoint's layout (ComfyUI's), or None if the
        family has none; (name, index, count) where the original fuses `count` of ours along the
        output (a qkv): the index-th slice (lora.save_comfy stacks them)."""
        return None

    def diffusers_key(self, original: str) -> str | list[str] | None:
        """The inverse of comfy_key: an original module name's diffusers name (a fused one's, in
        order), or None."""
        return None


def unpadded(embed: torch.Tensor) -> torch.Tensor:
    """One prompt's embedding [L, D] without its padding: the rows of zeros at the end (Wan's
    pipeline zeroes the rows past the attention mask; a family's encode_text gives padding rows
    zero), which are not stored."""
    nonzero = embed.abs().sum(-1).nonzero()
    return embed[: int(nonzero.max()) + 1 if len(nonzero) else 0]


def padded_text(entry: dict, text_length: int | dict[str, int]) -> dict[str, torch.Tensor]:
    """A text entry's embeddings padded back to the family's lengths with rows of zeros.

    One encoder (text_length an int): prompt_embeds [L, D]. Several (a dict, as encode_text named
    them): each [L_name, D_name], and beside it name_mask [L_name], true on the prompt's own rows, for
    the family's attention masks."""
    lengths = text_length if isinstance(text_length, dict) else {"prompt_embeds": text_length}
    out = {}
    for name, length in lengths.items():
        text = entry[name]
        out[name] = torch.cat([text, text.new_zeros(length - len(text), text.shape[1])])
        if isinstance(text_length, dict):
            out[f"{name}_mask"] = torch.arange(length) < len(text)
    return out


# --------------------------------------------------------------------------------------------------
# The registry of families: model.family -> its adapter class, checked against the contract.
#
# ADAPTERS names each family's module and class (families/*.py), imported only when a config names
# the family or the config check reads its OWN_KEYS. A family class is checked against the contract
# (model_adapter.Adapter) when it is imported, and its adapter once built, so that a family that
# leaves out part of it is named before it runs; check_config holds a run's config to its family's
# options, and load_adapter builds the run's adapter over model.path.


# model.family -> its module and adapter class. A family's module (and with it its diffusers and
# transformers classes) is imported when a config names it or check_config reads its OWN_KEYS.
ADAPTERS = {
    "cogvideox": ("families.cogvideox", "CogVideoXAdapter"),
    "wan": ("families.wan", "WanAdapter"),
    "ltx2": ("families.ltx2", "LTX2Adapter"),
    "kandinsky5": ("families.kandinsky5", "Kandinsky5Adapter"),
    "hunyuanvideo15": ("families.hunyuanvideo15", "HunyuanVideo15Adapter"),
}


def missing_members(family: type[Adapter], adapter: Adapter | None = None) -> list[str]:
    """What the family class (or, given it, its adapter's __init__) leaves out of the contract: the
    abstract methods, SOUND with sound, SINGLE_FILES with a SINGLE_FILE_KEY, IMAGE with image-to-video
    from image entries, and the attributes __init__ sets."""
    if adapter is None:
        groups = [
            name
            for name, wanted in (
                ("SOUND", "audio" in family.ENCODERS),
                ("SINGLE_FILES", bool(family.SINGLE_FILE_KEY)),
                ("IMAGE", "i2v" in family.TYPES and "image" in family.ENCODERS),
            )
            if wanted
        ]
        # A member of a group the family needs is missing while it is still Adapter's own
        # declaration.
        unfilled = [
            n
            for group in groups
            for n in getattr(Adapter, group)
            if getattr(family, n) is getattr(Adapter, n)
        ]
        return sorted(family.__abstractmethods__) + unfilled
    wanted = ["transformer_config", "vae_config"] + ["losses"] * bool(family.LOSS_PARTS)
    wanted += ["sound_rate", "audio_loss_weight"] * ("audio" in family.ENCODERS)
    return [name for name in wanted if not hasattr(adapter, name)]


def check_family(family: type[Adapter], adapter: Adapter | None = None) -> None:
    """A family class that does not fill the contract is named, with what it lacks, before it runs."""
    missing = missing_members(family, adapter)
    if missing:
        raise TypeError(
            f"the family adapter {family.__module__}.{family.__name__} does not provide "
            f"{', '.join(missing)}: every family defines them "
            "(model_adapter.Adapter declares each, docs/adding-a-family.md lists them)"
        )


def adapter_class(family: str) -> type[Adapter]:
    """model.family's adapter class, imported now (ADAPTERS) and checked against the contract."""
    module, name = ADAPTERS[family]
    cls = getattr(importlib.import_module(module), name)
    check_family(cls)
    return cls


def family_of(cfg: ModelConfig) -> str:
    """model.family, checked against the registry and the folder's pipeline; "": the folder's
    family.

    The pipeline is model_index.json's: another family's folder would fail obscurely in its configs.
    """
    known = ", ".join(f'"{family}"' for family in ADAPTERS)
    if cfg.family and cfg.family not in ADAPTERS:
        raise ConfigError(
            f'model.family = "{cfg.family}" is no family vidtrain trains: set one of '
            f'{known}, or "" for the family of model.path\'s pipeline'
        )
    index = Path(cfg.path) / "model_index.json"  # none, with a family set: the adapter says so
    pipeline = json.loads(index.read_text()).get("_class_name", "") if index.is_file() else ""
    family = next((f for f in ADAPTERS if pipeline.lower().startswith(f)), None)
    if pipeline and cfg.family and family != cfg.family:
        fix = f'set model.family = "{family}"' if family else f"vidtrain trains {', '.join(ADAPTERS)}"
        raise ConfigError(
            f"model.path = {cfg.path} holds a {pipeline} (its model_index.json), not a model of "
            f'model.family = "{cfg.family}": {fix}'
        )
    if not cfg.family and not pipeline:
        raise ConfigError(not_a_model_folder(cfg.path))
    if not cfg.family and family is None:
        raise ConfigError(
            f"model.path = {cfg.path} holds a {pipeline} (its model_index.json), which "
            f"is no family vidtrain trains: point model.path at a model of one of {known}"
        )
    return cfg.family or family


def check_config(cfg: Config) -> type[Adapter]:
    """The config against its family's options; returns the family's adapter class.

    model.family is checked against the registry; a key only another family accepts (its OWN_KEYS)
    stops the run with that family's message; then the family's own check_config runs. Nothing of
    the model is read but its model_index.json.
    """
    cls = adapter_class(family_of(cfg.model))
    for family in ADAPTERS:
        for key, message in adapter_class(family).OWN_KEYS.items():
            if key not in cls.OWN_KEYS and config_sets(cfg, key):
                raise ConfigError(message.format(key=key, family=cls.FAMILY))
        for key in adapter_class(family).READS:
            if key not in cls.READS and config_sets(cfg, key):
                readers = [f for f in ADAPTERS if key in adapter_class(f).READS]
                named = " and ".join([", ".join(readers[:-1]), readers[-1]] if len(readers) > 1 else readers)
                raise ConfigError(
                    f"{key} is read by the {named} families' training; "
                    f"{cls.FAMILY} does not read it: remove it"
                )
    cls.check_config(cfg)
    return cls


def load_adapter(cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()) -> Adapter:
    """model.family's adapter over the folder at model.path, built with the run's settings.

    With model.transformer_file, the file's reader too (weights.SingleFile), checked against the
    folder's transformer config.
    """
    family = family_of(cfg)
    cls = adapter_class(family)
    adapter = cls(cfg, device, run)
    check_family(cls, adapter)
    if cfg.transformer_file:  # checked now, before the cache pass
        if not adapter.SINGLE_FILE_KEY:
            raise ConfigError(
                f"model.transformer_file: vidtrain reads no single files of {family} models yet; "
                "remove it and give the diffusers folder's transformer in model.path"
            )
        marks = {family: adapter_class(family).SINGLE_FILE_KEY for family in ADAPTERS}
        files = [cfg.transformer_file] if isinstance(cfg.transformer_file, str) else cfg.transformer_file
        adapter.single_file = weights.open_single_file(files, adapter, marks)
    return adapter
