"""Every chapter executes unchanged with other emulated device counts: one device, two, a
count that divides none of the model's widths (6), and 4 and 16 (the book builds with 8)."""

from __future__ import annotations

import time
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient

from book import CHAPTERS

pytestmark = pytest.mark.book


@pytest.mark.parametrize("devices", [1, 2, 4, 6, 16])
@pytest.mark.parametrize("md", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_chapter_runs_with(
    md: Path, devices: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("NNXSCALE_DEVICES", str(devices))
    notebook = jupytext.read(md)
    start = time.perf_counter()
    NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(md.parent)}},
    ).execute()  # fmt: skip
    with capsys.disabled():
        print(f"\n{md.stem} with {devices} devices: {time.perf_counter() - start:.1f} s")
