"""The machine's unit of time that the book's budgets are stated in (benchmarks/build_time.py):
a compile of plain JAX and optax, which no change to the library can move."""

from __future__ import annotations

import ast
import sys

from book import CHAPTERS, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import build_time  # a script of the benchmarks, not a package


def test_the_unit_program_uses_jax_and_optax_alone() -> None:
    tree = ast.parse(build_time.UNIT_PROGRAM)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"time", "jax", "jax.numpy", "optax"}


def test_the_unit_is_the_seconds_a_fresh_process_compiles_it_in() -> None:
    seconds = build_time.unit_seconds()
    assert 0.05 < seconds < 60, seconds


def test_the_ceiling_names_every_chapter_in_units() -> None:
    ceiling = build_time.CEILING
    assert set(ceiling["chapters"]) == {p.stem for p in CHAPTERS}
    assert all(units > 0 for units in ceiling["chapters"].values())
    assert ceiling["cold build"] > max(ceiling["chapters"].values()) and ceiling["unit seconds"] > 0
