"""A step's collectives on a cluster's links: which link the devices along some mesh axes
cross (a fast domain's, or the slow network's, on rails), the seconds a collective takes
there, the lanes of links that collectives share, and how much of each lane's time the
step's compute hides (`priced_collectives`, which `nnxscale.costs.step_cost` calls with
the formulas of `nnxscale.costs.derive` evaluated)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

from nnxscale.analysis.comm import ring_bytes
from nnxscale.costs.counts import STATE_BYTES, Setup
from nnxscale.costs.derive import Costs
from nnxscale.costs.hardware import Hardware
from nnxscale.costs.moves import Transfer


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


def priced_collectives(
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
