"""The planner: every way the library can run a model on a cluster, priced and ranked.

For each rule set the model can use, the planner enumerates every factorisation of the
device count into the rule set's mesh axes (tensor parallelism no wider than a fast domain,
such as one host), every number of micro-batches the batch allows (gradient accumulation, or
a pipeline's), and every remat policy; it keeps those whose predicted peak memory, times the
headroom chapter 12 measured, fits the device, and ranks them by predicted step time. It
says why each rule set that has no such option was rejected. A mixture of experts adds the
expert-parallel rule sets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator

from nnxscale.core.show import Markdown, table
from nnxscale.costs.activations import mixture
from nnxscale.costs.counts import (
    LEDGERS,
    PLANNING,
    SCHEDULES,
    Precision,
    Setup,
    check_ledger,
    mixture_problem,
)
from nnxscale.costs.coverage import unpriced
from nnxscale.costs.derive import derive
from nnxscale.costs.hardware import Hardware, hardware, shared
from nnxscale.costs.steps import StepCost, step_cost
from nnxscale.costs.suitable import unsuitable
from nnxscale.model.config import Config
from nnxscale.placement.catalogue import STRATEGIES
from nnxscale.placement.rules import Rules

TOLERANCE = (0.7, 1.3)
"""How far a compiled step's peak memory may lie from the ledger's prediction (compiled /
predicted), over every strategy chapter 12 and the tests compile: below where XLA fuses
elementwise chains and keeps fewer values than autodiff asks for, above where a scanned
loop materialises its stacked activations and working set."""

HEADROOM = TOLERANCE[1]
"""The planner asks that the predicted peak times this fit the device's memory: under the
program ledger, a plan that fits keeps fitting if the compiler holds as much beyond the
ledger as it did here; under the fused ledger, the predicted peak times this covers what 93%
of the Ultra-Scale Playbook grid's fit runs measured (`nnxscale.evidence.grid`)."""

TIE = 1.17
"""Options whose predicted step times lie within this factor of the fastest's are tied: the
time model's ratio to what was published differs by up to this factor between two runs of
one model on one kind of device in two layouts (`nnxscale.evidence.runs.spread`: MaxText's
1024B on one v5p-2048 against one v5p-4096, 1.169), so a smaller gap between two plans is
not evidence that one is faster."""

PLANNED = (
    "DP",
    "ZeRO-2",
    "FSDP",
    "HSDP",
    "TP",
    "FSDP+TP",
    "PP",
    "PP+FSDP",
    "PP+FSDP+TP",
    "CP",
    "FSDP+CP",
)
"""The rule sets the planner considers for a dense model (their names in `STRATEGIES`). Not
ZeRO-1: XLA's partitioner splits a gradient that only the split update reads, so ZeRO-1
compiles to ZeRO-2's program (chapter 12 asserts it). Not PP+FSDP+CP+TP unless asked
(`plan(..., strategies=...)`): the time model prices no overhead per micro-batch beyond each
collective's latency, nor the lower efficiency of small products, so a context ring inside
stages would cut a step into many small micro-batches to shrink the pipeline's bubble
(Llama 3 405B at 8k tokens: CP 4 in 32 stages, 128 micro-batches of 2,048 tokens a device,
1.29 to 1.34 times as fast as Llama 3's layout), which no published run at that length does;
Llama 3 used it at 131k tokens only."""

EXPERT_PLANNED = ("EP", "FSDP+EP", "PP+FSDP+EP")
"""The rule sets the planner adds for a mixture of experts."""


def planned(cfg: Config) -> tuple[str, ...]:
    """The rule sets the planner considers for `cfg`: `PLANNED`, and for a mixture of experts
    those of them the cost model prices for one (no context axes, nor tensor axes for a
    dropless one; pipelines on 1F1B and zero-bubble schedules: a plan that names another
    rule set says why) and `EXPERT_PLANNED` (which a dropless mixture's plan lists as
    rejected, with the reason)."""
    if not cfg.experts:
        return PLANNED
    priced = (n for n in PLANNED if not unpriced(STRATEGIES[n], mixture(cfg), "1F1B"))
    return (*priced, *EXPERT_PLANNED)


SCHEDULED = ("lockstep", "1F1B")
"""The pipeline schedules the planner tries unless asked for more (`plan(schedules=)`): the
book's lockstep executor and 1F1B (interleaved with `VIRTUAL` stages). Not the zero-bubble
schedules: their weight-gradient task costs one forward pass in their bubble's formula,
where the book's executor measures more than two (chapter 7), and only a runtime with one
program per stage (MPMD) runs them; asked for, they are priced and marked as needing it."""

