"""model.transformer_file's single files (SingleFile, a Weights), as ComfyUI and the makers store them.

The layout ComfyUI and the original releases use, in bf16, fp16, fp32, plain float8 casts or
ComfyUI's scaled fp8.

A single file's names map to diffusers' through the family's adapter (SINGLE_FILE_KEY,
single_file_key and diffusers_names: Wan through diffusers' own
convert_wan_transformer_to_diffusers, CogVideoX through ComfyUI's module names, LTX-2 through
diffusers' convert_ltx2_to_diffusers tables), which also names the keys that are not the
transformer's (single_file_extra: LTX-2's connectors, CogVideoX 2b's sincos table). Reading stays
lean: the headers first, then each tensor (under FSDP each rank's rows) when the model asks for it;
an fp8 tensor is dequantized as ComfyUI does, the stored value times its layer's scale in fp32, one
tensor (one rank's rows) at a time. The quantization rules are ComfyUI's comfy/utils.py
convert_old_quants and comfy/ops.py (docs/models/wan.md, "Single files"). A file of another family
or size, with missing or extra keys, cut short, in diffusers' layout, of another format (GGUF, a
PyTorch pickle) or a folder is refused when the adapter is loaded, before the cache pass.
"""

import json
import logging
import re
from pathlib import Path

import torch

from config import ConfigError
from weights import FILE_DTYPES, Weights

log = logging.getLogger("vidtrain")
PREFIX = "model.diffusion_model."  # ComfyUI's checkpoints put the diffusion model's keys under it
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# ComfyUI's per-tensor fp8 formats (a layer's "format" in its quantization config); ComfyUI's other
# formats (nvfp4, mxfp8, int8) store blocks of scales vidtrain does not read.
SCALED_FORMATS = ("float8_e4m3fn", "float8_e5m2")
# Other formats' first bytes: GGUF's magic, and a zip archive's (torch.save's format since PyTorch
# 1.6); the older pickles have no fixed start, hence their usual suffixes.
GGUF_MAGIC, ZIP_MAGIC, PICKLE_SUFFIXES = b"GGUF", b"PK\x03\x04", (".ckpt", ".pt", ".pth", ".bin", ".pkl")
MAX_HEADER = 100_000_000  # the safetensors library refuses longer headers (MAX_HEADER_SIZE)
# Keys that describe the quantization, not weights: the old files' marker and scales (scale_input is
# the activations' scale of fp8 matrix products, which dequantized weights do not use), the new
# files' ones.
QUANT_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")


def read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Read a safetensors file's header: key -> (dtype, shape, first byte, bytes), and its metadata.

    A whole safetensors file's tensors: key -> (dtype, shape, first byte, bytes), with its metadata
    under "__metadata__"; a file of another format (by its first bytes, before reading more), cut
    short or not a safetensors file is named."""
    source, size = f"model.transformer_file = {path}", path.stat().st_size
    with path.open("rb") as f:
        start = f.read(8)
        if start.startswith(GGUF_MAGIC):
            raise ConfigError(
                f"{source} is a GGUF file (llama.cpp's format, as ComfyUI-GGUF's "
                "quantized models): vidtrain reads safetensors files only; use the model's "
                "bf16, fp16 or fp8 .safetensors"
            )
        length = int.from_bytes(start, "little")
        try:
            header = json.loads(f.read(length)) if 8 + length <= size and length <= MAX_HEADER else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if header is None and (start.startswith(ZIP_MAGIC) or path.suffix in PICKLE_SUFFIXES):
        raise ConfigError(
            f"{source} is a PyTorch pickle (torch.save's format, as .ckpt, .pt and .pth "
            "files are): vidtrain reads safetensors files only, which hold no code to run; use "
            "the model's .safetensors release"
        )
    if not isinstance(header, dict):
        raise ConfigError(
            f"{source} is not a safetensors file, or is cut short inside its header: download it again"
        )
    metadata = header.pop("__metadata__", None) or {}
    entries, cut = {"__metadata__": metadata}, []
    for key, entry in header.items():
        try:
            (begin, end), dtype, shape = entry["data_offsets"], entry["dtype"], tuple(entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{source}: its header's entry {key!r} is not a tensor's (safetensors gives "
                "each tensor a dtype, a shape and data_offsets): the file is not a safetensors "
                "file vidtrain can read; download it again"
            ) from None
        if dtype not in FILE_DTYPES:
            raise ConfigError(
                f"{source}: {key} is stored as {dtype}, which vidtrain does not read (bf16, "
                "fp16, fp32 and fp8 it does)"
            )
        entries[key] = (FILE_DTYPES[dtype], shape, 8 + length + begin, end - begin)
        if 8 + length + end > size:
            cut.append(key)
    if cut:
        raise ConfigError(
            f"{source} is truncated: {size} bytes, but its header places {len(cut)} tensors "
            f"past the end (first: {cut[0]}): download it again"
        )
    return entries


def _read_small(path: Path, entry) -> torch.Tensor:
    """A scale or a layer's quantization config, read whole."""
    dtype, shape, offset, nbytes = entry
    with path.open("rb") as f:
        f.seek(offset)
        return torch.frombuffer(bytearray(f.read(nbytes)), dtype=dtype).reshape(shape)


