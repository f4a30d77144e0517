"""Training one card's way, on one process: block streaming and activation offload.

Training one card's way, on one process: block streaming (parallel.cpu_offload on a 1-rank FSDP
mesh, all of the frozen base or its first parallel.offload_blocks blocks in host memory) and
activation offload (train.activation_offload) train the LoRA of the plain run, render its validation
clips and resume bitwise after a stop. On this CPU-only machine host and device are one memory: the
runs hold the code paths (FSDP2's units and policies, the saved-tensors hooks) to the plain run's
numbers, and tests/test_fake_cuda.py holds where each weight lives on a CUDA mesh."""

import logging

import pytest
import torch
import torch.distributed as dist
from conftest import train_losses, write_toml
from safetensors.torch import load_file

import memory
import parallel
import ranks
import trainer
from config import ConfigError, LoraConfig, ModelConfig, ParallelConfig, TrainConfig, load_config
from model import build_model
from model_adapter import load_adapter

STREAMING = {"parallel.strategy": "fsdp", "parallel.cpu_offload": True}
RUNS = {
    "plain": {},
    "streamed": STREAMING,
    # Block 0 on the host, block 1 and the rest resident; with checkpointing and its inputs
    # offloaded.
    "one_block": {
        **STREAMING,
        "parallel.offload_blocks": 1,
        "train.gradient_checkpointing": True,
        "train.activation_offload": True,
    },
}
# validation costs about as much as training here: two runs render
VALIDATED = ("plain", "streamed")
STEPS, BLOCKS = 4, 2  # the tiny CogVideoX-2b has 2 blocks


