"""Files written outside DCP: full disks, render names, shards as LoRAs, async staging.

A full disk names the file and the fix and leaves no temporary behind; render names never collide; a
checkpoint's shard given as --lora is named; async saves stage into one reused copy."""

import contextlib
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import run_ok, run_read_only, write_toml
from PIL import Image
from safetensors.torch import load_file

import cache
import ckpt
import command
import faults
import lora
import ranks
import render
import validate
from config import CheckpointConfig, ConfigError, DataConfig, load_config
from data import Sampler

DISK_FULL = r"failed \(\[Errno 28\] No space left on device \(injected disk_full\)\): "


@pytest.fixture
def disk_full(monkeypatch):
    """arm(): the next file this process writes through faults.written fails like a full disk."""
    return lambda: monkeypatch.setenv(faults.FAULT_ENV, f"disk_full:{faults.writes + 1}")


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def test_full_disk_while_writing_a_cache_entry(tmp_path, disk_full):
    entries = cache.Cache(
        DataConfig(data_root=str(tmp_path), cache_dir=str(tmp_path)), {"text": {}}, 4, "fp32", None
    )
    item = SimpleNamespace(clip=SimpleNamespace(prompt="a red ball"))
    path = entries.path(item, "text")
    disk_full()
    with pytest.raises(
        faults.WriteFailed,
        match=re.escape(f"writing {path} ") + DISK_FULL + "free space there, or set "
        "data.cache_dir to a disk with room",
    ):
        entries.write(item, "text", {"prompt_embeds": torch.ones(2, 3)})
    assert leftovers(tmp_path) == [] and not (tmp_path / path).exists()
    entries.write(item, "text", {"prompt_embeds": torch.ones(2, 3)})  # the next write succeeds
    assert torch.equal(load_file(path)["prompt_embeds"], torch.ones(2, 3)) and leftovers(tmp_path) == []


def test_full_disk_while_writing_a_clip(tmp_path, disk_full):
    disk_full()
    with pytest.raises(
        faults.WriteFailed,
        match=re.escape(f"writing {tmp_path / 'clip.mp4'} ")
        + DISK_FULL
        + re.escape("free space (or move run.output_dir) and launch again"),
    ):
        validate.write_mp4(tmp_path / "clip.mp4", torch.zeros(9, 8, 8, 3, dtype=torch.uint8), 8)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_during_the_export(tmp_path, disk_full):
    """The LoRA files, and (sft) the transformer folder, which an earlier export keeps intact."""
    weights = {
        "blocks.0.to_q.lora_A.weight": torch.ones(2, 4),
        "blocks.0.to_q.lora_B.weight": torch.zeros(4, 2),
    }
    for write in (
        lambda: lora.save_lora(str(tmp_path / "lora.safetensors"), weights, 2, 2.0, ["to_q"]),
        lambda: lora.save_peft_adapter(str(tmp_path / "peft"), weights, 2, 2.0, ["to_q"]),
    ):
        disk_full()
        with pytest.raises(
            faults.WriteFailed,
            match=DISK_FULL + re.escape("free space (or write elsewhere: python ckpt.py export --out DIR)"),
        ):
            write()
        assert leftovers(tmp_path) == []
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("earlier")
    for fault in (True, False):
        if fault:
            disk_full()
        with pytest.raises(faults.WriteFailed) if fault else contextlib.nullcontext():
            with faults.written(tmp_path / "transformer", lora.EXPORT_FIX) as tmp:
                tmp.mkdir()
                (tmp / "config.json").write_text("new")
        assert (tmp_path / "transformer" / "config.json").read_text() == ("earlier" if fault else "new")
        assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
            "peft",
            "transformer",
        ]


def test_a_write_failure_is_one_line(caplog):
    with caplog.at_level(logging.ERROR, logger="vidtrain"):
        assert command.report(faults.WriteFailed("writing x failed (...): free space"), 0) == 1
    assert caplog.messages == ["error: writing x failed (...): free space"]


