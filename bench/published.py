"""A model folder holding only a published checkpoint's configs, for the benchmarks that build
full-size models without their weights (bench_memory.py --arch, bench_gpu.py).

The configs are each family's (model_adapter.Adapter.PUBLISHED, in families/): a new family's
published checkpoints reach --arch without an edit here.
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import diffusers
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import ConfigError  # noqa: E402
from model_adapter import ADAPTERS, adapter_class, load_adapter  # noqa: E402
from weights import parameters_on_meta  # noqa: E402


@functools.cache
def families() -> dict[str, type]:
    """Each published checkpoint's name (--arch) -> its family's adapter class (Adapter.PUBLISHED)."""
    classes = [adapter_class(family) for family in ADAPTERS]
    return {name: cls for cls in classes for name in cls.PUBLISHED}


def transformer_config(arch: str) -> tuple[type, dict]:
    """A published checkpoint's transformer class and config (its first expert's)."""
    config = dict(families()[arch].PUBLISHED[arch]["transformer"])
    return getattr(diffusers, config.pop("_class_name")), config


def make_adapter(cfg, arch: str | None, root: Path, device: torch.device):
    """(family, adapter): model.path's, or the adapter of a folder holding only the published configs."""
    if arch is None:
        if not Path(cfg.model.path, "model_index.json").is_file():
            raise ConfigError(
                f"model.path = {cfg.model.path} is not here: pass --arch ({', '.join(families())})"
            )
        adapter = load_adapter(cfg.model, device)
        return adapter.FAMILY, adapter
    cls = families()[arch]
    root.mkdir(parents=True, exist_ok=True)
    for name, content in cls.PUBLISHED[arch].items():
        folder, _, kind = name.partition(".")
        if name == "model_index.json":
            (root / name).write_text(json.dumps(content))
            continue
        (root / folder).mkdir(parents=True, exist_ok=True)
        if kind == "weights":
            tensors = {key: torch.ones(shape) for key, shape in content.items()}
            save_file(tensors, root / folder / "diffusion_pytorch_model.safetensors")
        else:
            file = "scheduler_config.json" if folder == "scheduler" else "config.json"
            (root / folder / file).write_text(json.dumps(content))
    model_cfg = dataclasses.replace(cfg.model, path=str(root), family=cls.FAMILY)
    return cls.FAMILY, load_adapter(model_cfg, device)


def meta_transformer(adapter, config: dict, dtype: torch.dtype):
    """The adapter's transformer as from_pretrained(dtype=...) loads it, on the meta device, with
    the family's changes (Adapter.prepare_transformer).

    Parameters in dtype but the class's keep-in-fp32 modules; buffers and plain tensor attributes
    real, as the trainer builds it (weights.parameters_on_meta: Kandinsky 5's time embedding keeps
    its frequencies in an attribute, which a real step reads).
    """
    cls = adapter.TRANSFORMER
    with parameters_on_meta():
        transformer = cls.from_config(config)
    for name, p in transformer.named_parameters():
        p.data = p.data.to(
            torch.float32 if set(name.split(".")) & set(cls._keep_in_fp32_modules or []) else dtype
        )
    adapter.prepare_transformer(transformer)
    return transformer
