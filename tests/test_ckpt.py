"""Checkpoints: bitwise resumes, resharding, commit, rotation, fallback, signals, async save.

Killed and resumed runs equal uninterrupted ones bitwise; resharding; atomic commit, rotation and
fallback; SIGTERM; async save; failed writes; what is (not) in a checkpoint."""

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    finish,
    read_metrics,
    run_cmd,
    run_ok,
    run_read_only,
    start_paused,
    train_losses,
    write_toml,
)
from diffusers import CogVideoXPipeline
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckpt
import command
import lora
import ranks
from config import CheckpointConfig, ConfigError, LoraConfig, ModelConfig, load_config
from data import Sampler
from model_adapter import load_adapter

STEPS = 14
# Global batch 4 everywhere, with accumulation and EMA on.
VARIANTS = {
    "one": ({"train.batch_size": 2}, 1),
    "ddp": ({"train.batch_size": 1, "parallel.strategy": "ddp"}, 2),
    # With validation (held-out loss and one clip), which must not change training.
    "fsdp": (
        {
            "train.batch_size": 1,
            "parallel.strategy": "fsdp",
            "validation.do_validation": True,
            "validation.validation_steps": 4,
            "validation.prompts": ["a red ball"],
            "validation.num_inference_steps": 2,
        },
        2,
    ),
}


@pytest.fixture(scope="module")
def make_config(base_settings, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")

    def make(name: str, variant: str, **settings):
        merged = {
            **base_settings,
            "run.output_dir": str(root / name),
            "train.steps": STEPS,
            "train.gradient_accumulation_steps": 2,
            "train.ema_decay": 0.9,
            "checkpoint.checkpointing_steps": 2,
            "checkpoint.checkpointing_limit": 0,
            "validation.do_validation": False,
            **VARIANTS[variant][0],
            **settings,
        }
        return write_toml(root / f"{name}.toml", merged), root / name, VARIANTS[variant][1]

    return make


@pytest.fixture(scope="module")
def references(make_config):
    """Uninterrupted runs, one per variant."""
    outputs = {}
    for variant in VARIANTS:
        cfg, out, nproc = make_config(f"ref_{variant}", variant)
        run_ok(["--cfg", str(cfg)], nproc=nproc)
        outputs[variant] = out
    return outputs


def assert_intact(path):
    assert ckpt.check_files(path, list(json.loads((path / "meta.json").read_text())["files"])) is None


def weights(output_dir, folder="lora"):
    return load_file(output_dir / folder / "pytorch_lora_weights.safetensors")


def assert_bitwise_equal_runs(a, b):
    assert train_losses(a) == train_losses(b)
    for folder in ("lora", "lora_ema"):
        wa, wb = weights(a, folder), weights(b, folder)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), folder


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_killed_run_resumes_bitwise(references, make_config, variant):
    cfg, out, nproc = make_config(f"kill_{variant}", variant)
    killed = run_cmd(["--cfg", str(cfg)], nproc=nproc, env={"VIDTRAIN_FAULT": "step_kill:5"})
    assert killed.returncode != 0 and not (out / "checkpoint-6").exists()
    # The killed run's run.lock names it, but its flock died with it: the next run takes the folder.
    assert (out / "run.lock").read_text().startswith("pid ")
    resumed = run_ok(["--cfg", str(cfg)], nproc=nproc)
    assert f"resumed from step 4 ({out / 'checkpoint-4'})" in resumed.stderr
    assert (out / "config-resume-4.toml").is_file()
    assert_bitwise_equal_runs(references[variant], out)
    # TensorBoard shows each step once: the resumed run purged what followed step 4
    if variant == "one":
        events = EventAccumulator(str(out / "logs")).Reload()
        assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("adapter, variant", [("dora", "fsdp"), ("lokr", "one")])
