"""A step on a cluster: the derived formulas evaluated for a model, batch and hardware, the
time each collective takes on its link, what compute hides, and the memory ledger."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from nnxscale.analysis.comm import ring_bytes
from nnxscale.costs.activations import mixture
from nnxscale.costs.arrays import Transfer
from nnxscale.costs.counts import DTYPE_BYTES, STATE_BYTES, Setup, sizes_of
from nnxscale.costs.derive import Costs, derive
from nnxscale.costs.hardware import EFFICIENCY, Hardware, hardware
from nnxscale.model.transformer import Config


@dataclasses.dataclass(frozen=True)
class Collective:
    """A group of collectives of one step, evaluated: bytes sent per device, seconds it takes
    on the link its axes cross, and the seconds left exposed after overlap."""

    transfer: Transfer
    group: int
    array_bytes: float
    sent: float
    seconds: float
    exposed: float


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
    collectives: tuple[Collective, ...]
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
        """What sets the step time: compute, or communication that compute cannot hide."""
        return "compute" if self.exposed <= 0.5 * self.step_time else "communication"


def memory_phases(costs: Costs, sizes: Mapping[str, float], micro: int) -> dict[str, float]:
    """Working memory (beyond the state) at the moments that can be a step's peak: the start
    of the backward pass (every layer's activations and weight copies, the logits' gradient
    and the head's gradients), a layer's backward pass (its gradients made, and with remat
    its activations rebuilt), and the optimizer's update (every gradient, and the update
    beside it). With micro-batches, the running sum of gradients is held throughout. On a
    pipeline, a backward task: the buffers, a stage rebuilt, the stage's gradients."""
    if costs.stage_axis is not None:
        parts = (costs.activations, costs.rebuilt, costs.gradients, costs.weights, costs.head)
        return {"a backward task": sum(f(sizes) for f in parts)}
    accumulate = costs.accumulator(sizes) if micro > 1 else 0.0
    kept = costs.activations(sizes) + costs.weights(sizes) + costs.head_gradients(sizes)
    return {
        "backward starts": kept + costs.head(sizes) + accumulate,
        "a layer's backward": kept
        + costs.rebuilt(sizes)
        + costs.layer_gradients(sizes)
        + accumulate,
        "update": 2 * costs.gradients(sizes) + accumulate,
    }


def link(axes: Iterable[str], mesh: Mapping[str, int], hw: Hardware) -> tuple[float, float]:
    """Bytes per second and seconds per step of a collective over mesh `axes`: the fast
    links if the devices along them lie in one fast domain, else the slow ones. Devices fill
    the mesh with the last axis fastest, so the devices along the axes span the sizes from
    the first of them to the last axis of the mesh."""
    names = list(mesh)
    first = min(names.index(a) for a in axes)
    span = math.prod(mesh[a] for a in names[first:])
    return (hw.fast, hw.hop) if span <= hw.domain else (hw.slow, hw.far_hop)


def collective_seconds(
    kind: str, array: float, n: int, mesh: Mapping[str, int], axes: Iterable[str], hw: Hardware
) -> tuple[float, float]:
    """Bytes one device sends for a collective of `kind` on an array of `array` bytes over `n`
    devices, and its seconds: a latency per ring step plus the bytes over the link. An
    all-to-all's `array` is one device's buffer; on a ring it travels part-way around (the
    scaling book: a quarter of an all-gather of the whole array), through a switch only
    the pieces for others leave."""
    bandwidth, hop = link(axes, mesh, hw)
    ring = bandwidth == hw.fast and hw.ring
    steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)
    if kind == "all-to-all":
        sent = (n - 1) / n * array
        moved = n * array * (n - 1) / n / 4 if ring else sent
    else:
        sent = ring_bytes(kind, array, n)
        moved = sent
    return sent, steps * hop + moved / bandwidth


def _exposed(
    transfer: Transfer, seconds: float, pieces: float, window: Mapping[str, float]
) -> float:
    """Seconds of a group of collectives that compute does not hide: all of it on the
    critical path (`blocking`); otherwise what exceeds the compute it can overlap, plus the
    first piece, which nothing precedes (`OVERLAPS`)."""
    if transfer.overlap == "blocking":
        return seconds
    return max(0.0, seconds - window[transfer.overlap]) + seconds / max(1.0, pieces)


def _collectives(
    costs: Costs,
    sizes: dict[str, int],
    mesh: dict[str, int],
    hw: Hardware,
    window: dict[str, float],
) -> list[Collective]:
    """Each transfer of the step that crosses devices, timed on `hw` and with the part of its
    time that compute in its `window` (the seconds it can overlap) leaves exposed."""
    found = []
    for t in costs.transfers:
        n = math.prod(mesh[a] for a in t.axes)
        if n == 1:
            continue
        array, passes = t.array(sizes), t.passes(sizes)
        sent, seconds = collective_seconds(t.kind, array, n, mesh, t.axes, hw)
        total = passes * seconds
        exposed = _exposed(t, total, t.launches(sizes), window)
        found.append(Collective(t, n, array, passes * sent, total, exposed))
    return found


