"""The config schema.

Strict keys and types, the override syntax, the model's shape rules, schedules."""

import dataclasses
import math
import re
import typing

import pytest
import torch

from config import Config, ConfigError, check_resolution, load_config, parse_overrides, to_toml
from model import LossScaler, Optimizers
from model_adapter import check_config
from trainer import TrainState, clip_and_step, lr_factor

REQUIRED = ["--run.output_dir", "/tmp/out", "--model.path", "/m", "--data.data_root", "/d"]


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_overrides_are_toml_literals_or_strings():
    parsed = parse_overrides(
        [
            "--train.steps",
            "3",
            "--train.learning_rate=1e-4",
            "--train.gradient_checkpointing",
            "false",
            "--data.train_resolution",
            "[9, 32, 32]",
            "--model.dtype",
            "bf16",
            "--lora.target_modules",
            '["to_q", "to_k"]',
            "--run.output_dir",
            "/a/b c",
        ]
    )
    assert parsed == {
        "train.steps": 3,
        "train.learning_rate": 1e-4,
        "train.gradient_checkpointing": False,
        "data.train_resolution": [9, 32, 32],
        "model.dtype": "bf16",
        "lora.target_modules": ["to_q", "to_k"],
        "run.output_dir": "/a/b c",
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.lerning_rate", "1e-4"], "did you mean 'train.learning_rate'"),
        (["--trian.steps", "3"], "did you mean 'train'"),
        (["--train.steps", "ten"], "train.steps must be int"),
        (["--train.steps", "true"], "train.steps must be int"),
        (["--train.gradient_checkpointing", "False"], "train.gradient_checkpointing must be bool"),
        (["--train.gradient_checkpointing", "1"], "train.gradient_checkpointing must be bool"),
        (["--train.steps", "3", "--train.steps=4"], "given twice"),
        (["--train.mixed_precision", "bf32"], '"bf16" | "fp16" | "no"'),
        (["--data.train_resolution", "[9, 32]"], "[frames, height, width]"),
        (["--lora.target_modules", "to_q"], "lora.target_modules must be a list"),
        (["--train.steps", "0"], "train.steps must be at least 1"),
        (
            ["--parallel.cpu_offload", "true"],
            'parallel.cpu_offload offloads FSDP\'s shards: set parallel.strategy = "fsdp"',
        ),
        (
            [
                "--parallel.cpu_offload",
                "true",
                "--parallel.strategy",
                "fsdp",
                "--train.mixed_precision",
                "fp16",
            ],
            'parallel.cpu_offload does not support train.mixed_precision = "fp16" yet',
        ),
        (
            ["--model.type", "i2v", "--data.train_resolution", "[1, 32, 32]"],
            "data.train_resolution = [1, 32, 32] has 1 frame, but image-to-video trains the frames after",
        ),
        (
            ["--model.type", "i2v", "--data.buckets", "[[9, 32, 32], [1, 32, 32]]"],
            "data.buckets[1] = [1, 32, 32] has 1 frame",
        ),
    ],
)
def test_mistakes_name_the_key(args, message):
    with pytest.raises(ConfigError, match=None) as error:
        load_config(None, REQUIRED + args)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--train.max_grad_norm", "-1"],
            "train.max_grad_norm must be 0 (no clipping) or positive, got -1.0",
        ),
        (
            ["--lora.lora_alpha", "0"],
            "lora.lora_alpha must be positive (the scale is lora_alpha / lora.rank), got 0.0",
        ),
        (["--train.lr_warmup_steps", "-5"], "train.lr_warmup_steps must be 0 or more, got -5"),
        (["--train.learning_rate", "-1e-4"], "train.learning_rate must be positive, got -0.0001"),
        (["--lora.target_modules", "[]"], "lora.target_modules is empty, so no layer would get an adapter"),
        (
            ["--lora.variant", "lokr", "--lora.dropout", "0.1", "--train.gradient_checkpointing", "false"],
            'lora.dropout > 0 with lora.variant = "lokr": only "lora" has dropout',
        ),
        (["--lora.lokr_factor", "0"], "lora.lokr_factor must be -1 or at least 1, got 0"),
        (
            ["--checkpoint.resume", "/nowhere/checkpoint-4"],
            "checkpoint.resume = /nowhere/checkpoint-4 does not exist",
        ),
    ],
)
def test_values_that_train_nothing_or_crash_late_are_refused(args, message):
    """Values that would train nothing or crash late are refused by the config check.

    Without their checks, each of these would pass the config check, then export an all-zero LoRA,
    crash after the cache pass, or (resume) be named only as a checkpoint without meta.json."""
    with pytest.raises(ConfigError) as error:
        load_config(None, REQUIRED + args)
    assert message in str(error.value)


def test_every_float_key_refuses_inf_and_nan(tmp_path):
    """Every float key refuses inf and nan, by name, when the config is read.

    TOML reads them as numbers, and nan fails no comparison: train.learning_rate = inf and
    train.max_grad_norm = nan exported an all-NaN LoRA with exit 0, train.audio_loss_weight,
    train.flow_shift and lora.lora_alpha an untrained one, data.target_fps = nan died after the cache
    pass. Each float of the tree (the keys a family declares its own too, validation.stg_scale's
    kind), on the command line and in a file."""
    floats = [
        f"{section.name}.{name}"
        for section in dataclasses.fields(Config)
        for name, kind in typing.get_type_hints(section.type).items()
        if kind is float
    ]
    assert {"train.learning_rate", "data.target_fps", "validation.stg_scale"} <= set(floats)
    for key in floats:
        for value in ("inf", "-inf", "nan"):
            with pytest.raises(ConfigError, match=f"^{re.escape(key)} = {value} is not a finite number"):
                load_config(None, REQUIRED + [f"--{key}", value])
    with pytest.raises(ConfigError, match=r"^train.max_grad_norm = nan is not a finite number \(TOML"):
        load_config(write(tmp_path, "[train]\nmax_grad_norm = nan\n"), REQUIRED)


