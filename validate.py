"""Validation: the held-out loss, clips rendered by our own sampling loop, and the clips' media.

`python render.py ...` is the render command: clips of a checkpoint, a LoRA file or the base model
without training, through this module's renderer.

The training loss of uniform-t v-prediction is dominated by which t were drawn and looks flat; the
held-out loss measures every held-out clip at the same timesteps with the same noise every time, so
successive values are comparable.

The sampling loop is CogVideoXPipeline's, step for step: the same T5 embeddings, scheduler steps and
guidance (cond and uncond in one forward), and, given the same generator, the same initial and
per-step noise, so its clips match the pipeline's. Clip i draws all its noise from a generator keyed
by (validation.seed, i): it does not depend on the step, the rank that renders it or the number of
ranks. Attention runs through FusedQKVAttention for the duration of sampling only. Last, the clips'
media: their conditions read, the mp4s written.
"""

import contextlib
import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import data
import decode
import faults
import memory
import model_adapter
import ranks
from config import VALIDATION_FILES, ConfigError, DataConfig, ValidationConfig


def eager():
    """Validation runs eagerly under train.compile: its calls (no grad, eval mode, the guided batch
    of two, its own resolution) would each add compiled variants of every block to training's,
    counted against dynamo's recompile limit (model.RECOMPILE_LIMIT), and pay their compile at the
    first validation; they run rarely enough that eager costs little."""
    return torch.compiler.set_stance("force_eager")


@torch.no_grad()
def held_out_loss(
    adapter, model, cache, clips: list, cfg: ValidationConfig, seed: int, d: ranks.Dist, autocast
):
    """val/loss and val/loss_t{t}, and each of the family's loss parts (LTX-2's val/loss_video and
    val/loss_audio: means over the clips that have the stream, and the timesteps). Clip i is
    measured by data-parallel rank i % dp_world (the whole sp group); every rank makes the same
    number of forward calls (FSDP needs it), the padding ones weighted 0."""
    timesteps = adapter.held_out_timesteps(cfg.loss_timesteps)
    if not clips or not timesteps:
        return {}
    sums = torch.zeros(len(timesteps), device=d.device)
    # per part: (sum, count), adapter.losses
    parts = torch.zeros(len(adapter.LOSS_PARTS), 2, device=d.device)
    was_training = model.training
    model.eval()
    for j in range(math.ceil(len(clips) / d.dp_world)):
        index = j * d.dp_world + d.dp_rank
        weight = 1.0 if index < len(clips) else 0.0
        batch = cache.load_batch([clips[min(index, len(clips) - 1)]])
        with autocast:
            sums += weight * adapter.fixed_losses(
                model, batch, timesteps, data.keyed_generator(seed, "held_out", index)
            )
        if adapter.LOSS_PARTS:
            parts += weight * adapter.losses.to(d.device)
    model.train(was_training)
    dist.all_reduce(sums)
    losses = (sums / (len(clips) * d.sp)).tolist()  # the ranks of an sp group hold the same sums
    values = {
        "val/loss": sum(losses) / len(losses),
        **{f"val/loss_t{t}": v for t, v in zip(timesteps, losses)},
    }
    if adapter.LOSS_PARTS:
        dist.all_reduce(parts)
        values |= {
            f"val/{name}": total / count
            for name, (total, count) in zip(adapter.LOSS_PARTS, parts.tolist())
            if count
        }
    return values


def prompt_text(embeds, i: int, text_length):
    """Prompt i's text [1, ...] as the family's denoise takes it: encode_text's row (one encoder),
    or (several) its named rows with their masks, as a cached batch holds them."""
    if not isinstance(embeds, dict):
        return embeds[i : i + 1]
    entry = model_adapter.padded_text(
        {n: model_adapter.unpadded(e[i]) for n, e in embeds.items()}, text_length
    )
    return {name: tensor[None] for name, tensor in entry.items()}


def both_texts(negative, prompt):
    """The negative prompt's text and the prompt's in one batch (cond and uncond in one forward)."""
    if isinstance(prompt, dict):
        return {name: torch.cat([negative[name], prompt[name]]) for name in prompt}
    return torch.cat([negative, prompt])


