"""model.storage_dtype = "fp8": the blocks' frozen linears in float8_e4m3fn, upcast per layer.

The frozen linears of the transformer blocks stored in float8_e4m3fn with a scale per output row,
upcast per layer (memory.py). The model computes what the bf16 one does within fp8's rounding, a
LoRA trains on it as on bf16, and its export is a LoRA of the original model."""

import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import read_metrics, write_toml
from diffusers import CogVideoXPipeline
from safetensors.torch import load_file, save_file

import lora
import memory
import ranks
import render
import trainer
from config import ConfigError, ModelConfig, load_config
from model_adapter import load_adapter

# Relative L2 error of the tiny models' output against bf16's, per block it runs through (measured:
# CogVideoX 0.006, Wan 0.009 over 2 blocks, Wan VACE 0.022 over 5; bf16's own against fp32 is
# 0.005-0.007). bench/bench_fp8.py measures it at full size (BENCHMARKS.md).
TOLERANCE_PER_BLOCK = 0.01


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def transformer_output(adapter, transformer) -> torch.Tensor:
    """The transformer's prediction for a fixed noisy latent, prompt and timestep."""
    c, g = adapter.transformer_config, torch.Generator().manual_seed(0)
    latent = (1, 3, adapter.latent_channels, 8, 8)  # [B, F, C, h, w]: CogVideoX's order
    x = torch.randn(latent, generator=g).to(adapter.dtype)
    text = torch.randn(1, adapter.text_length, c.get("text_embed_dim") or c["text_dim"], generator=g).to(
        adapter.dtype
    )
    if adapter.FAMILY == "wan":
        x = x.transpose(1, 2)  # [B, C, F, h, w]
    # Wan VACE: a context of the clip's frames for the VACE blocks
    vace = (
        {"control_hidden_states": torch.randn(1, 96, 3, 8, 8, generator=g).to(adapter.dtype)}
        if adapter.vace
        else {}
    )
    with torch.no_grad():
        return transformer(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=torch.tensor([500]),
            return_dict=False,
            **vace,
        )[0].float()


