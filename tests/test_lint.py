"""The code, chapters included (through their notebooks), is linted and formatted with ruff."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from book import ROOT

RUFF = str(Path(sys.executable).with_name("ruff"))


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command: list[str]) -> None:
    result = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
