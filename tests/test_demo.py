"""The demo, exactly as the README's quick start runs it.

`bash launch.sh` in a fresh copy of the repository."""

import json
import os
import shutil
import subprocess

import pytest
from conftest import REPO


@pytest.mark.slow
def test_demo_trains_on_two_processes_and_says_where_things_are(tmp_path):
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tmp_path / name)
    result = subprocess.run(
        ["bash", "launch.sh"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # A clean run (the tools that make the model and the clips included) prints no warning.
    assert [line for line in result.stderr.splitlines() if "warn" in line.lower()] == []
    assert "x 2 data-parallel ranks" in result.stderr
    assert "LoRA:        runs/tiny/lora/pytorch_lora_weights.safetensors" in result.stdout
    assert "TensorBoard: tensorboard --logdir runs/tiny/logs" in result.stdout
    run = tmp_path / "runs" / "tiny"
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(p.name for p in (run / "validation_res").iterdir()) == [
        f"step_{s}_prompt_{i}.mp4" for s in (0, 100, 200) for i in (0, 1)
    ]
    held_out = [
        m["val/loss"]
        for m in map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines())
        if "val/loss" in m
    ]
    assert held_out[-1] < 0.9 * held_out[0]
