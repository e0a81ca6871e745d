"""Every code block of README.md runs: Python blocks are executed (on the CPU, in a fresh
namespace, in a temporary directory), and every command of the shell blocks is checked: its
script exists, and its hydra overrides compose into a valid job (a misspelled key in the README
fails here), without training."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import launch.train  # noqa: F401  (registers the schema in the ConfigStore)
from loka_train.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang in ("bash", "sh")]

ENTRY_POINTS = {
    "./scripts/train.sh": "launch/train.py",
    "./scripts/ledger.sh": "launch/train.py",
    "./scripts/export.sh": "launch/export.py",
    "./scripts/test.sh": None,
}
"""README commands -> the hydra entry point they run (None: no overrides to check)."""


def _commands() -> list[list[str]]:
    """The commands of the shell blocks, continuation lines joined, comments dropped."""
    out = []
    for block in SHELL:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(shlex.split(line))
    return out


def test_the_readme_has_code_to_check() -> None:
    assert PYTHON and SHELL
    assert any(cmd[0] == "./scripts/train.sh" for cmd in _commands())


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    code = PYTHON[index]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)


def _overrides(cmd: list[str]) -> list[str]:
    return [a for a in cmd if "=" in a and not a.startswith("-")]


@pytest.mark.parametrize("cmd", _commands(), ids=lambda c: " ".join(c)[:60])
def test_shell_command_exists_and_its_overrides_compose(cmd: list[str]) -> None:
    program = cmd[0]
    if program in ENTRY_POINTS:
        script = ROOT / program
        entry = ENTRY_POINTS[program]
    elif program.endswith("torchrun") or program == "torchrun":
        entry = next(a for a in cmd[1:] if a.endswith(".py"))
        script = ROOT / entry
    else:
        pytest.fail(f"README command {' '.join(cmd)!r}: add its program to this test")
    assert script.exists(), f"README names {script}, which does not exist"
    if entry == "launch/export.py":
        from launch.export import ExportConfig  # registers conf/export.yaml's schema

        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="export", overrides=_overrides(cmd))
        assert isinstance(OmegaConf.to_object(cfg), ExportConfig)
        return
    if entry != "launch/train.py":
        return
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(cmd))
    assert isinstance(OmegaConf.to_object(cfg), JobConfig)
