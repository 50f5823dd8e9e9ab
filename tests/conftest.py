"""Test setup: 8 emulated CPU devices in the pytest process, and shared paths and helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnxscale.devices import emulate_devices

from book import ROOT

TEST_DEVICES = 8

emulate_devices(TEST_DEVICES)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh Python process (its own JAX backend) with extra environment."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=ROOT,
    )


def jupyter_book(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the jupyter-book command of this environment."""
    command = [str(Path(sys.executable).with_name("jupyter-book")), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=3600)


@pytest.fixture(scope="session")
def built_book() -> Path:
    """The whole book, built from clean with every chapter executed for real; its HTML folder."""
    assert jupyter_book("clean", "--all", ".").returncode == 0
    result = jupyter_book("build", ".")
    log = result.stdout + result.stderr
    (ROOT / "_build").mkdir(exist_ok=True)
    (ROOT / "_build" / "build.log").write_text(log)
    assert result.returncode == 0, log[-5000:]
    return ROOT / "_build" / "html"
