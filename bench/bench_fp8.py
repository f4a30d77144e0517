"""fp8 storage of the frozen base (model.storage_dtype = "fp8"): its error and its memory.

The storage is memory.py's; two parts measure it:

1. Error. The output of one full-size Wan 2.1 14B block (dim 5120, ffn 13824, 40 heads; random
   weights with the published init: Wan's init_weights, Xavier-uniform linears and zero biases, and
   diffusers' own, nn.Linear's default) with its linear weights stored as fp8 against the same block
   in bf16 and in fp32: per-row scales (what memory.py keeps), one scale per tensor, and a plain
   cast without a scale (what diffusers' layerwise casting does). Also with rows of unequal size
   (each row of the Xavier weights scaled by a log-normal factor, sigma 1), as trained weights have
   them and random ones do not. The error is the relative L2 norm of the difference in the block's
   update (output - input: the residual adds the input back, which would hide it; the stream is kept
   fp32), and in the tiny models' whole output (the transformer as the loader builds it).
2. Memory. The resident-size growth of loading a Wan 14B-shaped transformer of --layers blocks
   (random weights written to a temporary folder) with adapter.load_transformer(), in bf16 and with
   fp8 storage, each in a fresh process: the frozen weights' bytes, and the peak of the load.

    python bench/bench_fp8.py [--tokens 256] [--layers 4] [--only errors|memory]"""

import argparse
import copy
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import memory  # noqa: E402
from config import ModelConfig  # noqa: E402
from model_adapter import load_adapter  # noqa: E402
from tools.make_tiny_model import make_tiny_model, make_tiny_wan  # noqa: E402

WAN_14B = {
    "dim": 5120,
    "ffn_dim": 13824,
    "num_heads": 40,
    "text_dim": 4096,
    "freq_dim": 256,
    "in_channels": 16,
}


def fp8_linear(linear: torch.nn.Linear, scales: str) -> memory.Fp8Linear:
    """The layer in fp8 storage: per-row scales, one per tensor, or none.

    model.dtype is the weight's."""
    weight, dtype = linear.weight.detach(), linear.weight.dtype
    if scales == "cast":
        return memory.Fp8Linear(weight.to(memory.FP8), torch.ones(()), linear.bias, dtype)
    # per tensor: the whole tensor as one row
    rows = weight if scales == "row" else weight.reshape(1, -1)
    quantized, scale = memory.quantize(rows)
    return memory.Fp8Linear(quantized.reshape(weight.shape), scale, linear.bias, dtype)


def to_fp8(model: torch.nn.Module, blocks: list[torch.nn.Module], scales: str) -> torch.nn.Module:
    """A copy of the model whose blocks' linears are in fp8 storage."""
    inside = {id(m) for block in blocks for m in block.modules()}
    names = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear and id(m) in inside]
    model = copy.deepcopy(model)
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fp8_linear(model.get_submodule(name), scales))
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


SCALES = ("row", "tensor", "cast")


def wan_block(init: str) -> WanTransformerBlock:
    """One Wan 2.1 14B block from its published config, in fp32.

    The published config has a cross-attention norm and an RMS norm across heads."""
    torch.manual_seed(0)
    block = WanTransformerBlock(
        WAN_14B["dim"], WAN_14B["ffn_dim"], WAN_14B["num_heads"], "rms_norm_across_heads", True, 1e-6
    )
    for module in block.modules():
        if isinstance(module, torch.nn.Linear) and init != "diffusers":
            torch.nn.init.xavier_uniform_(module.weight)
            torch.nn.init.zeros_(module.bias)
            if init == "unequal rows":
                module.weight.data *= torch.randn(module.weight.shape[0], 1).exp()
    return block.eval().requires_grad_(False)