def step_cost(
    cfg: Config,
    setup: Setup,
    hw: Hardware | str,
    batch: int,
    seq: int | None = None,
    *,
    efficiency: float = EFFICIENCY,
) -> StepCost:
    """Memory per device at the step's peak, FLOPs, collectives and time of one step of
    `batch` sequences of `seq` tokens (default `cfg.max_len`) under `setup` on `hw`.

    Compute runs at `efficiency` of peak matmul FLOP/s, plus the bytes elementwise work and
    the optimizer move through memory at the device's bandwidth. Each collective costs a
    latency per ring step and its bytes over the link its axes cross (`link`); what compute
    can hide it behind depends on the step's dependencies (`OVERLAPS`). A pipeline runs the
    executor's lockstep ticks: each as long as a backward task (a stage rebuilt and
    differentiated, three forward passes' worth), two hand-overs per tick.
    """
    hw = hardware(hw)
    seq = seq or cfg.max_len
    costs = derive(setup.rules, cfg.compute_dtype, setup.remat, mixture(cfg))
    sizes = sizes_of(cfg, setup, batch, seq)
    mesh = setup.sizes
    phases = memory_phases(costs, sizes, setup.micro_batches)
    memory = {name: f(sizes) for name, f in costs.state.items()}
    memory["working memory"] = max(phases.values())
    flops = costs.flops(sizes)
    traffic = (
        2 * costs.activations(sizes)
        + 3 * costs.weights(sizes)
        + 3 * sum(memory[k] for k in costs.state)
    )
    compute = flops / (hw.flops * efficiency) + traffic / hw.hbm
    forward = compute * costs.forward_flops(sizes) / flops
    window = {
        "gather": compute,
        "reduce": compute - forward,
        "update": forward,
        "ring": compute * costs.attention_flops(sizes) / flops,
    }
    found = _collectives(costs, sizes, mesh, hw, window)
    bubble = 0.0
    if costs.stage_axis is not None:
        p, m = mesh[costs.stage_axis], setup.micro_batches
        lockstep = 2 * (m + p - 1) * 0.75 * compute / m
        bubble, compute = 1 - compute / lockstep, lockstep
    step = compute + sum(c.exposed for c in found)
    return StepCost(setup, memory, phases, flops, tuple(found), compute, bubble, step)


LEDGER_PARTS = ("parameters", "gradients", "optimizer state", "activations")
"""The four parts of a device's memory ledger, in the order they are usually drawn."""


def ledger(cfg: Config, setup: Setup, batch: int, seq: int | None = None) -> dict[str, float]:
    """Bytes per device of the four things a training step holds under `setup` (its
    `LEDGER_PARTS`): parameters, gradients, optimizer state, and activations (those the
    backward pass keeps, and those remat rebuilds). Each is held at its own moment of the
    step, so the step's peak (`step_cost(...).peak`) is not their sum."""
    seq = seq or cfg.max_len
    costs = derive(setup.rules, cfg.compute_dtype, setup.remat, mixture(cfg))
    sizes = sizes_of(cfg, setup, batch, seq)
    return {
        "parameters": costs.state["parameters"](sizes),
        "gradients": costs.gradients(sizes),
        "optimizer state": costs.state["optimizer state"](sizes),
        "activations": costs.activations(sizes) + costs.rebuilt(sizes),
    }


def ring_hop_tokens(
    hw: Hardware | str,
    mesh: Mapping[str, int],
    axis: str = "context",
    dtype: str = "bfloat16",
    efficiency: float = EFFICIENCY,
    causal: bool = True,
) -> float:
    """Tokens of a sequence per device above which each ring-attention hop computes longer
    than it takes to send the next block over the link the ring's axis crosses (`link`),
    whatever the model's shape. A chunk of c tokens scores a share p of its c^2 pairs with the
    block in hand (a half under a causal mask, on the zig-zag ring): forward, 4 p c^2 H D
    FLOPs against a K and a V block of c H D values in `dtype`; backward, 10 p c^2 H D FLOPs
    (five products) against K and V again and their float32 gradients. The larger of the
    two thresholds."""
    hw = hardware(hw)
    bandwidth, _ = link([axis], mesh, hw)
    share = 0.5 if causal else 1.0
    width, reach = DTYPE_BYTES[dtype], hw.flops * efficiency / bandwidth
    forward = 2 * width / (4 * share)
    backward = 2 * (width + STATE_BYTES) / (10 * share)
    return max(forward, backward) * reach


def crossover(cfg: Config, setup: Setup, hw: Hardware | str, seq: int | None = None) -> float:
    """Tokens per device below which `setup`'s weight gathers and gradient reductions take
    longer than its compute, so that they cannot hide: they do not grow with the batch,
    compute does. From the same collectives and compute time as `step_cost`, at one sequence
    per data-parallel device."""
    seq = seq or cfg.max_len
    tokens = setup.rules.token_axes(setup.rules.axes)
    rows = math.prod(setup.sizes[a] for a in tokens if a != "context") * setup.micro_batches
    cost = step_cost(cfg, setup, hw, rows, seq)
    weights = sum(
        c.seconds for c in cost.collectives if c.transfer.overlap in ("gather", "reduce", "update")
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
