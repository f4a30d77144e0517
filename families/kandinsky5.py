"""Kandinsky 5 Video (Lite and Pro): text- and image-to-video.

Kandinsky 5 (docs/models/kandinsky5.md): Kandinsky5Transformer3DModel, a text stream of its own
blocks (Qwen2.5-VL's hidden states, no padding: no attention mask) and a visual stream that
cross-attends to it; CLIP's pooled embedding joins the timestep's; the HunyuanVideo VAE, latents
scaled by its scaling_factor. Every published video model has visual_cond: the transformer's input
is the noisy latents, a visual condition (zeros) and its mask, channel-last. Image-to-video puts the
image's clean latent in the first latent frame of the noisy latents with the mask 1 there, as the
makers' generation_utils.generate and diffusers' Kandinsky5I2VPipeline do.

Flow matching: x_t = (1 - s) x0 + s e, the target e - x0, the loss in fp32, the model timestep
1000 s; s logit-normal then shifted by train.flow_shift (5 by default: musubi-tuner's recipe).
The sampling pieces are Kandinsky5T2VPipeline's and Kandinsky5I2VPipeline's loops.
"""

import contextlib
import json
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, Qwen2_5_VLForConditionalGeneration

from config import Config, ConfigError, ModelConfig
from model_adapter import TIMESTEP_KEYS, Adapter, RunSettings, log, masked_mean, sample_posterior, to_device
from parallel import SequenceSplit, split_blocks, stack_qkv
from weights import resolved_config