REMATS: tuple[bool | str, ...] = (False, "dots", "full")
"""Remat policies, from the fastest to the leanest."""


VIRTUAL = (1, 2, 4)
"""Virtual stages per device the planner tries on a 1F1B pipeline."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One priced way to run the step, and why it does not fit if it does not."""

    setup: Setup
    cost: StepCost | None
    """None when the setup cannot run this model and batch at all (`reason` says why)."""
    reason: str = ""

    @property
    def fits(self) -> bool:
        """Whether its predicted peak, with the headroom, fits the device."""
        return not self.reason

    @property
    def strategy(self) -> str:
        """The rule set's name."""
        return self.setup.rules.name


def factorisations(devices: int, axes: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `devices` as an ordered product of `axes` positive integers."""
    if axes == 1:
        yield (devices,)
        return
    small = [d for d in range(1, math.isqrt(devices) + 1) if devices % d == 0]
    for first in small + [devices // d for d in reversed(small) if d * d != devices]:
        for rest in factorisations(devices // first, axes - 1):
            yield (first, *rest)


def meshes(rules: Rules, devices: int, domain: int) -> Iterator[dict[str, int]]:
    """The meshes the planner tries for `rules`: the device count factorised into its axes,
    the axes it never uses of size 1, and an axis of tensor parallelism no wider than
    `domain` (the devices one fast link joins, such as a host's). The axes that make the rule
    set what it is are wider than one device, else it is another rule set: those it gives a
    size of their own (TP's `model`, HSDP's `replica`), and the one that takes the remaining
    devices unless it only splits the batch (CP's `context`, PP's `stage`)."""
    used = rules.mesh_axes()
    tensor = {
        a
        for name in ("heads", "mlp", "vocab")
        for c in rules.logical.get(name, ())
        for a in ((c,) if isinstance(c, str) else c)
    }
    tensor -= set(rules.token_axes(rules.axes))
    batch = {a for c in rules.logical.get("batch", ()) for a in ((c,) if isinstance(c, str) else c)}
    defining = {
        a
        for a, size in zip(rules.axes, rules.sizes, strict=True)
        if size > 1 or (size == -1 and a not in batch)
    }
    for shape in factorisations(devices, len(rules.axes)):
        mesh = dict(zip(rules.axes, shape, strict=True))
        if any(mesh[a] > 1 for a in rules.axes if a not in used):
            continue
        if any(mesh[a] > domain for a in tensor) or any(mesh[a] == 1 for a in defining & used):
            continue
        yield mesh


def micro_batches(
    setup_rules: Rules, mesh: dict[str, int], batch: int, stage: str | None
) -> list[int]:
    """Micro-batch counts the batch allows: each device's share cut evenly (a pipeline's:
    at least one per stage, for 1F1B)."""
    split = math.prod(mesh[a] for a in setup_rules.token_axes(setup_rules.axes) if a != "context")
    if batch % split:
        return [1]
    rows = batch // split
    counts = [m for m in (2**i for i in range(rows.bit_length())) if rows % m == 0]
    if stage is not None:
        counts = [m for m in counts if m >= mesh[stage]] or [mesh[stage]]
    return counts


class Plan:
    """Every option the planner priced for one model, cluster and batch: for each rule set
    its fastest option that fits (`ranked`, fastest first) or why none does (`rejected`)."""

    def __init__(
        self,
        cfg: Config,
        devices: int,
        hw: Hardware,
        batch: int,
        seq: int,
        memory: float,
        options: list[Option],
        choices: Choices | None = None,
    ) -> None:
        self.cfg, self.devices, self.hardware = cfg, devices, hw
        self.batch, self.seq, self.memory = batch, seq, memory
        self.options = options
        self.choices = choices or Choices()
        best: dict[str, Option] = {}
        leanest: dict[str, Option] = {}
        first: dict[str, Option] = {}
        seen: dict[tuple[float, ...], str] = {}
        for option in options:
            name = option.strategy
            if option.cost is not None:  # a rule set with an axis of one device can be another
                key = _signature(option.cost)
                if seen.setdefault(key, name) != name:
                    continue
            first.setdefault(name, option)
            if option.fits and (name not in best or _rank(option) < _rank(best[name])):
                best[name] = option
            if option.cost and (name not in leanest or option.cost.peak < leanest[name].cost.peak):
                leanest[name] = option
        self.ranked = sorted(best.values(), key=_rank)
        self.rejected = {
            name: _why(leanest.get(name, option), memory)
            for name, option in first.items()
            if name not in best
        }

    @property
    def best(self) -> Option:
        """The fastest option that fits; an error naming every rule set's reason if none does."""
        if not self.ranked:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.rejected.items())
            nearest = ", ".join(map(str, self.nearest())) or "none within reach"
            raise ValueError(
                f"no plan fits {self.devices} x {self.hardware.name} ({_memory(self)} "
                f"each) for {self.batch} sequences of {self.seq} tokens: {reasons}. Device "
                f"counts near {self.devices} that have a plan for this batch: {nearest}. Or "
                "use devices with more memory, a smaller batch or shorter sequences."
            )
        return self.ranked[0]

    def nearest(self, wanted: int = 3) -> list[int]:
        """Up to `wanted` device counts near this plan's, the closest first (within 8
        either side, then twice and four times as many), for which a plan of the same
        model, batch and memory fits: what to ask for when none does here."""
        near = sorted(
            range(max(1, self.devices - 8), self.devices + 9), key=lambda k: abs(k - self.devices)
        )
        found = []
        farther = [k for k in (2 * self.devices, 4 * self.devices) if k not in near]
        for count in [*near[1:], *farther]:
            other = plan(
                self.cfg,
                count,
                self.hardware,
                global_batch=self.batch,
                seq=self.seq,
                memory_per_device=self.memory,
                precision=self.choices.precision,
                ledger=self.choices.ledger,
                schedules=self.choices.schedules,
            )
            if other.ranked:
                found.append(count)
                if len(found) == wanted:
                    break
        return sorted(found)

    @property
    def tied(self) -> list[Option]:
        """The options whose predicted step lies within `TIE` of the fastest's, the fastest
        first: the time model cannot tell them apart."""
        if not self.ranked:
            return []
        limit = self.ranked[0].cost.step_time * TIE
        return [o for o in self.ranked if o.cost.step_time <= limit]

    def behind(self, option: Option) -> str:
        """Why `option` is slower than the fastest: the seconds of compute (remat,
        micro-batches, a pipeline's idle ticks) and of exposed communication it adds."""
        best, cost = self.best.cost, option.cost
        if cost is None:
            return option.reason
        parts = {
            "compute": cost.compute_time - best.compute_time,
            "exposed communication": cost.exposed - best.exposed,
        }
        added = [f"{k} {v:+.3f} s" for k, v in parts.items() if abs(v) > 1e-3 * best.step_time]
        return f"{cost.step_time / best.step_time:.2f} x the fastest's step: " + (
            ", ".join(added) or "the same times"
        )

    def __getitem__(self, strategy: str) -> Option:
        """The fastest fitting option of a rule set, or its leanest if none fits."""
        fitting = [o for o in self.ranked if o.strategy == strategy]
        if fitting:
            return fitting[0]
        mine = [o for o in self.options if o.strategy == strategy]
        if not mine:
            raise KeyError(f"the plan has no option of rule set {strategy!r}")
        priced = [o for o in mine if o.cost is not None]
        return min(priced, key=lambda o: o.cost.peak) if priced else mine[0]

    def _repr_markdown_(self) -> str:
        rows = []
        tied = {id(o) for o in self.tied}
        for rank, option in enumerate(self.ranked, start=1):
            rows.append([rank, *_columns(option), "fits, tied" if id(option) in tied else "fits"])
        for name, why in self.rejected.items():
            rows.append(["-", name, "-", "-", "-", "-", "-", "-", why])
        headers = [
            "rank",
            "strategy",
            "mesh",
            "micro-batches",
            "remat",
            "peak GB",
            "GB sent",
            "step (s)",
            "verdict",
        ]
        title = (
            f"{self.devices} x {self.hardware.name}, {_memory(self)} each (a plan "
            f"fits if its peak x {HEADROOM} does); {self.batch} sequences of {self.seq} tokens; "
            f"{len(self.options)} options priced by {self.choices.describe()}; tied: within "
            f"{TIE} x the fastest's step"
        )
        return str(table(headers, rows, title))

    def summary(self) -> Markdown:
        """The plan as a Markdown table."""
        return Markdown(self._repr_markdown_())