def read_scales(stored: dict, metadata: dict) -> dict[str, float]:
    """Each scaled fp8 weight's scale, by ComfyUI's rules.

    ComfyUI's rules are convert_old_quants': a `scaled_fp8` key marks the old files, whose layers X
    carry X.scale_weight (float8_e4m3fn); the new files list their layers in the
    `_quantization_metadata` header entry (or a X.comfy_quant tensor each), each with its format,
    and carry X.weight_scale. A weight stored as fp8 without a scale is a plain cast (scale 1)."""
    layers, scale_key = {}, "weight_scale"
    if "_quantization_metadata" in metadata:
        listed = json.loads(metadata["_quantization_metadata"])["layers"]
        layers = {k.removeprefix(PREFIX): v for k, v in listed.items()}
    # every fp8 weight of an old scaled file has a scale: one missing is refused
    elif "scaled_fp8" in stored:
        layers = {
            k.removesuffix(".weight"): {"format": "float8_e4m3fn"}
            for k, entry in stored.items()
            if k.endswith(".weight") and entry[1] in FP8
        }
        scale_key = "scale_weight"
    for key in [k for k in stored if k.endswith(".comfy_quant")]:
        config = _read_small(stored[key][0], stored[key][1:])  # the layer's JSON, as uint8
        layers[key.removesuffix(".comfy_quant")] = json.loads(bytes(config.tolist()))
    # An fp8 weight with a scale beside it that no marker or metadata assigns would be read as a
    # plain cast.
    unassigned = [
        k
        for k in stored
        if k.endswith((".scale_weight", ".weight_scale"))
        and k.rpartition(".")[0] not in layers
        and stored.get(f"{k.rpartition('.')[0]}.weight", (None, None))[1] in FP8
    ]
    if unassigned:
        raise ConfigError(
            f"model.transformer_file = {stored[unassigned[0]][0]} holds fp8 scales "
            f"({unassigned[0]}, ...) that neither ComfyUI's scaled_fp8 key nor its quantization "
            "metadata (_quantization_metadata, .comfy_quant) assign to their layers, so whether "
            "they apply is unknown: the file is incomplete or was re-saved without them; "
            "download it again"
        )
    scales = {}
    for layer, layer_config in layers.items():
        where = f"model.transformer_file = {stored[f'{layer}.weight'][0]}: layer {layer}"
        if layer_config.get("format") not in SCALED_FORMATS:
            raise ConfigError(
                f"{where} is quantized as {layer_config.get('format')}, which vidtrain does not read "
                f"(it reads {' and '.join(SCALED_FORMATS)} with one scale per tensor): use a bf16, "
                "fp16 or fp8 file"
            )
        if f"{layer}.{scale_key}" not in stored:
            raise ConfigError(
                f"{where} is quantized as {layer_config['format']} but the file lacks its scale, "
                f"{layer}.{scale_key}: the file is incomplete"
            )
        scale = _read_small(stored[f"{layer}.{scale_key}"][0], stored[f"{layer}.{scale_key}"][1:])
        if scale.numel() != 1:
            raise ConfigError(
                f"{where} has a {scale_key} of shape {list(scale.shape)}; vidtrain reads one scale "
                "per tensor, as ComfyUI's fp8 formats store it"
            )
        scales[f"{layer}.weight"] = scale.float().item()
    return scales


