"""What JAX can say about a step that misbehaves, as values a program can assert on.

`compiles()` records every compilation in a block with JAX's own explanation of why its cache
missed (`jax.explain_cache_misses`), instead of letting JAX print it; `first_nan(fn, ...)`
runs a function under `jax.debug_nans` and returns the operation, and the line of the
reader's code, that first made a NaN; `busy_devices(fn)` counts the ops each device ran in
one call, read off a profile. The appendix "When it breaks" reads each of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

MISS = re.compile(r"TRACING CACHE MISS at (?P<where>.*?):\n(?P<why>.*)", re.DOTALL)
COMPILING = re.compile(r"Compiling (?P<name>\S+) with global shapes and types (?P<types>.*?)\.")


@dataclasses.dataclass(frozen=True)
class Compilation:
    """One compilation JAX logged: the function and the argument types it compiled for."""

    function: str
    types: str


@dataclasses.dataclass
class Compiles:
    """What `compiles()` recorded: each compilation, and why each trace missed the cache."""

    compilations: list[Compilation] = dataclasses.field(default_factory=list)
    misses: list[str] = dataclasses.field(default_factory=list)
    """JAX's explanation of each cache miss: where it was called and what differed."""

    def of(self, name: str) -> list[Compilation]:
        """The compilations of the function called `name` (as `jax.jit` names it)."""
        return [c for c in self.compilations if c.function == f"jit({name})"]


class _Recorder(logging.Handler):
    """Keeps JAX's compile and cache-miss log records in a `Compiles`."""

    def __init__(self, seen: Compiles) -> None:
        super().__init__(logging.DEBUG)
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if miss := MISS.match(text):
            self.seen.misses.append(miss["where"] + ": " + " ".join(miss["why"].split()))
        elif made := COMPILING.match(text):
            self.seen.compilations.append(Compilation(made["name"], made["types"]))


@contextlib.contextmanager
def compiles() -> Iterator[Compiles]:
    """Record every compilation inside the block, and JAX's reason for each cache miss
    (`jax.log_compiles`, `jax.explain_cache_misses`), without printing them: a step that
    compiles more than once says what changed between its calls."""
    seen = Compiles()
    logger = logging.getLogger("jax")
    recorder, propagate = _Recorder(seen), logger.propagate
    logger.addHandler(recorder)
    logger.propagate = False  # recorded, not printed
    try:
        with jax.log_compiles(True), jax.explain_cache_misses(True):
            yield seen
    finally:
        logger.removeHandler(recorder)
        logger.propagate = propagate


@dataclasses.dataclass(frozen=True)
class FirstNaN:
    """Where a NaN first appeared: JAX's message (it names the operation) and the line of the
    caller's code that ran it."""

    message: str
    code: str


def first_nan(fn: Callable[..., Any], *args: Any) -> FirstNaN | None:
    """Run `fn(*args)` under `jax.debug_nans`, which re-runs a compiled function one
    operation at a time once its output holds a NaN, and return the first operation that made
    one, and where in the caller's code; None if none did."""
    quiet = io.StringIO()  # JAX prints that it re-runs the function op by op
    try:
        with jax.debug_nans(True), contextlib.redirect_stdout(quiet):
            jax.block_until_ready(fn(*args))
    except FloatingPointError as error:
        mine = [f for f in traceback.extract_tb(error.__traceback__) if _callers(f.filename)]
        return FirstNaN(str(error).splitlines()[0], mine[-1].line if mine else "")
    return None


def _callers(filename: str) -> bool:
    """Whether a traceback's frame is the caller's code: neither JAX's nor this module's."""
    parts = Path(filename).parts
    return "jax" not in parts and "jaxlib" not in parts and Path(filename) != Path(__file__)


def busy_devices(fn: Callable[[], Any]) -> Counter[int]:
    """Device id -> ops it ran during one call of `fn`, read off a profile
    (`profiles.record`): a step whose inputs all sit on one device runs there alone. `fn` runs
    once before, waited for, so that neither its compilation nor its own earlier work lands
    in the profile; work other code left in flight would, so wait for it first."""
    from nnxscale.profiling.profiles import record

    jax.block_until_ready(fn())
    trace = record(lambda: jax.block_until_ready(fn()))
    return Counter(op.device for op in trace.ops)