@pytest.mark.parametrize("family", ["cogvideox", "wan", "wan_vace"])
def test_fp8_storage_halves_the_block_weights_and_keeps_the_output(family, tiny_model, wan_models):
    """fp8 storage halves the block weights' bytes and keeps bf16's output within tolerance.

    Only the blocks' linear weights turn fp8 (scales in fp32, one per row); norms, biases,
    embeddings and everything outside the blocks stay bf16 (Wan's fp32 modules fp32); those weights
    take half the bytes; the output is bf16's within TOLERANCE_PER_BLOCK per block. An Fp8Linear built from the same fp8
    weight with a per-tensor scale (ComfyUI's scaled fp8) spreads the scale to every row. Wan VACE:
    its context blocks are blocks too (their projections in and out included)."""
    path = str({"cogvideox": tiny_model, "wan": wan_models("t2v"), "wan_vace": wan_models("vace")}[family])
    kind = {"wan_vace": ("wan", "vace")}.get(family, (family, "t2v"))
    adapters = {
        s: load_adapter(
            ModelConfig(path=path, family=kind[0], type=kind[1], dtype="bf16", storage_dtype=s),
            torch.device("cpu"),
        )
        for s in ("", "fp8")
    }
    plain, fp8 = (adapters[s].load_transformer() for s in ("", "fp8"))
    block_linears = {f"{name}.weight" for name, m in fp8.named_modules() if isinstance(m, memory.Fp8Linear)}
    in_blocks = {
        f"{name}.weight"
        for block in adapters[""].blocks(plain)
        for name, m in plain.named_modules()
        if isinstance(m, torch.nn.Linear) and any(m is b for b in block.modules())
    }
    assert block_linears == in_blocks and block_linears
    if family == "wan_vace":
        assert {
            "vace_blocks.0.proj_in.weight",
            "vace_blocks.1.attn1.to_q.weight",
            "vace_blocks.1.proj_out.weight",
        } < block_linears
    params = dict(fp8.named_parameters())
    for name, param in plain.named_parameters():
        if name in block_linears:
            assert params[name].dtype == torch.float8_e4m3fn and params[name].shape == param.shape
            scale = params[f"{name}_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (param.shape[0], 1)
            assert params[name].nbytes * 2 == param.nbytes
        else:
            assert torch.equal(params[name], param), name  # bitwise the bf16 model's
    assert params.keys() - dict(plain.named_parameters()).keys() == {
        f"{name}_scale" for name in block_linears
    }

    expected = transformer_output(adapters[""], plain)
    error = ((transformer_output(adapters["fp8"], fp8) - expected).norm() / expected.norm()).item()
    assert 0 < error < TOLERANCE_PER_BLOCK * adapters["fp8"].block_count

    module = fp8.get_submodule(sorted(block_linears)[0].removesuffix(".weight"))
    per_tensor = memory.Fp8Linear(
        module.weight.data, module.weight_scale[:1, 0].clone(), module.bias, torch.bfloat16
    )
    assert per_tensor.weight_scale.shape == module.weight_scale.shape
    assert torch.equal(
        memory.weight(per_tensor), (module.weight.float() * module.weight_scale[0]).to(torch.bfloat16)
    )


def test_fp16_keeps_rows_of_zeros_and_of_small_weights(tiny_model, tmp_path):
    """With model.dtype fp16, rows of zeros and of small weights survive fp8 storage.

    model.dtype = "fp16": a row of zeros and a row of weights below 2.7e-5 (whose scale, max / 448,
    is under fp16's smallest value, 6e-8) come back as zeros and as themselves within fp8's
    rounding, and the model's output is finite: the scales are kept in fp32, not in fp16, where they
    would be 0 and the rows NaN."""
    folder = shutil.copytree(tiny_model, tmp_path / "model")
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(file)
    name = "transformer_blocks.0.ff.net.2.weight"
    weights[name][0] = 0
    weights[name][1] *= 1e-5 / weights[name][1].abs().max()
    save_file(weights, file)
    cfg = ModelConfig(path=str(folder), dtype="fp16", storage_dtype="fp8")
    adapter = load_adapter(cfg, torch.device("cpu"))
    model = adapter.load_transformer()
    upcast = memory.weight(model.get_submodule(name.removesuffix(".weight")))
    assert upcast.dtype == torch.float16 and torch.isfinite(upcast).all()
    assert torch.equal(upcast[0], torch.zeros_like(upcast[0]))
    # e4m3's 3 mantissa bits: a relative error of at most 2^-4, down to fp16's own spacing of 6e-8
    # there
    torch.testing.assert_close(upcast[1].float(), weights[name][1].float(), rtol=2**-4, atol=6e-8)
    assert torch.isfinite(transformer_output(adapter, model)).all()


def test_fp8_linear_computes_as_its_upcast_weight():
    """An fp8 linear computes as its upcast weight does, forward and backward.

    Forward and backward (which keeps the fp8 weight, not its upcast copy) equal nn.Linear's with
    the upcast weight, under bf16 autocast as in training, and inside a LoRALinear."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(48, 24).to(torch.bfloat16)
    weight, scale = memory.quantize(reference.weight.detach())
    reference.weight.data = memory.dequantize(weight, scale, torch.bfloat16)
    fp8 = memory.Fp8Linear(weight, scale, reference.bias.detach(), torch.bfloat16)
    layers = [torch.nn.Sequential(module) for module in (reference, fp8)]
    for model in layers:
        lora.inject_lora(model, ["0"], 4, 4, 0.0, seed=0)
        torch.nn.init.normal_(model[0].lora_B.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, 48)
    results = []
    for model in layers:
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            out = model(leaf * 1)  # not a leaf: autocast would share its cast between the two paths
        out.float().square().sum().backward()
        results.append((out, leaf.grad, model[0].lora_A.weight.grad))
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


def test_sft_with_fp8_storage_stops_before_any_work(write_config):
    with pytest.raises(
        ConfigError, match='model.storage_dtype = "fp8" stores a frozen base, but train.training_type'
    ):
        load_config(str(write_config("sft", **{"model.storage_dtype": "fp8", "train.training_type": "sft"})))


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ranks.Dist(0, 1, 0, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_lora_on_fp8_trains_as_without_it_and_exports_for_the_original_model(
    base_settings, tiny_model, tmp_path, one_process_group
):
    """A LoRA trains on the fp8 base as on model.dtype's and exports for the original model.

    20 steps (one-process FSDP, activation checkpointing, EMA, a validation render): the held-out
    loss falls on the fp8 base as on the model.dtype one. The export holds the same keys as that
    run's, and diffusers' pipeline loads it (load_lora_weights) into the original model, where it
    computes what our model computes with it. In fp32 (the session's cache), where the tiny model
    steps far faster than in bf16 on CPUs (docs/testing.md): fp8 storage upcasts to model.dtype,
    whichever it is, and the test above holds its output to bf16's."""
    settings = {
        **base_settings,
        "train.steps": 20,
        "train.learning_rate": 3e-3,
        "train.gradient_checkpointing": True,
        "train.ema_decay": 0.9,
        "parallel.strategy": "fsdp",
        "lora.rank": 8,
        "lora.lora_alpha": 4,
        "checkpoint.checkpointing_steps": 20,
        "validation.validation_steps": 20,
        "validation.prompts": ["a red ball"],
        "validation.num_inference_steps": 2,
    }
    losses, configs = {}, {}
    for name in ("plain", "fp8"):
        configs[name] = load_config(
            str(
                write_toml(
                    tmp_path / f"{name}.toml",
                    {
                        **settings,
                        "run.output_dir": str(tmp_path / name),
                        "model.storage_dtype": "fp8" if name == "fp8" else "",
                    },
                )
            )
        )
        trainer.train(configs[name], one_process_group)
        losses[name] = {m["step"]: m["val/loss"] for m in read_metrics(tmp_path / name) if "val/loss" in m}
    drops = {name: held_out[0] - held_out[20] for name, held_out in losses.items()}
    assert drops["plain"] > 0 and abs(drops["fp8"] - drops["plain"]) < 0.2 * drops["plain"], losses
    assert (tmp_path / "fp8" / "validation_res" / "step_20_prompt_0.mp4").is_file()

    exported = tmp_path / "fp8" / "lora" / "pytorch_lora_weights.safetensors"
    weights, info = lora.load_lora(str(exported))
    assert (
        weights.keys()
        == lora.load_lora(str(tmp_path / "plain" / "lora" / "pytorch_lora_weights.safetensors"))[0].keys()
    )
    pipe = CogVideoXPipeline.from_pretrained(str(tiny_model))
    pipe.load_lora_weights(str(exported))
    adapter = load_adapter(configs["plain"].model, torch.device("cpu"))
    ours = render.load_model(configs["plain"], adapter, one_process_group, None, str(exported))
    base = transformer_output(adapter, adapter.load_transformer())
    theirs = transformer_output(adapter, pipe.transformer)
    torch.testing.assert_close(theirs, transformer_output(adapter, ours.eval()), rtol=0, atol=1e-5)
    assert (theirs - base).abs().max() > 0.1  # the LoRA shows
