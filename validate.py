"""Validation: the held-out loss at fixed timesteps, and clips rendered by our own sampling loop.

    python validate.py --cfg FILE.toml [--checkpoint DIR [--online] | --lora FILE] --prompt TEXT [--image FILE] [--prompt TEXT ...]
    torchrun --nproc_per_node N validate.py ...       # the same, prompts spread over the ranks

The training loss of uniform-t v-prediction is dominated by which t were drawn and looks flat; the
held-out loss measures every held-out clip at the same timesteps with the same noise every time, so
successive values are comparable.

The sampling loop is CogVideoXPipeline's, step for step: the same T5 embeddings, scheduler steps and
guidance (cond and uncond in one forward), and, given the same generator, the same initial and
per-step noise, so its clips match the pipeline's. Clip i draws all its noise from a generator keyed
by (validation.seed, i): it does not depend on the step, the rank that renders it or the number of
ranks. Attention runs through FusedQKVAttention for the duration of sampling only.
"""

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path

import av
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image, ImageOps
from safetensors.torch import save_file
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb

import ckpt
import data
import faults
import lora
import parallel
from config import Config, ConfigError, DataConfig, ValidationConfig, check_values
from model import EMA, build_model
from model_adapter import load_adapter

log = logging.getLogger("vidtrain")
SCHEDULERS = {"dpm": CogVideoXDPMScheduler, "ddim": CogVideoXDDIMScheduler}


@torch.no_grad()
def held_out_loss(adapter, model, cache, clips: list, cfg: ValidationConfig, seed: int, d: parallel.Dist, autocast):
    """val/loss and val/loss_t{t}. Clip i is measured on rank i % world; every rank makes the same
    number of forward calls (FSDP needs it), the padding ones weighted 0."""
    if not clips:
        return {}
    timesteps = torch.tensor(cfg.loss_timesteps, device=d.device)
    sums = torch.zeros(len(timesteps), device=d.device)
    was_training = model.training
    model.eval()
    for j in range(math.ceil(len(clips) / d.world)):
        index = j * d.world + d.rank
        weight = 1.0 if index < len(clips) else 0.0
        batch = cache.load_batch([clips[min(index, len(clips) - 1)]])
        x0 = adapter.clean_latents(batch["latent_mean"].to(d.device), batch["latent_logvar"].to(d.device), None)
        condition = adapter.batch_condition(batch, x0.shape[1], None)
        x0 = x0.expand(len(timesteps), -1, -1, -1, -1)
        condition = None if condition is None else condition.expand(len(timesteps), -1, -1, -1, -1)
        noise = torch.randn(x0.shape[1:], generator=data.keyed_generator(seed, "held_out", index)).to(d.device)
        embeds = batch["prompt_embeds"].to(d.device).expand(len(timesteps), -1, -1)
        with autocast:
            sums += weight * adapter.loss(model, x0, embeds, timesteps, noise.expand_as(x0), condition)
    model.train(was_training)
    dist.all_reduce(sums)
    losses = (sums / len(clips)).tolist()
    return {"val/loss": sum(losses) / len(losses), **{f"val/loss_t{t}": v for t, v in zip(cfg.loss_timesteps, losses)}}


class FusedQKVAttention:
    """diffusers' CogVideoXAttnProcessor2_0 with Q, K and V from one matmul over the concatenated base
    weights, then F.scaled_dot_product_attention (FlashAttention/cuDNN on GPU). LoRA runs unmerged beside
    it, exactly as in training: merging it into a bf16 copy of the weights would round away the small
    deltas of early training (diffusers' own fuse_qkv_projections drops LoRA altogether). The fused
    weight is built on every call, inside the block's forward: under FSDP that is when the block's
    parameters are gathered, and it is freed with them, so no rank holds a second copy of the model."""

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("FusedQKVAttention serves CogVideoX's joint attention, which takes no attention mask")
        text_length = encoder_hidden_states.size(1)
        tokens = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, length, _ = tokens.shape
        projections = (attn.to_q, attn.to_k, attn.to_v)
        weight = torch.cat([p.weight for p in projections])
        bias = None if attn.to_q.bias is None else torch.cat([p.bias for p in projections])
        outputs = F.linear(tokens, weight, bias).chunk(3, dim=-1)
        outputs = [p.add_delta(out, tokens) if isinstance(p, lora.LoRALinear) else out
                   for p, out in zip(projections, outputs)]
        qkv = torch.cat(outputs, dim=-1).view(batch, length, 3, attn.heads, -1).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:  # video tokens only, as the diffusers processor does
            query = torch.cat([query[:, :, :text_length], apply_rotary_emb(query[:, :, text_length:], image_rotary_emb)], 2)
            if not attn.is_cross_attention:
                key = torch.cat([key[:, :, :text_length], apply_rotary_emb(key[:, :, text_length:], image_rotary_emb)], 2)
        out = F.scaled_dot_product_attention(query, key, value)
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(batch, length, -1)))
        return out[:, text_length:], out[:, :text_length]


