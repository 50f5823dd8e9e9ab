"""What crosses processes on a mesh across hosts, read off a compiled step and held against
the cost model.

`python -m nnxscale crossing`, launched as two processes of four devices, compiles a train
step on a hybrid mesh (`replica` across the processes, the other axes inside each) and
reports, for each kind of collective and the mesh axes it runs over, its bytes per step and
whether its groups cross processes (an `events.Crossing`). `cli.crossing` runs it; `RECORDED`
holds the reports of the rule sets the book shows, recorded by `benchmarks/crossing.py`, so
that chapter 8 can show them without starting processes; `tests/test_multi.py` checks that
a fresh run still reports the same. `compare` holds a report against the cost model: the
collectives that cross processes must be exactly those the model puts on the slow links,
and the bytes of the gradient that cross must be those it prices.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

from nnxscale.core.show import Markdown, table
from nnxscale.costs.counts import Setup, sizes_of
from nnxscale.costs.derive import derive
from nnxscale.costs.hardware import HARDWARE
from nnxscale.costs.network import within
from nnxscale.model.config import TINY
from nnxscale.placement.catalogue import STRATEGIES
from nnxscale.runtime import events

SHOWN = ("HSDP", "HSDP+TP")
"""The rule sets whose reports are recorded: FSDP, and FSDP with TP, inside; DP across."""
RECORDED = "crossing.json"
"""The recorded reports, beside this module: {rule set: the process-0 event's JSON line}."""
BATCH, SEQ = 16, 32
"""The step the `crossing` program compiles: its default batch, and TINY's sequence."""
LOSS_BYTES = 4
"""The float32 loss, all-reduced over every device with the small arrays."""


def recorded(rules: str) -> events.Crossing:
    """The report recorded for rule set `rules` (a two-process run of four devices each)."""
    lines = json.loads(resources.files("nnxscale.costs").joinpath(RECORDED).read_text())
    if rules not in lines:
        raise KeyError(f"no recorded crossing for {rules!r}; recorded: {sorted(lines)}")
    event = events.parse(lines[rules])
    assert isinstance(event, events.Crossing)
    return event


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A compiled step's collectives on a mesh across processes, beside the cost model."""

    rules: str
    mesh: dict[str, int]
    rows: list[tuple[str, tuple[str, ...], int, bool, bool]]
    """(kind, mesh axes, bytes per step, crosses processes, on a slow link in the model)."""
    slow: set[tuple[str, ...]]
    """The axes of the transfers the cost model puts on the slow links."""
    crossed: int
    """The gradient's bytes that cross processes per step, counted in the program."""
    priced: float
    """The bytes the cost model prices for its transfer over `replica`."""

    def show(self) -> Markdown:
        """The collectives as a table: which cross processes, and which the model calls slow."""
        rows = [
            (kind, " and ".join(axes), size, "yes" if crosses else "", "yes" if slow else "")
            for kind, axes, size, crosses, slow in self.rows
        ]
        return table(["collective", "over", "bytes", "crosses processes", "slow link"], rows)

    def check(self) -> None:
        """Raise AssertionError, naming the difference, unless the program and the model agree."""
        differ = [(k, a) for k, a, _, crosses, slow in self.rows if crosses != slow]
        assert not differ, f"{self.rules}: the program and the model disagree on {differ}"
        assert self.slow == {("replica",)}, f"{self.rules}: the model's slow transfers {self.slow}"
        assert self.crossed == self.priced, (
            f"{self.rules}: {self.crossed} bytes cross, the model prices {self.priced:g}"
        )


def compare(rules: str, report: events.Crossing) -> Crossing:
    """Hold `report` against the cost model of rule set `rules`, a fast domain being one
    process's devices. The gradient crosses as a 1/d slice reduced over `replica` (d the
    `data` axis), and, for the small arrays the compiler reduces whole, over both axes."""
    strategy = STRATEGIES[rules]
    domain = dataclasses.replace(HARDWARE["H100"], domain=math.prod(report.inside.values()))
    moved = {(kind, tuple(axes)): (size, crosses) for kind, axes, size, crosses in report.moved}
    rows = [
        (kind, axes, size, crosses, not within(axes, report.mesh, domain))
        for (kind, axes), (size, crosses) in moved.items()
    ]
    transfers = derive(strategy).transfers
    slow = {t.axes for t in transfers if not within(t.axes, report.mesh, domain)}
    d = report.mesh["data"]
    sizes = sizes_of(TINY, Setup.of(strategy, report.mesh), BATCH, SEQ)
    (priced,) = [t.array(sizes) * d for t in transfers if t.axes == ("replica",)]
    across = moved.get(("all-reduce", ("replica",)), (0, True))[0] * d
    whole = moved.get(("all-reduce", ("replica", "data")), (LOSS_BYTES, True))[0] - LOSS_BYTES
    return Crossing(rules, dict(report.mesh), rows, slow, across + whole, priced)
