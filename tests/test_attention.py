"""train.attention_backend and run.deterministic: the attention kernel every call runs.

train.attention_backend holds SDPA to one kernel in every transformer call, the recompute of
activation checkpointing included; run.deterministic keeps the fused kernels (their backward passes
turn deterministic in that mode) and refuses cuDNN attention, which has no deterministic backward.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import read_metrics

import parallel
import ranks
import trainer
from config import ConfigError, ModelConfig, load_config
from model_adapter import load_adapter

KERNELS = {
    "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "math": "aten::_scaled_dot_product_attention_math",
}


def kernels_of_a_step(model_path, backend: str) -> dict[str, int]:
    """How often each CPU attention kernel runs in one checkpointed training step of the tiny model."""
    adapter = load_adapter(ModelConfig(path=str(model_path), dtype="fp32"), torch.device("cpu"))
    transformer = adapter.load_transformer().train().requires_grad_(True)
    transformer.enable_gradient_checkpointing()
    c = adapter.transformer_config
    # [B, C, F, h, w]
    latent = (1, adapter.latent_channels, 3, 32 // adapter.spatial_ratio, 32 // adapter.spatial_ratio)
    batch = {
        "latent_mean": torch.randn(latent),
        "latent_logvar": torch.full(latent, -5.0),
        "prompt_embeds": torch.randn(1, adapter.text_length, c["text_embed_dim"]),
    }
    compute = parallel.Compute(torch.device("cpu"), "no", backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with compute:
            loss = adapter.train_loss(transformer, batch, [torch.Generator().manual_seed(0)]).mean()
        with compute.attention():
            loss.backward()
    names = [event.name for event in profile.events()]
    return {kernel: names.count(name) for kernel, name in KERNELS.items()}


def test_the_backend_is_in_force_in_the_forward_and_the_recompute(tiny_model):
    """The chosen backend replaces SDPA's own in the forward and in checkpointing's recompute.

    On CPUs SDPA picks its flash kernel; "math" replaces it in the forward and in checkpointing's
    recompute inside the backward (2 blocks: 4 calls), and no flash call remains."""
    assert kernels_of_a_step(tiny_model, "") == {"flash": 4, "math": 0}
    assert kernels_of_a_step(tiny_model, "math") == {"flash": 0, "math": 4}


def test_a_backend_the_device_lacks_stops_the_first_step(write_config):
    """A backend the device lacks stops the first training step.

    The trainer applies it: memory-efficient attention has no CPU kernel, so SDPA refuses the first
    training step (CUDA words it "No available kernel")."""
    cfg = load_config(
        str(
            write_config(
                "efficient", **{"train.attention_backend": "efficient", "validation.do_validation": False}
            )
        )
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product_attention"):
            trainer.train(cfg, ranks.Dist(0, 1, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    assert read_metrics(cfg.run.output_dir) == []  # no step was logged


def test_deterministic_keeps_the_fused_attention_kernels(monkeypatch, write_config):
    """run.deterministic keeps the fused attention kernels and refuses cuDNN attention.

    The flags would otherwise force the math backend (56.5 GiB of scores for CogVideoX-5B); cuDNN
    attention, which has no deterministic backward, is a config error with run.deterministic."""
    # the GPU path of make_deterministic
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    benchmark = torch.backends.cudnn.benchmark
    try:
        ranks.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = benchmark
        for enable in (
            torch.backends.cuda.enable_flash_sdp,
            torch.backends.cuda.enable_mem_efficient_sdp,
            torch.backends.cuda.enable_cudnn_sdp,
        ):
            enable(True)
    with pytest.raises(ConfigError, match='attention_backend = "cudnn" has no deterministic backward'):
        load_config(
            str(write_config("cudnn", **{"run.deterministic": True, "train.attention_backend": "cudnn"}))
        )
