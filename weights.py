"""Reading the transformer's weights: folders row by row, single files, the model built lean on meta.

A diffusers folder's files (Weights), read lean: the headers first, then each tensor (under FSDP each
rank's rows) when the model asks for it. Then model.transformer_file's single files (SingleFile, a
Weights), and the transformer as from_pretrained builds it, made on the meta device and filled
(TransformerLoading). rename_module and rename_key map module names between layouts.
"""

import contextlib
import inspect
import json
import logging
import math
import re
from pathlib import Path

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import memory
import parallel
from config import ConfigError

# safetensors' dtype names.
FILE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class Weights:
    """The safetensors files of a diffusers model folder, read one tensor or rank's rows at a time.

    One file, or shards listed by an index. Read with plain reads into the tensor, not through
    safetensors' memory map: the mapped pages a read touches count in the process's resident size
    until the map closes, so a mapped file would add its own size to the peak of loading."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        single = folder / "diffusion_pytorch_model.safetensors"
        if index.is_file():
            paths = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif single.is_file():
            paths = [single]
        else:
            raise ConfigError(
                f"{folder} holds no diffusion_pytorch_model.safetensors (nor its .index.json): "
                "the transformer's weights are missing"
            )
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
                self.entries[key] = (
                    path,
                    FILE_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]),
                    8 + length + begin,
                )
                self.data_bytes += end - begin
        self.keys: list[str] = []
        self.read_bytes = 0  # of tensor data, as stored
        self._open: dict[Path, object] = {}

    def check(self, model: torch.nn.Module, ignored: list[str]) -> None:
        """Check that the files hold exactly the model's state dict.

        The files must hold exactly the model's state dict (keys and shapes), but for the class's
        ignored unexpected keys."""
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        unexpected = [
            k for k in self.entries if k not in expected and not any(re.search(p, k) for p in ignored)
        ]
        missing = [k for k in expected if k not in self.entries]
        if missing or unexpected:
            raise ConfigError(
                f"{self.folder}: the weights do not fit {type(model).__name__} built from its "
                f"config.json: {len(missing)} missing (first: {missing[:3]}), {len(unexpected)} "
                f"unexpected (first: {unexpected[:3]})"
            )
        self.keys = [k for k in expected if k in self.entries]
        wrong = [k for k in self.keys if self.entries[k][2] != expected[k]]
        if wrong:
            raise ConfigError(
                f"{self.folder}: {len(wrong)} weights have another shape than its config.json "
                f"gives (first: {wrong[0]})"
            )

    @contextlib.contextmanager
    def opened(self):
        with contextlib.ExitStack() as stack:
            self._open = {
                path: stack.enter_context(path.open("rb"))
                for path in {entry[0] for entry in self.entries.values()}
            }
            try:
                yield
            finally:
                self._open = {}

    def _rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of dim 0 (the whole tensor for a 0-dim one), as stored."""
        return self._read_rows(key, self.entries[key], start, count)

    def _read_rows(self, key: str, entry: tuple, start: int, count: int) -> torch.Tensor:
        """Rows of the tensor an entry (file, dtype, shape, first byte) places, as stored."""
        path, dtype, shape, offset = entry
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
        """(first row, rows) of `key` that this rank holds of the sharded parameter.

        The parameter is a DTensor sharded on dim 0 by FSDP2, replicated on HSDP's other mesh
        dimension."""
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        local = param.to_local()
        if tuple(local.shape) != tuple(shape) or any(offset[1:]):
            raise ValueError(f"{key}: expected a dim-0 shard, got {local.shape} at {offset}")
        return offset[0], shape[0]

    def fp8_source(self, key: str, start: int, count: int) -> tuple[torch.Tensor, float | None]:
        """Rows of a weight for fp8 storage, and the scale they are already stored with (or None).

        For model.storage_dtype = "fp8" (storage.load_rows); the scale is None where the rows are to
        be quantized: a folder stores no fp8 (single files can)."""
        return self._rows(key, start, count), None


def rename_module(name: str, blocks: str, new_blocks: str, in_block: dict, outside: dict) -> str | None:
    """A module name in another layout (ComfyUI's), or None where that layout has no such module.

    blocks.N.<x> -> new_blocks.N.<in_block[x]>, others by `outside`."""
    parts = name.split(".", 2)
    if parts[0] == blocks and len(parts) == 3 and parts[1].isdigit():
        return f"{new_blocks}.{parts[1]}.{in_block[parts[2]]}" if parts[2] in in_block else None
    return outside.get(name)


