"""A step on a cluster: the derived formulas evaluated for a model, batch and hardware, the
time each collective takes on its link, what compute hides, and the memory ledger."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence

from nnxscale.analysis.comm import ring_bytes
from nnxscale.costs.counts import DTYPE_BYTES, STATE_BYTES, Precision, Setup, sizes_of
from nnxscale.costs.derive import Costs
from nnxscale.costs.formula import Formula
from nnxscale.costs.hardware import Hardware, hardware
from nnxscale.costs.moves import Transfer
from nnxscale.costs.suitable import derive_for
from nnxscale.model.transformer import Config, remat_policy
from nnxscale.parallelism.schedules import (
    bubble_formula,
    zero_bubble_formula,
    zero_bubble_v_formula,
)


@dataclasses.dataclass(frozen=True)
class PricedCollective:
    """A group of collectives of one step, evaluated: bytes sent per device, seconds it takes
    on the link its axes cross, and its share of the seconds compute leaves exposed in its
    lane (`lanes`)."""

    transfer: Transfer
    group: int
    array_bytes: float
    sent: float
    seconds: float
    exposed: float
    link: str
    """The link it crosses: `fast` inside a fast domain, `slow` across domains."""
    lane: str
    """The links it shares with other collectives (`lanes`): what adds up before compute
    hides any of it."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the cost model predicts for one training step on one device."""

    setup: Setup
    memory: dict[str, float]
    """Bytes per device at the step's peak, by part: parameters and optimizer state (the
    state, at rest between steps), and the working memory of the step's busiest moment."""
    phases: dict[str, float]
    """Working memory at each candidate for the peak (the peak is the largest)."""
    flops: float
    collectives: tuple[PricedCollective, ...]
    compute_time: float
    bubble: float
    step_time: float

    @property
    def peak(self) -> float:
        """Bytes per device at the step's peak: the state plus the working memory."""
        return sum(self.memory.values())

    @property
    def state(self) -> float:
        """Bytes per device of parameters and optimizer state (what is held between steps)."""
        return self.memory["parameters"] + self.memory["optimizer state"]

    @property
    def sent(self) -> float:
        """Bytes each device sends per step."""
        return sum(c.sent for c in self.collectives)

    @property
    def comm_time(self) -> float:
        """Seconds of the step's collectives, hidden or not."""
        return sum(c.seconds for c in self.collectives)

    @property
    def exposed(self) -> float:
        """Seconds of collectives that compute does not hide."""
        return sum(c.exposed for c in self.collectives)

    @property
    def bound(self) -> str:
        """What sets the step time: compute, or communication, when a lane (`lanes`) is busy
        longer than the step computes, so that compute cannot hide its collectives (`crossover`)."""
        busiest = max(
            (
                sum(c.seconds for c in self.collectives if c.lane == lane)
                for lane in {c.lane for c in self.collectives}
            ),
            default=0.0,
        )
        return "communication" if busiest > self.compute_time else "compute"


def memory_phases(
    costs: Costs, sizes: Mapping[str, float], micro: int, gradients: float = 1.0
) -> dict[str, float]:
    """Working memory (beyond the state) at the moments that can be a step's peak: the start
    of the backward pass (every layer's activations and weight copies, the logits' gradient
    and the head's gradients), a layer's backward pass (its gradients made, and with remat
    its activations rebuilt), and the optimizer's update (every gradient, and the update
    beside it). With micro-batches, the running sum of gradients is held throughout. On the
    lockstep pipeline, a backward task: the buffers, a stage rebuilt, the stage's gradients;
    on a pipeline of one program per stage, the first stage's backward starting holds its
    micro-batches in flight and the last stage's its one micro-batch and the loss. A
    framework that updates in place (`Costs.in_place`) holds its gradient buffer alone at
    the update. Every gradient is scaled by `gradients`, its bytes over float32's
    (`Precision.gradients`)."""
    if costs.stage_axis is not None and costs.schedule == "lockstep":
        parts = (costs.activations, costs.rebuilt, costs.weights, costs.head)
        return {
            "a backward task": sum(f(sizes) for f in parts) + gradients * costs.gradients(sizes)
        }
    accumulate = gradients * costs.accumulator(sizes) if micro > 1 else 0.0
    weights = costs.weights(sizes) + accumulate
    kept = costs.activations(sizes) + weights + gradients * costs.head_gradients(sizes)
    found = {
        "backward starts": kept + costs.head(sizes),
        "a layer's backward": kept
        + costs.rebuilt(sizes)
        + gradients * costs.layer_gradients(sizes),
        "update": gradients * costs.gradients(sizes)
        if costs.in_place
        else 2 * gradients * costs.gradients(sizes) + accumulate,
    }
    if costs.stage_axis is not None:  # one program per stage: its first and its last
        last = costs.last_stage(sizes) + costs.head(sizes) + gradients * costs.head_gradients(sizes)
        found = {
            "the first stage's backward starts": costs.activations(sizes) + weights,
            "the last stage's backward starts": last + weights,
            "a layer's backward": found["a layer's backward"],
            "update": found["update"],
        }
    return found