def test_a_family_rule_is_its_adapters():
    """Wan's forward without autocast (crashed after the cache pass): refused by
    WanAdapter.check_config, from the config alone (model.path = /m does not exist), and not for
    fp32 weights."""
    wan = ["--model.family", "wan", "--train.mixed_precision", "no"]
    with pytest.raises(ConfigError) as error:
        check_config(load_config(None, REQUIRED + wan))
    assert 'model.dtype = "bf16" with train.mixed_precision = "no": Wan\'s forward needs autocast' in str(
        error.value
    )
    check_config(load_config(None, REQUIRED + wan + ["--model.dtype", "fp32"]))


def test_max_grad_norm_zero_does_not_clip():
    """train.max_grad_norm = 0 means no clipping.

    The step is the unclipped one (clip_grad_norm_ with 0 scales every gradient to 0, and the LoRA
    stayed all zero)."""
    cfg = load_config(None, REQUIRED + ["--train.max_grad_norm", "0"])
    updated = []
    for max_grad_norm in (0.0, math.inf):
        cfg.train.max_grad_norm = max_grad_norm
        weight = torch.nn.Parameter(torch.zeros(3))
        # reads found_inf
        optimizer = Optimizers([torch.optim.AdamW([weight], lr=1.0, weight_decay=0.0, fused=True)])
        weight.grad = torch.tensor([3.0, 4.0, 0.0])
        norm, skipped = clip_and_step(
            [weight],
            optimizer,
            LossScaler(torch.device("cpu"), False),
            cfg.train,
            TrainState(torch.device("cpu")),
            1,
            torch.zeros(()),
        )
        assert norm.item() == 5.0 and not skipped
        updated.append(weight.detach().clone())
    # Adam's first step: about lr
    assert torch.equal(updated[0], updated[1]) and updated[0][:2].abs().min() > 0.5


def test_missing_required_key_says_how_to_set_it():
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(None, ["--run.output_dir", "/o", "--data.data_root", "/d"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'"):
        load_config(write(tmp_path, "[train]\nstepz = 3\n"), REQUIRED)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train]\nsteps = 3\nsteps = 4\n"), REQUIRED)
    with pytest.raises(ConfigError, match="inside a \\[section\\]"):
        load_config(write(tmp_path, "steps = 3\n"), REQUIRED)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"), REQUIRED)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(
        write(tmp_path, '[train]\nsteps = 7\n[lora]\ntarget_modules = ["to_q"]\n'),
        REQUIRED + ["--train.learning_rate", "3e-5"],
    )
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg and again.train.steps == 7 and again.train.learning_rate == 3e-5


def test_model_shape_rules():
    check_resolution([49, 480, 720], 8, 16)
    with pytest.raises(ConfigError, match="use 41 or 49"):
        check_resolution([48, 480, 720], 8, 16)
    with pytest.raises(ConfigError, match="height = 470 must be a positive multiple of 16"):
        check_resolution([49, 470, 720], 8, 16)
    with pytest.raises(ConfigError, match="frames = 0, but this model needs 4k\\+1 frames .*: use 1 or 5$"):
        check_resolution([0, 32, 32], 4, 16, "validation.resolution")  # never a negative count
    # frames FFmpeg cannot scale to: the key, not every clip ("cannot decode (Invalid argument)")
    check_resolution([9, 16000, 16000], 8, 16)
    with pytest.raises(ConfigError) as refused:
        check_resolution([9, 16384, 16384], 8, 16)
    assert str(refused.value) == (
        "data.train_resolution = [9, 16384, 16384]: a frame of 16384 x 16384 is larger than FFmpeg "
        "decodes to ((height + 128) x (width + 128) under 2^28 pixels; 16,000 x 16,000 at most), so "
        "every clip would fail to decode: use a smaller height and width"
    )


def test_lr_schedules():
    cfg = load_config(None, REQUIRED + ["--train.steps", "100", "--train.lr_warmup_steps", "10"])
    assert [lr_factor(s, cfg.train) for s in (1, 5, 10, 50, 100)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cfg.train.lr_scheduler = "linear"
    assert lr_factor(55, cfg.train) == pytest.approx(0.5) and lr_factor(100, cfg.train) == 0.0
    cfg.train.lr_scheduler = "cosine"
    assert lr_factor(55, cfg.train) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    cfg.train.lr_scheduler = "constant"
    assert lr_factor(1, cfg.train) == 1.0


def test_configuration_page_is_config_output():
    """docs/configuration.md is what `python config.py` prints: config.py's comments, key for key."""
    import subprocess
    import sys

    from conftest import REPO

    printed = subprocess.run(
        [sys.executable, "config.py"], cwd=REPO, capture_output=True, text=True, check=True
    )
    page = (REPO / "docs/configuration.md").read_text()
    assert page == printed.stdout, "docs/configuration.md is stale: python config.py > docs/configuration.md"


def test_shipped_configs_load():
    """Every file in configs/ passes the schema and the value checks.

    Every file in configs/ passes the schema and the value checks (the model's own rules need the
    model, which the tests have only in tiny form)."""
    from conftest import REPO

    configs = sorted((REPO / "configs").glob("*.toml"))
    assert len(configs) >= 7
    for path in configs:
        load_config(str(path))