def rename_key(key: str, blocks: str, new_blocks: str, in_block: dict, outside: dict) -> str | None:
    """A state-dict key renamed into another layout.

    Its module renamed by rename_module and the leaf kept, or, for a parameter a table names itself
    (Wan's scale_shift_table, modulation), the whole key renamed."""
    module, _, leaf = key.rpartition(".")
    renamed = rename_module(module, blocks, new_blocks, in_block, outside)
    return f"{renamed}.{leaf}" if renamed else rename_module(key, blocks, new_blocks, in_block, outside)


# --------------------------------------------------------------------------------------------------
# model.transformer_file's single files (SingleFile, a Weights), as ComfyUI and the makers store them.
#
# The layout ComfyUI and the original releases use, in bf16, fp16, fp32, plain float8 casts or
# ComfyUI's scaled fp8.
#
# A single file's names map to diffusers' through the family's adapter (SINGLE_FILE_KEY,
# single_file_key and diffusers_names: Wan through diffusers' own
# convert_wan_transformer_to_diffusers, CogVideoX through ComfyUI's module names, LTX-2 through
# diffusers' convert_ltx2_to_diffusers tables, HunyuanVideo 1.5 through its conversion script's, where
# one file tensor may hold several weights' rows or one's halves swapped: file_rows), which also names the keys that are not the
# transformer's (single_file_extra: LTX-2's connectors, CogVideoX 2b's sincos table). Reading stays
# lean: the headers first, then each tensor (under FSDP each rank's rows) when the model asks for it;
# an fp8 tensor is dequantized as ComfyUI does, the stored value times its layer's scale in fp32, one
# tensor (one rank's rows) at a time. The quantization rules are ComfyUI's comfy/utils.py
# convert_old_quants and comfy/ops.py (docs/models/wan.md, "Single files"). A file of another family
# or size, with missing or extra keys, cut short, in diffusers' layout, of another format (GGUF, a
# PyTorch pickle) or a folder is refused when the adapter is loaded, before the cache pass.


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


def file_rows(
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, str | list[str]],
    swapped: tuple[str, ...],
    source: str = "model.transformer_file",
) -> dict[str, tuple[str, list[tuple[int, int]]]]:
    """Each diffusers weight's rows in a single file: key -> (the file's key, [(first row, rows)]).

    `names` maps the file's keys to diffusers' (Adapter.diffusers_names): one name takes the whole
    tensor; a list of names takes equal parts of its rows, in order (the makers' fused qkv, which
    diffusers' conversion chunks into to_q, to_k and to_v); a name in `swapped`
    (Adapter.SWAPPED_HALVES) takes its rows' two halves the other way round (diffusers' scale and
    shift, the makers' shift and scale). A file tensor whose rows do not split into its parts is of
    another layout: the key is named."""
    rows = {}
    for key, shape in shapes.items():
        parts = [names[key]] if isinstance(names[key], str) else names[key]
        total = shape[0] if shape else 1
        if total % len(parts):
            raise ConfigError(
                f"{source}: {key} has {total} rows, which do not split into the "
                f"{len(parts)} weights it holds ({', '.join(parts)}): the file is of another model"
            )
        n = total // len(parts)
        for i, name in enumerate(parts):
            first, half = i * n, n // 2
            rows[name] = (key, [(first + half, n - half), (first, half)] if name in swapped else [(first, n)])
    return rows


