"""fp8 storage of the frozen base: linear weights in float8_e4m3fn, upcast per layer as they run.

How the frozen base is stored: model.storage_dtype = "fp8" keeps the transformer blocks' frozen
linear weights as float8_e4m3fn with one scale per output row, upcast to the compute dtype per layer
as it runs.

Half the bytes of bf16 for the weights that dominate a LoRA run's memory (and a streamed block's
transfer); LoRA, norms, embeddings, biases and everything outside the blocks keep model.dtype. The
scale is per row, not per tensor: a row's scale needs only that row, so each rank quantizes the rows
it reads under FSDP (and a row of small weights keeps its precision beside a row of large ones);
BENCHMARKS.md compares the two. The weight and its scale are ordinary frozen parameters that FSDP2
shards on dim 0 alike and all-gathers (as bytes: a unit whose parameters differ in dtype is gathered
as uint8). The scales are fp32, as ComfyUI's files keep theirs (model.dtype's fp16 would turn a row
of small weights to NaN). A single file's weights that are already float8_e4m3fn with one scale per
tensor (ComfyUI's scaled fp8, or a plain cast: scale 1) are kept as the file stores them, the scale
spread to every row: quantizing them again would round them twice. diffusers' layerwise casting
(diffusers.hooks) casts without a scale and casts a module's every parameter, LoRA's included, back
and forth around its forward: neither fits.
"""

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row still divides by something, and quantizes to zeros.
MIN_SCALE = 1e-12
# Rows quantized at a time: the fp32 temporaries are a block's (20 MB at Wan 14B's width), not the
# tensor's.
ROWS = 1024


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-d weight to fp8 with one fp32 scale per row.

    (fp8 weight, fp32 scale [rows, 1]) of a 2-d weight (bf16, fp16 or fp32), its largest magnitude
    per row mapped to fp8's largest value. The scale stays fp32, as ComfyUI's files keep theirs: in
    fp16 a row of weights below 2.7e-5 would have a scale under fp16's smallest value (6e-8), 0, and
    its weights would divide into NaN."""
    low, high = torch.aminmax(weight, dim=1, keepdim=True)
    scale = (torch.maximum(-low, high).float() / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    for start in range(0, weight.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        quantized[rows] = (weight[rows].float() / scale[rows]).clamp_(-FP8_MAX, FP8_MAX)
    return quantized, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 weight times its fp32 scale, rounded once to `dtype` (the compute dtype).

    Every fp8 value is exact in bf16 and fp16, so the upcast copy is the only temporary: the product
    is taken in fp32."""
    return weight.to(dtype).mul_(scale)


class _Fp8Linear(torch.autograd.Function):
    """F.linear with an fp8 weight that keeps the fp8 weight, not its upcast copy, for the backward.

    Otherwise every layer between a forward and its backward would hold its weight in bf16 again."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, dtype):
        ctx.save_for_backward(weight, scale)
        ctx.dtype = dtype
        return F.linear(x, dequantize(weight, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        return grad @ dequantize(weight, scale, ctx.dtype).to(grad.dtype), None, None, None, None


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) of a linear layer.

    Its weight is upcast from fp8 storage where it has one."""
    if module.weight.dtype != FP8:
        return F.linear(x, module.weight, module.bias)
    return _Fp8Linear.apply(x, module.weight, module.weight_scale, module.bias, module.compute_dtype)


def weight(module: nn.Linear) -> torch.Tensor:
    """The weight a linear layer computes with: its own, or its fp8 storage upcast."""
    if module.weight.dtype != FP8:
        return module.weight
    return dequantize(module.weight, module.weight_scale, module.compute_dtype)


class Fp8Linear(nn.Linear):
    """A frozen nn.Linear stored in fp8 with one fp32 scale per output row.

    `weight` (float8_e4m3fn, [out, in]), `weight_scale` ([out, 1], fp32) and `bias` (in `dtype`, the
    compute dtype, or None). Built from an already-quantized weight and its scale, per row ([out, 1]
    or [out]) or per tensor (one value, as ComfyUI's scaled fp8 files keep it, spread to every row).
    """

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate and fill a weight of its own
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"Fp8Linear takes a 2-d {FP8} weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        scale = scale.float().reshape(-1, 1).expand(self.out_features, 1).contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def on_meta(cls, base: nn.Linear) -> "Fp8Linear":
        """The Fp8Linear that will hold `base`'s weight, its parameters still on the meta device.

        The layer that will hold `base`'s weight in fp8, its parameters still on the meta device
        (the loader fills them: with `quantize`, or one rank's rows at a time under FSDP:
        `load_rows`)."""
        out_features, in_features = base.weight.shape
        return cls(
            torch.empty(out_features, in_features, dtype=FP8, device="meta"),
            torch.empty(out_features, 1, device="meta"),
            base.bias,
            base.weight.dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def store_fp8(model: nn.Module, blocks: list[nn.Module], keep) -> list[str]:
    """Replace the blocks' nn.Linear layers by Fp8Linear; return the fp8 weights' names.

    Replace every nn.Linear inside the blocks (on the meta device, before loading) by an Fp8Linear,
    but those whose weight name `keep(name)` keeps in its own dtype (a family's fp32 modules);
    return the names of the fp8 weights."""
    inside = {id(module) for block in blocks for module in block.modules()}
    names = []
    for name, module in list(model.named_modules()):
        if id(module) in inside and type(module) is nn.Linear and not keep(f"{name}.weight"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.on_meta(module))
            names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_rows(
    weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, stored_scale: float | None = None
) -> None:
    """Fill an fp8 weight's rows and their scales from rows of a weight.

    The scales are tensors of the same rows (e.g. one rank's shard). The rows are quantized, or,
    with `stored_scale`, rows a file already stores in fp8 with that one scale are kept as they are
    (quantizing them again would round them twice)."""
    if stored_scale is None:
        quantized, row_scale = quantize(rows.to(weight.device))
        weight.copy_(quantized)
        scale.copy_(row_scale)
    else:
        weight.copy_(rows)
        scale.fill_(stored_scale)
