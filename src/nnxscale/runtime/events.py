"""What the library's programs report, as typed events: one JSON line each on their output.

A program in another process (`python -m nnxscale train`, `restore`, `collective`) prints
each event as `{"event": KIND, "process": I, ...}`, I being its JAX process index; `read`
turns a run's output back into the same dataclasses, whether or not the launcher put its
`[process N] ` prefix before each line. The command line, the chapters' figures, the
benchmarks and the tests all read these classes, so an event's fields are written once.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterable
from typing import Any, ClassVar

PREFIX = re.compile(r"^\[process (\d+)\] ")
"""What the launcher puts before each line of a worker's output when it runs several."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing a program reports; `process` is its JAX process index."""

    kind: ClassVar[str] = ""
    process: int

    def line(self) -> str:
        """The event as the JSON line a program prints."""
        return json.dumps({"event": self.kind, **dataclasses.asdict(self)})


@dataclasses.dataclass(frozen=True)
class Start(Event):
    """A training worker's first report: its devices, where they sit in the global mesh, and
    the rows [start, stop) of each batch of `batch_size` that this process loads."""

    kind: ClassVar[str] = "start"
    processes: int
    local_devices: int
    devices: int
    device_ids: list[int]
    mesh_axes: list[str]
    mesh_device_ids: list[Any]
    rows: list[int]
    batch_size: int


@dataclasses.dataclass(frozen=True)
class Resumed(Event):
    """Training resumed from the checkpoint of `step`."""

    kind: ClassVar[str] = "resumed"
    step: int


@dataclasses.dataclass(frozen=True)
class Step(Event):
    """The loss of one training step, exactly (JSON keeps every bit of a float)."""

    kind: ClassVar[str] = "step"
    step: int
    loss: float


@dataclasses.dataclass(frozen=True)
class Checksums(Event):
    """Array path -> checksum of the state whose save of `step` begins (one process only)."""

    kind: ClassVar[str] = "checksums"
    step: int
    sums: dict[str, str]

    def __repr__(self) -> str:
        return (
            f"Checksums(process={self.process}, step={self.step}, sums=<{len(self.sums)} arrays>)"
        )


@dataclasses.dataclass(frozen=True)
class Saving(Event):
    """The save of `step` writes in the background; training waited `blocked_seconds`."""

    kind: ClassVar[str] = "saving"
    step: int
    blocked_seconds: float


@dataclasses.dataclass(frozen=True)
class Preempted(Event):
    """Asked to stop (SIGTERM), the run saved `step`, the step every process agreed on
    (`nnxscale.preemption`), and stops there."""

    kind: ClassVar[str] = "preempted"
    step: int


@dataclasses.dataclass(frozen=True)
class Written(Event):
    """Every save is on disk, after `waited_seconds` of waiting at the end."""

    kind: ClassVar[str] = "written"
    waited_seconds: float


@dataclasses.dataclass(frozen=True)
class Restored(Event):
    """A checkpoint restored onto this process's mesh: what was saved, what it became."""

    kind: ClassVar[str] = "restored"
    step: int
    devices: int
    platform: str
    saved: dict[str, Any]
    rules: str
    mesh: dict[str, int]
    seconds: float
    bytes_per_device: int
    total_bytes: int
    embed: dict[str, Any]
    arrays: int


@dataclasses.dataclass(frozen=True)
class Hello(Event):
    """A launched worker's sum of one number per device over every process."""

    kind: ClassVar[str] = "hello"
    processes: int
    local_devices: int
    devices: int
    sum: int


@dataclasses.dataclass(frozen=True)
class Crossing(Event):
    """A launched worker's compiled train step on a mesh across processes
    (`nnxscale.mesh.hybrid_mesh`): the mesh, and for each kind of collective and the mesh
    axes it runs over, the bytes of its arrays per step and whether its groups cross
    processes."""

    kind: ClassVar[str] = "crossing"
    mesh: dict[str, int]
    inside: dict[str, int]
    moved: list[Any]
    """[kind, axes, array bytes per step, crosses processes] for each (kind, axes)."""


@dataclasses.dataclass(frozen=True)
class Entering(Event):
    """A worker is about to run `collective` (its kind and the mesh axes it runs over, read
    off the compiled program): should the run hang, the launcher names what each worker waits
    in."""

    kind: ClassVar[str] = "entering"
    collective: str


@dataclasses.dataclass(frozen=True)
class Joined(Event):
    """The run a process joined (`nnxscale.cluster.join`): the engine that started it (a key
    of `cluster.ENGINES`, or "none" for a process on its own), the process count, the
    coordinator the engine named, and the devices this process holds."""

    kind: ClassVar[str] = "joined"
    engine: str
    processes: int
    coordinator: str | None
    local_devices: int


@dataclasses.dataclass(frozen=True)
class Leaving(Event):
    """A worker of a distributed run reached the end of its program (`cluster.join` has it
    printed at exit): the launcher names one that leaves while the others still run."""

    kind: ClassVar[str] = "leaving"


KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        Start,
        Resumed,
        Step,
        Checksums,
        Saving,
        Preempted,
        Written,
        Restored,
        Hello,
        Crossing,
        Entering,
        Joined,
        Leaving,
    )
}
"""Every kind of event, by the name its JSON line carries."""


def emit(event: Event) -> None:
    """Print `event` as one JSON line, at once (a launcher reads it while the program runs).

    The line and its end go in one write: a launcher sets PYTHONUNBUFFERED, where `print`
    writes the text and the newline apart, and a log line from another thread (Orbax's saving
    thread) that lands between them would join the event's line and hide it."""
    sys.stdout.write(event.line() + "\n")
    sys.stdout.flush()


def parse(line: str) -> Event | None:
    """The event on one output line, or None for a line that is not one (a log, a warning).

    A launcher's `[process N] ` prefix is removed; an event without a `process` gets N. A
    JSON object naming a kind of event this library does not have, or with other fields,
    is an error that names it, not a line to skip.
    """
    prefix = PREFIX.match(line)
    text = line[prefix.end() :] if prefix else line
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    if not isinstance(fields, dict) or "event" not in fields:
        return None
    kind = fields.pop("event")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"unknown event {kind!r} in {line!r}; the kinds are {sorted(KINDS)}")
    if prefix and "process" not in fields:
        fields["process"] = int(prefix[1])
    wanted = {f.name for f in dataclasses.fields(KINDS[kind])}
    if set(fields) != wanted:
        missing, extra = sorted(wanted - set(fields)), sorted(set(fields) - wanted)
        raise ValueError(f"a {kind!r} event missing {missing}, with unknown {extra}: {line!r}")
    return KINDS[kind](**fields)


def read[E: Event](
    output: str | Iterable[str], kind: type[E] | None = None, process: int | None = None
) -> list[E]:
    """The events in a run's output (a string or its lines), in order, optionally only those
    of one class (`Step`, `Start`, ...) or one process."""
    lines = output.splitlines() if isinstance(output, str) else output
    found = [parse(line.rstrip("\n")) for line in lines]
    return [
        e
        for e in found
        if e is not None
        and (kind is None or isinstance(e, kind))
        and (process is None or e.process == process)
    ]
