"""The TOML config as a dataclass tree: schema, overrides, the shared checks, the resolved copy.

Every field documents itself with the comment above it. Unknown keys, wrong types and repeated keys
are errors that name the key and the nearest valid one. Each module receives only its own section.
"""

import dataclasses
import difflib
import inspect
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tomllib


class ConfigError(ValueError):
    """A mistake in the config or in the files it names; the message names the culprit and the fix."""


@dataclass
class RunConfig:
    # Where checkpoints, logs, validation clips and exports go (required).
    output_dir: str = ""
    # The one seed: every random draw is keyed by it.
    seed: int = 42
    # Deterministic kernels on GPUs (torch.use_deterministic_algorithms: FlashAttention's and
    # memory-efficient attention's backward passes take their deterministic paths, cuDNN attention
    # is left out; no cuDNN autotuning), so same-seed runs and resumed runs are bitwise identical
    # there as on CPUs; slower.
    deterministic: bool = False


@dataclass
class ModelConfig:
    # Local folder in diffusers layout (model_index.json, transformer/, vae/, text_encoder/, ...).
    path: str = ""
    # Model family: a name in model_adapter.ADAPTERS, whose adapter (families/<name>.py) knows its
    # classes, loss, sampling and the keys only it accepts; "": the family of model.path's pipeline
    # (model_index.json).
    family: str = ""
    # "t2v" text-to-video, or "i2v" image-to-video (the transformer also takes a conditioning image:
    # data.image_column's, or each clip's first frame; a first-last-frame model also the clip's last
    # frame from data.last_image_column), "ic" in-context (each clip's control video,
    # data.control_column's, rides along as clean tokens the model attends to: an in-context LoRA,
    # docs/control.md), or "vace" a VACE model (a control video, its mask and reference images
    # through context blocks: data.control_column, data.mask_column, data.reference_column).
    type: Literal["t2v", "i2v", "ic", "vace"] = "t2v"
    # One family's key (docs/models/), for its two-expert models: the expert this run trains,
    # "high_noise" (transformer/, t >= boundary_ratio x 1000) or "low_noise" (transformer_2/,
    # below); validation renders with both.
    expert: Literal["", "high_noise", "low_noise"] = ""
    # Storage dtype of the frozen weights.
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    # The trained transformer's weights from a safetensors file (or a list of its shards) in
    # ComfyUI's or the original release's layout, bf16, fp16, fp32, fp8 or ComfyUI's scaled fp8,
    # instead of model.path's transformer folder (its config.json still shapes the model; the VAE
    # and text encoder stay model.path's).
    transformer_file: str | list[str] = ""
    # "fp8" stores the frozen linear weights of the transformer blocks as float8_e4m3fn with a scale
    # per output row (half of bf16's bytes), upcast to model.dtype per layer as it runs (LoRA only);
    # "" keeps them in model.dtype.
    storage_dtype: Literal["", "fp8"] = ""
    # One family's key (docs/models/), for in-context models (model.type = "ic"): each control
    # video is read at 1/k of its clip's height and width (the reference has k^2 times fewer tokens;
    # its positions are scaled by k to the clip's), as Lightricks' trainer's
    # reference_downscale_factor; written into the exported LoRA's metadata. Each bucket's height and width must then be
    # multiples of k times the model's size multiple.
    reference_downscale_factor: int = 1