@contextlib.contextmanager
def fused_attention(model: torch.nn.Module):
    """FusedQKVAttention on every attention layer while the block runs; the original processors after."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    originals = [m.processor for m in layers]
    for layer in layers:
        layer.set_processor(FusedQKVAttention())
    try:
        yield
    finally:
        for layer, processor in zip(layers, originals):
            layer.set_processor(processor)


def load_scheduler(adapter, name: str):
    """The sampler named by validation.scheduler, configured from the model's scheduler/ folder."""
    return SCHEDULERS[name].from_config(adapter.scheduler.config)


@torch.no_grad()
def sample_latents(adapter, model, scheduler, prompt_embeds, negative_embeds, generator: torch.Generator,
                   cfg: ValidationConfig, resolution: list[int], autocast, on_step=lambda i: None,
                   image=None) -> torch.Tensor:
    """Denoised latents [1, F', C, h, w] of one prompt (and, image-to-video, its conditioning image):
    CogVideoXPipeline.__call__'s loop (CogVideoXImageToVideoPipeline's), with every draw from `generator`
    (a CPU generator, as the pipeline uses it). Latents and scheduler math stay fp32. on_step(i) runs
    before sampling step i (from 1): the renderer's stop check."""
    frames, height, width = resolution
    latent_frames = (frames - 1) // adapter.temporal_ratio + 1
    # CogVideoX 1.5: noise for extra leading frames up to a multiple of patch_size_t, dropped at the end.
    extra = adapter.extra_frames(latent_frames)
    shape = (1, latent_frames + extra, adapter.vae_config["latent_channels"],
             height // adapter.spatial_ratio, width // adapter.spatial_ratio)
    # The pipeline draws the image's latent from the generator before the noise.
    condition = None if image is None else adapter.sampling_image_condition(image, resolution, shape[1], generator)
    latents = torch.randn(shape, generator=generator).to(adapter.device) * scheduler.init_noise_sigma
    scheduler.set_timesteps(cfg.num_inference_steps, device=adapter.device)
    rotary = adapter.rotary_embeddings(shape[1], shape[3], shape[4])
    guided = cfg.guidance_scale > 1.0
    embeds = torch.cat([negative_embeds, prompt_embeds]) if guided else prompt_embeds
    if condition is not None and guided:
        condition = torch.cat([condition] * 2)
    steps, previous_x0 = cfg.num_inference_steps, None
    for i, t in enumerate(scheduler.timesteps):
        on_step(i + 1)
        x_t = scheduler.scale_model_input(torch.cat([latents] * 2) if guided else latents, t)
        with autocast:
            v = adapter.predict_v(model, x_t, t.expand(x_t.shape[0]), embeds, rotary, condition)
        if guided:
            scale = cfg.guidance_scale
            if cfg.use_dynamic_cfg:  # the pipeline's formula, which uses the timestep t, not the step index
                scale = 1 + scale * (1 - math.cos(math.pi * ((steps - t.item()) / steps) ** 5.0)) / 2
            uncond, cond = v.chunk(2)
            v = uncond + scale * (cond - uncond)
        if isinstance(scheduler, CogVideoXDPMScheduler):
            t_back = scheduler.timesteps[i - 1] if i > 0 else None
            latents, previous_x0 = scheduler.step(v, previous_x0, t, t_back, latents, generator=generator,
                                                  return_dict=False)
        else:
            latents = scheduler.step(v, t, latents, generator=generator, return_dict=False)[0]
    return latents[:, extra:]


def to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output [C, F, H, W] in [-1, 1] -> float frames [F, H, W, C] in [0, 1], as the pipeline's postprocess."""
    return (pixels.float() * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).cpu()


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """As diffusers' numpy_to_pil rounds."""
    return (frames * 255).round().to(torch.uint8)


def write_mp4(path: Path, frames: torch.Tensor, fps: int) -> None:
    """uint8 [F, H, W, 3] -> H.264 mp4. yuv420p (what players accept) needs even sizes: odd ones get
    their last row or column repeated. Written under a temporary name, then renamed."""
    if frames.shape[1] % 2:
        frames = torch.cat([frames, frames[:, -1:]], dim=1)
    if frames.shape[2] % 2:
        frames = torch.cat([frames, frames[:, :, -1:]], dim=2)
    tmp = path.with_name(path.name + ".tmp")
    with av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    os.replace(tmp, path)


def load_image(path: str):
    """A validation image, upright as displayed (EXIF orientation), in RGB: the pipeline resizes it."""
    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except OSError as e:
        raise ConfigError(f"validation image {path} is unreadable ({e}): fix validation.images or --image") from None


class ClipRenderer:
    """The validation prompts' clips. Embeddings are computed once, here; clip i is rendered on rank
    i % world, every rank making the same number of forward calls (FSDP needs it); rank 0 gathers and
    writes them. Ranks advance in lockstep, so no collective waits longer than one forward or decode."""

    def __init__(self, adapter, cfg: ValidationConfig, data_cfg: DataConfig, output_dir: str, d: parallel.Dist):
        self.adapter, self.cfg, self.d = adapter, cfg, d
        self.resolution = cfg.resolution or (data_cfg.buckets or [data_cfg.train_resolution])[0]
        key = "validation.resolution" if cfg.resolution else "data.buckets[0]" if data_cfg.buckets else "data.train_resolution"
        adapter.check_resolution(self.resolution, key)
        self.out_dir = Path(output_dir) / "validation_res"
        self.prompts, self.sampling_steps = list(cfg.prompts), 0  # steps taken, counted for fault injection
        self.images = [load_image(path) for path in cfg.images] or [None] * len(self.prompts)
        if self.prompts:
            embeds = adapter.encode_text([cfg.negative_prompt, *self.prompts])
            self.negative_embeds, self.prompt_embeds = embeds[:1], embeds[1:]
            adapter.release_text_encoder()  # not needed again

    def frames(self, model, index: int, scheduler, autocast, on_step=lambda i: None) -> torch.Tensor:
        """Float frames [F, H, W, 3] in [0, 1] of prompt `index`."""
        generator = data.keyed_generator(self.cfg.seed, index)
        latents = sample_latents(self.adapter, model, scheduler, self.prompt_embeds[index : index + 1],
                                 self.negative_embeds, generator, self.cfg, self.resolution, autocast, on_step,
                                 self.images[index])
        return to_frames(self.adapter.decode_latents(latents)[0])

    def _on_step(self, i: int) -> None:
        """Between sampling steps every rank learns whether any got a stop signal (a collective: every
        rank samples in lockstep), so a render never outlasts a scheduler's grace period by much."""
        self.sampling_steps += 1
        faults.fault("render", self.sampling_steps)
        parallel.stop_if_preempted(self.d, "during validation")

    def render(self, model, autocast) -> list[torch.Tensor]:
        """Called on every rank: uint8 clips [F, H, W, 3] of every prompt on rank 0, [] on the others."""
        was_training = model.training
        model.eval()
        scheduler = load_scheduler(self.adapter, self.cfg.scheduler)
        num_frames, height, width = self.resolution
        clips = []
        try:
            with fused_attention(model):
                for j in range(math.ceil(len(self.prompts) / self.d.world)):
                    index = j * self.d.world + self.d.rank
                    if index < len(self.prompts):
                        clip = to_uint8(self.frames(model, index, scheduler, autocast, self._on_step))
                    else:  # a padding rank: its forward calls are needed, its clip is not
                        sample_latents(self.adapter, model, scheduler, self.prompt_embeds[-1:], self.negative_embeds,
                                       data.keyed_generator(self.cfg.seed, index), self.cfg, self.resolution, autocast,
                                       self._on_step, self.images[-1])
                        clip = torch.zeros(num_frames, height, width, 3, dtype=torch.uint8)
                    gathered = [torch.empty_like(clip) for _ in range(self.d.world)] if self.d.is_main else None
                    dist.gather(clip, gathered, dst=0)
                    clips += gathered or []
        finally:
            model.train(was_training)
            self.adapter.park_vae()  # on the CPU until the next validation: no second load from disk
        return clips[: len(self.prompts)]

    def save(self, clips: list[torch.Tensor], name: str) -> list[Path]:
        """Rank 0: validation_res/{name}_prompt_{i}.mp4 at gen_fps, and with validation.save_frames the
        frames themselves (what was encoded, exactly) as {name}_prompt_{i}.safetensors."""
        if not self.d.is_main:
            return []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        paths = [self.out_dir / f"{name}_prompt_{i}.mp4" for i in range(len(clips))]
        for path, clip in zip(paths, clips):
            write_mp4(path, clip, self.cfg.gen_fps)
            if self.cfg.save_frames:
                save_file({"frames": clip.contiguous()}, path.with_suffix(".safetensors"))
        return paths

    def run(self, model, step: int, metrics, autocast) -> dict[str, float]:
        """The training-time validation: mp4s, val/clip_{i} and val/prompt_{i}; returns time and peak memory."""
        if not self.prompts:
            return {}
        start = time.perf_counter()
        clips = self.render(model, autocast)
        self.save(clips, f"step_{step}")
        for i, (prompt, clip) in enumerate(zip(self.prompts, clips)):
            metrics.clip(step, f"val/clip_{i}", clip, self.cfg.gen_fps)
            metrics.text(step, f"val/prompt_{i}", prompt)
        peak = parallel.max_over_ranks(torch.tensor(parallel.peak_memory_gb(self.d.device), device=self.d.device))
        return {"val/time_s": time.perf_counter() - start, "val/peak_mem_gb": peak.item()}


def load_model(cfg: Config, adapter, d: parallel.Dist, checkpoint: str | None, lora_file: str | None,
               online: bool = False):
    """The transformer as the trainer builds it (LoRA injected, DDP or FSDP), holding the weights of a
    checkpoint (its EMA weights when it has them, as in-training validation, unless `online`), of an
    exported LoRA file, or the base model's."""
    lora_cfg = dataclasses.replace(cfg.lora, init_from="")  # a checkpoint or --lora decides the weights
    model = build_model(adapter, cfg.train, lora_cfg, cfg.parallel, cfg.run.seed, d, lora_file or "")
    if checkpoint:
        ema = EMA(model, cfg.train.ema_decay) if ckpt.has_ema(checkpoint) and not online else None
        ckpt.load_weights(model, checkpoint, cfg.train.training_type, ckpt.run_identity(cfg, adapter), d, ema)
        if ema is not None:
            ema.swap_in()
            log.info("rendering with the checkpoint's EMA weights (--online renders the others)")
    return model


def render_command(cfg: Config, prompts: list[str], images: list[str], checkpoint: str | None,
                   lora_file: str | None, online: bool, d: parallel.Dist) -> None:
    if prompts:  # the command line's prompts (and images) replace the config's
        cfg.validation.prompts, cfg.validation.images = prompts, images
        check_values(cfg)
    if not cfg.validation.prompts:
        raise ConfigError("nothing to render: pass --prompt TEXT or set validation.prompts in the config")
    with parallel.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
        renderer = ClipRenderer(adapter, cfg.validation, cfg.data, cfg.run.output_dir, d)
        model = load_model(cfg, adapter, d, checkpoint, lora_file, online)
    mixed = cfg.train.mixed_precision
    autocast = torch.autocast(d.device.type, dtype=parallel.AUTOCAST_DTYPES[mixed], enabled=mixed != "no")
    source = Path(checkpoint).name if checkpoint else Path(lora_file).stem if lora_file else "base"
    for path in renderer.save(renderer.render(model, autocast), f"render_{source}{'_online' if online else ''}"):
        log.info("wrote %s", path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", required=True, help="TOML config file (a run's config.toml for its checkpoints)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a checkpoint-N folder of a run trained with --cfg")
    source.add_argument("--lora", help="an exported LoRA: ours, diffusers' or PEFT's layout")
    parser.add_argument("--online", action="store_true", help="with --checkpoint: the online weights, not the EMA")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); default: validation.prompts")
    parser.add_argument("--image", action="append", default=[], help="i2v: the image of each --prompt, in order")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.online and not args.checkpoint:
        parser.error("--online chooses between a checkpoint's weights: it needs --checkpoint")
    if args.image and not args.prompt:
        parser.error("--image goes with --prompt: one image per prompt")
    parallel.run_command(lambda cfg, d: render_command(cfg, args.prompt, args.image, args.checkpoint, args.lora,
                                                       args.online, d), args.cfg, overrides)


if __name__ == "__main__":
    main()