def state_bytes(costs: Costs, sizes: Mapping[str, float], precision: Precision) -> dict[str, float]:
    """Bytes per device of the parameters and the optimizer state (master copy, moments,
    EMA) under `precision`: the derived state is the book's (float32 parameters, three
    float32 copies beside them), scaled to the bytes per parameter chosen."""
    book = Precision()
    return {
        "parameters": costs.state["parameters"](sizes) * precision.parameters / book.parameters,
        "optimizer state": costs.state["optimizer state"](sizes)
        * precision.optimizer
        / book.optimizer,
    }


def within(axes: Iterable[str], mesh: Mapping[str, int], hw: Hardware) -> bool:
    """Whether the devices along mesh `axes` lie in one fast domain. Devices fill the mesh
    with the last axis fastest, so the devices along the axes span the sizes from the first
    of them to the last axis of the mesh."""
    return _span(tuple(axes), tuple(mesh.items())) <= hw.domain


@functools.cache
def _span(axes: tuple[str, ...], mesh: tuple[tuple[str, int], ...]) -> int:
    """How many consecutive devices the devices along `axes` span (`within`): worked out
    once per mesh and axes, as the planner asks it of every collective of every setup."""
    names = [a for a, _ in mesh]
    first = min(names.index(a) for a in axes)
    return math.prod(size for _, size in mesh[first:])