@dataclass
class TrainConfig:
    # "lora" trains adapters on a frozen base; "sft" trains the transformer's weights (every one, or
    # train.trainable_modules').
    training_type: Literal["lora", "sft"] = "lora"
    # sft: only the parameters whose name contains one of these (VideoX-Fun's --trainable_modules:
    # "vace" trains every VACE block and the VACE patch embedding) or matches one as an fnmatch glob
    # ("vace_blocks.*"); the rest stays frozen in model.dtype, out of checkpoints, EMA and AdamW
    # (the export still writes the whole transformer). Empty: every weight.
    trainable_modules: list[str] = field(default_factory=list)
    # Number of optimizer steps.
    steps: int = 1000
    # Clips per rank per micro-step.
    batch_size: int = 1
    # Micro-steps per optimizer step.
    gradient_accumulation_steps: int = 1
    # Peak learning rate (prodigy: 1.0, the multiplier of its own estimate).
    learning_rate: float = 1e-4
    # Learning-rate schedule after warmup (constant_with_warmup warms up, then holds).
    lr_scheduler: Literal["constant_with_warmup", "constant", "cosine", "linear"] = "constant_with_warmup"
    # Linear warmup steps (ignored by "constant").
    lr_warmup_steps: int = 100
    # Weight decay, decoupled (every train.optimizer takes it).
    weight_decay: float = 1e-4
    # AdamW's first-moment decay.
    adam_beta1: float = 0.9
    # AdamW's second-moment decay (torch's own default is 0.999).
    adam_beta2: float = 0.95
    # AdamW's epsilon.
    adam_epsilon: float = 1e-8
    # "adamw" (torch's fused AdamW); "adafactor" and "muon" (torch.optim's own; Muon takes the 2-D
    # weights, AdamW the rest); "prodigy" (prodigyopt: set train.learning_rate = 1.0); "adamw8bit"
    # (torchao's AdamW8bit: 8-bit moments, CUDA and CPU). The adam_* keys go to adamw, adamw8bit,
    # prodigy and Muon's AdamW half (docs/training.md).
    optimizer: Literal["adamw", "adafactor", "muon", "prodigy", "adamw8bit"] = "adamw"
    # The optimizer's other settings, by the names of its constructor's arguments ({ d_coef = 0.5 }
    # for prodigy); an unknown name is an error that lists the allowed ones.
    optimizer_args: dict = field(default_factory=dict)
    # Gradient clipping by global norm, once per optimizer step; 0: no clipping.
    max_grad_norm: float = 1.0
    # Autocast dtype of the forward pass; the loss is always fp32. fp16 adds a dynamic loss scale
    # (2**16, halved on an overflow, whose step is skipped; doubled after 2000 finite steps), kept
    # in checkpoints.
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    # Recompute each transformer block in the backward pass to save activation memory.
    gradient_checkpointing: bool = True
    # With gradient_checkpointing: the block inputs that checkpointing keeps for the backward (one
    # per block, the largest activations left) wait in pinned host memory instead, copied out and
    # back beside the compute.
    activation_offload: bool = False
    # torch.compile each transformer block (regional: one compile serves every block); slow first
    # steps.
    compile: bool = False
    # The attention kernel of every transformer call, training's and validation's (through
    # sdpa_kernel): "" lets SDPA choose (FlashAttention-2 on H100/H200), or "flash", "cudnn" (cuDNN
    # attention, which SDPA never picks itself), "efficient" (memory-efficient attention), "math"
    # (unfused; memory grows with the square of the sequence). A kernel that cannot serve the
    # device, dtype or shape stops the first step.
    attention_backend: Literal["", "flash", "cudnn", "efficient", "math"] = ""
    # Optimizer steps between metric reductions and log lines (each one waits for the device).
    log_every: int = 10
    # Stop after this many optimizer steps in a row whose gradient norm is NaN or Inf (each is
    # skipped; with fp16, only those whose loss is too). Counted on the device, read on log steps,
    # saves and validations: the stop comes up to log_every - 1 steps later.
    max_nonfinite_steps: int = 3
    # The flow-matching families that read it (their Adapter.READS, docs/models/): the training
    # timestep shift, s = shift u / (1 + (shift - 1) u); 0 takes the scheduler config's flow_shift
    # (diffusers recommends 3.0 at 480p, 5.0 at 720p).
    flow_shift: float = 0.0
    # The flow-matching families (Adapter.READS; docs/training.md): how each sample's noise level s
    # is drawn. "" the family's own draw (its makers': docs/models/), "uniform", "logit_normal"
    # (sigmoid of a normal of train.logit_mean and train.logit_std, SD3's), "mode" (SD3's mode
    # sampling at train.mode_scale), "sigmoid" (logit-normal at mean 0, its scale train.logit_std:
    # musubi-tuner's and sd-scripts' name, their sigmoid_scale). The named draws take no shift
    # (train.flow_shift shifts the family's own).
    timestep_sampling: Literal["", "uniform", "logit_normal", "mode", "sigmoid"] = ""
    # "logit_normal": the normal's mean (above 0 favours noisier samples).
    logit_mean: float = 0.0
    # "logit_normal" and "sigmoid": the normal's standard deviation.
    logit_std: float = 1.0
    # "mode": SD3's scale, between -1 and 1.75 (where the draw stays monotone); 0 is uniform.
    mode_scale: float = 1.29
    # The flow-matching families: each sample's loss weighted by its noise level s: "none",
    # "bell" (DiffSynth-Studio's, exp(-2 (s - 1/2)^2) less its value at the ends, mean 1 over
    # s in [0, 1]) or "cosmap" (SD3's, 2 / (pi (1 - 2 s + 2 s^2))). The held-out loss is unweighted.
    loss_weighting: Literal["none", "bell", "cosmap"] = "none"
    # Families with sound: the loss is the video loss plus this times the audio loss.
    audio_loss_weight: float = 1.0
    # One family's key (docs/models/), for image-to-video and in-context models (model.type = "i2v",
    # "ic"): the probability that a training sample's first latent frame is given clean (timestep 0,
    # outside the loss), as in Lightricks' trainer; drawn per sample from its keyed generator. -1:
    # the type's own, 1 for "i2v" (every sample) and 0 for "ic".
    first_frame_conditioning_p: float = -1.0
    # One family's key for VACE models (model.type = "vace"; docs/control.md), as VideoX-Fun's VACE
    # trainer randomises the condition: the chance that a step trains without the clips' reference
    # images (one draw per batch); 0, off.
    vace_drop_references_p: float = 0.0
    # VACE: the chance that a step trains on one frame of each clip's window as its only
    # reference image (one draw per batch; the frame drawn per clip at cache time, the first with
    # chance 0.4, the others alike); with train.vace_drop_references_p, at most 1 in all. 0, off.
    vace_frame_reference_p: float = 0.0
    # VACE: the chance that a sample trains on an inpainting condition in place of its control
    # video: the clip itself with a mask drawn per clip at cache time (VideoX-Fun's
    # get_random_mask) and its masked pixels 0. 0, off.
    vace_inpaint_p: float = 0.0
    # Exponential moving average of the trainable weights (0 = off, e.g. 0.999), used for validation
    # and exported beside the online weights.
    ema_decay: float = 0.0