@torch.no_grad()
def sample_latents(
    adapter,
    denoisers: dict,
    scheduler,
    prompt_embeds,
    negative_embeds,
    generator: torch.Generator,
    cfg: ValidationConfig,
    resolution: list[int],
    autocast,
    on_step=lambda i: None,
    image=None,
    last_image=None,
    **conditions,
):
    """Run the family's sampling loop for one prompt; return its final state.

    The final sampling state of one prompt (and, image-to-video, its conditioning image;
    first-last-frame, its last image too): adapter.sampled gives its latents (sampled_audio its
    sound, LTX-2). The family's pipeline loop, step for step, with every draw from `generator` (a
    CPU generator, as the pipelines use it); the adapter builds the denoiser's input (condition,
    expert, per-token timesteps) and steps the scheduler. Latents and scheduler math stay fp32.
    on_step(i) runs before sampling step i (from 1): the renderer's stop check. `conditions` go to
    the family's sampling_start: an in-context model's `control` (its control video's frames, uint8
    [F, H, W, 3] at the clip's size), Wan VACE's references."""
    # only first-last-frame models take one
    last = {} if last_image is None else {"last_image": last_image}
    state = adapter.sampling_start(
        scheduler, cfg.num_inference_steps, resolution, generator, image, **last, **conditions
    )
    guided = cfg.guidance_scale > 1.0 or cfg.audio_guidance_scale > 1.0
    embeds = both_texts(negative_embeds, prompt_embeds) if guided else prompt_embeds
    for i, t in enumerate(scheduler.timesteps):
        on_step(i + 1)
        with autocast:
            # cond and uncond in one forward
            prediction = adapter.denoise(denoisers, state, t, embeds, guided)
            if guided:
                prediction = adapter.guide(cfg, denoisers, state, t, i, embeds, prediction)
        adapter.sampling_step(state, prediction, t, i)
    return state