def members(axes: Iterable[str], mesh: Mapping[str, int], hw: Hardware) -> int:
    """How many devices of one group along mesh `axes` lie in one fast domain: the domain
    holds `hw.domain` consecutive devices of the mesh (last axis fastest), and along each
    axis as many of the group's positions as fit in it."""
    names, found = list(mesh), 1
    for a in axes:
        stride = math.prod(mesh[b] for b in names[names.index(a) + 1 :])
        found *= min(mesh[a], max(1, hw.domain // stride))
    return found


def link(
    axes: Iterable[str], mesh: Mapping[str, int], hw: Hardware, rails: bool = True
) -> tuple[float, float]:
    """Bytes per second and seconds per step of a collective over mesh `axes`: the fast
    links if the devices along them lie in one fast domain (`within`), else the slow ones.
    Across domains, a group with k devices in each domain sends on k adapters at once (a
    ring per adapter, NCCL's rails), so its bandwidth is k slow links', up to the fast one;
    not a permute (`rails=False`), whose block crosses on its sender's one adapter. On a TPU
    torus, a ring whose length the wraparound (`Hardware.wrap`) does not divide is a line:
    its collectives get half the bandwidth."""
    axes = list(axes)
    if not within(axes, mesh, hw):
        spread = members(axes, mesh, hw) if rails else 1
        return min(hw.fast, spread * hw.slow), hw.far_hop
    n = math.prod(mesh[a] for a in axes)
    line = hw.wrap > 0 and n % hw.wrap != 0
    return (hw.fast / 2 if line else hw.fast), hw.hop


def collective_seconds(
    kind: str, array: float, n: int, mesh: Mapping[str, int], axes: Iterable[str], hw: Hardware
) -> tuple[float, float]:
    """Bytes one device sends for a collective of `kind` on an array of `array` bytes over `n`
    devices, and its seconds: a latency per ring step plus the bytes over the link. An
    all-to-all's `array` is one device's buffer; on a ring it travels part-way around (the
    scaling book: a quarter of an all-gather of the whole array), through a switch only
    the pieces for others leave."""
    axes = list(axes)
    bandwidth, hop = link(axes, mesh, hw, rails=kind != "collective-permute")
    ring = hw.ring and within(axes, mesh, hw)
    steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)
    if kind == "all-to-all":
        sent = (n - 1) / n * array
        moved = n * array * (n - 1) / n / 4 if ring else sent
    else:
        sent = ring_bytes(kind, array, n)
        moved = sent
    return sent, steps * hop + moved / bandwidth


HIDDEN = ("gather", "reduce", "ring")
"""The classes of `OVERLAPS` that compute can hide; the others wait on the critical path."""


def hide(
    seconds: list[float], overlap: list[str], pieces: list[float], window: Mapping[str, float]
) -> float:
    """Seconds that compute leaves exposed of the collectives of one lane (`lanes`) that it
    can hide (`seconds`, each of a class in `HIDDEN`, launched in `pieces`). They share the
    lane's links and their bandwidth, so they add up before anything hides: together they
    must fit in the whole step's compute, the reductions in the backward pass, the ring's
    hops in the attention (`window`). What does not fit is exposed, and so is each group's
    first piece, which nothing precedes."""
    total = sum(seconds)
    if not total:
        return 0.0
    excess = max(
        0.0,
        total - window["gather"],
        *(
            sum(s for s, o in zip(seconds, overlap, strict=True) if o == k) - window[k]
            for k in ("reduce", "ring")
        ),
    )
    first = sum(s / max(1.0, p) for s, p in zip(seconds, pieces, strict=True))
    return min(total, excess + first)


def lanes(
    collectives: Sequence[tuple[Sequence[str], str]], torus: bool, dimensions: int = 0
) -> list[str]:
    """The lane each collective (its mesh axes, and its link: `fast` or `slow`) travels in:
    the collectives of one lane share links, so their seconds add up before compute hides
    any of them (`hide`). The slow links are one lane (a host's network adapters), and so
    are a switch's fast links (NVLink). On a torus, each mesh axis is taken to lie along
    torus dimensions of its own, with links no other axis uses, so collectives over
    disjoint axes run side by side and those that share an axis, directly or through a
    third, share a lane; more groups of axes than the torus has `dimensions` cannot each
    have their own, and share one lane."""
    groups: list[set[str]] = []
    for axes, where in collectives:
        if torus and where == "fast":
            joined = set(axes).union(*(g for g in groups if g & set(axes)))
            groups = [g for g in groups if not g & joined] + [joined]
    crowded = 0 < dimensions < len(groups)

    def lane(axes: Sequence[str], where: str) -> str:
        if not (torus and where == "fast") or crowded:
            return where
        (group,) = [g for g in groups if g & set(axes)]
        return "fast: " + " x ".join(sorted(group))

    return [lane(axes, where) for axes, where in collectives]


def overlapped(transfer: Transfer, overlaps: Iterable[str]) -> Transfer:
    """`transfer` as a framework that overlaps `overlaps` (`nnxscale.costs.OVERLAPPED`) runs
    it: tensor parallelism's all-reduces behind their products (a collective matmul), ZeRO's
    gather of updated parameters behind the next forward pass; both then hide behind the
    step's compute as FSDP's gathers do."""
    tensor = transfer.kind == "all-reduce" and transfer.overlap == "blocking"
    if (tensor and "collective matmul" in overlaps) or (
        transfer.overlap == "update" and "parameter prefetch" in overlaps
    ):
        return dataclasses.replace(transfer, overlap="gather")
    return transfer


def _collectives(
    costs: Costs,
    sizes: dict[str, int],
    mesh: dict[str, int],
    hw: Hardware,
    window: dict[str, float],
    setup: Setup,
) -> list[PricedCollective]:
    """Each transfer of the step that crosses devices, timed on `hw`, exposed whole if compute
    cannot hide it, else with its share of what compute leaves exposed in its lane (`hide`,
    per lane: `lanes`, which run side by side); what the framework overlaps
    (`Setup.overlaps`) hides as `overlapped` says, and the gradients and updated parameters
    move at the width `Setup.precision` stores them in."""
    timed = []
    widths = {
        "gradients": setup.precision.gradients / STATE_BYTES,
        "updated parameters": setup.precision.parameters / STATE_BYTES,
    }
    for t in (overlapped(t, setup.overlaps) for t in costs.transfers):
        n = math.prod(mesh[a] for a in t.axes)
        if n == 1:
            continue
        array, passes = t.array(sizes) * widths.get(t.what, 1.0), t.passes(sizes)
        sent, seconds = collective_seconds(t.kind, array, n, mesh, t.axes, hw)
        if t.overlap not in HIDDEN:  # each waits for every device of its group
            seconds += hw.sync
        where = "fast" if within(t.axes, mesh, hw) else "slow"
        timed.append((t, n, array, passes * sent, passes * seconds, where, t.launches(sizes)))
    found = lanes([(row[0].axes, row[5]) for row in timed], hw.ring, hw.dimensions)
    share = {}
    for lane in set(found):
        group = [
            row
            for row, x in zip(timed, found, strict=True)
            if x == lane and row[0].overlap in HIDDEN
        ]
        seconds = [row[4] for row in group]
        overlap = [row[0].overlap for row in group]
        exposed = hide(seconds, overlap, [row[6] for row in group], window)
        share[lane] = exposed / (sum(seconds) or 1.0)
    return [
        PricedCollective(
            t, n, array, sent, s, s * share[lane] if t.overlap in HIDDEN else s, where, lane
        )
        for (t, n, array, sent, s, where, _), lane in zip(timed, found, strict=True)
    ]


def _sizes_checked(cfg: Config, batch: int, seq: int | None) -> int:
    """The sequence length (default `cfg.max_len`), once `batch` and it are positive whole
    numbers: a negative batch priced negative activations."""
    seq = cfg.max_len if seq is None else seq
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r}: a step's {name} must be a positive integer")
    return int(seq)


