"""The transformer's safetensors weights, read one tensor (or one rank's rows of one) at a time.

A diffusers folder's files (Weights), read lean: the headers first, then each tensor (under FSDP each
rank's rows) when the model asks for it. model.transformer_file's single files are single_file.py's
(SingleFile, a Weights). rename_module and rename_key map module names between layouts.
"""

import contextlib
import json
import math
import re
from pathlib import Path

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
