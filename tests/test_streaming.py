"""Training one card's way, on one process: block streaming (parallel.cpu_offload on a 1-rank FSDP mesh,
all of the frozen base or its first parallel.offload_blocks blocks in host memory) and activation offload
(train.activation_offload) train the LoRA of the plain run, render its validation clips and resume
bitwise after a kill. On this CPU-only machine host and device are one memory: the runs hold the code
paths (FSDP2's units and policies, the saved-tensors hooks) to the plain run's numbers, and
tests/test_fake_cuda.py holds where each weight lives on a CUDA mesh."""

import logging

import pytest
import torch
from conftest import run_cmd, train_losses, write_toml
from safetensors.torch import load_file

import activations
import trainer
from config import ConfigError, load_config

STREAMING = {"parallel.strategy": "fsdp", "parallel.cpu_offload": True}
RUNS = {
    "plain": {},
    "streamed": STREAMING,
    # Block 0 on the host, block 1 and the rest resident; with checkpointing and its inputs offloaded.
    "one_block": {**STREAMING, "parallel.offload_blocks": 1, "train.gradient_checkpointing": True,
                  "train.activation_offload": True},
    "activations": {"train.gradient_checkpointing": True, "train.activation_offload": True},
}
VALIDATED = ("plain", "streamed", "one_block")
STEPS, BLOCKS = 4, 2  # the tiny CogVideoX-2b has 2 blocks


@pytest.fixture(scope="module")
def settings(base_settings, tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")

    def make(name: str, run: str) -> tuple:
        validation = {"validation.do_validation": True, "validation.validation_steps": STEPS,
                      "validation.prompts": ["a red ball"], "validation.num_inference_steps": 2,
                      "validation.save_frames": True} if name in VALIDATED else {}
        merged = {**base_settings, "run.output_dir": str(root / name), "train.steps": STEPS,
                  "checkpoint.checkpointing_steps": 2, **validation, **RUNS[run]}
        return write_toml(root / f"{name}.toml", merged), root / name

    return make


@pytest.fixture(scope="module")
def runs(settings):
    """Each run in this process, 4 steps in fp32; the tensors that activation offload packed and unpacked."""
    outputs, packed, unpacked = {}, [], []
    pack, unpack = activations.HostActivations.pack, activations.HostActivations.unpack
    with pytest.MonkeyPatch.context() as m:
        m.setattr(activations.HostActivations, "pack",
                  lambda self, kept, tensor: packed.append(tuple(tensor.shape)) or pack(self, kept, tensor))
        m.setattr(activations.HostActivations, "unpack", lambda self, handle: unpacked.append(1) or unpack(self, handle))
        for run in RUNS:
            config, outputs[run] = settings(run, run)
            before = len(packed)
            trainer.main(["--cfg", str(config)])
            outputs[f"{run}_packed"], outputs[f"{run}_unpacked"] = packed[before:], len(unpacked)
            unpacked.clear()
    return outputs


def lora_of(output_dir):
    return load_file(output_dir / "lora" / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("run", ["streamed", "one_block", "activations"])
def test_trains_the_plain_runs_lora(runs, run):
    plain, ours = lora_of(runs["plain"]), lora_of(runs[run])
    assert ours.keys() == plain.keys()
    assert max((ours[k] - plain[k]).abs().max().item() for k in plain) <= 1e-6
    assert train_losses(runs[run]) == pytest.approx(train_losses(runs["plain"]), rel=1e-6, abs=0)


@pytest.mark.parametrize("run", ["one_block", "activations"])
def test_activation_offload_moves_what_checkpointing_keeps(runs, run):
    """Each step's forward sends every block's tensor inputs (the video tokens [batch, tokens, dim], the
    text tokens, the timestep embedding) to the host once, and the backward takes each back."""
    packed = runs[f"{run}_packed"]
    assert runs[f"{run}_unpacked"] == len(packed)
    # The tiny CogVideoX-2b at 9x32x32: 3 latent frames of 4x4 patches (48 video tokens), 16 text tokens, width 32.
    assert packed == [(2, 48, 32), (2, 16, 32), (2, 32)] * (STEPS * BLOCKS)


@pytest.mark.parametrize("run", ["streamed", "one_block"])
def test_validation_clips_equal_the_plain_runs(runs, run):
    clips = sorted(p.name for p in (runs["plain"] / "validation_res").glob("*.safetensors"))
    assert clips == sorted(p.name for p in (runs[run] / "validation_res").glob("*.safetensors")) and len(clips) == 2
    for name in clips:
        ours, plain = load_file(runs[run] / "validation_res" / name), load_file(runs["plain"] / "validation_res" / name)
        assert all(torch.equal(ours[k], plain[k]) for k in plain), name


def test_killed_streaming_run_resumes_bitwise(runs, settings):
    """Without validation, which leaves training bitwise unchanged (tests/test_validate.py): a quicker kill."""
    config, out = settings("killed", "one_block")
    killed = run_cmd(["--cfg", str(config)], env={"VIDTRAIN_FAULT": "step_kill:3"})
    assert killed.returncode != 0 and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    trainer.main(["--cfg", str(config)])
    assert train_losses(out) == train_losses(runs["one_block"])
    ours, reference = lora_of(out), lora_of(runs["one_block"])
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


REQUIRED = ["--run.output_dir", "/tmp/out", "--model.path", "/m", "--data.data_root", "/d"]
STREAM = ["--parallel.strategy", "fsdp", "--parallel.cpu_offload", "true"]


@pytest.mark.parametrize("args, message", [
    (["--parallel.offload_blocks", "-1"], "parallel.offload_blocks must be 0 (every block) or a number of blocks"),
    (["--parallel.offload_blocks", "2"], "parallel.offload_blocks chooses how many blocks parallel.cpu_offload keeps"),
    ([*STREAM, "--parallel.offload_blocks", "2", "--train.training_type", "sft"],
     "parallel.offload_blocks is for LoRA"),
    (["--train.activation_offload", "true", "--train.gradient_checkpointing", "false"],
     "train.activation_offload moves the block inputs that activation checkpointing keeps"),
])
def test_mistakes_name_the_key(args, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, REQUIRED + args)
    assert message in str(error.value)


def test_more_blocks_than_the_model_has_stop_before_the_cache_pass(settings, caplog):
    config, out = settings("too_many", "streamed")
    with pytest.raises(SystemExit), caplog.at_level(logging.ERROR, logger="vidtrain"):
        trainer.main(["--cfg", str(config), "--parallel.offload_blocks", "3", "--data.cache_dir", str(out / "cache")])
    assert "parallel.offload_blocks = 3, but the model has 2 transformer blocks: set at most 2" in caplog.text
    assert not (out / "cache").exists()