def step_cost(
    cfg: Config,
    setup: Setup,
    hw: Hardware | str,
    batch: int,
    seq: int | None = None,
    *,
    efficiency: float | None = None,
) -> StepCost:
    """Memory per device at the step's peak, FLOPs, collectives and time of one step of
    `batch` sequences of `seq` tokens (default `cfg.max_len`) under `setup` on `hw`.

    Compute runs at `efficiency` (default `Hardware.efficiency`: fitted to a published run,
    or a published HFU) of peak matmul FLOP/s, flash attention at `Hardware.attention`,
    plus the bytes elementwise work and the optimizer move through memory at the device's
    bandwidth, and no faster than the host launches the layers (`compute_seconds`). Each
    collective costs a latency per ring step and its bytes over the link its axes cross
    (`link`), and one that blocks the step `Hardware.sync` more; what compute can hide it
    behind depends on the step's dependencies (`OVERLAPS`) and what the framework overlaps
    (`Setup.overlaps`), and collectives in one lane add up before they hide (`lanes`,
    `hide`). A pipeline's compute is stretched by its schedule's bubble (`pipeline_bubble`).
    Memory is `Setup.ledger`'s (`nnxscale.costs.LEDGERS`).
    """
    hw = hardware(hw)
    seq = _sizes_checked(cfg, batch, seq)
    efficiency = hw.efficiency if efficiency is None else efficiency
    if not 0 < efficiency <= 1:
        raise ValueError(
            f"efficiency={efficiency!r}: the fraction of peak FLOP/s a step reaches lies in "
            f"(0, 1]; leave it out for {hw.name}'s ({hw.efficiency:.0%}, "
            f"{hw.efficiency_source})"
        )
    costs = derive_for(cfg, setup)
    sizes = sizes_of(cfg, setup, batch, seq)
    mesh = setup.sizes
    precision = setup.precision
    phases = memory_phases(costs, sizes, setup.micro_batches, precision.gradients / STATE_BYTES)
    memory = state_bytes(costs, sizes, precision)
    memory["working memory"] = max(phases.values())
    flops = costs.flops(sizes)
    state = sum(memory[k] for k in costs.state)
    compute = compute_seconds(costs, setup, sizes, hw, state, efficiency)
    forward = compute * costs.forward_flops(sizes) / flops
    once = costs.stage_axis is not None or setup.reduce_once  # after the last micro-batch
    window = {
        "gather": compute,
        "reduce": (compute - forward) / (setup.micro_batches if once else 1),
        "ring": compute * costs.attention_flops(sizes) / flops,
    }
    found = _collectives(costs, sizes, mesh, hw, window, setup)
    bubble = 0.0
    if costs.stage_axis is not None:
        bubble = pipeline_bubble(
            setup.schedule, mesh[costs.stage_axis], setup.micro_batches, setup.virtual
        )
        compute = compute / (1 - bubble)
    step = compute + sum(c.exposed for c in found)
    return StepCost(setup, memory, phases, flops, tuple(found), compute, bubble, step)


