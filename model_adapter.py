"""What every model family's adapter provides, and the machinery they share.

An adapter knows one family's diffusers classes (families/cogvideox.py, families/wan.py; nothing else imports them):
loading the components from a local diffusers folder (the VAE and text encoder lazily: training from
a complete cache never builds them), encoding video, images and text for the cache, the noise and
the loss, the pieces of the sampling loop (validate.py runs the loop), the transformer blocks (FSDP
and checkpointing units), the exported LoRA's other layouts. Every config value comes from the model
classes' resolved configs: the file's values over the class's defaults, since published files predate
keys newer diffusers versions add.
"""

import contextlib
import inspect
import json
import logging
import math
import re
from fractions import Fraction
from pathlib import Path

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoTokenizer

import parallel
import storage
from config import ConfigError, ModelConfig, check_resolution

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
log = logging.getLogger("vidtrain")


def resolved_config(model_class, path: Path, subfolder: str) -> dict:
    """The config the class builds from a folder: its config.json over the class's own defaults."""
    defaults = {name: p.default for name, p in inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    saved = model_class.load_config(path, subfolder=subfolder)
    return {**defaults, **{k: v for k, v in saved.items() if not k.startswith("_")}}


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter a module registers goes to the meta device at once, so the initialisation that
    follows in the module's __init__ touches no memory (what accelerate's init_empty_weights does; a
    parameter made from a computed tensor, as Wan's small scale_shift_table, is computed first);
    buffers stay real, as the ones no file holds are computed only here."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _replace(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put tensor in place of the parameter or buffer `name` (a parameter stays one, as trainable as it was)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        tensor = torch.nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
        module._parameters[leaf] = tensor
    else:
        module._buffers[leaf] = tensor


# safetensors' dtype names.
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Weights:
    """The safetensors files of a diffusers model folder (one file, or shards listed by an index), read
    one tensor, or one rank's rows of one, at a time. Read with plain reads into the tensor, not through
    safetensors' memory map: the mapped pages a read touches count in the process's resident size until
    the map closes, so a mapped file would add its own size to the peak of loading."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        single = folder / "diffusion_pytorch_model.safetensors"
        if index.is_file():
            paths = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif single.is_file():
            paths = [single]
        else:
            raise ConfigError(f"{folder} holds no diffusion_pytorch_model.safetensors (nor its .index.json): "
                              "the transformer's weights are missing")
        # key -> (file, dtype, shape, first byte in the file)
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        self.data_bytes = 0
        for path in paths:
            with path.open("rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                begin, end = entry["data_offsets"]
                self.entries[key] = (path, FILE_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin)
                self.data_bytes += end - begin
        self.keys: list[str] = []
        self.read_bytes = 0  # of tensor data, as stored
        self._open: dict[Path, object] = {}

    def check(self, model: torch.nn.Module, ignored: list[str]) -> None:
        """The files must hold exactly the model's state dict (keys and shapes), but for the class's
        ignored unexpected keys."""
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        unexpected = [k for k in self.entries if k not in expected and not any(re.search(p, k) for p in ignored)]
        missing = [k for k in expected if k not in self.entries]
        if missing or unexpected:
            raise ConfigError(f"{self.folder}: the weights do not fit {type(model).__name__} built from its "
                              f"config.json: {len(missing)} missing (first: {missing[:3]}), {len(unexpected)} "
                              f"unexpected (first: {unexpected[:3]})")
        self.keys = [k for k in expected if k in self.entries]
        wrong = [k for k in self.keys if self.entries[k][2] != expected[k]]
        if wrong:
            raise ConfigError(f"{self.folder}: {len(wrong)} weights have another shape than its config.json "
                              f"gives (first: {wrong[0]})")

    @contextlib.contextmanager
    def opened(self):
        with contextlib.ExitStack() as stack:
            self._open = {path: stack.enter_context(path.open("rb"))
                          for path in {entry[0] for entry in self.entries.values()}}
            try:
                yield
            finally:
                self._open = {}

    def _rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of dim 0 (the whole tensor for a 0-dim one), as stored."""
        path, dtype, shape, offset = self.entries[key]
        row = math.prod(shape[1:]) * dtype.itemsize
        tensor = torch.empty((count, *shape[1:]) if shape else (), dtype=dtype)
        file = self._open[path]
        file.seek(offset + start * row)
        if file.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != tensor.nbytes:
            raise ConfigError(f"{path} is truncated: {key} is cut short")
        self.read_bytes += tensor.nbytes
        return tensor

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._rows(key, 0, (self.entries[key][2] or (1,))[0])
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def read_shard(self, key: str, param: torch.Tensor) -> None:
        """Copy this rank's part of `key` into the sharded parameter: only those rows are read."""
        param.to_local().copy_(self.shard_rows(key, param))

    def shard_rows(self, key: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `key`, as stored, for the sharded parameter."""
        return self._rows(key, *self.shard_range(key, param))

    def shard_range(self, key: str, param: torch.Tensor) -> tuple[int, int]:
        """(first row, rows) of `key` that this rank holds of the sharded parameter (a DTensor sharded on
        dim 0 by FSDP2, replicated on HSDP's other mesh dimension)."""
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        if tuple(local.shape) != tuple(shape) or any(offset[1:]):
            raise ValueError(f"{key}: expected a dim-0 shard, got {local.shape} at {offset}")
        return offset[0], shape[0]

    def fp8_source(self, key: str, start: int, count: int) -> tuple[torch.Tensor, float | None]:
        """Rows of a weight for model.storage_dtype = "fp8" (storage.load_rows) and the scale they are already
        stored with, None where they are to be quantized: a folder stores no fp8 (single files can)."""
        return self._rows(key, start, count), None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device` that queues behind the running step instead of waiting for it: a
    blocking copy synchronises the stream, and so may a non-blocking one from pageable memory (CUDA
    stages it through a bounce buffer), hence pinned first on a GPU (a CPU-only torch has no pinning)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def rename_module(name: str, blocks: str, new_blocks: str, in_block: dict, outside: dict) -> str | None:
    """A module name in another layout (ComfyUI's): blocks.N.<x> -> new_blocks.N.<in_block[x]>, others by
    `outside`; None where that layout has no such module."""
    parts = name.split(".", 2)
    if parts[0] == blocks and len(parts) == 3 and parts[1].isdigit():
        return f"{new_blocks}.{parts[1]}.{in_block[parts[2]]}" if parts[2] in in_block else None
    return outside.get(name)


def sample_posterior(mean, logvar, generators: list[torch.Generator] | None) -> torch.Tensor:
    """A diagonal Gaussian's sample in fp32 (each row from its own keyed generator), or its mean."""
    mean, logvar = mean.float(), logvar.float()
    if generators is None:
        return mean
    # Drawn on the CPU (keyed generators), copied without waiting for the queued step.
    eps = to_device(torch.stack([torch.randn(m.shape, generator=g) for m, g in zip(mean, generators)]), mean.device)
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * eps


class Adapter:
    """The machinery every family shares. A family sets the class attributes and provides, besides:
    frame_multiple, size_multiple, text_length and transformer_config (the shape rules and configs);
    published_fps (the frame rate the model was released at);
    encode_video, encode_image, encode_text and decode_latents (the cache and the clips); train_loss and
    fixed_losses (training and the held-out loss); sampler, sampling_start, denoise, guidance_scale (or guide),
    sampling_step, sampled and sampling_attention (validate.py's sampling loop); blocks (the FSDP and
    activation-checkpointing units); split_sequence (sequence parallelism, sequence.py). A family with sound
    (ENCODERS has "audio") also has audio_sample_rate, audio_channels and encode_audio (cache.py's audio entries),
    sampled_audio, decode_audio and sound_rate (validate.py's soundtracks), and audio_loss_weight (cache.prepare
    sets it from train.audio_loss_weight).
    families/cogvideox.py and families/wan.py are the two, and the tests of each are the template for a third."""

    FAMILY = ""
    # The model folders whose files shape each kind of cache entry.
    ENCODERS: dict[str, tuple[str, ...]] = {}
    TRANSFORMER = VAE = TEXT_ENCODER = None  # diffusers / transformers classes
    VAE_DTYPE: torch.dtype | None = None  # the VAE's own precision, where the family's reference keeps one
    COMFY = False  # whether exports also write ComfyUI's layout (comfy_key, diffusers_key)
    # A key every single file of the family holds (model.transformer_file; single_file_key and diffusers_names
    # map the names); "" for a family whose single files vidtrain does not read.
    SINGLE_FILE_KEY = ""
    COMFY_ALPHA = True  # whether that file carries an .alpha per module (else alpha / rank is baked into lora_B)
    # Parts of the loss logged beside it (train/<part>, val/<part>): a family with several streams (LTX-2's video
    # and audio) names them, and its train_loss and fixed_losses leave `losses`, [parts, 2]: each part's sum over
    # the samples that have it, and their count (a clip without sound has no audio loss to average in).
    LOSS_PARTS: tuple[str, ...] = ()
    # Whether a step may leave trainable weights without a gradient (LTX-2's audio stream in a batch without
    # sound): DDP then looks for them every step instead of assuming one graph for the run.
    GRAPH_VARIES = False
    # data.audio on a family with sound (cache.prepare sets it): the batches may differ in sound.
    trains_sound = False

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
        self.storage_dtype = cfg.storage_dtype
        self.vae_dtype = self.VAE_DTYPE or self.dtype
        self.transformer_folder = "transformer"
        self.single_file = None  # model.transformer_file's reader (single_file.SingleFile), set by model.load_adapter
        # Whether the model also conditions on each clip's last frame (first-last-frame, Wan FLF2V): the
        # cache and validation then need a last image per clip and per prompt.
        self.first_last = False
        self.sequence = None  # the SequenceSplit under sequence parallelism (split_sequence)
        self._vae = self._text_encoder = self._tokenizer = None

    def check_resolution(self, resolution, key: str) -> None:
        """[frames, height, width] against the model's rules, or a ConfigError naming the key."""
        check_resolution(resolution, self.frame_multiple, self.size_multiple, key)

    # Loading.
    def load_transformer(self, trainable_dtype: torch.dtype | None = None, folder: str = "", shard=None):
        """The transformer this run trains (or another expert's folder), in trainable_dtype or model.dtype,
        as from_pretrained builds it, weight for weight, but without allocating any weight before its
        values are read: without accelerate (not a requirement) from_pretrained allocates the whole model
        first, and refuses Wan (its fp32 modules). Without `shard`, every weight is read from the
        folder's safetensors files. With it, shard(model) gets the model with its parameters still on
        the meta device (buffers real), wraps it (LoRA, fully_shard) and returns it; each rank then
        reads only its own rows of every sharded weight, so no rank ever holds the whole model, nor
        sft's fp32 copy of it. The rows of the units that parallel.cpu_offload streams are kept in host
        memory, where FSDP2's CPUOffloadPolicy wants them (it pins them itself) and checks them at the first
        forward; the others' on the device. With model.storage_dtype = "fp8" the blocks' linear weights are
        quantized as they are read, one tensor (or one rank's rows) at a time: no copy of the whole model in
        model.dtype ever exists (a single file's float8_e4m3fn weights are kept as stored, fp8_source)."""
        folder = folder or self.transformer_folder
        dtype = trainable_dtype or self.dtype
        from_file = self.single_file is not None and folder == self.transformer_folder  # model.transformer_file
        weights = self.single_file if from_file else Weights(self.path / folder)
        transformer = self._empty_transformer(resolved_config(self.TRANSFORMER, self.path, folder), dtype)
        weights.check(transformer, self.TRANSFORMER._keys_to_ignore_on_load_unexpected or [])
        fp8 = set(storage.store_fp8(transformer, self.blocks(transformer), self.keeps_fp32)
                  if self.storage_dtype == "fp8" else [])
        buffers = dict(transformer.named_buffers())
        with weights.opened():
            for name in weights.keys:
                if name in fp8 and shard is None:
                    shape = weights.entries[name][2]
                    weight = torch.empty(shape, dtype=storage.FP8, device=self.device)
                    scale = torch.empty(shape[0], 1, device=self.device)
                    storage.load_rows(weight, scale, *weights.fp8_source(name, 0, shape[0]))
                    _replace(transformer, name, weight)
                    _replace(transformer, f"{name}_scale", scale)
                elif shard is None or name in buffers:  # buffers are whole on every rank
                    _replace(transformer, name, weights.read(name, self._load_dtype(name, dtype)).to(self.device))
            transformer.eval()  # as from_pretrained returns it
            if shard is None:
                transformer.to(self.device)
            else:
                transformer = shard(transformer)
                # fully_shard left the meta parameters on meta: allocate this rank's rows (FSDP's own
                # _apply re-pads uneven shards) where FSDP keeps them, then fill them.
                on_host = parallel.offloaded(transformer)
                transformer._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in on_host else self.device)
                                   if t.is_meta else t)
                with torch.no_grad():
                    for name, param in transformer.named_parameters():
                        if name in fp8:
                            scale = transformer.get_parameter(f"{name}_scale").to_local()
                            rows = weights.fp8_source(name, *weights.shard_range(name, param))
                            storage.load_rows(param.to_local(), scale, *rows)
                        elif name in weights.keys:
                            weights.read_shard(name, param)
        log.info("loaded %s/: read %.1f%% of its %.1f MB of weights%s", folder,
                 100 * weights.read_bytes / weights.data_bytes, weights.data_bytes / 2**20,
                 ", this rank's shard" if shard else "")
        if fp8:
            elements = sum(math.prod(weights.entries[name][2]) for name in fp8)
            log.info("model.storage_dtype = fp8: %d linear weights of the blocks stored in %.1f MB (%.1f MB in %s)",
                     len(fp8), elements / 2**20, elements * dtype.itemsize / 2**20, str(dtype).removeprefix("torch."))
        return transformer

    def transformer_from_state_dict(self, state: dict[str, torch.Tensor]):
        """A CPU transformer in model.dtype holding a full state dict, for export. Built with its weights
        on the meta device and given the tensors themselves, so rank 0 holds the weights once, not twice."""
        transformer = self._empty_transformer(self.transformer_config, self.dtype)
        transformer.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, assign=True)
        return transformer

    def _empty_transformer(self, config: dict, dtype: torch.dtype):
        """The transformer with its parameters on the meta device, each in the dtype from_pretrained gives
        it (the class's _keep_in_fp32_modules stay fp32), and its buffers computed as from_pretrained
        computes them: under dtype as the default (the buffers no file holds, rotary tables and sincos
        positions, are only made here)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with parameters_on_meta():
                transformer = self.TRANSFORMER.from_config(config)
        finally:
            torch.set_default_dtype(previous)
        for name, param in transformer.named_parameters():
            _replace(transformer, name, param.to(self._load_dtype(name, dtype)))
        return transformer

    @classmethod
    def keeps_fp32(cls, name: str) -> bool:
        """Whether a weight belongs to the class's _keep_in_fp32_modules (Wan's norms, time embedder,
        scale_shift_table): from_pretrained keeps them fp32 whatever the dtype, and so do we."""
        keep = cls.TRANSFORMER._keep_in_fp32_modules or []
        return any(m in name.split(".") for m in keep)

    def _load_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """A floating weight's dtype, by from_pretrained's rule."""
        return torch.float32 if self.keeps_fp32(name) else dtype

    def _load_vae(self):
        if self._vae is None:
            log.info("loading VAE from %s", self.path)
            self._vae = self.VAE.from_pretrained(self.path, subfolder="vae", dtype=self.vae_dtype)
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
        """Its memory back to the device (T5-XXL's 8.9 GiB, UMT5-XXL's 10.6 GiB in bf16), not to PyTorch's cache."""
        self._text_encoder = self._tokenizer = None
        torch.cuda.empty_cache()  # a no-op without CUDA

    def park_vae(self) -> None:
        """Move the VAE to the CPU between validations: the next decode moves it back, not reloads it."""
        if self._vae is not None:
            self._vae.to("cpu")

    def release_encoders(self) -> None:
        """After the cache pass: the encoders' memory goes back to the device, not to PyTorch's cache (T5-XXL's
        9.5 GB would stay reserved otherwise, where training cannot reach them under fragmentation)."""
        self._vae = self._text_encoder = self._tokenizer = None
        torch.cuda.empty_cache()  # a no-op without CUDA

    def _pixels(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [B, F, H, W, 3] -> [B, 3, F, H, W] in [-1, 1], in the VAE's dtype, on the device."""
        return frames.to(self.device).permute(0, 4, 1, 2, 3).to(self.vae_dtype) / 127.5 - 1.0

    def encoding_precision(self, dtype: str) -> str:
        """What the cache's keys name as the encoders' precision: model.dtype, and the VAE's where it differs."""
        return dtype if self.vae_dtype == self.dtype else f"{dtype}, VAE {self.vae_dtype}"

    def held_out_timesteps(self, timesteps: list[int]) -> list[int]:
        """The held-out loss's timesteps this run's transformer is trained on (all, but for an expert)."""
        return timesteps

    def other_experts(self) -> list[str]:
        """Folders of the transformers that sampling needs besides the trained one (Wan 2.2 A14B)."""
        return []

    def clip_rate(self, gen_fps: int) -> Fraction:
        """The frame rate validation's mp4s are written at: validation.gen_fps, or the published rate for 0.
        A family with sound (LTX-2) writes at the rate its sound was generated for."""
        return Fraction(gen_fps or self.published_fps)

    def check_guidance(self, cfg) -> None:
        """validation's guidance options against this model, before any compute (LTX-2 adds its STG blocks')."""
        if cfg.guidance_scale_2 and not self.other_experts():
            raise ConfigError(f"validation.guidance_scale_2 guides Wan 2.2 A14B's low-noise expert, but {self.path} "
                              "has one transformer: remove it")

    def guide(self, cfg, models: dict, state, t: torch.Tensor, i: int, embeds: torch.Tensor,
              prediction: torch.Tensor) -> torch.Tensor:
        """The guided prediction from denoise's (uncond, cond) pair: classifier-free guidance at guidance_scale. A
        family whose pipeline adds terms (LTX-2) overrides it; models and embeds serve its extra forwards."""
        uncond, cond = prediction.chunk(2)
        return uncond + self.guidance_scale(cfg, state, t) * (cond - uncond)

    @classmethod
    def single_file_tables(cls, config: dict) -> dict[str, torch.Tensor]:
        """Tensors tools/to_single_file.py writes beside the weights of a transformer built from `config`,
        under their diffusers names, for other readers' sake (CogVideoX 2b's sincos table, for ComfyUI's
        model detection)."""
        return {}

    def single_file_extra(self, key: str) -> bool:
        """Whether a single file's key (its own name, without ComfyUI's prefix) holds something besides the
        transformer's weights, which reading skips (LTX-2's text connectors; CogVideoX 2b's sincos table)."""
        return False

    def comfy_key(self, module: str) -> str | None:
        """A LoRA module's name in the original checkpoint's layout (ComfyUI's), or None if the family has none."""
        return None

    def diffusers_key(self, original: str) -> str | None:
        """The inverse of comfy_key: an original module name's diffusers name, or None."""
        return None
