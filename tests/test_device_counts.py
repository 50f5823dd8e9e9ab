"""Every chapter executes unchanged with other emulated device counts: one device, two, a
count that divides none of the model's widths (6), and 16 (the book builds with 8). Four, a
power of two that divides every width as 8 does, is left out: on jax 0.12 the CPU compiles
about twice as slowly, and the whole suite must stay within CI's 90 minutes.

One class per count: pytest-xdist (`--dist loadscope`) gives each class to one worker, so the
counts run side by side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient

from book import CHAPTERS
from conftest import ROOT

sys.path.insert(0, str(ROOT / "book" / "_ext"))
from nnxscale_book import shared_compilation

pytestmark = pytest.mark.sweep


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the build's shared compilation cache, one per worker: the chapters
    of one device count read back what the chapters before them compiled, as in the build."""
    return shared_compilation(tmp_path_factory.mktemp("jax-cache"))


def execute(
    md: Path, devices: int | str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """Run every cell of a chapter in a fresh kernel with `devices` devices (times: --durations)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NNXSCALE_DEVICES", str(devices))
    NotebookClient(
        jupytext.read(md), timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(md.parent)}},
    ).execute()  # fmt: skip


def with_devices(devices: int) -> type:
    """A test class that executes every chapter with `devices` devices."""

    @pytest.mark.parametrize("md", CHAPTERS, ids=[c.stem for c in CHAPTERS])
    def test_chapter_runs(
        self, md: Path, monkeypatch: pytest.MonkeyPatch, compiled: dict[str, str]
    ) -> None:
        execute(md, devices, monkeypatch, compiled)

    return type(f"TestDevices{devices}", (), {"test_chapter_runs": test_chapter_runs})


TestDevices1 = with_devices(1)
TestDevices2 = with_devices(2)
TestDevices6 = with_devices(6)
TestDevices16 = with_devices(16)


def test_a_chapter_runs_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    # NNXSCALE_DEVICES=native here finds one CPU device, so the setup cell emulates 8 instead.
    execute(CHAPTERS[0], "native", monkeypatch, {})
