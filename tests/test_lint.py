"""The code, chapters included (through their notebooks), is linted and formatted with ruff."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nnxscale.runtime.launch import run

from book import ROOT

RUFF = str(Path(sys.executable).with_name("ruff"))


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command: list[str]) -> None:
    result = run([RUFF, *command, "."], cwd=ROOT, check=False)
    assert result.returncodes == [0], result.text