class SingleFile(Weights):
    """model.transformer_file's weights under diffusers' names, read as Weights reads a folder's."""

    def __init__(self, files: list[str], adapter, marks: dict[str, str]):
        self.files = [Path(f) for f in files]
        self.config_folder = adapter.path / adapter.transformer_folder
        stored, metadata = {}, {}
        for path in self.files:
            if path.is_dir():
                raise ConfigError(
                    f"model.transformer_file = {path} is a folder; it takes a single "
                    ".safetensors file (or a list of them); a diffusers folder's transformer "
                    "is read from model.path"
                )
            if not path.is_file():
                raise ConfigError(f"model.transformer_file = {path} does not exist")
            header = read_header(path)
            metadata |= header.pop("__metadata__")
            stored |= {key: (path, *entry) for key, entry in header.items()}
        # an all-in-one checkpoint's VAE and text encoder stay out
        if any(key.startswith(PREFIX) for key in stored):
            stored = {
                key.removeprefix(PREFIX): entry for key, entry in stored.items() if key.startswith(PREFIX)
            }
        stored = {key: entry for key, entry in stored.items() if not adapter.single_file_extra(key)}
        diffusers_mark = adapter.diffusers_names([adapter.SINGLE_FILE_KEY])[adapter.SINGLE_FILE_KEY]
        if adapter.SINGLE_FILE_KEY not in stored and (
            diffusers_mark in stored
            or any(path.name.startswith("diffusion_pytorch_model") for path in self.files)
        ):
            raise ConfigError(
                f"model.transformer_file = {', '.join(files)} is in diffusers' layout (a "
                "diffusers folder's transformer/diffusion_pytorch_model.safetensors), which "
                "vidtrain reads from model.path: point model.path at the folder whose "
                "transformer/ holds it and remove model.transformer_file"
            )
        if adapter.SINGLE_FILE_KEY not in stored:
            family = next((f for f, mark in marks.items() if mark in stored), None)
            kind = (
                f"a {family} transformer (it holds {marks[family]})"
                if family
                else f"no transformer vidtrain knows (its first key: {next(iter(stored), 'none')})"
            )
            raise ConfigError(
                f"model.transformer_file = {', '.join(files)} holds {kind}, not a {adapter.FAMILY} one "
                f"(which holds {adapter.SINGLE_FILE_KEY}): use the {adapter.FAMILY} file of the model "
                "at model.path"
            )
        scales = read_scales(stored, metadata)
        weights = [k for k in stored if k != "scaled_fp8" and not k.endswith(QUANT_SUFFIXES)]
        names = adapter.diffusers_names(weights)
        # key -> (file, dtype, shape, first byte), as Weights keeps them; the file's own names for
        # messages.
        self.entries = {names[k]: stored[k][:4] for k in weights}
        self.file_keys = {names[k]: k for k in weights}
        self.scales = {names[k]: scale for k, scale in scales.items()}
        self.data_bytes = sum(stored[k][4] for k in weights)
        self.keys: list[str] = []
        self.read_bytes = 0
        self._open: dict[Path, object] = {}
        log.info(
            "model.transformer_file: %d weights (%d fp8 with a scale) in %s",
            len(weights),
            len(scales),
            ", ".join(files),
        )

    def check(self, model: torch.nn.Module, ignored: list[str]) -> None:
        """Check that the file holds the model's state dict, shape for shape.

        The file must hold the model's state dict, key for key and shape for shape, but for the
        class's ignored keys: a first differing shape means another size of the model, so it comes
        first."""
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        source = f"model.transformer_file = {', '.join(map(str, self.files))}"
        wrong = [k for k in expected if k in self.entries and self.entries[k][2] != expected[k]]
        if wrong:
            key = wrong[0]
            raise ConfigError(
                f"{source}: {self.file_keys[key]} is {list(self.entries[key][2])} there, but "
                f"{self.config_folder}/config.json makes it {list(expected[key])} ({key}): the file is "
                "another size of the model; use the file of the model at model.path"
            )
        missing = [k for k in expected if k not in self.entries]
        if missing:
            raise ConfigError(
                f"{source} lacks {len(missing)} weights of {type(model).__name__} as "
                f"{self.config_folder}/config.json builds it (first: {missing[0]}): the file is "
                "incomplete or of another variant"
            )
        unexpected = [
            k for k in self.entries if k not in expected and not any(re.search(p, k) for p in ignored)
        ]
        if unexpected:
            raise ConfigError(
                f"{source} holds {len(unexpected)} keys that {type(model).__name__} as "
                f"{self.config_folder}/config.json builds it has no weight for (first: "
                f"{self.file_keys[unexpected[0]]}): the file is of another variant"
            )
        self.keys = [k for k in expected if k in self.entries]

    def fp8_source(self, key: str, start: int, count: int) -> tuple[torch.Tensor, float | None]:
        """A weight's rows for fp8 storage, and the file's scale for them (None: to quantize).

        For model.storage_dtype = "fp8": a weight the file stores as storage.py keeps one
        (float8_e4m3fn, one scale for its rows; 1 for a plain cast) as it is stored, rounded once,
        by the file's maker; any other (float8_e5m2 too) at full precision, an fp8 one dequantized,
        to be quantized once."""
        if self.entries[key][1] == torch.float8_e4m3fn:
            return Weights._rows(self, key, start, count), self.scales.get(key, 1.0)
        return super().fp8_source(key, start, count)

    def _rows(self, key: str, start: int, count: int) -> torch.Tensor:
        rows = super()._rows(key, start, count)
        # ComfyUI's dequantization: the stored value times the layer's scale, in fp32
        if rows.dtype in FP8:
            return rows.float() * self.scales.get(key, 1.0)
        return rows


def open_single_file(files: list[str], adapter, marks: dict[str, str]) -> SingleFile:
    """Open model.transformer_file's reader, checked against model.path's config.

    model.transformer_file's reader, checked against the transformer model.path's config builds (on
    the meta device: nothing is allocated, nothing read but the headers and the scales)."""
    weights = SingleFile(files, adapter, marks)
    transformer = adapter._empty_transformer(adapter.transformer_config, adapter.dtype)
    weights.check(transformer, adapter.TRANSFORMER._keys_to_ignore_on_load_unexpected or [])
    return weights
