"""A diffusers folder's transformer as one safetensors file, in ComfyUI's or the original layout.

Write a diffusers model folder's transformer as one safetensors file in the layout ComfyUI and the
original releases use (what model.transformer_file reads): Wan in the original checkpoint's names,
CogVideoX in ComfyUI's native ones (2b's with its sincos table, which ComfyUI detects it by), LTX-2
in Lightricks' (ltx-core's), with the folder's text connectors beside the transformer, as Lightricks'
files carry them and ComfyUI's model loads them from the same file, HunyuanVideo 1.5 in the
makers' (the text refiner's q, k and v fused into self_attn_qkv, the final modulation shift first)
(docs/models/*.md, "Single files").

    python tools/to_single_file.py MODEL_DIR OUT.safetensors [--fp8 [--scaled]] [--prefix]
                                   [--folder transformer]

Every floating tensor is written in bf16, but for those the diffusers class keeps in fp32 (Wan's
norms, time embedder and modulation, as the folder stores them). --fp8 stores the 2-D weights of the
transformer blocks' linear layers (the family's blocks: Wan VACE's context blocks too) as float8_e4m3fn: a plain cast, or with --scaled ComfyUI's scaled
fp8 (per tensor: scale = max|w| / 448, the stored value w / scale, its `.scale_weight` beside it and
the `scaled_fp8` marker key, as comfy/utils.py convert_old_quants reads them). --prefix puts every
key under `model.diffusion_model.`, as ComfyUI's own checkpoints have them. The file is written one
tensor at a time, never held whole.
"""

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path

import diffusers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model_adapter  # noqa: E402
from weights import (  # noqa: E402
    FILE_DTYPES,
    PREFIX,  # noqa: E402
    Weights,
    resolved_config,  # noqa: E402
)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: a plain cast of a value past it gives NaN, not 448
FILE_NAMES = {dtype: name for name, dtype in FILE_DTYPES.items()}


def adapter_class(model_dir: Path):
    """The family's adapter class, from the folder's model_index.json.

    As model_adapter.load_adapter tells it."""
    pipeline = json.loads((model_dir / "model_index.json").read_text())["_class_name"]
    return model_adapter.adapter_class(
        next(f for f in model_adapter.ADAPTERS if pipeline.lower().startswith(f))
    )


def block_prefixes(cls, model_dir: Path, folder: str) -> tuple[str, ...]:
    """The diffusers names of the family's blocks (Adapter.blocks: Wan VACE's context blocks too),
    from the transformer built on the meta device from the folder's config."""
    name = json.loads((model_dir / folder / "config.json").read_text())["_class_name"]
    transformer_class = getattr(diffusers, name)
    with torch.device("meta"):
        transformer = transformer_class.from_config(resolved_config(transformer_class, model_dir, folder))
    names = {id(module): name for name, module in transformer.named_modules()}
    return tuple(names[id(block)] + "." for block in cls.blocks(transformer))