def _memory(found: Plan) -> str:
    """The memory a plan fits into, in words, naming the runtime's share where it is not all."""
    hw, gb = found.hardware, found.memory / 1e9
    share = shared(hw, found.choices.ledger)
    if share < 1 and found.memory == hw.memory * share:
        whose = "JAX's default" if share == hw.usable else "a tuned trainer's"
        return (
            f"{gb:.0f} GB of arrays: {whose} {share:.0%} of {hw.memory / 1e9:.0f} GB "
            "(XLA_CLIENT_MEM_FRACTION sets JAX's)"
        )
    return f"{gb:.0f} GB"


def _columns(option: Option) -> list[object]:
    c = option.cost
    mesh = " x ".join(f"{a} {s}" for a, s in option.setup.mesh if s > 1) or "one device"
    remat = (
        option.setup.remat
        if isinstance(option.setup.remat, str)
        else ("full" if option.setup.remat else "no")
    )
    return [
        option.strategy,
        mesh,
        option.setup.micro_batches,
        remat,
        f"{c.peak / 1e9:.1f}",
        f"{c.sent / 1e9:.1f}",
        f"{c.step_time:.3f} ({c.bound})",
    ]


def _signature(cost: StepCost) -> tuple[float, ...]:
    """What tells plans apart: equal in all of it, two setups are the same plan."""
    return (*(round(v) for v in cost.memory.values()), round(cost.sent), round(cost.step_time, 12))


