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


SHARED_BUILD = ("test_book", "test_browser")
"""Modules that read the one built book: one pytest-xdist worker runs them all."""

SPREAD = ("test_device_counts",)
"""Modules whose tests share nothing: pytest-xdist spreads them over every worker."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep each module on one worker (its module fixtures then run once), except SPREAD."""
    for item in items:
        module = item.module.__name__
        if module not in SPREAD:
            group = "built-book" if module in SHARED_BUILD else module
            item.add_marker(pytest.mark.xdist_group(group))


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