def wan_block_errors(tokens: int, init: str) -> dict[str, float]:
    """The block's update (output - input) in bf16 with fp8 storage against bf16 and fp32."""
    block32 = wan_block(init)
    side = int(math.sqrt(tokens // 4))
    # patch 1x2x2: 4 x side^2 tokens
    latent = torch.zeros(1, WAN_14B["in_channels"], 4, 2 * side, 2 * side)
    rotary = WanRotaryPosEmbed(WAN_14B["dim"] // WAN_14B["num_heads"], (1, 2, 2), 1024)(latent)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4 * side * side, WAN_14B["dim"], generator=g)
    text = torch.randn(1, 512, WAN_14B["dim"], generator=g)
    temb = torch.randn(1, 6, WAN_14B["dim"], generator=g) * 0.1

    def update(block, dtype) -> torch.Tensor:
        """One block's update (output - input) in `dtype`, the residual stream kept in fp32.

        The residual stream stays fp32 (the block adds to its input's dtype), so the figure is the
        weights' and the bf16 matmuls' error, not the rounding of the stream to bf16 (which would
        dominate it)."""
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            return block(x, text, temb, rotary).float() - x

    reference32 = update(block32, torch.float32)
    # bf16 as from_pretrained loads it: the family's fp32 modules (norm2, scale_shift_table) stay
    # fp32.
    block = block32.to(torch.bfloat16)
    del block32
    block.norm2.float()
    block.scale_shift_table.data = block.scale_shift_table.data.float()
    reference = update(block, torch.bfloat16)
    errors = {"bf16 vs fp32": relative(reference, reference32)}
    for scales in SCALES:
        ours = update(to_fp8(block, [block], scales), torch.bfloat16)
        errors[f"{scales} vs bf16"], errors[f"{scales} vs fp32"] = (
            relative(ours, reference),
            relative(ours, reference32),
        )
    return errors


def tiny_errors(root: Path) -> dict[str, dict[str, float]]:
    """The tiny models' whole output with fp8 storage against bf16.

    As in tests/test_fp8.py: per-row through the loader, and the three ways from the bf16 model."""
    make_tiny_model(str(root / "cogvideox"), "2b")
    make_tiny_wan(str(root / "wan"), "t2v")
    results = {}
    for family in ("cogvideox", "wan"):
        adapters = {
            s: load_adapter(
                ModelConfig(path=str(root / family), family=family, dtype="bf16", storage_dtype=s),
                torch.device("cpu"),
            )
            for s in ("", "fp8")
        }
        plain = adapters[""].load_transformer()
        expected = transformer_output(adapters[""], plain)
        errors = {
            "loader (row)": relative(
                transformer_output(adapters["fp8"], adapters["fp8"].load_transformer()), expected
            )
        }
        for scales in SCALES:
            errors[scales] = relative(
                transformer_output(adapters[""], to_fp8(plain, adapters[""].blocks(plain), scales)), expected
            )
        results[family] = errors
    return results


def transformer_output(adapter, transformer) -> torch.Tensor:
    """The transformer's prediction for a fixed noisy latent, prompt and timestep.

    tests/test_fp8.py's."""
    c, g = adapter.transformer_config, torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, adapter.latent_channels, 8, 8, generator=g).to(adapter.dtype)
    text = torch.randn(1, adapter.text_length, c.get("text_embed_dim") or c["text_dim"], generator=g).to(
        adapter.dtype
    )
    if adapter.FAMILY == "wan":
        x = x.transpose(1, 2)
    with torch.no_grad():
        return transformer(
            hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([500]), return_dict=False
        )[0].float()


def write_wan_14b(folder: Path, layers: int) -> None:
    """Write a Wan 2.1 14B-shaped transformer of `layers` blocks with random bf16 weights.

    A Wan 2.1 14B-shaped transformer of `layers` blocks, random bf16 weights, beside the tiny
    model's other folders (the loader reads only the transformer's)."""
    make_tiny_wan(str(folder), "t2v")
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text()) | {
        "num_attention_heads": WAN_14B["num_heads"],
        "attention_head_dim": WAN_14B["dim"] // WAN_14B["num_heads"],
        "ffn_dim": WAN_14B["ffn_dim"],
        "text_dim": WAN_14B["text_dim"],
        "freq_dim": WAN_14B["freq_dim"],
        "in_channels": WAN_14B["in_channels"],
        "out_channels": WAN_14B["in_channels"],
        "num_layers": layers,
        "cross_attn_norm": True,
    }
    config_path.write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in WanTransformer3DModel.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()
    }
    save_file(weights, str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def resident() -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of this process image, in bytes.

    Per process image, where getrusage's maxrss keeps the forking parent's peak across exec."""
    fields = dict(
        line.split(":")
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("Vm")
    )
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def load_child(folder: str, storage_dtype: str) -> None:
    """Measure adapter.load_transformer()'s resident size and peak in a fresh process.

    In a fresh process: the resident size before and after adapter.load_transformer(), and its peak.
    """
    adapter = load_adapter(
        ModelConfig(path=folder, family="wan", dtype="bf16", storage_dtype=storage_dtype), torch.device("cpu")
    )
    before = resident()["VmRSS"]
    transformer = adapter.load_transformer()
    after, peak = resident()["VmRSS"], resident()["VmHWM"]
    frozen = sum(p.nbytes for p in transformer.parameters())
    blocks = sum(p.nbytes for block in adapter.blocks(transformer) for p in block.parameters())
    print(
        json.dumps(
            {"growth": after - before, "peak_growth": peak - before, "parameters": frozen, "blocks": blocks}
        )
    )


def memory(layers: int) -> dict[str, dict]:
    folder = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    try:
        write_wan_14b(folder, layers)
        return {
            s or "bf16": json.loads(
                subprocess.run(
                    [sys.executable, __file__, "--load-child", str(folder), s],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.splitlines()[-1]
            )
            for s in ("", "fp8")
        }
    finally:
        shutil.rmtree(folder)


def errors_part(tokens: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        for family, errors in tiny_errors(Path(root)).items():
            print(
                f"tiny {family} output, relative L2 error vs bf16: "
                + ", ".join(f"{k} {v:.4f}" for k, v in errors.items())
            )
    for init in ("published (Xavier)", "diffusers", "unequal rows"):
        errors = wan_block_errors(tokens, init.split(" (")[0] if init.startswith("published") else init)
        print(
            f"Wan 14B block, {tokens} tokens, {init} init, relative L2 error of its update: "
            + ", ".join(f"{k} {v:.4f}" for k, v in errors.items())
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=256, help="video tokens of the Wan 14B block's input")
    parser.add_argument(
        "--layers", type=int, default=4, help="blocks of the Wan 14B-shaped model whose load is measured"
    )
    parser.add_argument("--only", choices=["errors", "memory"], help="run one of the two parts")
    parser.add_argument("--load-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        return load_child(*args.load_child)
    torch.set_grad_enabled(False)
    if args.only != "memory":
        errors_part(args.tokens)
    if args.only != "errors":
        measured = memory(args.layers)
        for name, m in measured.items():
            print(
                f"Wan 14B-shaped, {args.layers} blocks, {name}: parameters {m['parameters'] / 2**30:.2f} GiB "
                f"(blocks {m['blocks'] / 2**30:.2f}), resident growth {m['growth'] / 2**30:.2f} GiB, peak growth "
                f"{m['peak_growth'] / 2**30:.2f} GiB"
            )
        print(
            f"fp8 / bf16: parameters {measured['fp8']['parameters'] / measured['bf16']['parameters']:.3f}, blocks "
            f"{measured['fp8']['blocks'] / measured['bf16']['blocks']:.3f}, resident growth "
            f"{measured['fp8']['growth'] / measured['bf16']['growth']:.3f}, peak growth "
            f"{measured['fp8']['peak_growth'] / measured['bf16']['peak_growth']:.3f}"
        )


if __name__ == "__main__":
    main()