@dataclass
class ParallelConfig:
    # "ddp" replicates the model on every rank; "fsdp" shards it (FSDP2, fully_shard per block).
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # Seconds a collective may wait before the job fails (a rank that died, a hung node).
    timeout_s: int = 600
    # FSDP: free gathered block weights after forward (less memory, one more all-gather in
    # backward).
    reshard_after_forward: bool = True
    # FSDP: replicate groups (HSDP): the model is sharded within a group and replicated across them.
    # Set it to the number of nodes to keep all-gathers inside a node.
    dp_replicate: int = 1
    # Sequence parallelism (Ulysses): this many adjacent ranks share each sample, its video tokens
    # split between them; must divide the world size and the model's attention heads. Per-rank
    # batches count sp groups: the global batch is batch_size x accumulation x world / sp_size.
    sp_size: int = 1
    # FSDP (one process too): keep the sharded weights in pinned CPU memory, each block streamed to
    # the GPU as it runs (FSDP2's CPUOffloadPolicy); LoRA's weights and AdamW state stay on the GPU,
    # sft's gradients and AdamW state go to the CPU too (AdamW steps there): for GPUs too small for
    # the model, at a cost in speed.
    cpu_offload: bool = False
    # FSDP with cpu_offload, LoRA: only the first this many transformer blocks live in host memory,
    # streamed to the GPU block by block; the others and the rest of the model stay on the GPU. 0:
    # all of it on the host.
    offload_blocks: int = 0


@dataclass
class LoraConfig:
    # Rank r of every adapter.
    rank: int = 128
    # Scale is lora_alpha / rank (written to the exported file's metadata); must be positive.
    lora_alpha: float = 64
    # Module names (or dotted suffixes) of the nn.Linear layers that get adapters, or fnmatch globs
    # matching whole names ("vace_blocks.*.attn1.to_q", "*.ffn.net.0.proj"; an export names the
    # modules a glob matched). A target that matches nothing is refused with the closest names.
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    # Dropout on the adapter input, drawn on the activations' device from a generator keyed by
    # (seed, step, rank).
    dropout: float = 0.0
    # Start from an existing LoRA instead of a fresh one: a file (or folder) in our, diffusers',
    # PEFT's or ComfyUI's layout (lora/comfy/), whose rank, alpha and targets must equal the ones
    # above. A DoRA or LoKr: our (or PEFT's DoRA) layout, of the same variant (and lokr_factor).
    init_from: str = ""
    # LoRA+: the B matrices learn at this multiple of train.learning_rate (A at the rate itself;
    # the paper suggests 16); 0: off.
    plus_ratio: float = 0.0
    # The adapter: "lora"; "dora" (PEFT's use_dora: a LoRA whose merged rows are rescaled to a
    # trained magnitude, ComfyUI's dora_scale; costs time and memory, docs/training.md); "lokr"
    # (LyCORIS' LoKr: the Kronecker product of a small full matrix and a rank-`rank` one, ComfyUI's
    # lokr_w1 / lokr_w2_a / lokr_w2_b; no diffusers or PEFT file). Neither takes lora.dropout.
    variant: Literal["lora", "dora", "lokr"] = "lora"
    # lora.variant = "lokr": LyCORIS' factor, how each dimension splits between the two Kronecker
    # factors: -1 the divisor pair nearest its square root, a positive value that side where it
    # divides the dimension (LyCORIS' default is -1; 4 to 16 make w1 smaller).
    lokr_factor: int = -1


