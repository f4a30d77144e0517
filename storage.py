"""How the frozen base is stored: model.storage_dtype = "fp8" keeps the transformer blocks' frozen linear
weights as float8_e4m3fn with one scale per output row, upcast to the compute dtype per layer as it runs.

Half the bytes of bf16 for the weights that dominate a LoRA run's memory (and a streamed block's
transfer); LoRA, norms, embeddings, biases and everything outside the blocks keep model.dtype. The
scale is per row, not per tensor: a row's scale needs only that row, so each rank quantizes the rows
it reads under FSDP (and a row of small weights keeps its precision beside a row of large ones);
BENCHMARKS.md compares the two. The weight and its scale are ordinary frozen parameters that FSDP2
shards on dim 0 alike and all-gathers (as bytes: a unit whose parameters differ in dtype is gathered
as uint8). diffusers' layerwise casting (diffusers.hooks) casts without a scale and casts a module's
every parameter, LoRA's included, back and forth around its forward: neither fits.
"""

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row still divides by something, and quantizes to zeros.
MIN_SCALE = 1e-12
# Rows quantized at a time: the fp32 temporaries are a block's (20 MB at Wan 14B's width), not the tensor's.
ROWS = 1024


def quantize(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale [rows, 1] in `dtype`) of a 2-d weight, its largest magnitude per row mapped to
    fp8's largest value. The scale is rounded to `dtype` first and the weight divided by the rounded
    one, so fp8 * scale in `dtype` is the weight up to fp8's own rounding."""
    low, high = torch.aminmax(weight, dim=1, keepdim=True)
    scale = (torch.maximum(-low, high).float() / FP8_MAX).clamp(min=MIN_SCALE).to(dtype)
    quantized = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    for start in range(0, weight.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        quantized[rows] = (weight[rows].float() / scale[rows].float()).clamp_(-FP8_MAX, FP8_MAX)
    return quantized, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 weight upcast to its scale's dtype (the compute dtype)."""
    return weight.to(scale.dtype) * scale


class _Fp8Linear(torch.autograd.Function):
    """F.linear with an fp8 weight that saves the fp8 weight for the backward, not its upcast copy:
    otherwise every layer between a forward and its backward would hold its weight in bf16 again."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        ctx.save_for_backward(weight, scale)
        return F.linear(x, dequantize(weight, scale), bias)

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        return grad @ dequantize(weight, scale).to(grad.dtype), None, None, None


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's F.linear(x, weight, bias), its weight upcast from fp8 storage where it has one."""
    if module.weight.dtype != FP8:
        return F.linear(x, module.weight, module.bias)
    return _Fp8Linear.apply(x, module.weight, module.weight_scale, module.bias)


def weight(module: nn.Linear) -> torch.Tensor:
    """The weight a linear layer computes with: its own, or its fp8 storage upcast."""
    return dequantize(module.weight, module.weight_scale) if module.weight.dtype == FP8 else module.weight


class Fp8Linear(nn.Linear):
    """A frozen nn.Linear stored in fp8: `weight` (float8_e4m3fn, [out, in]), `weight_scale` ([out, 1], in the
    compute dtype) and `bias` (compute dtype, or None). Built from an already-quantized weight and its
    scale, per row ([out, 1] or [out]) or per tensor (one value, as ComfyUI's scaled fp8 files keep it,
    spread to every row); the scale's dtype is the compute dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate and fill a weight of its own
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"Fp8Linear takes a 2-d {FP8} weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        scale = scale.reshape(-1, 1).expand(self.out_features, 1).contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(scale.dtype), requires_grad=False)

    @classmethod
    def on_meta(cls, base: nn.Linear) -> "Fp8Linear":
        """The layer that will hold `base`'s weight in fp8, its parameters still on the meta device (the
        loader fills them: with `quantize`, or one rank's rows at a time under FSDP: `load_rows`)."""
        out_features, in_features = base.weight.shape
        return cls(torch.empty(out_features, in_features, dtype=FP8, device="meta"),
                   torch.empty(out_features, 1, dtype=base.weight.dtype, device="meta"), base.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def store_fp8(model: nn.Module, blocks: list[nn.Module], keep) -> list[str]:
    """Replace every nn.Linear inside the blocks (on the meta device, before loading) by an Fp8Linear, but
    those whose weight name `keep(name)` keeps in its own dtype (a family's fp32 modules); return the
    names of the fp8 weights."""
    inside = {id(module) for block in blocks for module in block.modules()}
    names = []
    for name, module in list(model.named_modules()):
        if id(module) in inside and type(module) is nn.Linear and not keep(f"{name}.weight"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.on_meta(module))
            names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_rows(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize `rows` of a weight into an fp8 weight's rows and their scales (tensors of the same rows,
    e.g. one rank's shard)."""
    quantized, row_scale = quantize(rows.to(weight.device), scale.dtype)
    weight.copy_(quantized)
    scale.copy_(row_scale)