class ClipRenderer:
    """The validation prompts' clips. Embeddings are computed once, here; clip i is rendered by
    data-parallel rank i % dp_world (with sequence parallelism, its whole sp group), every rank
    making the same number of forward calls (FSDP needs it); rank 0 receives them from the
    data-parallel leaders and writes them. Ranks advance in lockstep, so no collective waits longer
    than one forward or decode."""

    def __init__(
        self,
        adapter,
        cfg: ValidationConfig,
        data_cfg: DataConfig,
        output_dir: str,
        d: ranks.Dist,
        load_frozen=None,
    ):
        """load_frozen(folder) builds another expert the sampling needs (Wan 2.2 A14B), frozen and
        wrapped as the trained one is; it is built at the first render and kept."""
        self.adapter, self.cfg, self.d, self.load_frozen, self.frozen = adapter, cfg, d, load_frozen, {}
        self.resolution = cfg.resolution or (data_cfg.buckets or [data_cfg.train_resolution])[0]
        key = (
            "validation.resolution"
            if cfg.resolution
            else "data.buckets[0]"
            if data_cfg.buckets
            else "data.train_resolution"
        )
        adapter.check_resolution(self.resolution, key)
        adapter.check_guidance(cfg)
        self.out_dir = Path(output_dir) / "validation_res"
        self.fps = adapter.clip_rate(cfg.gen_fps)
        # steps taken, counted for fault injection
        self.prompts, self.sampling_steps = list(cfg.prompts), 0
        # A family with sound (LTX-2) renders each clip's soundtrack too: muxed into the mp4, and in
        # TensorBoard.
        self.sound, self.sounds = "audio" in adapter.ENCODERS, []
        if adapter.first_last and self.prompts and not cfg.last_images:
            raise ConfigError(
                f"{adapter.path} is a first-last-frame model (Wan FLF2V): each validation prompt "
                "renders between its image and its last image; set validation.last_images (render.py: "
                "--last-image), one per prompt"
            )
        if cfg.last_images and not adapter.first_last:
            raise ConfigError(
                f"validation.last_images conditions first-last-frame models, and {adapter.path} is not "
                "one: remove them (and --last-image)"
            )
        if adapter.type == "ic" and self.prompts and not cfg.control_videos:
            raise ConfigError(
                f'{adapter.path} follows a control video (model.type = "ic"): each validation prompt '
                "renders from one; set validation.control_videos (render.py: --control), one per prompt"
            )
        if cfg.control_videos and not adapter.takes_control:
            raise ConfigError(
                f"validation.control_videos conditions control models, and {adapter.path} is not one "
                'here: remove them (and --control), or set model.type = "ic" or "vace"'
            )
        self.controls = [
            load_control(path, self.resolution, float(self.fps)) for path in cfg.control_videos
        ] or [None] * len(self.prompts)
        self.images = [load_image(path) for path in cfg.images] or [None] * len(self.prompts)
        self.last_images = [load_image(path, "last_images") for path in cfg.last_images] or [None] * len(
            self.prompts
        )
        self.masks = [
            load_control(path, self.resolution, float(self.fps), mask=True) for path in cfg.masks
        ] or [None] * len(self.prompts)
        # Wan VACE: each prompt's reference images (a path, or a list of paths)
        if adapter.vace:  # before any compute: the pipeline's resize would stop with a ValueError
            data.check_validation_references(cfg, self.resolution, adapter.spatial_ratio)
        self.references = [
            [load_image(p, "reference_images") for p in ([paths] if isinstance(paths, str) else paths)]
            for paths in cfg.reference_images
        ] or [[]] * len(self.prompts)
        if self.prompts:
            embeds = adapter.encode_text([cfg.negative_prompt, *self.prompts])
            texts = [prompt_text(embeds, i, adapter.text_length) for i in range(1 + len(self.prompts))]
            self.negative_embeds, self.prompt_embeds = texts[0], texts[1:]
            adapter.release_text_encoder()  # not needed again

    def denoisers(self, model) -> dict:
        """The transformers sampling calls, by folder: the trained one, and the other experts."""
        for folder in self.adapter.other_experts():
            if folder not in self.frozen:
                self.frozen[folder] = self.load_frozen(folder)
        return {self.adapter.transformer_folder: model, **self.frozen}

    def frames(self, model, index: int, scheduler, autocast, on_step=lambda i: None) -> torch.Tensor:
        """Float frames [F, H, W, 3] in [0, 1] of prompt `index`."""
        return self.clip(model, index, scheduler, autocast, on_step)[0]

    def clip(self, model, index: int, scheduler, autocast, on_step=lambda i: None, prompt: int | None = None):
        """Float frames [F, H, W, 3] in [0, 1] and, for a family with sound, the soundtrack (float
        [channels, samples] at adapter.sound_rate; else None) of prompt `prompt` (default: `index`)
        with clip `index`'s noise."""
        prompt = index if prompt is None else prompt
        # only VACE takes them
        conditions = {"references": self.references[prompt]} if self.adapter.vace else {}
        conditions |= {} if self.controls[prompt] is None else {"control": self.controls[prompt]}
        conditions |= {} if self.masks[prompt] is None else {"mask": self.masks[prompt]}
        state = sample_latents(
            self.adapter,
            self.denoisers(model),
            scheduler,
            self.prompt_embeds[prompt],
            self.negative_embeds,
            data.keyed_generator(self.cfg.seed, index),
            self.cfg,
            self.resolution,
            autocast,
            on_step,
            self.images[prompt],
            self.last_images[prompt],
            **conditions,
        )
        frames = to_frames(self.adapter.decode_latents(self.adapter.sampled(state))[0])
        sound = self.adapter.decode_audio(self.adapter.sampled_audio(state)).cpu() if self.sound else None
        return frames, sound

    def _on_step(self, i: int) -> None:
        """Between sampling steps every rank learns whether any got a stop signal (a collective:
        every rank samples in lockstep), so a render never outlasts a scheduler's grace period by
        much."""
        self.sampling_steps += 1
        faults.fault("render", self.sampling_steps)
        ranks.stop_if_preempted(self.d, "during validation")

    def render(self, model, autocast) -> list[torch.Tensor]:
        """Called on every rank: uint8 clips [F, H, W, 3] of every prompt on rank 0, [] on the
        others; with sound, self.sounds holds their soundtracks (rank 0)."""
        was_training = model.training
        model.eval()
        scheduler = self.adapter.sampler(self.cfg.scheduler)
        num_frames, height, width = self.resolution
        clips, self.sounds = [], []
        try:
            with contextlib.ExitStack() as stack:
                for denoiser in self.denoisers(model).values():
                    stack.enter_context(self.adapter.sampling_attention(denoiser))
                for j in range(math.ceil(len(self.prompts) / self.d.dp_world)):
                    index = j * self.d.dp_world + self.d.dp_rank
                    if index < len(self.prompts):
                        clip, sound = self.clip(model, index, scheduler, autocast, self._on_step)
                        clip = to_uint8(clip)
                    # a padding rank: its forward calls are needed, its clip is not (its sound's
                    # shape is)
                    else:
                        _, sound = self.clip(
                            model, index, scheduler, autocast, self._on_step, len(self.prompts) - 1
                        )
                        clip = torch.zeros(num_frames, height, width, 3, dtype=torch.uint8)
                    clips += self._collect(clip)
                    self.sounds += self._collect(sound) if self.sound else []
        finally:
            model.train(was_training)
            # on the CPU until the next validation: no second load from disk
            self.adapter.park_vae()
        self.sounds = self.sounds[: len(self.prompts)]
        return clips[: len(self.prompts)]

    def _collect(self, clip: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0 gets the clip of each data-parallel leader (the first rank of an sp group, whose
        ranks all made the same clip), in data-parallel rank order; the other ranks send nothing,
        and get []."""
        if self.d.is_main:
            # contiguous
            clips = [clip] + [clip.new_empty(clip.shape) for _ in range(1, self.d.dp_world)]
            for dp_rank in range(1, self.d.dp_world):
                dist.recv(clips[dp_rank], src=dp_rank * self.d.sp)
            return clips
        if self.d.rank % self.d.sp == 0:
            dist.send(clip.contiguous(), dst=0)  # frames come permuted from the VAE's layout
        return []

    def save(
        self, clips: list[torch.Tensor], names: list[str], sounds: list[torch.Tensor] = ()
    ) -> list[Path]:
        """Called on every rank; rank 0 writes validation_res/{name}.mp4 at self.fps (with its
        sound, from `sounds`, at the adapter's sound_rate), and with validation.save_frames the
        frames themselves (what was encoded, exactly) as {name}.safetensors. A failed write (a full
        disk) stops every rank, naming the file."""
        paths = [self.out_dir / f"{name}.mp4" for name in names]
        with ranks.all_or_none():
            if self.d.is_main:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                for i, (path, clip) in enumerate(zip(paths, clips)):
                    sound, rate = (sounds[i], self.adapter.sound_rate) if sounds else (None, 0)
                    write_mp4(path, clip, self.fps, sound, rate)
                    if self.cfg.save_frames:
                        with faults.written(path.with_suffix(".safetensors"), CLIP_FIX) as tmp:
                            save_file({"frames": clip.contiguous()}, tmp)
        return paths if self.d.is_main else []

    def beside(self, i: int, clip: torch.Tensor) -> torch.Tensor:
        """Prompt i's clip [F, H, W, 3] with its conditions side by side in one clip: control video,
        mask, first image and references to its left, last image to its right; each image held for
        every frame, at the clip's size."""

        def held(image) -> torch.Tensor:
            still = np.array(image.convert("RGB").resize((clip.shape[2], clip.shape[1])))
            return torch.from_numpy(still).expand(len(clip), -1, -1, -1)

        left = [self.images[i], *self.references[i]]
        return torch.cat(
            [
                *(c for c in (self.controls[i], self.masks[i]) if c is not None),
                *(held(image) for image in left if image is not None),
                clip,
                *(held(image) for image in (self.last_images[i],) if image is not None),
            ],
            dim=2,
        )

    def run(self, model, step: int, metrics, autocast) -> dict[str, float]:
        """The training-time validation: mp4s, val/clip_{i} (the clip beside its conditions) and
        val/prompt_{i}; returns time and peak memory."""
        if not self.prompts:
            return {}
        start = time.perf_counter()
        clips = self.render(model, autocast)
        self.save(clips, [f"step_{step}_prompt_{i}" for i in range(len(self.prompts))], self.sounds)
        for i, (prompt, clip) in enumerate(zip(self.prompts, clips)):
            metrics.clip(step, f"val/clip_{i}", self.beside(i, clip), self.fps)
            if self.sounds:
                metrics.audio(step, f"val/audio_{i}", self.sounds[i], self.adapter.sound_rate)
            metrics.text(step, f"val/prompt_{i}", prompt)
        peak = ranks.max_over_ranks(torch.tensor(memory.peak_memory_gb(self.d.device), device=self.d.device))
        return {"val/time_s": time.perf_counter() - start, "val/peak_mem_gb": peak.item()}


# --------------------------------------------------------------------------------------------------
# Validation clips' media: the conditions they are rendered from, read; the clips, written.
#
# The conditions: a validation image upright as displayed, a control video (or Wan VACE's mask) at the
# clip's frame times, covering its size and centre-cropped to it, as the pipelines take them; a bad
# file is a ConfigError naming the key or flag that gave it. The clips: the VAE's output as frames
# rounded as diffusers rounds them, written as H.264 mp4 with the soundtrack as AAC beside it, under a
# temporary name (faults.written: a full disk names the file). ClipRenderer uses them.


def to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output [C, F, H, W] in [-1, 1] -> float frames [F, H, W, C] in [0, 1], as the pipeline's
    postprocess."""
    return (pixels.float() * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).cpu()


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """As diffusers' numpy_to_pil rounds."""
    return (frames * 255).round().to(torch.uint8)


CLIP_FIX = (
    "free space (or move run.output_dir) and launch again; a training run resumes from its last checkpoint"
)


def write_mp4(
    path: Path, frames: torch.Tensor, fps: Fraction, sound: torch.Tensor | None = None, rate: int = 0
) -> None:
    """uint8 [F, H, W, 3] -> H.264 mp4, with `sound` (float [channels, samples] at `rate`) as AAC
    beside it. yuv420p (what players accept) needs even sizes: odd ones get their last row or column
    repeated. Written under a temporary name, then renamed."""
    if frames.shape[1] % 2:
        frames = torch.cat([frames, frames[:, -1:]], dim=1)
    if frames.shape[2] % 2:
        frames = torch.cat([frames, frames[:, :, -1:]], dim=2)
    with faults.written(path, CLIP_FIX) as tmp, av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        # Every stream before the first packet: the header is written then.
        audio = (
            None
            if sound is None
            else container.add_stream("aac", rate=rate, layout="stereo" if len(sound) == 2 else "mono")
        )
        for frame in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:
            write_aac(container, audio, sound, rate)


def write_aac(container, stream, sound: torch.Tensor, rate: int) -> None:
    """float [channels, samples] into the AAC `stream`, clipped to [-1, 1]."""
    samples = sound.clamp(-1, 1).contiguous().numpy()
    for start in range(0, samples.shape[1], 1024):  # AAC's frame size
        frame = av.AudioFrame.from_ndarray(
            samples[:, start : start + 1024], format="fltp", layout=stream.layout.name
        )
        frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def load_image(path: str, key: str = "images"):
    """A validation image (of validation.<key>), upright as displayed (EXIF orientation), in RGB: the
    pipeline resizes it."""
    try:
        return decode.open_image(Path(path))
    except decode.MediaError as e:
        raise ConfigError(
            f"validation image {path} is unreadable ({e}): fix {VALIDATION_FILES[key]}"
        ) from None


def load_control(path: str, resolution, rate: float, mask: bool = False) -> torch.Tensor:
    """A validation control video (with `mask`, Wan VACE's mask: a video, or an image for every
    frame): the frames shown at the clip's frame times from its first frame, resized to cover the
    clip's size (keeping its aspect) and centre-cropped to it, as LTX2InContextPipeline's crop mode
    does: uint8 [F, H, W, 3]."""
    frames, height, width = resolution
    try:
        media = decode.probe(Path(path))
        if decode.available_frames(media, rate) < frames and not (mask and media.image):
            raise decode.MediaError(
                f"has {decode.available_frames(media, rate)} frames at {rate:g} fps, and the "
                f"clips have {frames}"
            )
        scale = max(height / media.height, width / media.width)
        resized = (max(height, round(media.height * scale)), max(width, round(media.width * scale)))
        crop = ((resized[0] - height) // 2, (resized[1] - width) // 2, height, width)
        times = [k / rate for k in range(frames)]
        return torch.from_numpy(decode.read_frames(Path(path), media, times, resized, crop, False))
    except decode.MediaError as e:
        keys = "masks or --mask" if mask else "control_videos or --control"
        raise ConfigError(
            f"validation {'mask' if mask else 'control video'} {path} {e}: fix validation.{keys}"
        ) from None


if __name__ == "__main__":  # the render command's old name
    sys.exit("the render command is `python render.py` (same arguments); validate.py renders nothing")