def _rank(option: Option) -> tuple[float, float, float]:
    c = option.cost
    return (round(c.step_time, 9), c.sent, c.peak)


def _why(leanest: Option, memory: float) -> str:
    if leanest.cost is None:
        return leanest.reason
    c, s = leanest.cost, leanest.setup
    return (
        f"needs {c.peak / 1e9:.1f} GB per device at its leanest ({s.describe()}), "
        f"{c.peak * HEADROOM / 1e9:.1f} GB with the headroom, of {memory / 1e9:.0f} GB"
    )


@dataclasses.dataclass(frozen=True)
class Choices:
    """What every option of a plan shares: the bytes per parameter its state holds, its
    memory ledger (`nnxscale.costs.LEDGERS`) and the pipeline schedules tried."""

    precision: Precision = PLANNING
    ledger: str = "fused"
    schedules: tuple[str, ...] = SCHEDULED

    def describe(self) -> str:
        """In words, for a plan's title."""
        return f"the {self.ledger} ledger ({LEDGERS[self.ledger].split(':')[0]})"


def _runs(cfg: Config, rules: Rules, choices: Choices) -> tuple[tuple[str, int, bool | str], ...]:
    """The (schedule, virtual stages, remat policy) triples the planner tries for `rules`."""
    if not rules.axes_of("layers"):
        return tuple(("lockstep", 1, remat) for remat in REMATS)
    lockstep = "lockstep" in choices.schedules and choices.ledger == "program"
    lockstep &= not unpriced(rules, int(bool(cfg.experts)))
    found = [("lockstep", 1, False)] if lockstep else []
    if "1F1B" in choices.schedules:
        found += [("1F1B", v, r) for v in VIRTUAL for r in REMATS]
    found += [
        (name, 1, r)
        for name in ("ZB-H1", "ZB-V")
        if name in choices.schedules
        for r in REMATS
        if r != "full"
    ]
    return tuple(found)


def candidates(
    cfg: Config,
    rules: Rules,
    devices: int,
    hw: Hardware,
    batch: int,
    seq: int,
    choices: Choices = Choices(),
) -> Iterator[tuple[Setup, str]]:
    """Every setup of `rules` the planner tries, and why it cannot run if it cannot: a
    pipeline on the book's lockstep executor (the program ledger's; it rebuilds each stage
    itself, and runs no context ring or mixture), on 1F1B with each remat policy and
    `VIRTUAL` stages, and on the zero-bubble schedules asked for, without full remat; with
    micro-batches, gradients reduced once per micro-batch and once a step
    (`Setup.reduce_once`; a pipeline reduces once already)."""
    stage = next(iter(rules.axes_of("layers")), None)
    runs = _runs(cfg, rules, choices)
    for mesh in meshes(rules, devices, hw.domain):
        for m in micro_batches(rules, mesh, batch, stage):
            once = (False, True) if m > 1 and stage is None else (False,)
            for (schedule, virtual, remat), reduce in itertools.product(runs, once):
                setup = Setup.of(
                    rules,
                    mesh,
                    m,
                    remat,
                    choices.precision,
                    schedule,
                    virtual,
                    reduce,
                    choices.ledger,
                )
                yield setup, unsuitable(cfg, setup, batch, seq)


