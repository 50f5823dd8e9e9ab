"""A step on a cluster: the derived formulas evaluated for a model, batch and hardware, the
time each collective takes on its link, what compute hides, and the memory ledger."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping

from nnxscale.costs.counts import DTYPE_BYTES, STATE_BYTES, Precision, Setup, sizes_of
from nnxscale.costs.derive import Costs
from nnxscale.costs.formula import Formula
from nnxscale.costs.hardware import Hardware, hardware
from nnxscale.costs.network import PricedCollective, link, priced_collectives
from nnxscale.costs.suitable import derive_for
from nnxscale.model.config import Config, remat_policy
from nnxscale.parallelism.schedules import (
    bubble_formula,
    zero_bubble_formula,
    zero_bubble_v_formula,
)


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
    found = priced_collectives(costs, sizes, mesh, hw, window, setup)
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
