"""One-process training end to end.

Learning, determinism, the export, and errors before any compute."""

import ast
import inspect
import shutil

import av
import pytest
import torch
from conftest import read_metrics, run_cmd, run_ok, train_losses, write_toml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import faults
import lora
import trainer
from tools.make_synthetic_dataset import make_synthetic_dataset


def held_out(output_dir) -> dict[int, float]:
    return {m["step"]: m["val/loss"] for m in read_metrics(output_dir) if "val/loss" in m}


def lora_file(output_dir):
    return output_dir / "lora" / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def learned(base_settings, tmp_path_factory):
    """60 steps at a learning rate that moves the held-out loss; (output folder, trainer stderr)."""
    root = tmp_path_factory.mktemp("learn")
    cfg = write_toml(
        root / "learn.toml",
        {
            **base_settings,
            "run.output_dir": str(root / "learn"),
            "train.steps": 60,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "lora.lora_alpha": 4,
            "checkpoint.checkpointing_steps": 60,
            "validation.validation_steps": 30,
        },
    )
    return root / "learn", run_ok(["--cfg", str(cfg)]).stderr


def test_training_lowers_the_held_out_loss(learned):
    out, log = learned
    losses = held_out(out)
    assert sorted(losses) == [0, 30, 60]
    assert losses[60] < 0.9 * losses[0], losses
    assert (
        "parameters: " in log
        and "global batch 2 = 2 per rank x 1 accumulation x 1 data-parallel ranks" in log
    )
    assert f"step 60/60  held-out loss {losses[60]:.4f}" in log  # where the terminal shows it
    metrics = read_metrics(out)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/peak_mem_gb"} <= set(
        metrics[1]
    )
    assert (out / "config.toml").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["lora/pytorch_lora_weights.safetensors", "lora/adapter_model.safetensors"]
)
def test_init_from_continues_an_exported_lora(learned, write_config, tmp_path, layout):
    """lora.init_from continues an exported LoRA and refuses one of another rank.

    Started from a run's export (diffusers' or PEFT's layout), the step-0 held-out loss is that
    run's last one; a file of another rank is refused before any compute, naming the difference."""
    out, _ = learned
    settings = {
        "lora.rank": 8,
        "lora.lora_alpha": 4,
        "lora.init_from": str(out / layout),
        "train.steps": 1,
        "validation.validation_steps": 1,
    }
    run_ok(["--cfg", str(write_config("continued", **settings))])
    assert held_out(tmp_path / "continued")[0] == held_out(out)[60]
    refused = run_cmd(["--cfg", str(write_config("refused", **{**settings, "lora.rank": 4}))])
    assert (
        refused.returncode == 1
        and f"lora.init_from = {out / layout} has rank 8, but lora.rank = 4" in refused.stderr
    )
    assert "cache:" not in refused.stderr


@pytest.mark.slow
def test_same_seed_same_run(write_config, tmp_path):
    """The same seed gives the same run, bitwise.

    Bitwise, with run.deterministic on in one of them (on CPUs it changes nothing, and every op used
    has a deterministic implementation, or torch would raise)."""
    run_ok(["--cfg", str(write_config("first"))])
    run_ok(["--cfg", str(write_config("second", **{"run.deterministic": True}))])
    assert train_losses(tmp_path / "first") == train_losses(tmp_path / "second")
    for folder, name in (("lora", "pytorch_lora_weights.safetensors"), ("lora", "adapter_model.safetensors")):
        first, second = tmp_path / "first" / folder / name, tmp_path / "second" / folder / name
        assert first.read_bytes() == second.read_bytes()
    run_ok(["--cfg", str(write_config("other_seed", **{"run.seed": 7}))])
    assert train_losses(tmp_path / "other_seed") != train_losses(tmp_path / "first")
    # masks from keyed generators
    run_ok(["--cfg", str(write_config("dropout", **{"lora.dropout": 0.5}))])
    assert train_losses(tmp_path / "dropout") != train_losses(tmp_path / "first")


@pytest.mark.slow
def test_compile_trains_as_eager(write_config, tmp_path):
    """train.compile computes eager's steps, with two graphs per block.

    train.compile (inductor, each block, inside activation checkpointing) computes eager's 4 steps:
    losses and weights within rtol 1e-4, with validation on. Validation runs eagerly, so the blocks'
    compiled variants are training's alone: 2 graphs (the first block's input needs no gradient, the
    others' does), none for a no-grad call (with validation compiled, the first validation alone
    made 4 of dynamo's default 8). A second bucket adds the same two with dynamic sizes
    (docs/distributed.md). docs/testing.md has the compile's cost."""
    settings = {"train.steps": 4, "checkpoint.checkpointing_steps": 4, "validation.do_validation": False}
    run_ok(["--cfg", str(write_config("eager", **settings))])
    compiled = run_ok(
        [
            "--cfg",
            str(
                write_config(
                    "compiled",
                    **{
                        **settings,
                        "train.compile": True,
                        "train.gradient_checkpointing": True,
                        "validation.do_validation": True,
                        "validation.validation_steps": 2,
                        "validation.prompts": ["a red ball"],
                        "validation.num_inference_steps": 1,
                    },
                )
            ),
        ],
        env={"TORCH_LOGS": "recompiles"},
    ).stderr
    eager, compiled_losses = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert eager.keys() == compiled_losses.keys() == {1, 2, 3, 4}
    torch.testing.assert_close(list(compiled_losses.values()), list(eager.values()), rtol=1e-4, atol=0)
    weights, reference = (
        lora.load_lora(str(lora_file(tmp_path / name)))[0] for name in ("compiled", "eager")
    )
    assert weights.keys() == reference.keys()
    for key in weights:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=1e-7, msg=key)
    assert sorted(held_out(tmp_path / "compiled")) == [0, 2, 4]
    assert "grad_mode" not in compiled and "recompile_limit" not in compiled, compiled[-3000:]
    assert compiled.count("Recompiling function") == 1, compiled[-3000:]