@dataclass
class DataConfig:
    # Dataset folder (required): prompts.txt and videos.txt, or metadata.jsonl / metadata.csv
    # (docs/data.md).
    data_root: str = ""
    # File under data_root with one prompt per line.
    caption_column: str = "prompts.txt"
    # File under data_root with one video path (relative to data_root) per line.
    video_column: str = "videos.txt"
    # File under data_root with one first-frame image per line (image-to-video; unused by t2v).
    image_column: str = ""
    # File under data_root with one last-frame image per line (metadata files: a last_image column),
    # for first-last-frame models: each clip's window ends at the clip's last frame, which it shows.
    last_image_column: str = ""
    # File under data_root with one control video per line (metadata files: a control column), for
    # models that follow a control clip (a depth or pose video, edges, a clip to restyle): each is
    # read at its clip's window's timestamps, resized to the clip's size and cropped as it is
    # (docs/control.md). VACE models: optional, an empty line (or entry) gives a clip none.
    control_column: str = ""
    # VACE models (model.type = "vace"): file under data_root with one mask per line (metadata
    # files: a mask column), a video read as the control video is or an image for every frame; white
    # marks what to generate, black what to keep. "" (or a clip's empty line) masks nothing (all
    # white, the pipeline's default).
    mask_column: str = ""
    # VACE models: file under data_root with each clip's reference images on its line, separated by
    # "|" (metadata files: a reference column; metadata.jsonl may give a JSON list), subjects or
    # styles the clip shows, each fitted into the frame on white as the pipeline does; an empty
    # line: none. Every clip has as many.
    reference_column: str = ""
    # Every family: file under data_root with one loss mask per line (metadata files: a loss_mask
    # column), a video read as control videos are (the window's frames, resized and cropped as the
    # clip) or an image for every frame: white counts in the loss, black not, grey in between
    # (docs/training.md). An empty line (or entry): the clip's whole frame counts.
    loss_mask_column: str = ""
    # [frames, height, width] that every clip is resized, cropped and cut to.
    train_resolution: list[int] = field(default_factory=lambda: [49, 480, 720])
    # Latent and text-embedding cache; "" means <data_root>/.cache.
    cache_dir: str = ""
    # Skip unreadable clips (listed in output_dir/skipped.txt) instead of stopping.
    skip_bad: bool = False
    # The last N clips are held out of training and used for the held-out loss.
    held_out: int = 0
    # [[frames, height, width], ...]: when set, replaces train_resolution; each clip goes to the
    # bucket of the nearest aspect ratio, then the largest area and most frames it fills; [1, H, W]
    # buckets take images; every global batch holds one bucket.
    buckets: list[list[int]] = field(default_factory=list)
    # Frames are chosen at this rate by their timestamps; 0 keeps the clip's own rate.
    target_fps: float = 0.0
    # Crop after the aspect-preserving resize: "center", or "random" (drawn once per clip from
    # (run.seed, clip)).
    crop: Literal["center", "random"] = "center"
    # A clip with fewer frames than its bucket: "error" stops the run, "skip" lists it in
    # skipped.txt, "pad" repeats its last frame.
    short_clips: Literal["error", "skip", "pad"] = "error"
    # Clips per VAE and T5 call in the cache pass (clips of one bucket only).
    cache_batch_size: int = 4
    # Threads per rank decoding clips in the cache pass, a batch ahead of the VAE (0: min(8, CPUs
    # per rank)).
    decode_workers: int = 0
    # Families with sound: train each clip's soundtrack, cut to its frames' seconds; false: video
    # only.
    audio: bool = True


@dataclass
class CheckpointConfig:
    # Optimizer steps between checkpoints (one is always written at the end).
    checkpointing_steps: int = 200
    # Newest complete checkpoints to keep; 0 keeps all.
    checkpointing_limit: int = 10
    # "auto" resumes from the newest complete checkpoint in output_dir, "none" starts fresh, or a
    # path.
    resume: str = "auto"
    # Write checkpoints in the background on a dedicated gloo group; a checkpoint commits at the
    # next save (so `latest` lags one interval); the final save is synchronous.
    async_save: bool = False


@dataclass
class ValidationConfig:
    # Run validation every validation_steps and at the end.
    do_validation: bool = True
    # Optimizer steps between validations.
    validation_steps: int = 200
    # Timesteps at which the held-out loss is measured (fixed noise), logged as val/loss_t{t}.
    loss_timesteps: list[int] = field(default_factory=lambda: [100, 300, 500, 700, 900])
    # Prompts rendered into validation_res/step_{step}_prompt_{i}.mp4 and TensorBoard's
    # val/clip_{i}.
    prompts: list[str] = field(default_factory=list)
    # Text the guidance steers away from (by default the empty prompt).
    negative_prompt: str = ""
    # Seed of clip i's noise, keyed by (seed, i): a prompt's clip is comparable across steps and
    # ranks.
    seed: int = 42
    # One family's key (docs/models/): the sampler, "" the model folder's own (its pipeline's), or
    # "dpm" or "ddim".
    scheduler: Literal["", "dpm", "ddim"] = ""
    # Denoising steps per clip.
    num_inference_steps: int = 50
    # Classifier-free guidance scale; 1 or less renders without guidance.
    guidance_scale: float = 6.0
    # Two-expert models: the low-noise expert's guidance scale (the pipeline's guidance_scale_2); 0:
    # guidance_scale.
    guidance_scale_2: float = 0.0
    # One family's key (docs/models/): raise the guidance scale along a cosine schedule over the
    # steps, as the pipeline's use_dynamic_cfg.
    use_dynamic_cfg: bool = False
    # One family's key (docs/models/): the sound's guidance scale (the pipeline's
    # audio_guidance_scale; its configs: 7); 0: guidance_scale.
    audio_guidance_scale: float = 0.0
    # One family's key (docs/models/): spatio-temporal guidance (STG) of both streams, away from one
    # more forward per step with the self-attention of validation.stg_blocks skipped (the pipeline's
    # stg_scale and audio_stg_scale; 1); 0: off.
    stg_scale: float = 0.0
    # One family's key (docs/models/): the blocks STG skips; []: the pipelines' default.
    stg_blocks: list[int] = field(default_factory=list)
    # One family's key (docs/models/): modality-isolation guidance of both streams, away from one
    # more forward per step without the audio-video cross-attention (the pipeline's modality_scale
    # and audio_modality_scale; 3); 1: off.
    modality_scale: float = 1.0
    # One family's key (docs/models/): the guided prediction rescaled toward the conditional one's
    # spread, both streams (the pipeline's guidance_rescale and audio_guidance_rescale; 0.7); 0:
    # off.
    guidance_rescale: float = 0.0
    # One family's key (docs/models/): the keyframe marker (the transformer's
    # keyframes_abs_pos_embedding) on the first latent frame while sampling, as its makers' own
    # pipelines render; false: as diffusers' pipelines and the makers' training, which pass none.
    keyframe_marker: bool = False
    # [frames, height, width] of the clips; [] renders at data.train_resolution (data.buckets[0]
    # when set).
    resolution: list[int] = field(default_factory=list)
    # Frame rate written into the mp4s and the TensorBoard clips; 0: the model's published rate
    # (docs/models/), as the configs of published models set. A family with sound writes at the rate
    # its sound was generated for (data.target_fps, else its published rate), no other.
    gen_fps: int = 0
    # i2v: one conditioning image per prompt, in the same order (paths; a clip's first frame, say);
    # ic: optionally, one per prompt, the first frame its clip starts from beside its control video.
    images: list[str] = field(default_factory=list)
    # First-last-frame models: one last-frame image per prompt, beside validation.images.
    last_images: list[str] = field(default_factory=list)
    # Models that follow a control video (model.type = "ic" or "vace"): one per prompt, read at the
    # rendered clip's rate from its first frame, resized to cover and centre-cropped to its size;
    # TensorBoard shows it beside the output.
    control_videos: list[str] = field(default_factory=list)
    # VACE models (model.type = "vace"): one mask per prompt (a video, read as its control video
    # is, or an image for every frame; white: generate, black: keep), beside
    # validation.control_videos (the pipeline takes a mask only with a video); [] renders with the
    # pipeline's all-white mask. TensorBoard shows it between the control video and the output.
    masks: list[str] = field(default_factory=list)
    # VACE models (model.type = "vace"): the reference images of each prompt, which the clip is to
    # show (a subject, a style): a path, or a list of paths for several; [] renders without.
    reference_images: list[str | list[str]] = field(default_factory=list)
    # Also write each clip's uint8 frames, exactly as they went into the mp4 encoder, as
    # validation_res/*.safetensors (for metrics, or exact comparisons between runs).
    save_frames: bool = False


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