def test_render_names(base_settings, tmp_path):
    """Render names never collide, and the same render keeps its name.

    By checkpoint (or LoRA file), prompt index and a hash of all that makes the clip: a render never
    replaces one of other weights, prompts, images or settings; the same render keeps its name."""
    images = [tmp_path / "a.png", tmp_path / "b.png"]
    for image, colour in zip(images, ("red", "blue")):
        Image.new("RGB", (8, 8), colour).save(image)
    settings = {**base_settings, "run.output_dir": str(tmp_path), "validation.prompts": ["a", "b"]}
    cfg = load_config(str(write_toml(tmp_path / "run.toml", settings)))
    cfg.validation.images = [str(p) for p in images]  # as render.py's --image sets them (i2v)
    run = str(tmp_path / "checkpoint-4")
    names = render.render_names(cfg, run, None, False)
    assert all(re.fullmatch(rf"render_checkpoint-4_prompt_{i}_[0-9a-f]{{8}}", n) for i, n in enumerate(names))
    assert render.render_names(cfg, run, None, False) == names

    def changed(new_names):
        return [a != b for a, b in zip(names, new_names)]

    online = render.render_names(cfg, run, None, True)
    assert changed(online) == [True, True] and online[0].startswith("render_checkpoint-4_online_prompt_0_")
    assert changed(render.render_names(cfg, str(tmp_path / "other" / "checkpoint-4"), None, False)) == [
        True,
        True,
    ]
    lora_file = tmp_path / "pytorch_lora_weights.safetensors"
    lora_file.write_bytes(b"0")
    assert render.render_names(cfg, None, str(lora_file), False)[0].startswith(
        "render_pytorch_lora_weights_prompt_0_"
    )
    images[1].write_bytes(images[0].read_bytes())
    assert changed(render.render_names(cfg, run, None, False)) == [False, True]
    names = render.render_names(cfg, run, None, False)
    cfg.validation.prompts = ["c", "b"]
    assert changed(render.render_names(cfg, run, None, False)) == [True, False]
    cfg.validation.num_inference_steps += 1
    assert changed(render.render_names(cfg, run, None, False)) == [True, True]