def compute_seconds(
    costs: Costs,
    setup: Setup,
    sizes: Mapping[str, float],
    hw: Hardware,
    state: float,
    efficiency: float | None = None,
) -> float:
    """Seconds a device computes in a step, before a pipeline's bubble: its products at
    `efficiency` of peak (default `hw.efficiency`), flash attention's at `hw.attention`
    (where known), and the bytes its elementwise work and optimizer move through memory (the
    kept activations twice, the weights and the `state` three times); no faster than its
    host launches its layers (`launched`)."""
    efficiency = hw.efficiency if efficiency is None else efficiency
    flops = costs.flops(sizes)
    traffic = 2 * costs.activations(sizes) + 3 * costs.weights(sizes) + 3 * state
    attention = costs.attention_flops(sizes) if hw.attention else 0.0
    products = (flops - attention) / (hw.flops * efficiency)
    compute = products + attention / (hw.flops * (hw.attention or 1)) + traffic / hw.hbm
    return max(compute, hw.launch * launched(costs, setup, sizes))


def launched(costs: Costs, setup: Setup, sizes: Mapping[str, float]) -> float:
    """How many layers' forward and backward passes a device's host launches in a step: its
    layers (a stage's, in a pipeline) for each micro-batch, half as many again when full
    remat runs each forward twice. At `Hardware.launch` seconds each, the step computes no
    faster than its host launches."""
    stages = sizes[costs.stage_axis] if costs.stage_axis is not None else 1
    again = 1.5 if remat_policy(setup.remat) == "full" else 1.0
    return sizes["layers"] / stages * setup.micro_batches * again


def efficiency_where(above: Callable[[float], bool], rises: bool) -> float:
    """The efficiency in (0, 1] at which a prediction meets its target, by bisection: `above`
    says whether the prediction at an efficiency exceeds the target, and `rises` whether the
    prediction grows with the efficiency (a rate) or falls (a time)."""
    low, high = 1e-3, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if above(middle) == rises:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def fitted_efficiency(
    seconds: float, cfg: Config, setup: Setup, hw: Hardware, batch: int, seq: int | None = None
) -> float:
    """The efficiency at which `step_cost` takes the `seconds` a step was measured to take:
    one measured step calibrates a device, as one published run calibrates a datasheet's
    (`nnxscale.evidence.runs.calibrate`). A step faster than the model at peak is refused,
    and so is one its host's launches bind (`launched`): no efficiency changes its time."""
    fastest = step_cost(cfg, setup, hw, batch, seq, efficiency=1.0)
    if fastest.step_time > seconds:
        raise ValueError(
            f"a step of {seconds:.3g} s is faster than the time model at {hw.name}'s peak: "
            "measure the peak on the device that ran the step (`nnxscale.machine.Probe`)"
        )
    fitted = efficiency_where(
        lambda e: step_cost(cfg, setup, hw, batch, seq, efficiency=e).step_time > seconds,
        rises=False,
    )
    if step_cost(cfg, setup, hw, batch, seq, efficiency=fitted).step_time == fastest.step_time:
        raise ValueError(
            f"a step of {seconds:.3g} s is as long as {hw.name}'s host takes to launch its "
            f"layers ({fastest.compute_time:.3g} s, `launched`) at any efficiency above "
            f"{fitted:.2g}: it does not measure the efficiency; time a larger batch"
        )
    return fitted


def pipeline_bubble(schedule: str, stages: int, micro: int, virtual: int = 1) -> float:
    """The share of a pipelined step its devices wait. The book's lockstep executor runs
    2 (m + p - 1) ticks, each as long as a backward task (a stage rebuilt and differentiated,
    three forward passes' worth, where m micro-batches' work is four): 1 - m / (1.5 (m + p - 1)).
    1F1B with v virtual stages idles p - 1 of every v m + p - 1 chunks' time (Narayanan et
    al. 2021: `nnxscale.schedules.bubble_formula`). ZB-H1 idles (p - 1) / (3m + p - 1) and
    ZB-V (p - 1) / (6m + p - 1), F, B and W each a forward pass's worth (Qi et al. 2024:
    `zero_bubble_formula`, `zero_bubble_v_formula`)."""
    if schedule == "lockstep":
        return 1 - micro / (1.5 * (micro + stages - 1))
    if schedule == "ZB-H1":
        return zero_bubble_formula(stages, micro)
    if schedule == "ZB-V":
        return zero_bubble_v_formula(stages, micro)
    return bubble_formula(stages, micro, virtual)


LEDGER_PARTS = ("parameters", "gradients", "optimizer state", "activations")
"""The four parts of a device's memory ledger, in the order they are usually drawn."""


