"""Chapters execute unchanged with other emulated device counts (the book builds with 8).

Every chapter runs with one device. The other counts run only for chapters whose code takes
a path there that neither 1 nor 8 devices take, each with the reason (`OTHER_COUNTS`), and
for the two chapters that take under 20 s (`CHEAP`), at every count. Four adds nothing six
does not: 6 divides none of the model's widths (64, 128, 256), and the chapters that take
the largest power of two below the count run at 6 as at 4.

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


CHEAP = ("01_device_meshes", "02_logical_axis_rules")
"""Chapters that execute in under 20 s (book/_ext/chapter_seconds.json): run at every count."""

OTHER_COUNTS = {
    2: {
        "07_pipeline_schedules": "two stages: no middle stage; PP+FSDP on a 2x1 mesh",
        "09_sequence_and_context_parallelism": "a ring of two skips the ring's middle steps",
    },
    6: {
        "02_logical_axis_rules": "6 divides no width: FSDP splits nothing, Flax's rules refused",
        "03_sharded_init": "whole arrays instead of 1/N; half the devices split nothing",
        "04_training_strategies": "arrays kept whole, no weight gathered, inexact 1/N",
        "05_orbax_resharding": "saved chunks larger than the shard a restore keeps",
        "07_pipeline_schedules": "PP+FSDP on a 2x2 mesh (as at 4 devices)",
        "08_multi_process": "FSDP splits nothing across two processes: one writes no array",
        "11_where_the_time_goes": "a batch of 12; FSDP's step holds no all-gather",
        "A1_your_own_model": "foreign models split nothing; a 3x1 restore; Flax's rules refused",
    },
    16: {
        "09_sequence_and_context_parallelism": "blocks of two tokens; a ring of 16",
        "10_expert_parallelism": "more devices than experts: expert axis capped, FSDP+EP on 4x4",
    },
}
"""Per count: the chapters whose code branches there as it does at neither 1 nor 8 devices,
with the branch (line by line in each chapter: its `jax.device_count()`, the mesh shapes it
computes and the asserts that depend on what the count divides)."""


def chosen(devices: int) -> list[Path]:
    """The chapters executed with `devices` devices."""
    if devices == 1:
        return CHAPTERS
    return [c for c in CHAPTERS if c.stem in CHEAP or c.stem in OTHER_COUNTS[devices]]


def test_every_chosen_chapter_exists() -> None:
    names = {c.stem for c in CHAPTERS}
    assert set(CHEAP) <= names
    for chapters in OTHER_COUNTS.values():
        assert set(chapters) <= names


def with_devices(devices: int) -> type:
    """A test class that executes the chapters `chosen` for `devices` devices."""

    @pytest.mark.parametrize("md", chosen(devices), ids=[c.stem for c in chosen(devices)])
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