@pytest.mark.slow
def test_export_equals_the_final_checkpoint_read_by_dcp(write_config, tmp_path):
    """The exported LoRA is the final checkpoint's weights, as DCP's converter reads them.

    The exported LoRA holds exactly the weights of the last checkpoint, as DCP's own converter reads
    it, with the trained alpha in its metadata; the checkpoint holds no frozen weight."""
    run_ok(["--cfg", str(write_config("export", **{"lora.lora_alpha": 8}))])
    weights, meta = lora.load_lora(str(lora_file(tmp_path / "export")))
    assert meta["rank"] == 4 and meta["alpha"] == 8
    dcp_to_torch_save(tmp_path / "export" / "checkpoint-6", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model = saved["model"]
    assert model.keys() == weights.keys() and all(torch.equal(model[k], weights[k]) for k in model)
    assert any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k), "training moved no B matrix"
    assert not any(k.endswith(".weight") and "lora_" not in k for k in model)


@pytest.mark.slow
def test_peak_memory_is_measured_per_phase(write_config, tmp_path):
    """Peak memory is measured per phase: validation's does not leak into training's.

    Validation (a 128x128 render, which takes far more memory than training at 32x32) reports its
    own peak, and training's next log step does not inherit it: the peak is reset before and after
    each validation and at each log step (on CPUs through /proc/self/clear_refs, after glibc returns
    the validation's freed blocks)."""
    run_ok(
        [
            "--cfg",
            str(
                write_config(
                    "peaks",
                    **{
                        "train.steps": 3,
                        "validation.validation_steps": 1,
                        "validation.prompts": ["a red ball"],
                        "validation.num_inference_steps": 1,
                        "validation.resolution": [9, 128, 128],
                    },
                )
            ),
        ]
    )
    metrics = read_metrics(tmp_path / "peaks")
    train = {m["step"]: m["train/peak_mem_gb"] for m in metrics if "train/peak_mem_gb" in m}
    val = {m["step"]: m["val/peak_mem_gb"] for m in metrics if "val/peak_mem_gb" in m}
    assert sorted(train) == [1, 2, 3] and sorted(val) == [0, 1, 2, 3]
    assert max(train.values()) < min(val.values()) - 0.1, (train, val)
    # each step after a validation as the first
    assert max(train.values()) - min(train.values()) < 0.03, train


def corrupt_dataset(tiny_data, tmp_path, how: str):
    data = tmp_path / "bad-data"
    shutil.copytree(tiny_data, data)
    videos = (data / "videos.txt").read_text().splitlines()
    if how == "missing":
        videos[2] = "videos/nowhere.mp4"
        (data / "videos.txt").write_text("\n".join(videos) + "\n")
    else:
        (data / videos[2]).write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    return data


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings, message",
    [
        ({"train.stepz": 3}, "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        ({"train.steps": "many"}, "train.steps must be int"),
        ({"data.train_resolution": [8, 32, 32]}, "frames = 8, but this model needs 8k+1 frames"),
        ({"model.path": "/nowhere/model"}, "model.path = /nowhere/model is not a diffusers model folder"),
        ({"data.train_resolution": [9, 36, 32]}, "height = 36 must be a positive multiple of 8"),
    ],
)
def test_bad_settings_stop_before_training(write_config, tmp_path, settings, message):
    result = run_cmd(["--cfg", str(write_config("bad", **settings))])
    assert result.returncode == 1
    assert message in result.stderr and result.stderr.count(message) == 1, result.stderr[-3000:]
    assert not (tmp_path / "bad" / "logs").exists()


@pytest.mark.parametrize("how, message", [("missing", "line 3"), ("corrupt", "videos/00002.mp4")])
def test_bad_clips_stop_before_training(write_config, tmp_path, tiny_data, how, message):
    data = corrupt_dataset(tiny_data, tmp_path, how)
    result = run_cmd(["--cfg", str(write_config("bad", **{"data.data_root": str(data)}))])
    assert result.returncode == 1 and message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "bad" / "logs").exists()


