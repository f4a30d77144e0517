"""Shared test harness: the tiny model, the synthetic dataset and its cache are built once per session.

Tests run the real commands (`python trainer.py`, `torchrun ... trainer.py`) as subprocesses, so the
configs, the loading code and the process-group setup under test are the ones users run.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models import modeling_utils

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.make_synthetic_dataset import make_synthetic_dataset  # noqa: E402
from config import toml_value  # noqa: E402
from tools.make_tiny_model import make_tiny_model, make_tiny_wan  # noqa: E402


def written_on_first_use(root: Path, make):
    """get(variant): the folder make(folder, variant) writes under root, written on the first call."""
    made = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = root / variant
            make(str(made[variant]), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Every published CogVideoX variant's tiny model, written on first use."""
    return written_on_first_use(tmp_path_factory.mktemp("models"), make_tiny_model)


@pytest.fixture(scope="session")
def wan_models(tmp_path_factory):
    """Every Wan variant's tiny model, written on first use."""
    return written_on_first_use(tmp_path_factory.mktemp("wan"), make_tiny_wan)


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    """The session's model: CogVideoX-2b's key set (no rotary embeddings, sincos positions)."""
    return tiny_models("2b")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "shapes"
    make_synthetic_dataset(str(path), num_videos=24, frames=17, height=40, width=48, seed=0)
    return path


def write_toml(path: Path, settings: dict) -> Path:
    """{"section.key": value} -> a TOML file at path."""
    sections: dict[str, list[str]] = {}
    for key, value in settings.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n\n" for s, lines in sections.items()))
    return path


@pytest.fixture(scope="session")
def base_settings(tiny_model, tiny_data, tmp_path_factory) -> dict:
    """The settings every test starts from: fp32 and fast, a cache shared by the whole session."""
    return {
        "model.path": str(tiny_model),
        "model.dtype": "fp32",
        "data.data_root": str(tiny_data),
        "data.train_resolution": [9, 32, 32],
        "data.cache_dir": str(tmp_path_factory.mktemp("cache")),
        "data.held_out": 4,
        "train.steps": 6,
        "train.batch_size": 2,
        "train.learning_rate": 1e-3,
        "train.lr_warmup_steps": 2,
        "train.log_every": 1,  # the tests compare every step's loss
        "train.mixed_precision": "no",
        "train.gradient_checkpointing": False,
        "lora.rank": 4,
        "lora.lora_alpha": 2,
        "checkpoint.checkpointing_steps": 3,
        "validation.validation_steps": 3,
    }


@pytest.fixture
def write_config(base_settings, tmp_path):
    """write_config(name, **{"section.key": value}) -> path of a TOML file; output_dir under tmp_path."""

    def write(name: str = "run", **settings) -> Path:
        settings = {"run.output_dir": str(tmp_path / name), **base_settings, **settings}
        return write_toml(tmp_path / f"{name}.toml", settings)

    return write


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: list[str], nproc: int, env: dict | None, script: str) -> tuple[list[str], dict]:
    """One of our commands: in one process, through torchrun, or through launch.sh (NPROC processes; its
    arguments are the config file, then overrides)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    if script == "launch.sh":
        return ["bash", str(REPO / script), *args], {**full_env, "NPROC": str(nproc)}
    if nproc == 1:
        return [sys.executable, str(REPO / script), *args], full_env
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            str(REPO / script), *args], full_env


def default_sigint() -> None:
    """A job started in the background by a non-interactive shell (as CI may be) ignores SIGINT, and so
    would the trainer it starts: the child gets the default disposition, as under a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cmd(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 300, script: str = "trainer.py"):
    """Run one of our commands, in one process or through torchrun; return the CompletedProcess."""
    cmd, full_env = command(args, nproc, env, script)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=default_sigint)


def start_paused(args: list[str], fault: str, nproc: int = 1, script: str = "trainer.py"):
    """Start a command with a `pause` fault (faults.pause) in a session of its own, as a terminal or a
    scheduler starts a job; return the process, the pid of the paused rank and the output so far, once
    it has paused. Signal the whole job with os.killpg(process.pid, ...), then finish(process, output)."""
    cmd, full_env = command(args, nproc, {"VIDTRAIN_FAULT": fault}, script)
    process = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=default_sigint)
    output = []
    for line in process.stdout:
        output.append(line)
        if paused := re.search(r"\(pid (\d+)\) paused at", line):
            return process, int(paused.group(1)), output
    process.wait()
    raise AssertionError(f"never paused (exit {process.returncode}):\n{''.join(output)[-4000:]}")


def finish(process, output: list[str], timeout: int = 300) -> tuple[int, str]:
    """The exit code and whole output of a process start_paused started."""
    output.append(process.communicate(timeout=timeout)[0])
    return process.returncode, "".join(output)


def run_read_only(folders: list[Path], args: list[str], nproc: int = 1, script: str = "trainer.py", timeout: int = 300):
    """Run one of our commands with `folders` read-only: for root, whom permissions do not stop, as a read-only
    bind mount in a mount namespace of the command's own (unshare); for other users by their permissions."""
    cmd, env = command(args, nproc, None, script)
    if os.geteuid() != 0:
        modes = {folder: folder.stat().st_mode for folder in folders}
        try:
            for folder in folders:
                folder.chmod(0o555)
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        finally:
            for folder, mode in modes.items():
                folder.chmod(mode)
    mounts = " && ".join(f"mount --bind {f} {f} && mount -o remount,bind,ro {f}" for f in map(shlex.quote, map(str, folders)))
    return subprocess.run(["unshare", "--mount", "bash", "-c", f'{mounts} && exec "$@"', "bash", *cmd], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_ok(*args, **kwargs):
    result = run_cmd(*args, **kwargs)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()]


def train_losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(output_dir) if "train/loss" in m}


def assert_loads_lean(adapter, monkeypatch, folder: str = "") -> None:
    """adapter.load_transformer with accelerate hidden (requirements.txt does not list it; without it
    from_pretrained allocates every weight for real, and refuses Wan): every parameter is registered on
    the meta device (so no initialisation touches memory), and the result equals from_pretrained's (with
    accelerate) tensor for tensor, dtypes, buffers and eval mode included."""
    folder = folder or adapter.transformer_folder
    reference = adapter.TRANSFORMER.from_pretrained(adapter.path, subfolder=folder, dtype=adapter.dtype)
    on_meta, register = [], torch.nn.Module.register_parameter

    def record(module, name, param):
        on_meta.append(param is None or param.is_meta)
        register(module, name, param)

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "accelerate", None)  # `import accelerate` raises ImportError
        m.setattr(modeling_utils, "is_accelerate_available", lambda: False)
        m.setattr(torch.nn.Module, "register_parameter", record)
        ours = adapter.load_transformer(folder=folder)
    assert on_meta and all(on_meta), f"{on_meta.count(False)} parameters registered off the meta device"
    theirs = {**dict(reference.named_buffers()), **dict(reference.named_parameters())}
    mine = {**dict(ours.named_buffers()), **dict(ours.named_parameters())}
    assert mine.keys() == theirs.keys()
    different = [k for k in theirs if mine[k].dtype != theirs[k].dtype or not torch.equal(mine[k], theirs[k])]
    assert different == [] and not ours.training