def plan(
    cfg: Config,
    devices: int,
    hw: Hardware | str,
    *,
    global_batch: int,
    seq: int | None = None,
    memory_per_device: float | None = None,
    strategies: Iterable[str] | None = None,
    efficiency: float | None = None,
    precision: Precision = PLANNING,
    ledger: str = "fused",
    schedules: Iterable[str] = SCHEDULED,
) -> Plan:
    """Every option for training `cfg` on `devices` devices of `hw` with batches of
    `global_batch` sequences of `seq` tokens (default `cfg.max_len`), priced and ranked;
    `memory_per_device` defaults to the share of the device's memory its runtime gives
    arrays (`nnxscale.costs.shared`: 90% of a GPU's for a tuned trainer under the fused
    ledger, JAX's default 75% for this library's program), `strategies` to
    `planned(cfg)`, `precision` (the bytes per parameter of the state) to the planner's 16
    (`nnxscale.costs.PLANNING`), `ledger` to the fused kernels a real accelerator's trainer
    runs (`nnxscale.costs.LEDGERS`; "program" prices this library's own), `schedules` to
    `SCHEDULED`."""
    hw = hardware(hw)
    choices = Choices(precision, check_ledger(ledger), _schedules(schedules))
    strategies = planned(cfg) if strategies is None else tuple(strategies)
    seq = cfg.max_len if seq is None else seq
    share = shared(hw, ledger)
    memory = hw.memory * share if memory_per_device is None else memory_per_device
    _check(cfg, devices, global_batch, seq, memory)
    extra = {} if efficiency is None else {"efficiency": efficiency}
    options = []
    found = False
    for name in strategies:
        if name not in STRATEGIES:
            raise ValueError(
                f"no rule set named {name!r}; use names of nnxscale.STRATEGIES: "
                f"{', '.join(STRATEGIES)}"
            )
        found_setups = candidates(cfg, STRATEGIES[name], devices, hw, global_batch, seq, choices)
        for setup, reason in found_setups:
            found = True
            if reason:
                options.append(Option(setup, None, reason))
                continue
            cost = step_cost(cfg, setup, hw, global_batch, seq, **extra)
            fits = cost.peak * HEADROOM <= memory
            options.append(Option(setup, cost, "" if fits else "needs more memory"))
    if not found:
        raise ValueError(
            f"none of the rule sets {list(strategies)} has a mesh of {devices} devices to try"
        )
    return Plan(cfg, devices, hw, global_batch, seq, memory, options, choices)


def _schedules(names: Iterable[str]) -> tuple[str, ...]:
    """`names`, each a schedule (`nnxscale.costs.SCHEDULES`); an error otherwise."""
    found = tuple(names)
    unknown = sorted(set(found) - set(SCHEDULES))
    if unknown:
        raise ValueError(f"schedules {unknown}: use some of {', '.join(SCHEDULES)}")
    return found


MAX_DEVICES = 2**20
"""The most devices `plan` prices: about a million, beyond any cluster built so far."""


def _check(cfg: Config, devices: int, batch: int, seq: int, memory: float) -> None:
    """Refuse input the planner cannot price, naming the problem and the fix (a `Config`
    checks its own sizes when it is made)."""
    for name, value in (("devices", devices), ("global_batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if devices > MAX_DEVICES:
        raise ValueError(
            f"devices={devices:,}: the planner prices meshes of up to {MAX_DEVICES:,} devices, "
            "beyond the largest clusters built; the search over meshes grows with the count."
        )
    problem = mixture_problem(cfg)
    if problem:
        raise ValueError(problem)
    if seq > cfg.max_len:
        raise ValueError(
            f"seq={seq} exceeds the model's max_len ({cfg.max_len}): raise max_len or shorten seq"
        )
    if not 0 < memory < math.inf:
        raise ValueError(
            f"memory_per_device must be positive bytes, got {memory!r}: give the device's "
            "memory, such as 80e9 for an 80 GB H100 (a measured device's is not known)"
        )


def splits_the_sequence(option: Option) -> bool:
    """Whether an option's best setup runs context parallelism: a ring over an axis of more
    than one device that splits every sequence."""
    axis = derive(option.setup.rules, "float32", schedule=option.setup.schedule).ring_axis
    return axis is not None and option.setup.sizes.get(axis, 1) > 1


def context_wins_from(
    cfg: Config, devices: int, hw: Hardware | str, tokens: int, lengths: Iterable[int]
) -> tuple[int | None, dict[int, Plan]]:
    """The first of `lengths` at which the planner's fastest plan splits the sequence
    (context parallelism), for steps of `tokens` tokens (at least one sequence per device),
    or None; and the plan at each length tried."""
    plans = {}
    for length in lengths:
        longer = cfg.replace(max_len=max(cfg.max_len, length))
        batch = max(devices, tokens // length)
        plans[length] = plan(longer, devices, hw, global_batch=batch, seq=length)
        if splits_the_sequence(plans[length].best):
            return length, plans
    return None, plans