def nearest(name: str, candidates: list[str], cutoff: float = 0.0) -> str:
    """The did-you-mean for an unknown key or metadata column: the candidate nearest `name` (none
    below difflib's similarity `cutoff`), as " (did you mean 'x'?)"."""
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _finite(value) -> bool:
    """Whether a config value holds no inf or nan, in lists too."""
    if isinstance(value, list):
        return all(map(_finite, value))
    return not isinstance(value, float) or math.isfinite(value)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def _check_value(key: str, value, tp):
    """Return value as type tp, or raise naming the key. Booleans are never numbers here."""
    origin = typing.get_origin(tp)
    if origin is types.UnionType:  # str | list[str]: the first type the value is
        for member in typing.get_args(tp):
            try:
                return _check_value(key, value, member)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key} = {value!r} is not one of {_type_name(tp)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {_type_name(item_tp)}, got {value!r}")
        return [_check_value(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _set(cfg: Config, key: str, value) -> None:
    section_name, _, name = key.partition(".")
    sections = [f.name for f in dataclasses.fields(Config)]
    if section_name not in sections:
        raise ConfigError(
            f"unknown config section '{section_name}' in '{key}'{nearest(section_name, sections)}"
        )
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        keys = [f"{section_name}.{k}" for k in hints]
        raise ConfigError(f"unknown config key '{key}'{nearest(key, keys)}")
    setattr(section, name, _check_value(key, value, hints[name]))


def _parse_literal(text: str):
    """A TOML literal (3, 1e-4, true, [9, 32, 32]); anything else is a plain string (bf16, a path)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict:
    """`--section.key value` or `--section.key=value` pairs; a repeated key is an error."""
    overrides, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, text = arg[2:], args[i + 1]
            i += 2
        else:
            raise ConfigError(f"override '{arg}' has no value")
        if key in overrides:
            raise ConfigError(f"override '--{key}' is given twice")
        overrides[key] = _parse_literal(text)
    return overrides


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file, apply command-line overrides, check every key and value."""
    cfg = Config()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:  # TOML itself rejects repeated keys here.
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section_name, section in data.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: '{section_name}' must sit inside a [section], e.g. [run]")
            for name, value in section.items():
                _set(cfg, f"{section_name}.{name}", value)
    for key, value in parse_overrides(list(overrides)).items():
        _set(cfg, key, value)
    check_values(cfg)
    return cfg


def check_values(cfg: Config) -> None:
    """Checks that need no model and hold for every family; a family's own options are its adapter's
    (model_adapter.check_config), the model-dependent rules the adapter's check_resolution."""
    for key in ("run.output_dir", "model.path", "data.data_root"):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name):
            raise ConfigError(f"{key} is required: set it in the config file or pass --{key} VALUE")
    # TOML reads inf and nan as numbers, and nan fails no comparison: the range checks below would
    # pass it (and inf most of them), and a run would train NaN or nothing, exit 0. Every float of
    # the tree, the keys families declare their own (OWN_KEYS) included.
    for section in dataclasses.fields(cfg):
        for name, value in vars(getattr(cfg, section.name)).items():
            if not _finite(value):
                raise ConfigError(
                    f"{section.name}.{name} = {value} is not a finite number (TOML reads inf and nan "
                    "as numbers): give a finite value"
                )
    positive = (
        "train.steps",
        "parallel.timeout_s",
        "parallel.dp_replicate",
        "parallel.sp_size",
        "train.batch_size",
        "train.gradient_accumulation_steps",
        "train.log_every",
        "train.max_nonfinite_steps",
        "lora.rank",
        "checkpoint.checkpointing_steps",
        "validation.validation_steps",
    )
    for key in positive:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 1:
            raise ConfigError(f"{key} must be at least 1")
    if cfg.parallel.cpu_offload and cfg.parallel.strategy != "fsdp":
        raise ConfigError(
            'parallel.cpu_offload offloads FSDP\'s shards: set parallel.strategy = "fsdp" or remove it'
        )
    if cfg.parallel.cpu_offload and cfg.train.mixed_precision == "fp16":
        # The loss scale lives on the GPU and offloaded gradients on the CPU; untested there, so
        # refused.
        raise ConfigError(
            'parallel.cpu_offload does not support train.mixed_precision = "fp16" yet: use "bf16"'
        )
    if cfg.parallel.offload_blocks < 0:
        raise ConfigError(
            f"parallel.offload_blocks must be 0 (every block) or a number of blocks, got "
            f"{cfg.parallel.offload_blocks}"
        )
    if cfg.parallel.offload_blocks and not cfg.parallel.cpu_offload:
        raise ConfigError(
            "parallel.offload_blocks chooses how many blocks parallel.cpu_offload keeps in host memory: "
            "set parallel.cpu_offload = true, or remove it"
        )
    if cfg.parallel.offload_blocks and cfg.train.training_type == "sft":
        # sft's gradients and AdamW state would be split between host and GPU: one device per run
        # instead.
        raise ConfigError(
            'parallel.offload_blocks is for LoRA: with train.training_type = "sft" parallel.cpu_offload '
            "keeps every block, its gradients and its AdamW state in host memory; remove it"
        )
    if cfg.train.activation_offload and not cfg.train.gradient_checkpointing:
        raise ConfigError(
            "train.activation_offload moves the block inputs that activation checkpointing keeps to "
            "host memory: set train.gradient_checkpointing = true, or remove it"
        )
    if cfg.model.storage_dtype == "fp8" and cfg.train.training_type == "sft":
        raise ConfigError(
            'model.storage_dtype = "fp8" stores a frozen base, but train.training_type = "sft" '
            "trains every weight: remove model.storage_dtype, or train a LoRA"
        )
    if cfg.run.deterministic and cfg.train.attention_backend == "cudnn":
        raise ConfigError(
            'train.attention_backend = "cudnn" has no deterministic backward, and run.deterministic '
            '= true: use "flash" or "" (SDPA\'s choice), whose backward is deterministic then'
        )
    if len(cfg.data.train_resolution) != 3:
        raise ConfigError(
            f"data.train_resolution must be [frames, height, width], got {cfg.data.train_resolution}"
        )
    if cfg.model.type == "i2v":
        # The image is the first frame: a 1-frame sample is its own condition. TI2V masks that frame
        # out of the loss (0/0, NaN); the other image-to-video models would learn to copy the image.
        shapes = {f"data.buckets[{i}]": s for i, s in enumerate(cfg.data.buckets)} or {
            "data.train_resolution": cfg.data.train_resolution
        }
        for key, shape in shapes.items():
            if shape[:1] == [1]:
                raise ConfigError(
                    f"{key} = {shape} has 1 frame, but image-to-video trains the frames after its "
                    "conditioning image (the first frame): give it more frames (the model's 4k+1 or "
                    "8k+1); image-to-video cannot train on images listed as videos"
                )
    check_training_values(cfg)
    if not 0.0 <= cfg.train.ema_decay < 1.0:
        raise ConfigError(f"train.ema_decay must be in [0, 1), got {cfg.train.ema_decay}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg.train, key) < 1.0:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(cfg.train, key)}")
    if cfg.train.adam_epsilon <= 0:
        raise ConfigError(f"train.adam_epsilon must be positive, got {cfg.train.adam_epsilon}")
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
    if cfg.lora.dropout and cfg.train.gradient_checkpointing:
        # The recompute would draw a different dropout mask: checkpointing restores only the global
        # RNG.
        raise ConfigError("lora.dropout > 0 needs train.gradient_checkpointing = false")
    if cfg.lora.dropout and cfg.lora.variant != "lora":
        raise ConfigError(
            f'lora.dropout > 0 with lora.variant = "{cfg.lora.variant}": only "lora" has dropout (LyCORIS\' '
            "LoKr has none; PEFT's DoRA would recompute the base layer on the dropped input): set lora.dropout = 0"
        )
    if cfg.lora.lokr_factor == 0 or cfg.lora.lokr_factor < -1:
        raise ConfigError(f"lora.lokr_factor must be -1 or at least 1, got {cfg.lora.lokr_factor}")
    if cfg.lora.dropout and cfg.parallel.sp_size > 1:
        # The ranks of an sp group each compute the replicated text tokens: their masks would
        # differ.
        raise ConfigError("lora.dropout > 0 needs parallel.sp_size = 1")
    if cfg.checkpoint.checkpointing_limit < 0 or cfg.data.held_out < 0:
        raise ConfigError("checkpoint.checkpointing_limit and data.held_out must not be negative")
    for t in cfg.validation.loss_timesteps:
        if not 0 <= t < 1000:
            raise ConfigError(f"validation.loss_timesteps holds {t}; timesteps lie in [0, 1000)")
    if cfg.validation.num_inference_steps < 1:
        raise ConfigError("validation.num_inference_steps must be at least 1")
    if cfg.validation.gen_fps < 0:
        raise ConfigError("validation.gen_fps must be 0 (the family's published rate) or positive")
    if cfg.train.flow_shift < 0:
        raise ConfigError(
            f"train.flow_shift must be 0 (the scheduler's) or positive, got {cfg.train.flow_shift}"
        )
    check_timestep_sampling(cfg.train)
    if cfg.train.audio_loss_weight < 0:
        raise ConfigError(f"train.audio_loss_weight must be 0 or positive, got {cfg.train.audio_loss_weight}")
    # t2v and vace (their conditions are text, control videos and reference images)
    if cfg.model.type not in ("i2v", "ic") and cfg.validation.images:
        raise ConfigError(
            "validation.images conditions image-to-video models and in-context ones' first frame: "
            'set model.type = "i2v" (or "ic"), or remove it'
        )
    if cfg.validation.do_validation:  # render.py checks them whatever do_validation says
        check_validation_images(cfg)
    if len(cfg.validation.resolution) not in (0, 3):
        raise ConfigError(
            f"validation.resolution must be [] or [frames, height, width], got {cfg.validation.resolution}"
        )


def check_timestep_sampling(t: TrainConfig) -> None:
    """train.timestep_sampling's parameters in range, and each set only beside the draw that reads
    it."""
    if t.logit_std <= 0 or not -1 <= t.mode_scale <= 1.75:
        raise ConfigError(
            f"train.logit_std must be positive (got {t.logit_std}) and train.mode_scale between -1 and "
            f"1.75 (got {t.mode_scale}), where SD3's mode draw stays monotone"
        )
    readers = {
        "logit_mean": ("logit_normal",),
        "logit_std": ("logit_normal", "sigmoid"),
        "mode_scale": ("mode",),
    }
    for key, samplings in readers.items():
        if getattr(t, key) != getattr(TrainConfig(), key) and t.timestep_sampling not in samplings:
            named = " or ".join(f'"{s}"' for s in samplings)
            raise ConfigError(
                f"train.{key} shapes train.timestep_sampling = {named}, and "
                f'it is "{t.timestep_sampling}": remove train.{key}, or set the sampling that reads it'
            )
    if t.flow_shift and t.timestep_sampling:
        raise ConfigError(
            f'train.flow_shift shifts the family\'s own timestep draw (train.timestep_sampling = ""), '
            f'and train.timestep_sampling = "{t.timestep_sampling}" draws s itself: remove one of them'
        )


def check_training_values(cfg: Config) -> None:
    """Values that would train nothing (an all-zero LoRA, exported with exit 0) or crash after the
    cache pass."""
    t = cfg.train
    if t.learning_rate <= 0:
        raise ConfigError(f"train.learning_rate must be positive, got {t.learning_rate}")
    if t.lr_warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps must be 0 or more, got {t.lr_warmup_steps}")
    if t.max_grad_norm < 0:
        raise ConfigError(f"train.max_grad_norm must be 0 (no clipping) or positive, got {t.max_grad_norm}")
    if t.training_type == "lora" and cfg.lora.lora_alpha <= 0:
        # The adapters' scale is lora_alpha / rank: 0 multiplies every update away.
        raise ConfigError(
            f"lora.lora_alpha must be positive (the scale is lora_alpha / lora.rank), got "
            f"{cfg.lora.lora_alpha}"
        )
    if cfg.lora.plus_ratio < 0:
        raise ConfigError(f"lora.plus_ratio must be 0 (off) or positive, got {cfg.lora.plus_ratio}")
    if t.trainable_modules and t.training_type != "sft":
        raise ConfigError(
            "train.trainable_modules chooses the weights sft trains, but train.training_type = "
            f'"{t.training_type}": set train.training_type = "sft", or name LoRA\'s layers in '
            "lora.target_modules"
        )
    if t.training_type == "lora" and not cfg.lora.target_modules:
        raise ConfigError(
            "lora.target_modules is empty, so no layer would get an adapter: name the linear layers "
            'to adapt (the default is ["to_q", "to_k", "to_v", "to_out.0"])'
        )
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).exists():
        raise ConfigError(
            f'checkpoint.resume = {resume} does not exist: give a checkpoint-N folder, or "auto" '
            '(the newest in run.output_dir) or "none"'
        )


# The validation keys that name files, each with the render command's flag that replaces it.
VALIDATION_FILES = {
    "images": "validation.images or --image",
    "last_images": "validation.last_images or --last-image",
    "control_videos": "validation.control_videos or --control",
    "masks": "validation.masks or --mask",
    "reference_images": "validation.reference_images or --reference",
}


def check_validation_images(cfg: Config) -> None:
    images, prompts = cfg.validation.images, cfg.validation.prompts
    if cfg.model.type == "i2v" and len(images) != len(prompts):
        raise ConfigError(
            f'model.type = "i2v" renders each validation prompt from an image: validation.images '
            f"has {len(images)} for {len(prompts)} validation.prompts; give one per prompt"
        )
    if cfg.model.type == "ic" and images and len(images) != len(prompts):
        raise ConfigError(
            f"validation.images has {len(images)} for {len(prompts)} validation.prompts: an in-context "
            "model renders each prompt from its control video and, given images, its first frame; give "
            "one per prompt, or none"
        )
    last = cfg.validation.last_images
    if last and len(last) != len(prompts):
        raise ConfigError(
            f"validation.last_images has {len(last)} for {len(prompts)} validation.prompts: a "
            "first-last-frame model renders each prompt between its image and its last image; give "
            "one per prompt"
        )
    controls = cfg.validation.control_videos
    if controls and len(controls) != len(prompts):
        raise ConfigError(
            f"validation.control_videos has {len(controls)} for {len(prompts)} validation.prompts: a "
            "control model renders each prompt from its control video; give one per prompt"
        )
    references = cfg.validation.reference_images
    if references and cfg.model.type != "vace":
        raise ConfigError(
            'validation.reference_images conditions VACE models: set model.type = "vace" '
            "(and model.path to a VACE model), or remove them"
        )
    if references and len(references) != len(prompts):
        raise ConfigError(
            f"validation.reference_images has {len(references)} for {len(prompts)} "
            "validation.prompts: give one per prompt"
        )
    masks = cfg.validation.masks
    if masks and (cfg.model.type != "vace" or len(masks) != len(controls)):
        raise ConfigError(
            f"validation.masks has {len(masks)} for {len(controls)} validation.control_videos: a "
            'mask goes with a control video (model.type = "vace"), one per prompt; give both (or '
            "--mask with --control), or remove the masks"
        )


def check_validation_files(cfg: ValidationConfig) -> None:
    """Every file the validation keys name is there, before the cache pass and the model load (a
    command's check: shipped configs name files of the user's)."""
    for key, fix in VALIDATION_FILES.items():
        for i, paths in enumerate(getattr(cfg, key)):
            for path in [paths] if isinstance(paths, str) else paths:
                if not Path(path).is_file():
                    what = "is a folder, not a file" if Path(path).is_dir() else "does not exist"
                    raise ConfigError(f"validation.{key}[{i}] = {path} {what}: fix {fix}")


def check_resolution(
    resolution: list[int], frame_multiple: int, size_multiple: int, key: str = "data.train_resolution"
) -> None:
    """The model's own rules: frames = k * frame_multiple + 1, height and width divisible by
    size_multiple."""
    frames, height, width = resolution
    if frames < 1 or (frames - 1) % frame_multiple:
        # never a count below one frame
        lower = max(1, (frames - 1) // frame_multiple * frame_multiple + 1)
        raise ConfigError(
            f"{key} frames = {frames}, but this model needs {frame_multiple}k+1 frames "
            f"(the VAE decodes latents in pairs): use {lower} or {lower + frame_multiple}"
        )
    for name, value in (("height", height), ("width", width)):
        if value % size_multiple or value <= 0:
            raise ConfigError(
                f"{key} {name} = {value} must be a positive multiple of {size_multiple} "
                "(VAE spatial ratio x patch size)"
            )
    # Every clip's frames are scaled to at least this size by FFmpeg, whose av_image_check_size
    # refuses a frame of (width + 128) x (height + 128) pixels from INT_MAX / 8 up: each clip would
    # fail to decode ("Invalid argument") and be blamed instead of the key.
    if (height + 128) * (width + 128) >= (2**31 - 1) // 8:
        raise ConfigError(
            f"{key} = {list(resolution)}: a frame of {height} x {width} is larger than FFmpeg decodes "
            "to ((height + 128) x (width + 128) under 2^28 pixels; 16,000 x 16,000 at most), so every "
            "clip would fail to decode: use a smaller height and width"
        )


def reference() -> str:
    """docs/configuration.md: every key, its type, default and the comment above it."""
    lines = [
        "# Configuration reference",
        "",
        "Every key, its type, default and meaning: the comments of `config.py`, which is the schema.",
        "`python config.py` prints this page (a test keeps the two equal); how a run reads a config and",
        "its `--section.key value` overrides is in [training.md](training.md).",
        '"One family\'s key" marks a key that only one family accepts (its page in [models/](models/)',
        "names it); a run of another family refuses it before anything is computed.",
        "",
    ]
    for section in dataclasses.fields(Config):
        schema = typing.get_type_hints(section.type)
        comments = _field_comments(section.type)
        lines += [
            f"## [{section.name}]",
            "",
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for name, default in dataclasses.asdict(section.type()).items():
            kind = _type_name(schema[name]).replace("|", "\\|")
            lines.append(f"| `{section.name}.{name}` | {kind} | `{toml_value(default)}` | {comments[name]} |")
        lines.append("")
    return "\n".join(lines)


def _field_comments(section_type) -> dict[str, str]:
    """The comment lines above each field of a section dataclass, joined."""
    comments, pending = {}, []
    for line in inspect.getsource(section_type).splitlines():
        line = line.strip()
        if line.startswith("#"):
            pending.append(line.lstrip("# "))
        elif ":" in line and pending:
            comments[line.split(":")[0]] = " ".join(pending)
            pending = []
    return comments


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def to_toml(cfg: Config) -> str:
    lines = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        for name, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            lines.append(f"{name} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference())