def test_synthetic_clips_decode(tiny_data):
    with av.open(str(tiny_data / "videos" / "00000.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 17 and frames[0].shape == (40, 48, 3) and frames[5].max() > 200


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["1.5-5b", "1.5-5b-i2v"])
def test_cogvideox_15_lowers_the_held_out_loss(variant, tiny_models, write_config, tmp_path):
    """CogVideoX 1.5 (padded latents, I2V's condition) lowers the held-out loss.

    1.5's latents are padded to patch_size_t as the pipeline pads them, I2V's image condition rides
    along; both learn as 1.0 does."""
    cfg = write_config(
        "v15",
        **{
            "model.path": str(tiny_models(variant)),
            "model.type": "i2v" if variant.endswith("i2v") else "t2v",
            "train.steps": 60,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "lora.lora_alpha": 4,
            "checkpoint.checkpointing_steps": 60,
            "validation.validation_steps": 60,
        },
    )
    run_ok(["--cfg", str(cfg)])
    losses = held_out(tmp_path / "v15")
    assert sorted(losses) == [0, 60] and losses[60] < 0.9 * losses[0], losses


def test_synthetic_dataset_is_byte_identical_per_seed(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        make_synthetic_dataset(str(tmp_path / name), num_videos=3, seed=seed)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert (tmp_path / "a" / "prompts.txt").read_text() != (tmp_path / "c" / "prompts.txt").read_text()


def test_a_weight_no_batch_reached_steps_on_a_zero_gradient():
    """A weight no batch reached steps on a zero gradient under every strategy.

    LTX-2's audio stream in a step where no rank's batch has sound: FSDP reduce-scatters a zero
    gradient for it (set_reduce_scatter_unused_params), so one process and DDP step on zeros too,
    and AdamW's weight decay and momentum move it alike under every strategy (with None, AdamW would
    skip it)."""
    import trainer
    from config import TrainConfig
    from model import LossScaler, build_optimizer

    t = TrainConfig(learning_rate=1e-2, weight_decay=0.1)
    model = torch.nn.ModuleDict({"video": torch.nn.Linear(4, 4), "audio": torch.nn.Linear(4, 4)})
    params, optimizer = build_optimizer(model, t)
    scaler, state = LossScaler(torch.device("cpu"), enabled=False), trainer.TrainState(torch.device("cpu"))
    # step 2 has no sound
    for step, streams in enumerate([("video", "audio"), ("video",)], start=1):
        before = model["audio"].weight.detach().clone()
        loss = sum(model[s](torch.ones(1, 4)).square().sum() for s in streams)
        loss.backward()
        trainer.clip_and_step(params, optimizer, scaler, t, state, step, loss.detach(), zero_missing=True)
    assert not torch.equal(model["audio"].weight, before)  # moved by momentum and decay alone
    assert optimizer.state[model["audio"].weight]["step"] == 2  # stepped twice, as FSDP steps it


def test_the_loop_has_one_fault_hook(monkeypatch):
    """trainer.py's loop reaches faults.py through on_loss alone. nan_loss makes that step's loss
    NaN; overflow keeps the loss's value and starts its backward from 1e30 times the gradient, as
    autograd's backward from the loss times 1e30 does; a step fault fires at the step's first
    micro-step only."""
    loop = ast.parse(inspect.getsource(trainer.train))
    calls = [
        ast.unparse(node.func)
        for node in ast.walk(loop)
        if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("faults.")
    ]
    assert calls == ["faults.on_loss"]
    monkeypatch.setattr(faults, "_step_seen", 0)
    monkeypatch.setenv(faults.FAULT_ENV, "nan_loss:2,overflow:3,step_fail:4")
    weight = torch.tensor([0.5, -2.0], requires_grad=True)

    def loss_and_grad(step):
        loss = faults.on_loss((weight**3).sum(), step)
        (grad,) = torch.autograd.grad(loss, weight)
        return loss.detach(), grad

    plain_loss, plain_grad = loss_and_grad(1)
    assert torch.equal(plain_loss, (weight**3).sum().detach())
    nan_loss, nan_grad = loss_and_grad(2)
    assert nan_loss.isnan() and nan_grad.isnan().all()
    overflow_loss, overflow_grad = loss_and_grad(3)
    (expected,) = torch.autograd.grad((weight**3).sum() * 1e30, weight)
    assert torch.equal(overflow_loss, plain_loss) and torch.equal(overflow_grad, expected)
    with pytest.raises(OSError, match="injected fault step_fail at 4"):
        loss_and_grad(4)
    assert torch.equal(loss_and_grad(4)[1], plain_grad)  # the step's next micro-step: fired already


def test_validation_is_a_closure_over_the_run():
    """train() validates through a closure over what a run does not change (model, cache, EMA,
    renderer, metrics): its one parameter is the step, and no module-level function takes the
    eleven."""
    assert not hasattr(trainer, "run_validation")
    closures = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(trainer.train)))
        if isinstance(node, ast.FunctionDef) and node.name == "run_validation"
    ]
    assert [[arg.arg for arg in node.args.args] for node in closures] == [["step"]]