@pytest.fixture(scope="module")
def settings(base_settings, tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")

    def make(name: str, run: str) -> tuple:
        validation = (
            {
                "validation.do_validation": True,
                "validation.validation_steps": STEPS,
                "validation.prompts": ["a red ball"],
                "validation.num_inference_steps": 2,
                "validation.save_frames": True,
            }
            if name in VALIDATED
            else {}
        )
        merged = {
            **base_settings,
            "run.output_dir": str(root / name),
            "train.steps": STEPS,
            "checkpoint.checkpointing_steps": 2,
            **validation,
            **RUNS[run],
        }
        return write_toml(root / f"{name}.toml", merged), root / name

    return make


@pytest.fixture(scope="module")
def runs(settings):
    """Each run in this process, 4 steps in fp32; the tensors that activation offload packed, copied
    to the host and unpacked."""
    outputs, packed, copied, unpacked = {}, [], [], []
    pack, unpack = memory.HostActivations.pack, memory.HostActivations.unpack
    host_like = memory.HostActivations.host_like
    with pytest.MonkeyPatch.context() as m:
        m.setattr(
            memory.HostActivations,
            "pack",
            lambda self, kept, tensor: packed.append(tuple(tensor.shape)) or pack(self, kept, tensor),
        )
        m.setattr(
            memory.HostActivations,
            "host_like",
            lambda self, kept, tensor: copied.append(tuple(tensor.shape)) or host_like(self, kept, tensor),
        )
        m.setattr(
            memory.HostActivations,
            "unpack",
            lambda self, handle: unpacked.append(1) or unpack(self, handle),
        )
        for run in RUNS:
            config, outputs[run] = settings(run, run)
            trainer.main(["--cfg", str(config)])
    outputs["packed"], outputs["copied"], outputs["unpacked"] = packed, copied, len(unpacked)
    return outputs


def lora_of(output_dir):
    return load_file(output_dir / "lora" / "pytorch_lora_weights.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["streamed", "one_block"])
def test_trains_the_plain_runs_lora(runs, run):
    plain, ours = lora_of(runs["plain"]), lora_of(runs[run])
    assert ours.keys() == plain.keys()
    assert max((ours[k] - plain[k]).abs().max().item() for k in plain) <= 1e-6
    assert train_losses(runs[run]) == pytest.approx(train_losses(runs["plain"]), rel=1e-6, abs=0)


@pytest.mark.slow
def test_activation_offload_moves_what_checkpointing_keeps(runs):
    """Activation offload moves what checkpointing keeps, each tensor to the host once.

    Each step's forward packs every block's tensor inputs (the video tokens [batch, tokens, width],
    the text tokens, the timestep embedding), and the backward takes each back. A tensor goes to the
    host once: CogVideoX's blocks each make new video and text tokens, but share the timestep
    embedding, which the first block copies and the second keeps on the device."""
    assert runs["unpacked"] == len(runs["packed"])
    # The tiny CogVideoX-2b at 9x32x32: 3 latent frames of 4x4 patches (48 video tokens), 16 text
    # tokens, width 32.
    assert runs["packed"] == [(2, 48, 32), (2, 16, 32), (2, 32)] * (STEPS * BLOCKS)
    assert runs["copied"] == [(2, 48, 32), (2, 16, 32), (2, 32), (2, 48, 32), (2, 16, 32)] * STEPS


@pytest.mark.slow
def test_validation_clips_equal_the_plain_runs(runs):
    """Rendered with every block streamed, before training and after it: the plain run's frames."""
    clips = sorted(p.name for p in (runs["plain"] / "validation_res").glob("*.safetensors"))
    assert clips == sorted(p.name for p in (runs["streamed"] / "validation_res").glob("*.safetensors"))
    assert clips == ["step_0_prompt_0.safetensors", f"step_{STEPS}_prompt_0.safetensors"]
    for name in clips:
        ours = load_file(runs["streamed"] / "validation_res" / name)
        plain = load_file(runs["plain"] / "validation_res" / name)
        assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in plain), name


@pytest.mark.slow
def test_stopped_streaming_run_resumes_bitwise(runs, settings, monkeypatch):
    """A stopped streaming run resumes bitwise.

    Stopped by an error at step 3, in this process: what a kill leaves on disk (checkpoint-2,
    nothing after it; tests/test_ckpt.py kills with SIGKILL), at a fraction of a new process's cost.
    """
    config, out = settings("stopped", "one_block")
    monkeypatch.setenv("VIDTRAIN_FAULT", "step_fail:3")
    with pytest.raises(SystemExit):
        trainer.main(["--cfg", str(config)])
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    monkeypatch.delenv("VIDTRAIN_FAULT")
    trainer.main(["--cfg", str(config)])
    assert train_losses(out) == train_losses(runs["one_block"])
    ours, reference = lora_of(out), lora_of(runs["one_block"])
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


@pytest.mark.parametrize("offload_blocks", [0, 1])
def test_what_lives_on_the_host_and_what_prefetches(tiny_model, offload_blocks):
    """FSDP2's unit policies: what lives on the host and what prefetches.

    FSDP2's record of each unit's policy, which decides on a GPU where a shard lives: the frozen
    base on the host (every block and the root's own weights, or block 0 alone), LoRA's weights
    never; every unit prefetches the next block's copy as it starts, the root block 0's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        adapter = load_adapter(ModelConfig(path=str(tiny_model), dtype="fp32"), d.device)
        model = build_model(
            adapter,
            TrainConfig(mixed_precision="no"),
            LoraConfig(rank=4),
            ParallelConfig(strategy="fsdp", cpu_offload=True, offload_blocks=offload_blocks),
            0,
            d,
        )
    finally:
        dist.destroy_process_group()
    host = parallel.offloaded(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert {name for name, p in model.named_parameters() if id(p) in host} == (
        frozen
        if offload_blocks == 0
        else {name for name in frozen if name.startswith("transformer_blocks.0.")}
    )
    units = [model, *adapter.blocks(model)]
    assert [unit._get_fsdp_state()._states_to_forward_prefetch for unit in units[:-1]] == [
        [block._get_fsdp_state()] for block in units[1:]
    ]


REQUIRED = ["--run.output_dir", "/tmp/out", "--model.path", "/m", "--data.data_root", "/d"]
STREAM = ["--parallel.strategy", "fsdp", "--parallel.cpu_offload", "true"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--parallel.offload_blocks", "-1"],
            "parallel.offload_blocks must be 0 (every block) or a number of blocks",
        ),
        (
            ["--parallel.offload_blocks", "2"],
            "parallel.offload_blocks chooses how many blocks parallel.cpu_offload keeps",
        ),
        (
            [*STREAM, "--parallel.offload_blocks", "2", "--train.training_type", "sft"],
            "parallel.offload_blocks is for LoRA",
        ),
        (
            ["--train.activation_offload", "true", "--train.gradient_checkpointing", "false"],
            "train.activation_offload moves the block inputs that activation checkpointing keeps",
        ),
    ],
)
def test_mistakes_name_the_key(args, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, REQUIRED + args)
    assert message in str(error.value)


def test_more_blocks_than_the_model_has_stop_before_the_cache_pass(settings, caplog):
    config, out = settings("too_many", "streamed")
    with pytest.raises(SystemExit), caplog.at_level(logging.ERROR, logger="vidtrain"):
        trainer.main(
            ["--cfg", str(config), "--parallel.offload_blocks", "3", "--data.cache_dir", str(out / "cache")]
        )
    assert "parallel.offload_blocks = 3, but the model has 2 transformer blocks: set at most 2" in caplog.text
    assert not (out / "cache").exists()


def test_allocator_settings_keep_the_users_keys():
    """Our allocator settings keep the keys the user set.

    What ranks.init hands torch's allocators on a GPU, whatever launched the run: ours
    (expandable segments; pinned host memory above 16 MiB at its exact size and not cached) after
    the user's own PYTORCH_ALLOC_CONF, but for the keys the user named (the two pinned ones
    together: a block left unrounded but cached would be handed out for a larger request of its
    power of two)."""
    ours = "expandable_segments:True,pinned_max_round_threshold_mb:16,pinned_max_cached_size_mb:16"
    assert ranks.allocator_settings("") == ours
    user = "roundup_power2_divisions:[256:1,>:2],max_split_size_mb:64"
    assert ranks.allocator_settings(user) == f"{user},{ours}"
    user = "expandable_segments:False,pinned_max_cached_size_mb:64"
    assert ranks.allocator_settings(user) == user


def test_vace_blocks_stream_and_store_fp8(wan_models):
    """Wan VACE's context blocks are blocks to streaming and fp8 storage.

    Streaming (a 1-rank FSDP mesh) and fp8 storage reach Wan VACE's context blocks, the first
    units in forward order: parallel.offload_blocks counts them with the base blocks (4 of the tiny
    model's 2 + 3, above its 3 base blocks); those 4 keep their frozen weights on the host, their
    linears in fp8; the root prefetches the first context block, each block the next, across into
    the base blocks; the streamed model's loss and LoRA gradients (base and context blocks) equal
    the resident model's, with a reference frame in front of the clip's."""
    adapter = load_adapter(
        ModelConfig(
            path=str(wan_models("vace")), family="wan", type="vace", dtype="fp32", storage_dtype="fp8"
        ),
        torch.device("cpu"),
    )
    assert adapter.block_count == 5
    with pytest.raises(ConfigError, match="offload_blocks = 6, but the model has 5 transformer blocks"):
        parallel.check_offload_blocks(ParallelConfig(cpu_offload=True, offload_blocks=6), adapter.block_count)
    g = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(1, 16, 3, 4, 4, generator=g),
        "latent_logvar": torch.randn(1, 16, 3, 4, 4, generator=g) - 3,
        "prompt_embeds": torch.randn(1, 512, 32, generator=g),
        "control_latents": torch.randn(1, 96, 3, 4, 4, generator=g),
        "reference_latents": torch.randn(1, 16, 1, 4, 4, generator=g),
    }
    results = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        for name, strategy in (
            ("resident", ParallelConfig()),
            ("streamed", ParallelConfig(strategy="fsdp", cpu_offload=True, offload_blocks=4)),
        ):
            model = build_model(
                adapter, TrainConfig(mixed_precision="no"), LoraConfig(rank=4), strategy, 0, d
            )
            loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(1)])
            loss.sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results[name] = (
                loss.detach(),
                {n: getattr(grad, "full_tensor", lambda g=grad: g)() for n, grad in grads.items()},
            )
    finally:
        dist.destroy_process_group()
    blocks = adapter.blocks(model)
    host = parallel.offloaded(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    streamed = ("vace_blocks.0.", "vace_blocks.1.", "blocks.0.", "blocks.1.")
    assert {name for name, p in model.named_parameters() if id(p) in host} == {
        name for name in frozen if name.startswith(streamed)
    }
    assert {"vace_blocks.0.proj_in.weight", "vace_blocks.1.attn1.to_q.weight"} <= {
        name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn
    }
    units = [model, *blocks]
    assert blocks[:2] == list(model.vace_blocks)
    assert [unit._get_fsdp_state()._states_to_forward_prefetch for unit in units[:-1]] == [
        [block._get_fsdp_state()] for block in units[1:]
    ]
    (loss, grads), (streamed_loss, streamed_grads) = results["resident"], results["streamed"]
    assert any(n.startswith("vace_blocks.") for n in grads) and grads.keys() == streamed_grads.keys()
    torch.testing.assert_close(streamed_loss, loss, rtol=1e-6, atol=0)
    for n in grads:
        torch.testing.assert_close(streamed_grads[n], grads[n], rtol=1e-5, atol=1e-7, msg=n)
