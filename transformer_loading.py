"""The transformer as from_pretrained builds it, read lean: made on the meta device, then filled.

Weight for weight: its parameters are made on the meta device, then each filled from the safetensors
files as it is read (weights.py), under FSDP each rank its rows, with model.storage_dtype = "fp8"
quantized as read. Adapter (model_adapter.py) inherits it, so every family loads its transformer the
same way; it uses the family's TRANSFORMER, blocks and single file.
"""

import contextlib
import inspect
import logging
import math
from pathlib import Path

import torch

import memory
import parallel
from weights import Weights

log = logging.getLogger("vidtrain")


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

    def load_transformer(self, trainable_dtype: torch.dtype | None = None, folder: str = "", shard=None):
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
        exists (a single file's float8_e4m3fn weights are kept as stored, fp8_source)."""
        folder = folder or self.transformer_folder
        dtype = trainable_dtype or self.dtype
        # model.transformer_file
        from_file = self.single_file is not None and folder == self.transformer_folder
        weights = self.single_file if from_file else Weights(self.path / folder)
        transformer = self._empty_transformer(resolved_config(self.TRANSFORMER, self.path, folder), dtype)
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
                    _replace(
                        transformer, name, weights.read(name, self._load_dtype(name, dtype)).to(self.device)
                    )
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