def quantized(key: str, shape: tuple, blocks: tuple[str, ...]) -> bool:
    """A linear layer's weight inside a transformer block (`blocks`: their diffusers names, which
    model.storage_dtype = "fp8" stores in fp8 alike): what ComfyUI's fp8 files store in fp8."""
    return key.startswith(blocks) and key.endswith(".weight") and len(shape) == 2


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def to_single_file(
    model_dir: str,
    out: str,
    fp8: bool = False,
    scaled: bool = False,
    prefix: bool = False,
    folder: str = "transformer",
) -> None:
    cls = adapter_class(Path(model_dir))
    weights = Weights(Path(model_dir) / folder)
    tables = cls.single_file_tables(resolved_config(cls.TRANSFORMER, Path(model_dir), folder))
    stored = {key: entry[1:3] for key, entry in weights.entries.items()} | {
        key: (table.dtype, tuple(table.shape)) for key, table in tables.items()
    }
    names = {key: cls.single_file_key(key) for key in stored}
    blocks = block_prefixes(cls, Path(model_dir), folder) if fp8 else ()
    unnamed = [key for key, name in names.items() if name is None]
    # each name in the file -> the diffusers weights it holds, in row order (a fused qkv's three)
    back = {
        name: [parts] if isinstance(parts, str) else parts
        for name, parts in cls.diffusers_names(list(dict.fromkeys(names.values()))).items()
    }
    if unnamed or sorted(k for parts in back.values() for k in parts) != sorted(names):
        raise SystemExit(
            f"{model_dir}/{folder}: no single-file name for {unnamed[:3]}, or the names do not read back"
        )

    def read(parts: list[str]) -> torch.Tensor:
        """The file's tensor: its diffusers weights stacked (a fused qkv), each half-swapped where
        the family's files keep its halves the other way round (HunyuanVideo 1.5's norm_out)."""
        tensors = [tables[k].float() if k in tables else weights.read(k, torch.float32) for k in parts]
        tensors = [
            torch.cat(t.chunk(2)[::-1]) if k in cls.SWAPPED_HALVES else t for k, t in zip(parts, tensors)
        ]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    # (its name in the file, the dtype written, its shape, its reader); scaled layers' scales follow
    # their weights.
    plan = []
    for name, parts in back.items():
        key, (dtype, shape) = parts[0], stored[parts[0]]
        if len(parts) > 1:
            shape = (sum(stored[part][1][0] for part in parts), *shape[1:])
        if dtype.is_floating_point and not cls.keeps_fp32(key):
            dtype = FP8 if fp8 and quantized(key, shape, blocks) else torch.bfloat16
        plan.append(((PREFIX if prefix else "") + name, dtype, shape, functools.partial(read, parts)))
    # The other folders the family's files carry (LTX-2's text connectors, which ComfyUI's model and
    # the makers' code read from the same file), in bf16 as the makers' files hold them.
    parts = [Weights(Path(model_dir) / part) for part in cls.SINGLE_FILE_PARTS]
    for part in parts:
        for key, (_path, dtype, shape, _offset) in part.entries.items():
            name = cls.single_file_part_key(key)
            plan.append(
                (
                    name if prefix else name.removeprefix(PREFIX),
                    torch.bfloat16 if dtype.is_floating_point else dtype,
                    shape,
                    functools.partial(part.read, key, torch.float32),
                )
            )
    header, offset = {}, 0
    for name, dtype, shape, _read in plan:
        entries = [(name, dtype, shape)] + (
            [(name.removesuffix("weight") + "scale_weight", torch.float32, ())]
            if scaled and dtype == FP8
            else []
        )
        for entry_name, entry_dtype, entry_shape in entries:
            size = entry_dtype.itemsize * int(torch.Size(entry_shape).numel())
            header[entry_name] = {
                "dtype": FILE_NAMES[entry_dtype],
                "shape": list(entry_shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    if scaled:
        header[(PREFIX if prefix else "") + "scaled_fp8"] = {
            "dtype": "F8_E4M3",
            "shape": [0],
            "data_offsets": [offset] * 2,
        }
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    with open(out, "wb") as f, contextlib.ExitStack() as stack:
        for reader in (weights, *parts):
            stack.enter_context(reader.opened())
        f.write(len(text).to_bytes(8, "little") + text)
        for _name, dtype, _shape, read in plan:
            tensor = read()
            scale = None
            if dtype == FP8:
                scale = tensor.abs().max() / FP8_MAX if scaled else torch.tensor(1.0)
                tensor = (tensor / scale).clamp(-FP8_MAX, FP8_MAX)
            f.write(raw_bytes(tensor.to(dtype)))
            if scaled and scale is not None:
                f.write(raw_bytes(scale.float()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", help="a diffusers model folder (model_index.json, transformer/, ...)")
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument("--fp8", action="store_true", help="the blocks' linear weights as float8_e4m3fn")
    parser.add_argument(
        "--scaled", action="store_true", help="with --fp8: ComfyUI's scaled fp8, a scale per tensor"
    )
    parser.add_argument("--prefix", action="store_true", help=f"every key under {PREFIX}")
    parser.add_argument(
        "--folder", default="transformer", help="the transformer's subfolder (Wan 2.2 A14B: transformer_2)"
    )
    args = parser.parse_args()
    if args.scaled and not args.fp8:
        parser.error("--scaled scales fp8 weights: add --fp8")
    to_single_file(args.model_dir, args.out, args.fp8, args.scaled, args.prefix, args.folder)


if __name__ == "__main__":
    main()
