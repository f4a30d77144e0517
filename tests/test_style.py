"""The code's form: ruff's format and lint hold for every file, and few lines pass 100 characters."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tracked_python_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True).stdout
    return [REPO / name for name in names.split()] or sorted(REPO.rglob("*.py"))


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_passes(command):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: python -m pip install -r requirements-dev.txt"
    result = subprocess.run([ruff, *command, "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)} .:\n{result.stdout}{result.stderr}"


def test_few_lines_pass_100_characters():
    lines = [line for path in tracked_python_files() for line in path.read_text().splitlines()]
    long = sum(len(line) > 100 for line in lines)
    assert long <= 0.05 * len(lines), f"{long} of {len(lines)} lines are over 100 characters"