def test_a_checkpoint_shard_as_lora_is_named(tmp_path):
    """A checkpoint's shard passed as a LoRA is named.

    A .distcp file, or a checkpoint folder, passed as render.py --lora: named, with what to pass
    instead."""
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"0")
    (tmp_path / "x.safetensors").write_bytes(b"0")
    render.check_lora_file(str(tmp_path / "x.safetensors"))
    for given in (checkpoint / "__0_0.distcp", checkpoint):
        with pytest.raises(ConfigError) as refused:
            render.check_lora_file(str(given))
        assert str(refused.value) == (
            f"--lora {given} is part of the checkpoint {checkpoint}, not a LoRA file: render it with --checkpoint "
            f"{checkpoint}, or export it (python ckpt.py export --cfg FILE.toml --checkpoint {checkpoint}) and pass "
            f"--lora {checkpoint / 'export' / 'lora' / 'pytorch_lora_weights.safetensors'}"
        )
        (checkpoint / ".metadata").write_bytes(b"0")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_saves_reuse_one_staged_copy(tmp_path):
    """Two async saves stage into one reused copy, each checkpoint holding its own step.

    Two async saves stage into the same CPU buffers (not the live tensors'), and each checkpoint
    holds its own step's values exactly."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.AdamW(model.parameters())
        objects = {"model": model, "optimizer": optimizer, "sampler": Sampler([0] * 4, 2, 0)}
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        checkpoints = ckpt.Checkpointer(
            CheckpointConfig(async_save=True), str(tmp_path), d, {"training_type": "sft"}, {}
        )
        staged, expected = [], []
        for step in (1, 2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            checkpoints.save(step, objects, final=False)
            if step == 1:  # made at the first async save: record what it hands to the writer
                stage = checkpoints.stager.stage
                checkpoints.stager.stage = lambda state: staged.append(stage(state)) or staged[-1]
                staged.append(stage(checkpoints._state(objects, reuse=True)))
        checkpoints.wait_and_commit()
        pointers = [{k: t.data_ptr() for k, t in s["model"].items()} for s in staged]
        assert pointers[0] == pointers[1]
        assert not set(pointers[0].values()) & {p.data_ptr() for p in model.parameters()}
        for step, values in zip((1, 2), expected):
            state = {"model": {k: torch.zeros_like(v) for k, v in values.items()}}
            dcp.load(state, checkpoint_id=str(tmp_path / f"checkpoint-{step}"))
            assert all(torch.equal(state["model"][k], values[k]) for k in values)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_reach_the_disk_before_rotation_counts_them(tmp_path, monkeypatch):
    """Checkpoints reach the disk before rotation counts them.

    Every file of a committed checkpoint is fsynced (in the background), and rotation counts only
    checkpoints already synced: one more than checkpointing_limit between saves, the limit after the
    last save, which waits for its own."""
    synced = []
    fsync = ckpt.fsync_files
    monkeypatch.setattr(ckpt, "fsync_files", lambda paths: (fsync(paths), synced.extend(paths)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        objects = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        checkpoints = ckpt.Checkpointer(
            CheckpointConfig(checkpointing_limit=1), str(tmp_path), d, {"training_type": "sft"}, {}
        )
        kept = []
        for step in (1, 2, 3):
            checkpoints.save(step, objects, final=step == 3)
            kept.append([p.name for p in ckpt.complete_checkpoints(tmp_path)])
        checkpoints.syncing.result()
    finally:
        dist.destroy_process_group()
    assert kept == [["checkpoint-1"], ["checkpoint-1", "checkpoint-2"], ["checkpoint-3"]]
    assert sorted(p.name for p in synced if p.parent.name == "checkpoint-3") == sorted(
        p.name for p in (tmp_path / "checkpoint-3").iterdir()
    )
    assert {p.parent.name for p in synced} == {"checkpoint-1", "checkpoint-2", "checkpoint-3"}


def test_read_only_places_are_named(write_config, base_settings, tmp_path):
    """Read-only places are named with their key, before any compute.

    A complete cache is used read-only (its probe file refused it); an incomplete read-only cache
    and a read-only run.output_dir are named with their key, before any compute."""
    cfg = write_config("cache_only")
    run_ok(["--cfg", str(cfg)], script="cache.py")  # the session's cache, complete
    cache_dir = Path(base_settings["data.cache_dir"])
    complete = run_read_only([cache_dir], ["--cfg", str(cfg)], script="cache.py")
    assert complete.returncode == 0, complete.stderr[-3000:]
    assert "cache: 0 clips encoded, 24 reused" in complete.stderr
    empty = tmp_path / "empty_cache"
    empty.mkdir()
    refused = run_read_only(
        [empty],
        ["--cfg", str(write_config("cache_only", **{"data.cache_dir": str(empty)}))],
        script="cache.py",
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert (
        f"error: data.cache_dir = {empty} cannot be written (Read-only file system) and lacks entries of 24 of "
        "24 clips"
    ) in refused.stderr
    assert list(empty.iterdir()) == []
    out = tmp_path / "read_only_run"
    out.mkdir()
    refused = run_read_only([out], ["--cfg", str(write_config("read_only_run"))])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert (
        f"error: run.output_dir = {out} cannot be written (Read-only file system): choose a folder this user "
        "can write for run.output_dir"
    ) in refused.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"lora.target_modules": ["to_qq"]},
            "lora.target_modules: ['to_qq'] match no nn.Linear in CogVideoXTransformer3DModel",
        ),
        (
            {"validation.resolution": [0, 32, 32]},
            "validation.resolution frames = 0, but this model needs 8k+1 frames "
            "(the VAE decodes latents in pairs): use 1 or 9",
        ),
    ],
)
def test_model_checks_come_before_the_cache_pass_and_leave_no_run_lock(
    write_config, tmp_path, caplog, settings, message
):
    """Model checks come before the cache pass and leave no run.lock.

    Targets that match no layer and a validation resolution the model cannot render stop the launch
    with one error line before the cache pass (nothing encoded into an empty cache), and leave no
    run.lock (nor the run folder the launch made)."""
    import trainer

    cache_dir = tmp_path / "cache"
    cfg = write_config("early", **{"data.cache_dir": str(cache_dir), **settings})
    with pytest.raises(SystemExit) as stopped:
        trainer.main(["--cfg", str(cfg)])
    assert stopped.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}")
    assert not any(cache_dir.rglob("*.safetensors")) and not (tmp_path / "early").exists()