def test_killed_dora_and_lokr_runs_resume_bitwise(make_config, adapter, variant):
    """DoRA's magnitudes (sharded under FSDP2) and LoKr's Kronecker factors resume as LoRA's weights
    do: a run killed after its step-4 checkpoint ends, resumed, bitwise equal to one never stopped,
    EMA included. Short runs: 6 steps, no validation."""
    settings = {"lora.variant": adapter, "train.steps": 6, "validation.do_validation": False}
    cfg, reference, nproc = make_config(f"ref_{adapter}", variant, **settings)
    run_ok(["--cfg", str(cfg)], nproc=nproc)
    cfg, out, nproc = make_config(f"kill_{adapter}", variant, **settings)
    killed = run_cmd(["--cfg", str(cfg)], nproc=nproc, env={"VIDTRAIN_FAULT": "step_kill:5"})
    assert killed.returncode != 0 and not (out / "checkpoint-6").exists()
    resumed = run_ok(["--cfg", str(cfg)], nproc=nproc)
    assert f"resumed from step 4 ({out / 'checkpoint-4'})" in resumed.stderr
    assert_bitwise_equal_runs(reference, out)
    trained = weights(out)
    marker = {"dora": ".lora_magnitude_vector", "lokr": ".lokr_w1"}[adapter]
    assert any(marker in key for key in trained), sorted(trained)[:4]


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, target", [("fsdp", "one"), ("one", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp")]
)
def test_reshard_between_world_sizes_and_strategies(references, make_config, source, target):
    """A checkpoint reshards between world sizes and strategies.

    FSDP on 2 ranks -> 1 rank with the batch doubled, and back; 2-rank DDP -> 2-rank FSDP, and back:
    the next 10 steps match the run that was not stopped."""
    cfg, out, nproc = make_config(f"reshard_{source}_{target}", target)
    out.mkdir()
    shutil.copytree(references[source] / "checkpoint-4", out / "checkpoint-4")
    run_ok(["--cfg", str(cfg)], nproc=nproc)
    reference, resumed = train_losses(references[source]), train_losses(out)
    assert sorted(resumed) == list(range(5, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([resumed[s] for s in sorted(resumed)]),
        torch.tensor([reference[s] for s in sorted(resumed)]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
def test_kill_during_save_falls_back_and_rotation_keeps_the_newest(references, make_config):
    cfg, out, nproc = make_config("save_kill", "one", **{"checkpoint.checkpointing_limit": 2})
    assert run_cmd(["--cfg", str(cfg)], env={"VIDTRAIN_FAULT": "save_kill:4"}).returncode != 0
    assert (out / "checkpoint-4.tmp").is_dir() and (out / "latest").read_text() == "checkpoint-2\n"
    resumed = run_ok(["--cfg", str(cfg)])
    assert "resumed from step 2" in resumed.stderr and not (out / "checkpoint-4.tmp").exists()
    assert_bitwise_equal_runs(references["one"], out)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-14"]
    assert (out / "latest").read_text() == "checkpoint-14\n"


@pytest.mark.slow
def test_sigterm_during_a_save_completes_it_and_exits_zero(references, make_config):
    """SIGTERM during a save completes it and exits 0; the next launches end bitwise equal.

    SIGTERM on one rank while step 4's shards are written: the save commits, and every rank stops at
    the next check (the first sampling step of step 4's validation) with exit 0. The next launch
    runs step 4's validation first, and is stopped during the last one (step 14's), after
    checkpoint-14: it says so and exports nothing. The third runs that validation, then exports: the
    run ends bitwise equal to the one never stopped, with each validation's held-out loss and clip
    logged exactly once."""
    cfg, out, nproc = make_config("sigterm", "fsdp")
    stopped = run_ok(["--cfg", str(cfg)], nproc=2, env={"VIDTRAIN_FAULT": "save_sigterm:4:1"})
    assert "stopped by a signal: after step 4, checkpoint written" in stopped.stderr
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not (out / "lora").exists()
    # Each validation takes 2 sampling steps of each rank: steps 4, 8 and 12 take 1-6, step 14
    # starts at 7.
    last = run_ok(["--cfg", str(cfg)], nproc=2, env={"VIDTRAIN_FAULT": "render_sigterm:7:1"})
    assert (
        "stopped by a signal: after the last step (14), before its validation completed; checkpoint "
        "written; launch again to run the validation and export" in last.stderr
    )
    assert (out / f"checkpoint-{STEPS}").is_dir() and not (out / "lora").exists()
    run_ok(["--cfg", str(cfg)], nproc=2)
    assert_bitwise_equal_runs(references["fsdp"], out)
    validated = [0, 4, 8, 12, 14]
    assert [m["step"] for m in read_metrics(out) if "val/loss" in m] == validated
    events = EventAccumulator(str(out / "logs"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Scalars("val/loss")] == validated
    assert [e.step for e in events.Images("val/clip_0")] == validated
    assert sorted(p.name for p in (out / "validation_res").iterdir()) == sorted(
        f"step_{s}_prompt_0.mp4" for s in validated
    )


@pytest.mark.slow
def test_sigterm_to_launch_sh_stops_one_step_later(references, make_config):
    """SIGTERM to launch.sh stops the run one step later, with a checkpoint and exit 0.

    A run through launch.sh, paused by rank 0 at step 4, holds run.output_dir: the lock a second
    run takes first (command.run_lock, before any compute) is refused naming the first one's pid and
    host (test_killed_run_resumes_bitwise: a SIGKILLed run leaves it free). Then SIGTERM to
    launch.sh and torchrun, as a scheduler signals every process of a job (the workers get it from
    both): the ranks learn of it from the all-reduce that step 4's end starts and step 5's end reads
    (so no step waits for it), save checkpoint-5 and exit 0, and so does launch.sh (torchrun itself
    exits 1 after a signal); the next launch continues bitwise."""
    cfg, out, nproc = make_config("sigterm_step", "ddp")
    process, pid, output = start_paused([str(cfg)], "step_pause:4:0", nproc=nproc, script="launch.sh")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"run.output_dir = {out} is in use by another run: pid {pid} on "
            f"host {socket.gethostname()} (its run.lock)"
        ),
    ):
        command.take_lock(out / "run.lock").close()
    os.killpg(process.pid, signal.SIGTERM)
    code, output = finish(process, output)
    assert code == 0, output[-4000:]
    assert "stopped by a signal: after step 5, checkpoint written" in output
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    run_ok(["--cfg", str(cfg)], nproc=nproc)
    assert_bitwise_equal_runs(references["ddp"], out)


@pytest.mark.slow
def test_fp16_loss_scale_resumes_exactly(make_config):
    """The fp16 loss scale resumes exactly.

    The loss scale is a tensor in the checkpoint: halved by an overflow at step 3, killed at step 5,
    the run resumes from step 4 with the halved scale and ends bitwise equal to the uninterrupted
    one."""
    fp16 = {"train.mixed_precision": "fp16"}
    cfg, reference, _ = make_config("fp16_ref", "one", **fp16)
    run_ok(["--cfg", str(cfg)], env={"VIDTRAIN_FAULT": "overflow:3"})
    cfg, out, _ = make_config("fp16_kill", "one", **fp16)
    assert run_cmd(["--cfg", str(cfg)], env={"VIDTRAIN_FAULT": "overflow:3,step_kill:5"}).returncode != 0
    resumed = run_ok(["--cfg", str(cfg)], env={"VIDTRAIN_FAULT": "overflow:3"})
    assert "resumed from step 4" in resumed.stderr
    assert_bitwise_equal_runs(reference, out)
    scales = [(m["step"], m["train/loss_scale"]) for m in read_metrics(out) if "train/loss_scale" in m]
    assert scales == [(s, 2.0**16 if s < 3 else 2.0**15) for s in range(1, STEPS + 1)]


@pytest.mark.slow
def test_async_save_commits_and_resumes_bitwise(references, make_config):
    """An async save commits in the background, and a killed run resumes bitwise.

    Killed at step 7: step 6's background save never committed, step 4's (committed at step 6) is
    where the next launch resumes, and the run ends bitwise equal to the uninterrupted one."""
    cfg, out, nproc = make_config("async", "fsdp", **{"checkpoint.async_save": True})
    assert run_cmd(["--cfg", str(cfg)], nproc=2, env={"VIDTRAIN_FAULT": "step_kill:7"}).returncode != 0
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    resumed = run_ok(["--cfg", str(cfg)], nproc=2)
    assert f"resumed from step 4 ({out / 'checkpoint-4'})" in resumed.stderr
    assert_bitwise_equal_runs(references["fsdp"], out)
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [
        f"checkpoint-{s}" for s in range(2, STEPS + 1, 2)
    ]
    for path in ckpt.complete_checkpoints(out):
        assert_intact(path)


@pytest.mark.slow
def test_failed_write_is_reported_and_loses_nothing(make_config):
    cfg, out, nproc = make_config("disk_full", "ddp")
    result = run_cmd(["--cfg", str(cfg)], nproc=2, env={"VIDTRAIN_FAULT": "save_fail:4:1"}, timeout=150)
    assert result.returncode != 0
    assert (
        f"writing {out / 'checkpoint-4.tmp'} failed on rank 1: OSError: [Errno 28] No space left"
        in result.stderr
    )
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2"]
    assert_intact(out / "checkpoint-2")


@pytest.mark.parametrize("where", ["every thread", "the other threads"])
def test_a_full_disk_during_a_save_is_one_line(where, tmp_path, monkeypatch, capfd):
    """A full disk under DCP's writer threads is the save's one-line error, without each thread's
    chained traceback on stderr (Python's thread excepthook printed about 30 lines a thread); a
    failure of the threads beside the caller's alone fails the save too (DCP returned as if it had
    written everything)."""
    write = ckpt.HashingStream.write

    def full(self, data):
        if where == "the other threads" and threading.current_thread() is threading.main_thread():
            return write(self, data)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's
    monkeypatch.setattr(ckpt, "WRITE_THREADS", 4)
    monkeypatch.setattr(ckpt.HashingStream, "write", full)
    tmp = tmp_path / "checkpoint-2.tmp"
    with pytest.raises(ranks.StopRun) as failed, ckpt.write_failures_named(tmp):
        dcp.save({f"t{i}": torch.ones(1000) for i in range(8)}, storage_writer=ckpt.HashingWriter(tmp))
    assert str(failed.value).startswith(f"writing {tmp} failed on rank 0: OSError: [Errno 28] No space left")
    for thread in threading.enumerate():  # the writer threads, still ending after the caller raised
        if "_write_files_from_queue" in thread.name:
            thread.join()
    assert "Exception in thread" not in capfd.readouterr().err


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_and_the_advice_works(references, make_config):
    """Damaged checkpoints are passed over, and the advice printed when none passes works.

    A bad shard, a garbled or empty meta.json, a missing meta.json or .metadata: each newest
    checkpoint in turn is passed over naming its file. When none passes (every meta.json gone), the
    run stops without touching them, and the advice it prints works as written: the rehash command,
    then a launch."""
    cfg, out, nproc = make_config("corrupt", "one", **{"train.steps": STEPS + 2})
    shutil.copytree(references["one"], out)
    shard = out / f"checkpoint-{STEPS}" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (out / "checkpoint-12" / "meta.json").write_text('{"step": 12, "iden')
    (out / "checkpoint-10" / "meta.json").write_text("")
    (out / "checkpoint-8" / "meta.json").unlink()
    (out / "checkpoint-6" / ".metadata").unlink()
    result = run_ok(["--cfg", str(cfg)])
    for problem in (
        f"checkpoint-{STEPS}: __0_0.distcp does not match its size or sha256",
        "checkpoint-12: meta.json is damaged (Unterminated string",
        "checkpoint-10: meta.json is damaged (Expecting value",
        "checkpoint-8 has no meta.json",
        "checkpoint-6 is missing .metadata",
    ):
        assert (
            f"{problem}" in result.stderr and "; falling back to the previous checkpoint" in result.stderr
        ), problem
    assert "resumed from step 4" in result.stderr
    for meta in out.glob("checkpoint-*/meta.json"):  # none passes: refuse rather than start over
        meta.unlink()
    before = {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/*")}
    refused = run_cmd(["--cfg", str(cfg)])
    assert refused.returncode == 1 and f"checkpoint-{STEPS + 2} has no meta.json" in refused.stderr
    assert "to start over, choose another run.output_dir" in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/*")} == before
    advice = re.search(r"`python (ckpt\.py rehash [^`]+)`", refused.stderr).group(1)
    ckpt.main(shlex.split(advice)[1:])
    resumed = run_ok(["--cfg", str(cfg)])
    assert f"resumed from step {STEPS + 2}" in resumed.stderr


@pytest.mark.slow
def test_what_a_checkpoint_holds(references):
    """What a checkpoint holds: trainable weights only, every value a tensor.

    Nothing of ours is pickled, and a meta.json names it."""
    path = references["fsdp"] / "checkpoint-4"
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    assert all(isinstance(m, TensorStorageMetadata) for m in metadata.values())
    model_keys = [k for k in metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert {k.split(".")[0] for k in metadata} == {"model", "optimizer", "sampler", "train", "ema"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 4 and meta["world_size"] == 2
    assert meta["identity"]["lora"] == {
        "rank": 4,
        "lora_alpha": 2.0,
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0"],
    }
    assert set(meta["files"]) == {p.name for p in path.iterdir() if p.name != "meta.json"}


@pytest.mark.slow
def test_resume_refusals(references, make_config, tiny_model, tmp_path):
    other = tmp_path / "fine-tuned"  # the same model but for its transformer's weights
    shutil.copytree(tiny_model, other)
    weights_file = other / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file(
        {k: v + 0.01 for k, v in load_file(weights_file).items()}, weights_file, metadata={"format": "pt"}
    )
    cfg, out, _ = make_config("refusals", "one", **{"model.path": str(other)})
    shutil.copytree(references["one"], out)
    result = run_cmd(["--cfg", str(cfg)])
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        f"was trained on other base weights: ['{tiny_model / 'transformer' / weights_file.name}'] there, "
        f"['{weights_file}'] here (model.path, model.transformer_file)"
    ) in result.stderr
    cfg, out, _ = make_config("refusals", "one", **{"checkpoint.resume": "none"})
    result = run_cmd(["--cfg", str(cfg)])
    assert result.returncode == 1 and f"already holds checkpoint-{STEPS}" in result.stderr
    cfg, _, _ = make_config("refusals", "one", **{"lora.rank": 8})
    result = run_cmd(["--cfg", str(cfg)])
    assert result.returncode == 1 and "was trained with lora = {'rank': 4" in result.stderr
    cfg, _, _ = make_config("refusals", "one", **{"train.batch_size": 1})
    result = run_cmd(["--cfg", str(cfg)])
    assert (
        result.returncode == 1
        and "train.batch_size x train.gradient_accumulation_steps x world size" in result.stderr
    )


@pytest.mark.slow
def test_resume_on_other_data_is_refused(references):
    """A resume on other clips is refused, naming what changed.

    meta.json holds the training clips' identity (every resume above checks it and passes); a
    checkpoint whose sampler state would index other clips is refused, naming what changed (without
    the check, resuming with data.held_out = 6 here would end in an IndexError)."""
    path = references["one"] / f"checkpoint-{STEPS}"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["data"]["clips_per_bucket"] == {"[9, 32, 32]": 20}
    ckpt.check_data(path, meta, meta["data"])

    def clips(count: int, content: str) -> list:
        return [planned(f"{content}{i}") for i in range(count)]

    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"checkpoint {path} was trained on other data: clips per bucket "
            "{'[9, 32, 32]': 20} there, {'[9, 32, 32]': 18} here"
        ),
    ):
        ckpt.check_data(path, meta, ckpt.data_identity(clips(18, "a"), 0.0, False))
    with pytest.raises(ConfigError, match="as many clips per bucket, but other ones"):
        ckpt.check_data(path, meta, ckpt.data_identity(clips(20, "b"), 0.0, False))


def planned(content: str, **conditions) -> SimpleNamespace:
    """A planned clip (data.Item's fields that the data identity reads), without conditions unless
    given."""
    fields = dict(control_content=None, mask_content=None, reference_content=(), last_image_content=None)
    return SimpleNamespace(
        resolution=(9, 32, 32),
        content=content,
        image_content=None,
        bucket=0,
        clip=SimpleNamespace(prompt="a prompt"),
        **fields | conditions,
    )


def test_resume_on_other_conditions_or_data_settings_is_refused(tmp_path, caplog):
    """A resume on the same clips with other conditions or data settings is refused, naming them.

    Every clip's control video, mask, reference images or last image changed, or data.target_fps or
    the sound switched (LTX-2's data.audio): each trains on other data, as another prompt would. A
    checkpoint that `ckpt.py rehash` accepted has no record of its data: its resume says the check
    is off."""
    vace = [
        planned(f"c{i}", control_content=f"v{i}", mask_content=f"m{i}", reference_content=(f"r{i}",))
        for i in range(4)
    ]
    saved = {"data": ckpt.data_identity(vace, 24.0, True)}
    ckpt.check_data(tmp_path, saved, ckpt.data_identity(vace, 24.0, True))
    for change, message in (
        ({"control_content": "other"}, "other control videos (data.control_column)"),
        ({"mask_content": "other"}, "other masks (data.mask_column)"),
        ({"reference_content": ("other",)}, "other reference images (data.reference_column)"),
        ({"last_image_content": "other"}, "other last images (data.last_image_column)"),
    ):
        changed = [SimpleNamespace(**vars(item) | change) for item in vace]
        with pytest.raises(
            ConfigError, match=re.escape(f"was trained on the same clips with {message}: resume")
        ):
            ckpt.check_data(tmp_path, saved, ckpt.data_identity(changed, 24.0, True))
    with pytest.raises(ConfigError, match=re.escape("with data.audio = true there, false here: resume")):
        ckpt.check_data(tmp_path, saved, ckpt.data_identity(vace, 24.0, False))
    with pytest.raises(ConfigError, match=re.escape("with data.target_fps = 24.0 there, 25.0 here: resume")):
        ckpt.check_data(tmp_path, saved, ckpt.data_identity(vace, 25.0, True))
    # a checkpoint of a run before these were recorded: its clips alone are checked
    older = {"data": {k: saved["data"][k] for k in ("clips_per_bucket", "clips_sha256")}}
    ckpt.check_data(tmp_path, older, ckpt.data_identity(vace, 25.0, False))
    ckpt.check_data(tmp_path, {"data": None}, ckpt.data_identity(vace, 24.0, True))
    assert (
        f"checkpoint {tmp_path} has no record of the data it was trained on (ckpt.py rehash accepted "
        "its files as they are): this resume cannot check"
    ) in caplog.text


def test_base_identity_follows_the_weights_not_the_folder(tiny_model, tmp_path, caplog):
    """A checkpoint's base identity follows the weights, not the folder.

    A checkpoint records its base weights by content (model.path moved elsewhere still resumes);
    another model.dtype or model.storage_dtype is named with a warning, not refused."""

    def identity(path, dtype="fp32", optimizer="adamw"):
        cfg = load_config(
            None,
            [
                "--train.optimizer",
                optimizer,
                "--run.output_dir",
                str(tmp_path / "run"),
                "--data.data_root",
                str(tmp_path),
                "--model.path",
                str(path),
                "--model.dtype",
                dtype,
            ],
        )
        return ckpt.run_identity(load_adapter(cfg.model, torch.device("cpu")), cfg.model, cfg.train, cfg.lora)

    saved = {"identity": identity(tiny_model)}
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model, moved)
    ckpt.check_identity(tmp_path, saved, identity(moved), resuming=True)
    assert "precision" not in caplog.text
    ckpt.check_identity(tmp_path, saved, identity(moved, "bf16"), resuming=True)
    assert (
        "was trained with the base in {'model.dtype': 'fp32', 'model.storage_dtype': ''}, this run has "
        "{'model.dtype': 'bf16', 'model.storage_dtype': ''}: training continues in this run's precision"
    ) in caplog.text


def test_a_resume_with_another_optimizer_is_refused_by_name(tiny_model, tmp_path):
    """Another train.optimizer's state has other names (DCP would say "missing keys"): a resume is
    refused naming both optimizers; an export or a render reads no optimizer state and goes on. A
    checkpoint from before the optimizer was recorded was trained with AdamW."""

    def identity(optimizer):
        args = ["--run.output_dir", str(tmp_path / "run"), "--data.data_root", str(tmp_path)]
        args += ["--model.path", str(tiny_model), "--train.optimizer", optimizer]
        cfg = load_config(None, args)
        return ckpt.run_identity(load_adapter(cfg.model, torch.device("cpu")), cfg.model, cfg.train, cfg.lora)

    adamw, muon = identity("adamw"), identity("muon")
    with pytest.raises(ConfigError) as refused:
        ckpt.check_identity(tmp_path, {"identity": adamw}, muon, resuming=True)
    assert str(refused.value) == (
        f"checkpoint {tmp_path} was trained with train.optimizer = 'adamw', this run has 'muon': its "
        'state does not carry over; resume with train.optimizer = "adamw", or start over in another '
        "run.output_dir (lora.init_from carries a LoRA over)"
    )
    ckpt.check_identity(tmp_path, {"identity": adamw}, muon)  # an export
    before = {key: value for key, value in muon.items() if key != "optimizer"}
    with pytest.raises(ConfigError, match="train.optimizer = 'adamw', this run has 'muon'"):
        ckpt.check_identity(tmp_path, {"identity": before}, muon, resuming=True)
    ckpt.check_identity(tmp_path, {"identity": before}, adamw, resuming=True)


def test_export_of_a_missing_checkpoint_says_it_does_not_exist(write_config, tmp_path, caplog):
    """`ckpt.py export --checkpoint` of a checkpoint rotation deleted, or of a mistyped one, says it
    does not exist (and that rotation took it), naming those there."""
    run = tmp_path / "run"
    for step in (6, 8):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        for name in (".metadata", "meta.json"):
            (run / f"checkpoint-{step}" / name).write_text("")
    cfg = write_config()
    for name, message in (
        (
            "checkpoint-2",
            "does not exist: rotation (checkpoint.checkpointing_limit) deleted it, "
            f"{run} keeps checkpoint-6, checkpoint-8; export one of those",
        ),
        ("checkpoint-7", f"does not exist: {run} holds checkpoint-6, checkpoint-8; export one of those"),
        ("checkpoint-8/x", "does not exist: give --checkpoint a run's checkpoint-N folder"),
    ):
        caplog.clear()
        with pytest.raises(SystemExit):
            ckpt.main(["export", "--cfg", str(cfg), "--checkpoint", str(run / name)])
        assert f"checkpoint {run / name} {message}" in caplog.text
    assert not (run / "exports").exists()


def test_an_export_of_non_finite_weights_names_them_and_writes_nothing(monkeypatch, tmp_path):
    """An export of non-finite weights names the first and writes nothing.

    A run that diverged (train.learning_rate = inf: NaN within a step, in a checkpoint before the
    non-finite guard stops the run) exported an all-NaN LoRA with exit 0, which loads everywhere
    and renders noise. The export that the end of training and `ckpt.py export` share refuses."""
    nan = torch.full((4, 2), float("nan"))
    state = {
        "transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 4),
        "transformer_blocks.0.attn1.to_q.lora_B.weight": nan,
    }
    monkeypatch.setattr(ckpt, "model_state", lambda *args, **kwargs: state)
    adapter = SimpleNamespace(expert="", COMFY=False, lora_metadata=dict)
    lora_cfg = LoraConfig(rank=2, target_modules=["to_q"])
    with pytest.raises(ranks.StopRun) as refused:
        ckpt.export(None, "lora", lora_cfg, adapter, str(tmp_path), ranks.Dist(0, 1, 0, torch.device("cpu")))
    assert str(refused.value).startswith(
        f"1 of the 2 weights for {tmp_path / 'lora'} hold NaN or inf (first: "
        "transformer_blocks.0.attn1.to_q.lora_B.weight): the training diverged"
    )
    assert list(tmp_path.iterdir()) == []


def test_rotation_keeps_a_checkpoint_being_exported(tmp_path):
    """Rotation keeps a checkpoint that `ckpt.py export` is reading.

    `ckpt.py export` holds its checkpoint's export.lock: rotation in a running training passes it
    over until the export is written, then deletes it."""
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        for name in (".metadata", "meta.json"):
            (tmp_path / f"checkpoint-{step}" / name).write_text("")
    checkpoints = ckpt.Checkpointer(
        CheckpointConfig(checkpointing_limit=1),
        str(tmp_path),
        ranks.Dist(0, 1, 0, torch.device("cpu")),
        {"training_type": "lora"},
        {},
    )
    with ckpt.exporting(tmp_path / "checkpoint-2"):
        checkpoints._rotate(ckpt.complete_checkpoints(tmp_path))
        assert [p.name for p in ckpt.checkpoint_folders(tmp_path)] == ["checkpoint-2", "checkpoint-6"]
    checkpoints._rotate(ckpt.complete_checkpoints(tmp_path))
    assert [p.name for p in ckpt.checkpoint_folders(tmp_path)] == ["checkpoint-6"]


def test_rehash_refuses_what_no_resume_can_read(references, make_config, caplog):
    """`ckpt.py rehash` refuses what no resume can read.

    `ckpt.py rehash` refuses another config's shapes (the resume would fail in DCP), another model
    or LoRA over a readable meta.json (kept as it is), and a missing shard (the advice would loop);
    accepting a checkpoint whose meta.json is gone, it says that no resume can check its data.
    """
    cfg, out, _ = make_config("rehash", "one")
    path = out / f"checkpoint-{STEPS}"
    shutil.copytree(references["one"] / path.name, path)
    meta = (path / "meta.json").read_bytes()

    def refused(message: str, **settings):
        config = make_config("rehash", "one", **settings)[0]
        caplog.clear()
        with pytest.raises(SystemExit):
            ckpt.main(["rehash", "--cfg", str(config), "--checkpoint", str(path)])
        assert message in caplog.text

    refused("was trained with lora = {'rank': 4, 'lora_alpha': 2.0", **{"lora.lora_alpha": 4})
    assert (path / "meta.json").read_bytes() == meta
    (path / "meta.json").unlink()
    refused(f"{path} holds other shapes than", **{"lora.rank": 8})
    assert not (path / "meta.json").exists()
    caplog.clear()  # accepted without a record of its data: the rehash says the data check is off
    ckpt.main(["rehash", "--cfg", str(make_config("rehash", "one")[0]), "--checkpoint", str(path)])
    assert f"checkpoint {path} has no record of the data it was trained on" in caplog.text
    assert "a resume from it cannot check that the clips" in caplog.text
    (path / "meta.json").unlink()
    (path / "__0_0.distcp").unlink()
    refused(f"{path} lacks 1 shard(s) its .metadata names (first: __0_0.distcp)")
    assert not (path / "meta.json").exists()


@pytest.mark.slow
def test_finished_run_exports_and_exits_zero(references, make_config):
    """A finished run relaunched exports and exits 0.

    With train.steps lowered below its step, it exits 1."""
    cfg, out, _ = make_config("finished", "one")
    shutil.copytree(references["one"], out)
    shutil.rmtree(out / "lora")
    result = run_ok(["--cfg", str(cfg)])
    assert f"resumed from step {STEPS}" in result.stderr
    assert_bitwise_equal_runs(references["one"], out)
    cfg, _, _ = make_config("finished", "one", **{"train.steps": STEPS - 2})
    lowered = run_cmd(["--cfg", str(cfg)])
    assert lowered.returncode == 1
    assert (
        f"{out / f'checkpoint-{STEPS}'} is at step {STEPS}, past train.steps = {STEPS - 2}" in lowered.stderr
    )


@pytest.mark.slow
def test_export_command(references, make_config, tmp_path):
    """The export command writes where it says and names a read-only run folder.

    Without --out into the run's exports/checkpoint-N/ (never over the run's own lora/, nor inside
    the checkpoint, which rotation deletes), with --out where it says; a read-only run folder is
    named."""
    cfg, out, _ = make_config("ref_one", "one")
    final = (out / "lora" / "pytorch_lora_weights.safetensors").read_bytes()
    run_ok(["export", "--cfg", str(cfg), "--checkpoint", str(out / "checkpoint-8")], script="ckpt.py")
    exported = weights(out / "exports" / "checkpoint-8")
    assert not (out / "checkpoint-8" / "export").exists()
    assert exported.keys() == weights(out).keys()
    # step 8, not the end
    assert not all(torch.equal(exported[k], weights(out)[k]) for k in exported)
    assert (out / "lora" / "pytorch_lora_weights.safetensors").read_bytes() == final
    run_ok(
        [
            "export",
            "--cfg",
            str(cfg),
            "--checkpoint",
            str(out / f"checkpoint-{STEPS}"),
            "--out",
            str(tmp_path),
        ],
        script="ckpt.py",
    )
    for folder in ("lora", "lora_ema"):
        assert all(torch.equal(weights(tmp_path, folder)[k], weights(out, folder)[k]) for k in exported)
    read_only = run_read_only(
        [out], ["export", "--cfg", str(cfg), "--checkpoint", str(out / "checkpoint-6")], script="ckpt.py"
    )
    assert read_only.returncode == 1 and "Traceback" not in read_only.stderr
    assert (
        f"error: the export cannot be written to {out / 'exports' / 'checkpoint-6'} (Read-only file system): "
        "pass --out DIR, a folder you can write"
    ) in read_only.stderr


@pytest.mark.slow
def test_export_loads_in_the_pipeline(references, tiny_model):
    """The 2-rank FSDP export loads in the pipeline and computes what our transformer does.

    The 2-rank FSDP run's export (CogVideoX-2b's key set) loads with load_lora_weights and computes,
    at the trained alpha / rank, what our transformer holding it computes."""
    lora_file = str(references["fsdp"] / "lora" / "pytorch_lora_weights.safetensors")
    adapter = load_adapter(ModelConfig(path=str(tiny_model), dtype="fp32"), torch.device("cpu"))
    transformer = adapter.load_transformer().eval()
    weights, info = lora.load_lora(lora_file)
    lora.inject_lora(transformer, info["target_modules"], info["rank"], info["alpha"], 0.0, 0)
    lora.load_lora_into(transformer, weights)
    pipe = CogVideoXPipeline.from_pretrained(str(tiny_model))
    pipe.load_lora_weights(lora_file)
    gen = torch.Generator().manual_seed(0)
    x_t, embeds = (
        torch.randn(2, 3, 4, 8, 8, generator=gen),
        torch.randn(2, adapter.text_length, 32, generator=gen),
    )
    with torch.no_grad():
        ours = adapter.predict_v(transformer, x_t, torch.tensor([10, 900]), embeds, None)
        theirs = adapter.predict_v(pipe.transformer, x_t, torch.tensor([10, 900]), embeds, None)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


# one process, no group: as intended
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_rank_checks_only_the_files_it_reads(tmp_path):
    """A rank checks only the checkpoint files it reads.

    check_reads hashes DCP's .metadata and the shards named by this rank's own load plan: a damaged
    file that the plan does not read is another rank's to find (each rank checks its share)."""
    state = {"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    files = sorted(p.name for p in tmp_path.iterdir())
    (tmp_path / "meta.json").write_text(
        json.dumps(
            {
                "files": {
                    n: {
                        "size": (tmp_path / n).stat().st_size,
                        "sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest(),
                    }
                    for n in files
                }
            }
        )
    )
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    file_of = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    assert file_of["a"] != file_of["b"]
    wants_a = {"a": torch.zeros(1000)}
    assert ckpt.check_reads(tmp_path, wants_a, dcp.DefaultLoadPlanner(allow_partial_load=True)) is None
    shard = tmp_path / file_of["b"]
    shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes
    assert ckpt.check_reads(tmp_path, wants_a, dcp.DefaultLoadPlanner(allow_partial_load=True)) is None
    problem = ckpt.check_reads(
        tmp_path, {"b": torch.zeros(1000)}, dcp.DefaultLoadPlanner(allow_partial_load=True)
    )
    assert problem == f"checkpoint {tmp_path}: {file_of['b']} does not match its size or sha256 in meta.json"


def test_save_views_follow_the_live_tensors(tmp_path):
    """A save's state-dict views follow the live tensors.

    A save reuses the state-dict views DCP's helpers built before while they alias the live tensors,
    and rebuilds them when a tensor is replaced, gets other storage or changes requires_grad: every
    save hands DCP what a fresh build would."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    objects = {"model": model, "optimizer": optimizer, "sampler": Sampler([0] * 4, 2, 0)}
    one = ranks.Dist(0, 1, 0, torch.device("cpu"))
    checkpoints, reference = (
        ckpt.Checkpointer(CheckpointConfig(), str(tmp_path), one, {"training_type": "sft"}, {})
        for _ in range(2)
    )

    def step():
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def assert_fresh(state):
        fresh = reference._state(objects)
        assert {k: list(v) for k, v in state.items()} == {k: list(v) for k, v in fresh.items()}
        assert all(torch.equal(state[k][n], fresh[k][n]) for k in fresh for n in fresh[k])

    step()
    first = checkpoints._state(objects, reuse=True)
    step()
    second = checkpoints._state(objects, reuse=True)
    assert second["model"] is first["model"] and second["optimizer"] is first["optimizer"]
    assert_fresh(second)
    # replaced
    optimizer.state[model[1].weight]["exp_avg"] = optimizer.state[model[1].weight]["exp_avg"] + 1
    assert_fresh(checkpoints._state(objects, reuse=True))
    model[0].bias.data = model[0].bias.data + 1  # same Parameter, other storage
    assert_fresh(checkpoints._state(objects, reuse=True))
    # only the key changes here: an sft state holds frozen weights too
    model[0].weight.requires_grad_(False)
    third = checkpoints._state(objects, reuse=True)
    assert third["model"] is not second["model"]
    assert_fresh(third)
