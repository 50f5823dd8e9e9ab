"""A published training run as the cost model sees it, and the protocol the runs are held to.

A `Run` is a row of data: the model, the devices, the layout and the batch, what its source
measured and where, and the settings the source states (the rest assumed, and said so in
`where`). The protocol: each run is a calibrator or a test, never both. At most one run per
kind of device calibrates that device's `Hardware.efficiency` (`calibrate`: the efficiency at
which the cost model reproduces it exactly), chosen for how completely its source states its
settings, before any test was priced; every other run tests the rest of the model, and the
largest factor by which a test misses (`worst`) is held to `WORST`, apart from runs marked
`misses` with the reason, at most `MISSES` of them (`summary` counts them per device and per
layout). The runs themselves are in `nnxscale.evidence.tpu` and `nnxscale.evidence.gpu`;
`nnxscale.evidence.table` holds them all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

from nnxscale.costs.counts import PLANNING, Precision, Setup, model_flops, step_flops
from nnxscale.costs.hardware import Hardware, hardware
from nnxscale.costs.steps import StepCost, efficiency_where, step_cost
from nnxscale.costs.suitable import unsuitable
from nnxscale.model.config import Config
from nnxscale.placement.catalogue import STRATEGIES

QUANTITIES = (
    "TFLOP/s per device",
    "hardware TFLOP/s per device",
    "tokens/s per device",
    "MFU",
    "step time (s)",
)
"""What a run reports: model FLOPs per device per second as the field counts them
(`nnxscale.costs.model_flops`), the FLOPs the step runs with remat's recompute (Megatron-LM's
96 B s l h^2 in place of 72), tokens per device per second, model FLOPs utilisation, or step
time. A source's own FLOP count, where it differs, is converted to tokens per second with
that count, and `Run.where` says how."""

WORST = 1.5
"""The largest factor by which a test may miss a published number the model can express."""

MISSES = 0.10
"""The largest share of the runs the model may be known to miss (`Run.misses`)."""

GIB = 2**30 / 1e9
"""A datasheet's gigabyte of accelerator memory, in units of 10^9 bytes: the cards count
their memory in GiB (`nnxscale.costs.Hardware.memory` is in 10^9 bytes, which errs low)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One published training run: `batch` sequences of `seq` tokens a step on `mesh` of
    `hardware` under rule set `rules` (None when the library cannot express its layout,
    and `why` says so), and the `published` value of `quantity`, from `source` (a key of
    the bibliography) at `where` in it, with the settings the model prices it at."""

    name: str
    cfg: Config
    hardware: str
    rules: str | None
    mesh: dict[str, int]
    batch: int
    seq: int
    remat: bool | str
    quantity: str
    published: float
    source: str
    where: str
    why: str = ""
    calibrates: bool = False
    misses: str = ""
    """Why the model is known to miss this run by more than `WORST` (it is priced and shown,
    but not held to `WORST`), or ''."""
    slice: int = 0
    """Devices in one slice of a multislice run: its fast domain, beyond which the replicas
    talk over the data-centre network (0: the hardware's own domain)."""
    micro: int = 1
    """Micro-batches a step (a pipeline's, or gradient accumulation's)."""
    schedule: str = "lockstep"
    """A pipeline's schedule (`nnxscale.costs.SCHEDULES`) and its virtual stages."""
    virtual: int = 1
    precision: Precision = PLANNING
    """The bytes per parameter its state holds (unless its source says otherwise, the
    planner's 16: `nnxscale.costs.PLANNING`)."""
    memory: float = 0.0
    """Its devices' memory, where they are not the datasheet's (0: the datasheet's)."""
    reduce_once: bool = False
    """Whether its gradient accumulation reduces once a step (DDP's `no_sync`)."""
    ledger: str = "fused"
    """The memory ledger its trainer keeps (`nnxscale.costs.LEDGERS`)."""
    overlaps: tuple[str, ...] = ()
    """What its framework overlaps beyond one compiled step (`nnxscale.costs.OVERLAPPED`)."""
    flat: bool = False
    """Whether its framework shards its state as flat, padded buffers (`Setup.flat`)."""
    attention: float | None = None
    """The share of peak its attention kernel reaches, where it is not its device's
    (`nnxscale.costs.Hardware.attention`; 0: at the products' efficiency); None: the
    device's."""

    @property
    def devices(self) -> int:
        """How many devices ran it."""
        return math.prod(self.mesh.values())

    @property
    def family(self) -> str:
        """Its layout's family: the rule set's name, or why there is none."""
        return self.rules or "not expressible"

    def device(self, efficiency: float | None = None) -> Hardware:
        """The device it ran on: the datasheet's, with its slice, memory and attention
        kernel where they differ, and `efficiency` where given."""
        hw = hardware(self.hardware)
        changes: dict[str, float] = {}
        if self.slice:
            changes["domain"] = self.slice
        if self.memory:
            changes["memory"] = self.memory
        if efficiency is not None:
            changes["efficiency"] = efficiency
        if self.attention is not None:
            changes["attention"] = self.attention
        return hw.replace(**changes) if changes else hw

    def setup(self) -> Setup:
        """Its layout as the cost model takes it."""
        return Setup.of(
            STRATEGIES[str(self.rules)],
            self.mesh,
            self.micro,
            self.remat,
            self.precision,
            self.schedule,
            self.virtual,
            self.reduce_once,
            self.ledger,
            self.overlaps,
            flat=self.flat,
        )

    def cost(self, efficiency: float | None = None) -> StepCost:
        """The cost model's step for this run (at its device's efficiency, priced once)."""
        if efficiency is None:
            return self._priced
        return step_cost(self.cfg, self.setup(), self.device(efficiency), self.batch, self.seq)

    @functools.cached_property
    def _priced(self) -> StepCost:
        """The step at the device's own efficiency: the tables read it many times."""
        return step_cost(self.cfg, self.setup(), self.device(), self.batch, self.seq)

    def predicted(self, efficiency: float | None = None) -> float | None:
        """The cost model's value of `quantity` (None when it cannot express the run)."""
        if self.rules is None:
            return None
        seconds = self.cost(efficiency).step_time
        if self.quantity == "step time (s)":
            return seconds
        if self.quantity == "tokens/s per device":
            return self.batch * self.seq / self.devices / seconds
        if self.quantity == "hardware TFLOP/s per device":
            recomputed = step_flops(self.cfg, self.batch, self.seq, remat=self.remat)
            return recomputed / self.devices / seconds / 1e12
        flops = model_flops(self.cfg, self.batch, self.seq) / self.devices / seconds
        return (
            flops / 1e12 if self.quantity == "TFLOP/s per device" else flops / self.device().flops
        )

    @property
    def ratio(self) -> float | None:
        """Predicted over published (None when the model cannot express the run)."""
        predicted = self.predicted()
        return None if predicted is None else predicted / self.published

    def problem(self) -> str:
        """Why the layout cannot run this model and batch, or ''."""
        return (
            why if (why := self.why) else unsuitable(self.cfg, self.setup(), self.batch, self.seq)
        )

    @property
    def fits(self) -> bool:
        """Whether the cost model's peak for the run fits its devices' memory, as the card
        counts it (it ran): a datasheet's 80 GB are 80 GiB."""
        return self.cost().peak <= self.device().memory * GIB

    @property
    def role(self) -> str:
        """`calibrates`, `known miss` or `test`."""
        if self.calibrates:
            return "calibrates"
        return "known miss" if self.misses else "test"


def calibrate(run: Run) -> float:
    """The efficiency at which the cost model reproduces `run` exactly."""
    return efficiency_where(
        lambda e: run.predicted(e) > run.published,  # type: ignore[operator]
        rises=run.quantity != "step time (s)",
    )


def fastest_fitting(remats: Sequence[bool | str] = (False, "dots", "full"), **fields) -> Run:
    """The run of `fields` with the least recompute whose peak fits its devices (the first
    of `remats`), for a source that does not say which it ran: a benchmark runs the fastest
    setting that fits. If none fits, the last."""
    for remat in remats:
        run = Run(**{**fields, "remat": remat})
        if not run.problem() and run.fits:
            return run
    return run


COLUMNS = (
    "run",
    "device",
    "layout",
    "quantity",
    "published",
    "model",
    "ratio",
    "role",
    "source",
    "note",
)
"""The columns of `rows`."""


def layout(run: Run) -> str:
    """The run's rule set and mesh in words, as `name on axis size x ...`."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in run.mesh.items())
    return f"{run.family}: {mesh}"


def rows(found: Sequence[Run]) -> list[list[object]]:
    """One row per run (`COLUMNS`): the prediction and its ratio to the published value, or
    the reason the model cannot reproduce it, its role and its source."""
    table = []
    for run in found:
        problem = run.problem()
        predicted = None if problem else run.predicted()
        table.append(
            [
                run.name,
                run.hardware,
                layout(run),
                run.quantity,
                f"{run.published:,.4g}",
                "" if predicted is None else f"{predicted:,.4g}",
                "" if predicted is None else f"{predicted / run.published:.2f}",
                run.role,
                f"{run.source}, {run.where}",
                problem or run.misses,
            ]
        )
    return table


def tests(found: Sequence[Run]) -> list[Run]:
    """The runs held to `WORST`: priced, not calibrating, not known misses."""
    return [r for r in found if not r.problem() and not r.calibrates and not r.misses]


def factor(run: Run) -> float:
    """By how much the model misses `run`, either way."""
    ratio = run.ratio
    return max(ratio, 1 / ratio)  # type: ignore[operator, type-var]


def worst(found: Sequence[Run]) -> tuple[float, Run]:
    """The test the model misses by the largest factor, and that factor."""
    run = max(tests(found), key=factor)
    return factor(run), run


@dataclasses.dataclass(frozen=True)
class Tally:
    """How the model does on one group of runs (a kind of device, or a layout family)."""

    group: str
    runs: int
    calibrators: int
    tests: int
    misses: int
    median: float
    """The median ratio, predicted over published, of the tests (NaN without one)."""
    worst: float
    """The largest factor by which a test misses (NaN without one)."""


def summary(found: Sequence[Run], by: str = "hardware") -> list[Tally]:
    """Per kind of device (`by="hardware"`) or per layout family (`by="family"`): how many
    runs, calibrators, tests and known misses, the tests' median ratio and worst factor."""
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in found:
        groups[str(getattr(run, by))].append(run)
    out = []
    for name, members in groups.items():
        held = tests(members)
        median = statistics.median(r.ratio for r in held) if held else math.nan
        out.append(
            Tally(
                name,
                len(members),
                sum(r.calibrates for r in members),
                len(held),
                sum(bool(r.misses) for r in members),
                median,
                max(map(factor, held)) if held else math.nan,
            )
        )
    return out


def spread(found: Sequence[Run]) -> tuple[float, Run, Run]:
    """The largest factor between the model's ratios to published (`Run.ratio`) of two runs
    of one model on one kind of device, from one source, in two layouts, and the two runs:
    how far apart two plans' predictions may lie before the model's own error stops ranking
    them (`nnxscale.planner.TIE`). Runs across slices or hosts are left out: their decline
    with the count of slices or hosts is a miss of the model's own (chapter 12), not noise
    between layouts."""
    priced = [
        r for r in found if not r.problem() and not r.misses and r.devices <= r.device().domain
    ]
    ratios: dict[int, float] = {id(r): r.ratio for r in priced}  # type: ignore[misc]

    def apart(a: Run, b: Run) -> float:
        low, high = sorted((ratios[id(a)], ratios[id(b)]))
        return high / low

    pairs = [
        (apart(a, b), a, b)
        for i, a in enumerate(priced)
        for b in priced[i + 1 :]
        if (a.hardware, a.source, a.cfg) == (b.hardware, b.source, b.cfg)
        and (a.rules, a.mesh) != (b.rules, b.mesh)
    ]
    if not pairs:
        raise ValueError("no two runs of one model in two layouts to measure the spread on")
    return max(pairs, key=lambda pair: pair[0])