def ledger(cfg: Config, setup: Setup, batch: int, seq: int | None = None) -> dict[str, float]:
    """Bytes per device of the four things a training step holds under `setup` (its
    `LEDGER_PARTS`): parameters, gradients, optimizer state, and activations (those the
    backward pass keeps, and those remat rebuilds). Each is held at its own moment of the
    step, so the step's peak (`step_cost(...).peak`) is not their sum."""
    seq = _sizes_checked(cfg, batch, seq)
    costs = derive_for(cfg, setup)
    sizes = sizes_of(cfg, setup, batch, seq)
    state = state_bytes(costs, sizes, setup.precision)
    return {
        "parameters": state["parameters"],
        "gradients": costs.gradients(sizes) * setup.precision.gradients / STATE_BYTES,
        "optimizer state": state["optimizer state"],
        "activations": costs.activations(sizes) + costs.rebuilt(sizes),
    }


def ledger_terms(cfg: Config, setup: Setup, batch: int, seq: int | None = None) -> dict[str, float]:
    """The ledger's activations term by term, as the field reports activation memory: what
    the layers keep (with full remat each layer's input, Korthikanti et al.'s 2 s b h L in
    16 bits), what is kept outside them (the embedding's output, the last norm), the logits
    (float32, for the loss), and one layer rebuilt while its backward pass runs. Together
    they are `ledger(...)["activations"]`."""
    seq = _sizes_checked(cfg, batch, seq)
    costs = derive_for(cfg, setup)
    sizes = sizes_of(cfg, setup, batch, seq)
    parts = {"the layers' kept values": 0.0, "outside the layers": 0.0, "logits": 0.0}
    for powers, coefficient in costs.activations.terms.items():
        names = dict(powers)
        part = "outside the layers"
        if "vocab" in names:
            part = "logits"
        elif "layers" in names:
            part = "the layers' kept values"
        parts[part] += Formula({powers: coefficient})(sizes)
    parts["one layer rebuilt"] = costs.rebuilt(sizes)
    return parts


def ring_hop_tokens(
    hw: Hardware | str,
    mesh: Mapping[str, int],
    axis: str = "context",
    dtype: str = "bfloat16",
    efficiency: float | None = None,
    causal: bool = True,
    groups: int = 1,
) -> float:
    """Tokens of a sequence per device above which each ring-attention hop computes longer
    than it takes to send the next block over the link the ring's axis crosses (`link`; a
    permute, on one adapter). A chunk of c tokens scores a share p of its c^2 pairs with
    the block in hand (a half under a causal mask, on the zig-zag ring): forward,
    4 p c^2 H D FLOPs against a K and a V block of c K D values in `dtype`, K = H / `groups`
    key/value heads (grouped-query attention sends `groups` times less); backward,
    10 p c^2 H D FLOPs (five products) against K and V again and their float32 gradients.
    The larger of the two thresholds. `efficiency` defaults to the hardware's attention
    kernel's (`Hardware.attention`), else its products'."""
    hw = hardware(hw)
    efficiency = (hw.attention or hw.efficiency) if efficiency is None else efficiency
    bandwidth, _ = link([axis], mesh, hw, rails=False)
    share = 0.5 if causal else 1.0
    width, reach = DTYPE_BYTES[dtype], hw.flops * efficiency / bandwidth
    forward = 2 * width / (4 * share)
    backward = 2 * (width + STATE_BYTES) / (10 * share)
    return max(forward, backward) * reach / groups


def crossover(cfg: Config, setup: Setup, hw: Hardware | str, seq: int | None = None) -> float:
    """Tokens per device below which `setup`'s weight gathers and gradient reductions in its
    busiest lane take longer than its compute, so that they cannot hide: they do not grow
    with the batch, compute does. From the same collectives and compute time as
    `step_cost`, at one sequence per data-parallel device."""
    seq = seq or cfg.max_len
    tokens = setup.rules.token_axes(setup.rules.axes)
    rows = math.prod(setup.sizes[a] for a in tokens if a != "context") * setup.micro_batches
    cost = step_cost(cfg, setup, hw, rows, seq)
    weights = max(
        (
            sum(
                c.seconds
                for c in cost.collectives
                if c.lane == lane and c.transfer.overlap in ("gather", "reduce")
            )
            for lane in {c.lane for c in cost.collectives}
        ),
        default=0.0,
    )
    per_device = (
        seq / math.prod(setup.sizes[a] for a in tokens if a == "context")
        if "context" in tokens
        else seq
    )
    return per_device * weights / cost.compute_time


TIME_BAND = (0.5, 2.0)
"""How far the time model's prediction of a one-device step may lie from the measured time
(predicted / measured) on this book's CPU, where `benchmarks/time_model.py` checks it."""