# The pipelines' max_sequence_length: Qwen's tokens after the template's first 128, at most.
TEXT_LENGTH = 512
# train.flow_shift's default: musubi-tuner's Kandinsky 5 recipe (--timestep_sampling shift
# --discrete_flow_shift 5.0, its Kandinsky 5 guide); the makers publish no trainer.
TRAIN_SHIFT = 5.0
PIPELINES = {"Kandinsky5T2VPipeline": "t2v", "Kandinsky5I2VPipeline": "i2v"}
# The makers' checkpoints and ComfyUI's (comfy/ldm/kandinsky5/model.py) name every module as
# diffusers does: a key every video DiT of theirs holds, and none of another family's.
SINGLE_FILE_KEY = "pooled_text_embeddings.in_layer.weight"
# The published folders without weights (Adapter.PUBLISHED; docs/models/kandinsky5.md, Published
# configs): the Lite and Pro transformers as the makers' k5_*_t2v_5s_sft_sd.yaml give them; the
# HunyuanVideo VAE's and the scheduler's class defaults (memory does not depend on their values);
# Qwen2.5-VL 7B's language model and vision tower (Qwen/Qwen2.5-VL-7B-Instruct's config.json: the
# class's default vision config is 3584 wide, 3.1B parameters against the published 0.7B) and
# CLIP ViT-L/14's text model.
KANDINSKY5_COMMON = {
    "in_visual_dim": 16,
    "out_visual_dim": 16,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
    "patch_size": [1, 2, 2],
    "visual_cond": True,
}
LITE = {"model_dim": 1792, "ff_dim": 7168, "time_dim": 512, "num_text_blocks": 2, "num_visual_blocks": 32}
PRO = {"model_dim": 4096, "ff_dim": 16384, "time_dim": 1024, "num_text_blocks": 4, "num_visual_blocks": 60}
PUBLISHED_FOLDERS = {
    name: {
        "model_index.json": {"_class_name": "Kandinsky5T2VPipeline"},
        "transformer": {
            "_class_name": "Kandinsky5Transformer3DModel",
            **KANDINSKY5_COMMON,
            **size,
            "axes_dims": axes,
        },
        "vae": {"_class_name": "AutoencoderKLHunyuanVideo"},
        "text_encoder": {
            "model_type": "qwen2_5_vl",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "vision_config": {
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "out_hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
        },
        "tokenizer": {},
        "text_encoder_2": {"model_type": "clip_text_model", "hidden_size": 768, "projection_dim": 768},
        "tokenizer_2": {},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler"},
    }
    for name, size, axes in (
        ("kandinsky5-lite-t2v-5s", LITE, [16, 24, 24]),
        ("kandinsky5-pro-t2v-5s", PRO, [32, 48, 48]),
    )
}


class Kandinsky5Adapter(Adapter):
    FAMILY = "kandinsky5"
    READS = ("train.flow_shift",) + TIMESTEP_KEYS
    # No "image": image-to-video conditions on the clip's own first latent frame (the causal VAE
    # encodes frame 0 alone, as the pipeline encodes the image).
    ENCODERS = {
        "video": ("vae",),
        "text": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    }
    TRANSFORMER, VAE = Kandinsky5Transformer3DModel, AutoencoderKLHunyuanVideo
    TEXT_ENCODER = Qwen2_5_VLForConditionalGeneration
    COMFY = True
    SINGLE_FILE_KEY = SINGLE_FILE_KEY
    TYPES = ("t2v", "i2v")
    PUBLISHED = PUBLISHED_FOLDERS

    def __init__(self, cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()):
        super().__init__(cfg, device, run)
        for name in ("text_encoder_2", "tokenizer_2"):
            if not (self.path / name).is_dir():
                raise ConfigError(
                    f"model.path = {cfg.path} has no {name}/ folder (Kandinsky 5's CLIP): the model "
                    "copy is incomplete"
                )
        pipeline = json.loads((self.path / "model_index.json").read_text())["_class_name"]
        if PIPELINES.get(pipeline, cfg.type) != cfg.type:
            raise ConfigError(
                f'model.type = "{cfg.type}", but {cfg.path} is a {pipeline} model: set '
                f'model.type = "{PIPELINES[pipeline]}"'
            )
        self.transformer_config = resolved_config(Kandinsky5Transformer3DModel, self.path, "transformer")
        self.vae_config = resolved_config(AutoencoderKLHunyuanVideo, self.path, "vae")
        if cfg.type == "i2v" and not self.transformer_config["visual_cond"]:
            raise ConfigError(
                f'model.type = "i2v", but {cfg.path}/transformer has no visual_cond (no condition '
                'mask to mark the image\'s frame): set model.type = "t2v"'
            )
        self.scaling = self.vae_config["scaling_factor"]
        self.shift = run.flow_shift or TRAIN_SHIFT
        self._text_encoder_2 = self._tokenizer_2 = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Weights in bf16 or fp16 need autocast, as Wan's."""
        super().check_config(cfg)
        dtype = cfg.model.dtype
        if dtype != "fp32" and cfg.train.mixed_precision == "no":
            raise ConfigError(
                f'model.dtype = "{dtype}" with train.mixed_precision = "no": Kandinsky 5\'s fp32 '
                "modules (time embeddings, modulations) meet the other weights' dtype only under "
                f'autocast; set train.mixed_precision = "{dtype}", or model.dtype = "fp32"'
            )

    # Shape rules, read from the model's own config.
    @property
    def frame_multiple(self) -> int:
        # 4k+1 frames: the causal VAE encodes [0], [1:5], [5:9], ...
        return self.temporal_ratio * self.transformer_config["patch_size"][0]

    @property
    def size_multiple(self) -> int:
        return self.spatial_ratio * self.transformer_config["patch_size"][1]

    def check_resolution(self, resolution, key: str) -> None:
        """Image-to-video renders: the pipeline matches the first 4 latent frames' statistics to the
        next ones' (normalize_first_frame), which a clip of fewer than 5 latent frames lacks (its
        frames come out NaN)."""
        super().check_resolution(resolution, key)
        if self.type == "i2v" and (resolution[0] - 1) // self.temporal_ratio + 1 < 5:
            raise ConfigError(
                f"{key} frames = {resolution[0]}: Kandinsky 5's image-to-video render normalises its "
                "first 4 latent frames by the next, so it needs at least 5 latent frames: use at "
                f"least {4 * self.temporal_ratio + 1} frames"
            )

    @property
    def text_length(self) -> dict[str, int]:
        return {"prompt_embeds_qwen": TEXT_LENGTH, "prompt_embeds_clip": 1}

    @property
    def text_width(self) -> dict[str, int]:
        c = self.transformer_config
        return {"prompt_embeds_qwen": c["in_text_dim"], "prompt_embeds_clip": c["in_text_dim2"]}

    @property
    def published_fps(self) -> int:
        return 24  # 121 frames for 5 s, 241 for 10 s (docs/models/kandinsky5.md)

    @property
    def block_count(self) -> int:
        """The text stream's blocks and the visual stream's."""
        return self.transformer_config["num_text_blocks"] + self.transformer_config["num_visual_blocks"]

    @property
    def sequence_heads(self) -> list[int]:
        """model_dim / head_dim (the rotary axes' sum): 28 for Lite, 32 for Pro."""
        config = self.transformer_config
        return [config["model_dim"] // sum(config["axes_dims"])]

    def comfy_key(self, module: str) -> str | None:
        """ComfyUI's Kandinsky 5 model names its modules as diffusers does."""
        return module

    def diffusers_key(self, original: str) -> str | None:
        return original

    @staticmethod
    def single_file_key(key: str) -> str | None:
        return key

    @staticmethod
    def diffusers_names(keys: list[str]) -> dict[str, str]:
        return {key: key for key in keys}

    # Encoders.
    def _text(self):
        """Qwen2.5-VL and its tokenizer; CLIP and its tokenizer beside them."""
        if self._text_encoder is None:
            log.info("loading text encoders from %s", self.path)
            self._text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                self.path, subfolder="text_encoder", dtype=self.dtype
            )
            self._tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder="tokenizer")
            self._text_encoder_2 = CLIPTextModel.from_pretrained(
                self.path, subfolder="text_encoder_2", dtype=self.dtype
            )
            self._tokenizer_2 = CLIPTokenizer.from_pretrained(self.path, subfolder="tokenizer_2")
            for encoder in (self._text_encoder, self._text_encoder_2):
                encoder.to(self.device).requires_grad_(False).eval()
        return self._text_encoder, self._tokenizer

    def release_text_encoder(self) -> None:
        self._text_encoder_2 = self._tokenizer_2 = None
        super().release_text_encoder()

    def release_encoders(self) -> None:
        self._text_encoder_2 = self._tokenizer_2 = None
        super().release_encoders()

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's own encode_prompt, prompt by prompt (its Qwen batch would pad, and the
        transformer takes no text mask): prompt_embeds_qwen [B, 512, D] with the rows past each
        prompt's zero, prompt_embeds_clip [B, 1, 768] (CLIP's pooled output)."""
        text_encoder, tokenizer = self._text()
        pipe = Kandinsky5T2VPipeline(
            None, None, text_encoder, tokenizer, self._text_encoder_2, self._tokenizer_2, None
        )
        qwen, clip = [], []
        for prompt in prompts:
            embeds, pooled, _ = pipe.encode_prompt(
                [prompt], max_sequence_length=TEXT_LENGTH, device=self.device, dtype=self.dtype
            )
            qwen.append(F.pad(embeds[0], (0, 0, 0, TEXT_LENGTH - embeds.shape[1])))
            clip.append(pooled)
        return {"prompt_embeds_qwen": torch.stack(qwen), "prompt_embeds_clip": torch.stack(clip)}

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [B, F, H, W, 3] -> posterior mean and log-variance [B, C, F', h, w] (not scaled)."""
        posterior = self._load_vae().encode(self._pixels(video)).latent_dist
        return posterior.mean, posterior.logvar

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents [B, C, F', h, w] -> pixels [B, 3, F, H, W] in [-1, 1], as the pipeline."""
        vae = self._load_vae()
        latents = latents.to(self.vae_dtype) / self.scaling
        return torch.cat([vae.decode(clip, return_dict=False)[0] for clip in latents.split(1)])

    # The transformer's call, as the pipelines make it.
    def _predict(self, transformer, x, t, qwen, clip) -> torch.Tensor:
        """The velocity [n, C, F', h, w] (fp32) of latents x [n, C, F', h, w] at model timesteps t
        [n], for one prompt: its Qwen rows [L, D] (no padding) and CLIP embedding [D]. Channel-last
        input: the latents, then (visual_cond) a zero condition and its mask, 1 on the first latent
        frame for image-to-video (which the caller holds clean there). The timesteps go in as
        given: fp32 in training, as the makers' model takes them (generation_utils.py:102)."""
        dtype = compute_dtype(transformer)
        n, _, frames, height, width = x.shape
        x = x.permute(0, 2, 3, 4, 1)
        if self.transformer_config["visual_cond"]:
            mask = x.new_zeros(*x.shape[:-1], 1)
            if self.type == "i2v":
                mask[:, :1] = 1
            x = torch.cat([x, torch.zeros_like(x), mask], dim=-1)
        patch = self.transformer_config["patch_size"]
        visual_rope_pos = [
            torch.arange(frames // patch[0], device=self.device),
            torch.arange(height // patch[1], device=self.device),
            torch.arange(width // patch[2], device=self.device),
        ]
        out = transformer(
            hidden_states=x.to(dtype),
            encoder_hidden_states=qwen.to(dtype).expand(n, -1, -1),
            pooled_projections=clip.to(dtype).expand(n, -1),
            timestep=t,
            visual_rope_pos=visual_rope_pos,
            text_rope_pos=torch.arange(len(qwen), device=self.device),
            # the pipelines' rotary scale by the clip's pixel size: (1, 2, 2) within 480p, else
            # (1, 3.16, 3.16)
            scale_factor=Kandinsky5T2VPipeline._get_scale_factor(
                None, height * self.spatial_ratio, width * self.spatial_ratio
            ),
            # the tensor itself, not a tuple
            return_dict=False,
        )
        return out.permute(0, 4, 1, 2, 3).float()

    @staticmethod
    def _prompt(texts: dict, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s Qwen rows without padding and its CLIP embedding, from a padded batch."""
        mask = texts["prompt_embeds_qwen_mask"][row].to(texts["prompt_embeds_qwen"].device)
        return texts["prompt_embeds_qwen"][row][mask], texts["prompt_embeds_clip"][row, 0]

    # Training.
    def _sigmas(self, generators) -> torch.Tensor:
        """s per sample: sigmoid of a normal draw, shifted (musubi-tuner's "shift" sampling); or
        train.timestep_sampling's draw."""
        if self.timestep_sampling.sampling:
            return self.timestep_sampling.draw(generators)
        s = torch.sigmoid(torch.stack([torch.randn((), generator=g) for g in generators]))
        return self.shift * s / (1 + (self.shift - 1) * s)

    def _loss(self, transformer, x0, noise, sigmas, batch, rows) -> torch.Tensor:
        """Per-sample losses; `rows[i]` is sample i's prompt row of the batch's text. One forward per
        sample: the transformer takes no text mask, so each prompt goes unpadded (musubi-tuner's
        kandinsky5_train_network.py runs its samples one by one too)."""
        s = sigmas.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        mask = torch.ones_like(x0[:, :1])
        if "loss_mask" in batch:  # data.loss_mask_column
            mask = mask * batch["loss_mask"].to(self.device).float()
        if self.type == "i2v":
            # the clean first latent frame, as the pipeline's image latent; not in the loss
            x_t = torch.cat([x0[:, :, :1], x_t[:, :, 1:]], dim=2)
            mask = torch.cat([torch.zeros_like(mask[:, :, :1]), mask[:, :, 1:]], dim=2)
        texts = {name: batch[name].to(self.device) for name in batch if name.startswith("prompt_embeds")}
        prediction = torch.cat(
            [
                self._predict(
                    transformer, x_t[i : i + 1], 1000 * sigmas[i : i + 1], *self._prompt(texts, row)
                )
                for i, row in enumerate(rows)
            ]
        )
        return masked_mean((prediction - (noise - x0)).pow(2), mask, (1, 2, 3, 4))

    def train_loss(self, transformer, batch: dict[str, torch.Tensor], generators: list[torch.Generator]):
        """Per-sample loss of a cached batch; the latent sample, s and the noise come from each
        sample's own generator, keyed by (seed, step, position in the global batch)."""
        x0 = self.scaling * sample_posterior(
            batch["latent_mean"].to(self.device), batch["latent_logvar"].to(self.device), generators
        )
        sigmas = to_device(self._sigmas(generators), self.device)
        noise = to_device(
            torch.stack([torch.randn(x.shape, generator=g) for x, g in zip(x0, generators)]), self.device
        )
        loss = self._loss(transformer, x0, noise, sigmas, batch, range(len(x0)))
        if self.timestep_sampling.weighting == "none":
            return loss
        return self.timestep_sampling.weight(sigmas) * loss

    def fixed_losses(self, transformer, batch: dict[str, torch.Tensor], timesteps: list[int], generator):
        """The loss of one cached clip (its posterior mean) at each of `timesteps`, with the same
        noise."""
        x0 = self.scaling * batch["latent_mean"].to(self.device).float()
        noise = torch.randn(x0.shape[1:], generator=generator).to(self.device)
        n = len(timesteps)
        return self._loss(
            transformer,
            x0.expand(n, -1, -1, -1, -1),
            noise.expand(n, *noise.shape),
            torch.tensor(timesteps, device=self.device) / 1000,
            batch,
            [0] * n,
        )

    # Parallelism.
    @staticmethod
    def blocks(transformer) -> list[torch.nn.Module]:
        """The text stream's blocks, then the visual stream's: the forward's order."""
        return list(transformer.text_transformer_blocks) + list(transformer.visual_transformer_blocks)

    def split_sequence(self, transformer, split: SequenceSplit) -> None:
        """Sequence parallelism: the visual tokens and their rotary embeddings split at the first
        visual block, gathered after the last; the visual self-attention through an all-to-all, the
        cross-attention to the (whole, replicated) text local. The text stream's blocks run whole on
        every rank."""
        self.sequence = split
        blocks = list(transformer.visual_transformer_blocks)
        split_blocks(blocks, split, lambda arguments: {"rope": 1}, first=("visual_embed",))
        for block in blocks:
            block.self_attention.set_processor(SequenceParallelSelfAttention(split))

    # Sampling: the pipelines' loops, run by validate.sample_latents.
    def sampler(self, name: str):
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")

    def sampling_start(self, scheduler, steps: int, resolution, generator: torch.Generator, image=None):
        """The first noise [1, C, F', h, w] (fp32), drawn channel-last as prepare_latents draws it;
        image-to-video: the image's VAE sample (the same generator, after the noise), scaled, in
        the first latent frame."""
        frames, height, width = resolution
        scheduler.set_timesteps(steps, device=self.device)
        shape = (
            1,
            (frames - 1) // self.temporal_ratio + 1,
            height // self.spatial_ratio,
            width // self.spatial_ratio,
            self.transformer_config["in_visual_dim"],
        )
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).permute(0, 4, 1, 2, 3)
        latents = latents.to(self.device)
        if image is not None:
            pixels = VideoProcessor(vae_scale_factor=self.spatial_ratio).preprocess(image, height, width)
            posterior = (
                self._load_vae().encode(pixels[:, :, None].to(self.device, self.vae_dtype)).latent_dist
            )
            latents[:, :, :1] = self.scaling * posterior.sample(generator=generator).float()
        return SimpleNamespace(scheduler=scheduler, latents=latents)

    def denoise(self, models: dict, state, t: torch.Tensor, embeds: dict, guided: bool) -> torch.Tensor:
        """The velocity at step t, one forward per prompt row (uncond, cond when guided): their
        Qwen rows differ in length. The timestep in the transformer's dtype, as the pipelines pass
        it (in bf16 they round it)."""
        transformer = models[self.transformer_folder]
        t = t.view(1).to(compute_dtype(transformer))
        return torch.cat(
            [
                self._predict(transformer, state.latents, t, *self._prompt(embeds, row))
                for row in range(2 if guided else 1)
            ]
        )

    def sampling_step(self, state, prediction: torch.Tensor, t: torch.Tensor, i: int) -> None:
        """The scheduler's Euler step; image-to-video keeps the first latent frame, as the pipeline."""
        first = int(self.type == "i2v")
        state.latents[:, :, first:] = state.scheduler.step(
            prediction[:, :, first:], t, state.latents[:, :, first:], return_dict=False
        )[0]

    def sampled(self, state) -> torch.Tensor:
        """Image-to-video: the first latent frames' statistics matched to the next ones', as the
        pipeline's normalize_first_frame (the makers' "fix mesh artifacts")."""
        if self.type != "i2v":
            return state.latents
        channel_last = state.latents.permute(0, 2, 3, 4, 1)
        fixed = Kandinsky5I2VPipeline.normalize_first_frame(Kandinsky5I2VPipeline, channel_last)
        return fixed.permute(0, 4, 1, 2, 3)

    def sampling_attention(self, model: torch.nn.Module):
        return contextlib.nullcontext()


def compute_dtype(transformer) -> torch.dtype:
    """The dtype the pipelines cast the transformer's inputs to (diffusers' ModelMixin.dtype): its
    first parameter's outside the modules it keeps in fp32, also through a DDP wrapper."""
    kept = Kandinsky5Transformer3DModel._keep_in_fp32_modules
    return next(p.dtype for n, p in transformer.named_parameters() if not any(m in n for m in kept))


class SequenceParallelSelfAttention:
    """diffusers' Kandinsky5AttnProcessor for the visual self-attention, step for step, with this
    rank's slice of the visual tokens: Q, K and V (normalised and rotated per token) go through one
    all-to-all to the whole sequence with 1/sp of the heads, and the attention's output back."""

    def __init__(self, split: SequenceSplit):
        self.split = split

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        query, key, value = (
            layer(hidden_states).unflatten(-1, (attn.num_heads, -1))
            for layer in (attn.to_query, attn.to_key, attn.to_value)
        )
        query = rotate(attn.query_norm(query.float()).type_as(query), rotary_emb).type_as(query)
        key = rotate(attn.key_norm(key.float()).type_as(key), rotary_emb).type_as(key)
        # [3, B, tokens, heads, D]
        qkv = self.split.seq_to_heads(stack_qkv(query, key, value), 2, 3)
        query, key, value = qkv.transpose(2, 3).unbind(0)
        out = F.scaled_dot_product_attention(query, key, value).transpose(1, 2)
        out = self.split.heads_to_seq(out, 1, 2).flatten(2, 3).type_as(query)
        return attn.out_layer(out)


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Kandinsky5AttnProcessor's rotary embedding (a function inside its __call__), [B, tokens,
    heads, D]; rounded to bf16 as it rounds."""
    pairs = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    return (rope * pairs).sum(dim=-1).reshape(*x.shape).to(torch.bfloat16)
