"""A compiled program as XLA's own module: its computations, instructions and their graph.

`Program.of(compiled)` walks `compiled.runtime_executable().hlo_modules()`: XLA's Python
bindings give the computations, each one's instructions, and each instruction's operands and
users. What the bindings do not expose is read from each instruction's own line of text
(`to_string()`): its result shape, its opcode's spelling, the computations it calls, and
attributes such as replica groups or a loop's trip count; the module's header gives its
partition count and its entry. HLO text (`compiled.as_text()`, a dump) is parsed by XLA
itself (`hlo_module_from_text`), so text and compiled programs go through the same
structures. The analyses live in `nnxscale.hlo`; this module only reads.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jaxlib import xla_client

_CALLEES = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|select|scatter)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\b(branch|called)_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_ENTRY = re.compile(r"^ENTRY %?([\w.\-]+)", re.M)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group that opens at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclass(frozen=True)
class Instruction:
    """One instruction: from the bindings its name, operands and users; from its line of text
    its result shape, its opcode as HLO text spells it (`all-gather-start`, `sine`), and the
    attributes after its operand list."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    users: tuple[str, ...]
    attributes: str

    @classmethod
    def of(cls, ins: Any) -> Instruction:
        """Read one of XLA's `HloInstruction`s."""
        rest = ins.to_string().split(" = ", 1)[1]
        end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
        paren = rest.index("(", end)
        close = _balanced(rest, paren)
        return cls(
            name=ins.name,
            opcode=rest[end:paren].strip(),
            shape=rest[:end],
            operands=tuple(o.name for o in ins.operands()),
            users=tuple(u.name for u in ins.users()),
            attributes=rest[close:],
        )

    def callees(self) -> list[tuple[str, str]]:
        """(role, computation) of every computation it calls: loop body and condition,
        fused or applied computations, and each branch of a conditional."""
        found = [(role, callee) for role, callee in _CALLEES.findall(self.attributes)]
        for role, listed in _BRANCHES.findall(self.attributes):
            found += [(role, b.strip().lstrip("%")) for b in listed.split(",")]
        return found

    def trip_count(self) -> int | None:
        """How often a while loop runs, as XLA recorded it; None if it did not."""
        trip = _TRIP_COUNT.search(self.attributes)
        return int(trip.group(1)) if trip else None


@dataclass(frozen=True)
class Program:
    """A module's computations (each its instructions, by name), entry and partition count."""

    computations: dict[str, dict[str, Instruction]]
    entry: str
    partitions: int
    name: str = ""
    """The module's name (`jit_train_step`), which a profile's ops carry as their module."""

    @classmethod
    def of(cls, program: object) -> Program:
        """The program of a `jax.stages.Compiled`, or of HLO text (read once per program)."""
        if isinstance(program, str):
            return _from_text(program)
        if not hasattr(program, "runtime_executable"):
            raise TypeError(
                f"expected a compiled program (jax.jit(f).lower(...).compile()) or its HLO "
                f"text, got a {type(program).__name__}"
            )
        try:
            return _COMPILED[program]
        except KeyError:
            module = program.runtime_executable().hlo_modules()[0]
            _COMPILED[program] = read = cls.from_module(module)
            return read

    @classmethod
    def from_module(cls, module: Any) -> Program:
        """Read one of XLA's `HloModule`s."""
        computations = {
            c.name: {i.name: Instruction.of(i) for i in c.instructions()}
            for c in module.computations()
        }
        header = module.to_string(xla_client.hlo.HloPrintOptions.short_parsable())
        entry = _ENTRY.search(header)
        partitions = _PARTITIONS.search(header.split("\n", 1)[0])
        count = int(partitions.group(1)) if partitions else 1
        return cls(computations, entry.group(1), count, module.name)

    def instructions(self) -> Iterator[tuple[str, Instruction]]:
        """(computation, instruction) for every instruction of every computation."""
        for name, instructions in self.computations.items():
            for ins in instructions.values():
                yield name, ins

    def walk(self, start: str | None = None) -> Iterator[tuple[str, Instruction, int]]:
        """Every instruction a call of the program (or of computation `start`) runs, with how
        many times: once per loop iteration (the trip count XLA records on a while loop; a loop
        without one counts once), the branches of a conditional as if each ran. Yields
        (computation, instruction, executions)."""

        def visit(name: str, executions: int, path: tuple[str, ...]):
            for ins in self.computations.get(name, {}).values():
                yield name, ins, executions
                if ins.opcode.endswith("-done"):
                    continue
                trip = ins.trip_count()
                for role, callee in ins.callees():
                    if callee in path:
                        continue
                    times = trip if trip and role in ("body", "condition") else 1
                    yield from visit(callee, executions * times, (*path, callee))

        entry = start or self.entry
        yield from visit(entry, 1, (entry,))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The programs read so far, by the compiled object they came from (while it lives)."""


@functools.lru_cache(maxsize=8)
def _from_text(text: str) -> Program:
    try:
        module = xla_client.hlo.hlo_module_from_text(text)
    except Exception as error:  # XLA raises its own status errors
        raise ValueError(
            f"not an HLO module ({error}): pass a compiled program or its text (compiled.as_text())"
        ) from None
    return Program.from_module(module)