def span_rows(spans: list[tuple[int, int]], start: int, count: int) -> list[tuple[int, int]]:
    """The stored rows (first, rows) that hold rows [start, start + count) of a tensor made of
    `spans` (its stored rows, in order): only those are read."""
    out, begin = [], 0
    for first, n in spans:
        low, high = max(start, begin), min(start + count, begin + n)
        if low < high:
            out.append((first + low - begin, high - low))
        begin += n
    return out


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
        # The file's tensors (file, dtype, shape, first byte); each diffusers weight's source: the
        # file's key and its rows there, in order (file_rows); its shape in entries, as Weights
        # keeps them; the file's own names for messages. A scale is its file tensor's, whatever
        # rows of it a weight takes.
        self.stored = {k: stored[k][:4] for k in weights}
        self.sources: dict[str, tuple[str, list[tuple[int, int]]]] = {}
        self.entries = {}
        for key, (name, spans) in file_rows(
            {k: entry[2] for k, entry in self.stored.items()},
            adapter.diffusers_names(weights),
            adapter.SWAPPED_HALVES,
            f"model.transformer_file = {', '.join(files)}",
        ).items():
            path, dtype, shape, offset = self.stored[name]
            self.sources[key] = (name, spans)
            self.entries[key] = (path, dtype, (sum(n for _, n in spans), *shape[1:]) if shape else (), offset)
        self.file_keys = {key: name for key, (name, _) in self.sources.items()}
        self.scales = {key: scales[name] for key, name in self.file_keys.items() if name in scales}
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
            key, name = wrong[0], self.file_keys[wrong[0]]
            # a weight that is part of a file tensor (a fused qkv's q) is named with its share
            share = self.entries[key][2]
            part = "" if share == self.stored[name][2] else f" (its rows for {key}: {list(share)})"
            raise ConfigError(
                f"{source}: {name} is {list(self.stored[name][2])} there{part}, but "
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

        For model.storage_dtype = "fp8": a weight the file stores as memory.py keeps one
        (float8_e4m3fn, one scale for its rows; 1 for a plain cast) as it is stored, rounded once,
        by the file's maker; any other (float8_e5m2 too) at full precision, an fp8 one dequantized,
        to be quantized once."""
        if self.entries[key][1] == torch.float8_e4m3fn:
            return self._stored_rows(key, start, count), self.scales.get(key, 1.0)
        return super().fp8_source(key, start, count)

    def _stored_rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of a weight, as stored: read from its file tensor's rows
        (file_rows), only those."""
        name, spans = self.sources[key]
        entry = self.stored[name]
        parts = [self._read_rows(name, entry, first, n) for first, n in span_rows(spans, start, count)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else self._read_rows(name, entry, 0, 0)

    def _rows(self, key: str, start: int, count: int) -> torch.Tensor:
        rows = self._stored_rows(key, start, count)
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


# --------------------------------------------------------------------------------------------------
# The transformer as from_pretrained builds it, read lean: made on the meta device, then filled.
#
# Weight for weight: its parameters are made on the meta device, then each filled from the safetensors
# files as it is read (weights.py), under FSDP each rank its rows, with model.storage_dtype = "fp8"
# quantized as read. Adapter (model_adapter.py) inherits it, so every family loads its transformer the
# same way; it uses the family's TRANSFORMER, blocks and single file.


def resolved_config(model_class, path: Path, subfolder: str) -> dict:
    """The config the class builds from a folder: its config.json over the class's own defaults."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(model_class.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    saved = model_class.load_config(path, subfolder=subfolder)
    return {**defaults, **{k: v for k, v in saved.items() if not k.startswith("_")}}


@contextlib.contextmanager
def parameters_on_meta():
    """Make every parameter a module registers on the meta device, buffers real.

    Every parameter a module registers goes to the meta device at once, so the initialisation that
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
    """Put tensor in place of the parameter or buffer `name`.

    A parameter stays one, as trainable as it was."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        tensor = torch.nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
        module._parameters[leaf] = tensor
    else:
        module._buffers[leaf] = tensor


class TransformerLoading:
    """Adapter's loading of its transformer.

    self.TRANSFORMER from self.path, or self.single_file, in self.dtype on self.device."""

    def load_transformer(
        self, trainable_dtype: torch.dtype | None = None, folder: str = "", shard=None, trains=None
    ):
        """Load the transformer this run trains without allocating any weight before it is read.

        The transformer this run trains (or another expert's folder), in trainable_dtype or
        model.dtype, as from_pretrained builds it, weight for weight, but without allocating any
        weight before its values are read: without accelerate (not a requirement) from_pretrained
        allocates the whole model first, and refuses Wan (its fp32 modules). Without `shard`, every
        weight is read from the folder's safetensors files. With it, shard(model) gets the model
        with its parameters still on the meta device (buffers real), wraps it (LoRA, fully_shard)
        and returns it; each rank then reads only its own rows of every sharded weight, so no rank
        ever holds the whole model, nor sft's fp32 copy of it. The rows of the units that
        parallel.cpu_offload streams are kept in host memory, where FSDP2's CPUOffloadPolicy wants
        them (it pins them itself) and checks them at the first forward; the others' on the device.
        With model.storage_dtype = "fp8" the blocks' linear weights are quantized as they are read,
        one tensor (or one rank's rows) at a time: no copy of the whole model in model.dtype ever
        exists (a single file's float8_e4m3fn weights are kept as stored, fp8_source).
        `trains(name)` (train.trainable_modules) picks the parameters made in trainable_dtype; the
        rest, and the buffers, are in model.dtype, as a frozen base is."""
        folder = folder or self.transformer_folder
        dtype = trainable_dtype if trainable_dtype and trains is None else self.dtype
        # model.transformer_file
        from_file = self.single_file is not None and folder == self.transformer_folder
        weights = self.single_file if from_file else Weights(self.path / folder)
        transformer = self._empty_transformer(resolved_config(self.TRANSFORMER, self.path, folder), dtype)
        if trains is not None:
            for name, param in transformer.named_parameters():
                if trains(name):
                    _replace(transformer, name, param.to(self._load_dtype(name, trainable_dtype)))
        dtypes = {name: param.dtype for name, param in transformer.named_parameters()}
        weights.check(transformer, self.TRANSFORMER._keys_to_ignore_on_load_unexpected or [])
        fp8 = set(
            memory.store_fp8(transformer, self.blocks(transformer), self.keeps_fp32)
            if self.storage_dtype == "fp8"
            else []
        )
        buffers = dict(transformer.named_buffers())
        with weights.opened():
            for name in weights.keys:
                if name in fp8 and shard is None:
                    shape = weights.entries[name][2]
                    weight = torch.empty(shape, dtype=memory.FP8, device=self.device)
                    scale = torch.empty(shape[0], 1, device=self.device)
                    memory.load_rows(weight, scale, *weights.fp8_source(name, 0, shape[0]))
                    _replace(transformer, name, weight)
                    _replace(transformer, f"{name}_scale", scale)
                elif shard is None or name in buffers:  # buffers are whole on every rank
                    read_as = dtypes.get(name) or self._load_dtype(name, dtype)
                    _replace(transformer, name, weights.read(name, read_as).to(self.device))
            transformer.eval()  # as from_pretrained returns it
            if shard is None:
                transformer.to(self.device)
            else:
                transformer = shard(transformer)
                # fully_shard left the meta parameters on meta: allocate this rank's rows (FSDP's
                # own _apply re-pads uneven shards) where FSDP keeps them, then fill them.
                on_host = parallel.offloaded(transformer)
                transformer._apply(
                    lambda t: (
                        torch.empty_like(t, device="cpu" if id(t) in on_host else self.device)
                        if t.is_meta
                        else t
                    )
                )
                with torch.no_grad():
                    for name, param in transformer.named_parameters():
                        if name in fp8:
                            scale = transformer.get_parameter(f"{name}_scale").to_local()
                            rows = weights.fp8_source(name, *weights.shard_range(name, param))
                            memory.load_rows(param.to_local(), scale, *rows)
                        elif name in weights.keys:
                            weights.read_shard(name, param)
        log.info(
            "loaded %s/: read %.1f%% of its %.1f MB of weights%s",
            folder,
            100 * weights.read_bytes / weights.data_bytes,
            weights.data_bytes / 2**20,
            ", this rank's shard" if shard else "",
        )
        if fp8:
            elements = sum(math.prod(weights.entries[name][2]) for name in fp8)
            log.info(
                "model.storage_dtype = fp8: %d linear weights of the blocks stored in %.1f MB (%.1f MB in %s)",
                len(fp8),
                elements / 2**20,
                elements * dtype.itemsize / 2**20,
                str(dtype).removeprefix("torch."),
            )
        return transformer

    def transformer_from_state_dict(self, state: dict[str, torch.Tensor]):
        """A CPU transformer in model.dtype holding a full state dict, for export.

        Built with its weights on the meta device and given the tensors themselves, so rank 0 holds
        the weights once, not twice."""
        transformer = self._empty_transformer(self.transformer_config, self.dtype)
        transformer.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, assign=True)
        return transformer

    def _empty_transformer(self, config: dict, dtype: torch.dtype):
        """The transformer on the meta device in from_pretrained's dtypes, its buffers real.

        The transformer with its parameters on the meta device, each in the dtype from_pretrained
        gives it (the class's _keep_in_fp32_modules stay fp32), and its buffers computed as
        from_pretrained computes them: under dtype as the default (the buffers no file holds, rotary
        tables and sincos positions, are only made here)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with parameters_on_meta():
                transformer = self.TRANSFORMER.from_config(config)
        finally:
            torch.set_default_dtype(previous)
        for name, param in transformer.named_parameters():
            _replace(transformer, name, param.to(self._load_dtype(name, dtype)))
        self.prepare_transformer(transformer)
        return transformer

    @classmethod
    def keeps_fp32(cls, name: str) -> bool:
        """Whether a weight belongs to the class's _keep_in_fp32_modules.

        Wan's norms, time embedder, scale_shift_table: from_pretrained keeps them fp32 whatever the
        dtype, and so do we."""
        keep = cls.TRANSFORMER._keep_in_fp32_modules or []
        return any(m in name.split(".") for m in keep)

    def _load_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """A floating weight's dtype, by from_pretrained's rule."""
        return torch.float32 if self.keeps_fp32(name) else dtype
