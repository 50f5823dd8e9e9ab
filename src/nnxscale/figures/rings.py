"""Rings and exchanges drawn: ring attention's blocks, expert dispatch, the links of a
topology and which of them each mesh axis crosses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from nnxscale.costs.crossing import Crossing
from nnxscale.figures.drawing import box, device_colour, frameless
from nnxscale.model.context import Ring
from nnxscale.model.moe import Routing
from nnxscale.runtime.events import Start

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_topology(starts: Sequence[Start]) -> Figure:
    """Processes, their devices and the global mesh, from each worker's `Start` event: a box
    per process holding its devices, each labelled with its id and mesh position."""
    import matplotlib.pyplot as plt

    starts = sorted(starts, key=lambda e: e.process)
    axes_names = starts[0].mesh_axes
    grid = np.array(starts[0].mesh_device_ids)
    position = {int(d): idx for idx, d in np.ndenumerate(grid)}
    per_process = max(len(e.device_ids) for e in starts)
    fig, ax = plt.subplots(figsize=(1.3 * per_process * len(starts) + 1.2, 2.4))
    x = 0.0
    for event in starts:
        width = 1.2 * len(event.device_ids) + 0.4
        ax.add_patch(plt.Rectangle((x, 0), width, 2.2, facecolor="0.93", edgecolor="black"))
        rows = event.rows
        ax.text(x + width / 2, 1.95, f"process {event.process}", ha="center", fontsize=10)
        if rows:
            ax.text(
                x + width / 2,
                0.15,
                f"loads batch rows {rows[0]}-{rows[1] - 1}",
                ha="center",
                fontsize=8,
            )
        for k, device in enumerate(event.device_ids):
            where = ", ".join(
                f"{a}={i}" for a, i in zip(axes_names, position[int(device)], strict=True)
            )
            colour = device_colour(int(device), grid.size)
            label = f"device {device}\n{where}"
            box(ax, x + 0.3 + 1.2 * k, 0.55, 1.0, 1.1, colour, label, 7, "black")
        x += width + 0.3
    ax.set_xlim(-0.1, x)
    ax.set_ylim(2.3, -0.1)
    ax.invert_yaxis()
    ax.axis("off")
    shape = dict(zip(axes_names, grid.shape, strict=True))
    ax.set_title(
        f"{len(starts)} processes on one host, one mesh {shape} over all their devices",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_ring(ring: Ring) -> Figure:
    """Ring attention step by step, from the ring's own hop (`Ring.permutation`): each
    device's query chunks (left) stay put while the K/V shards move one hop per step
    (arrows); a cell is coloured by the device that owns the K/V shard held there, and its
    small grid marks the (query chunk, key chunk) pairs a causal mask needs (filled) or lets
    the device skip (empty)."""
    import matplotlib.pyplot as plt

    n = ring.devices
    chunks = np.array(ring.chunks()).reshape(n, -1)
    per = chunks.shape[1]
    width, gap = 1.0, 0.6
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * n, 0.9 + 0.9 * n))

    def column(step: int) -> float:
        return 1.6 + step * (width + gap)

    for device in range(n):
        label = "Q " + ",".join(map(str, chunks[device]))
        box(ax, 0, device + 0.15, 1.2, 0.7, device_colour(device, n), label, 8, "black")
    side = 0.5 / per
    for step in range(n):
        x = column(step)
        for device, owner in enumerate(ring.holding(step)):
            colour = device_colour(owner, n)
            held = "K/V " + ",".join(map(str, chunks[owner]))
            ax.text(x + width / 2, device + 0.22, held, ha="center", va="center", fontsize=7)
            for row, query in enumerate(chunks[device]):
                for col, key in enumerate(chunks[owner]):
                    face = colour if query >= key else "white"
                    left, top = x + width / 2 - per * side / 2 + col * side, device + 0.4
                    box(ax, left, top + row * side, side, side, face, edgecolor=colour)
        if step < n - 1:
            for source, destination in ring.permutation():
                ax.annotate(
                    "",
                    xy=(column(step + 1) - 0.05, destination + 0.6),
                    xytext=(x + width + 0.05, source + 0.6),
                    arrowprops={"arrowstyle": "->", "color": "0.45", "lw": 0.8},
                )
    ax.set_xlim(-0.1, column(n) - gap + 0.1)
    ax.set_ylim(n, 0)
    ax.set_xticks([0.6] + [column(t) + width / 2 for t in range(n)])
    ax.set_xticklabels(["queries\n(stay)"] + [f"step {t}" for t in range(n)], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([d + 0.5 for d in range(n)], [f"device {d}" for d in range(n)], fontsize=8)
    frameless(ax)
    ax.set_title(
        f"Ring attention on {n} devices ({ring.layout} chunks): queries stay, K/V shards hop\n"
        "filled squares: the (query chunk, key chunk) pairs a causal mask needs",
        fontsize=9,
        loc="left",
    )
    fig.tight_layout()
    return fig


def plot_dispatch(routing: Routing, devices: int) -> Figure:
    """Expert parallelism's dispatch, from a real routing with one group of tokens per device:
    left, each device's tokens and the experts they chose, coloured by the device that holds
    the expert (hatched: dropped, the expert's slots were full); right, each expert's slots
    after the all-to-all, labelled with the token that fills each one and coloured by the
    device it came from. The second all-to-all takes each slot's result back the same way."""
    import matplotlib.pyplot as plt

    dispatch = np.asarray(routing.dispatch)  # (groups, tokens, experts, slots)
    chosen = np.asarray(routing.chosen)  # (groups, tokens, k)
    groups, tokens, experts, slots = dispatch.shape
    if groups != devices or experts % devices:
        raise ValueError(
            f"draw one group of tokens per device and experts the devices divide: got "
            f"{groups} groups and {experts} experts for {devices} devices"
        )
    per, k = experts // devices, chosen.shape[-1]
    kept = dispatch.sum(axis=-1) > 0  # (groups, tokens, experts)
    size = (2.5 + 0.45 * (tokens + groups * slots), 1.0 + 0.8 * experts)
    fig, (left, right) = plt.subplots(1, 2, figsize=size, width_ratios=[tokens, groups * slots])
    rows = k + 1.5  # a device's rows on the left: its tokens, their k choices, a gap
    for g in range(groups):
        top = g * rows
        for t in range(tokens):
            box(left, t, top, 1, 1, device_colour(g, devices), f"t{t}", 7, "black")
            for c, e in enumerate(chosen[g, t]):
                colour = device_colour(int(e) // per, devices)
                if kept[g, t, e]:
                    box(left, t, top + 1 + c, 1, 1, colour, f"e{e}", 7)
                else:
                    box(left, t, top + 1 + c, 1, 1, "white", f"e{e}", 7, colour, 1.0, "////")
    left.set_xlim(0, tokens)
    left.set_ylim(groups * rows - 0.5, 0)
    left.set_yticks([g * rows + 0.5 for g in range(groups)], [f"device {g}" for g in range(groups)])
    left.set_xticks([])
    left.set_title(f"each device's tokens and their top-{k} experts", fontsize=9)
    for e in range(experts):
        y = e + e // per * 0.5  # a gap between devices
        for g in range(groups):
            for c in range(slots):
                filled = np.flatnonzero(dispatch[g, :, e, c])
                if filled.size:
                    colour = device_colour(g, devices)
                    box(right, g * (slots + 0.5) + c, y, 1, 1, colour, f"t{filled[0]}", 7, "black")
                else:
                    box(right, g * (slots + 0.5) + c, y, 1, 1, "white", "", 7, "0.6")
    right.set_xlim(0, groups * (slots + 0.5) - 0.5)
    right.set_ylim(experts + (devices - 1) * 0.5, 0)
    right.set_yticks(
        [e + e // per * 0.5 + 0.5 for e in range(experts)],
        [f"device {e // per}: e{e}" for e in range(experts)],
    )
    right.set_xticks([g * (slots + 0.5) + slots / 2 for g in range(groups)])
    right.set_xticklabels([f"slots from device {g}" for g in range(groups)], fontsize=8)
    right.set_title(f"after the all-to-all: {slots} slots per expert and group", fontsize=9)
    for ax in (left, right):
        frameless(ax, labelsize=8)
    fig.tight_layout()
    return fig


def plot_links(crossing: Crossing) -> Figure:
    """Which link each mesh axis crosses, from a compiled step's report on a mesh across
    processes (`costs.crossing`): a box per process (a host) holding its devices, the fast
    links between devices inside it, the slow network between the processes, and beside
    each the collectives the step runs over them, with their bytes."""
    import matplotlib.pyplot as plt

    mesh = crossing.mesh
    processes = mesh["replica"]
    local = math.prod(size for axis, size in mesh.items() if axis != "replica")
    fig, ax = plt.subplots(figsize=(1.3 * local + 4.6, 1.6 * processes + 0.6))
    for p in range(processes):
        y = 1.6 * p
        host = plt.Rectangle((0, y), 1.3 * local + 0.2, 1.2, facecolor="0.93", edgecolor="black")
        ax.add_patch(host)
        ax.text(0.1, y + 1.08, f"process {p} (a host)", fontsize=8, va="top")
        for k in range(local):
            device = p * local + k  # its place in the mesh: replica is the process's index
            coords = np.unravel_index(device, tuple(mesh.values()))
            label = "\n".join(f"{a}={i}" for a, i in zip(mesh, coords, strict=True))
            colour = device_colour(device, processes * local)
            box(ax, 0.2 + 1.3 * k, y + 0.1, 1.0, 0.8, colour, label, 6, "black")
            if k:  # a fast link to the device before
                ax.plot([1.3 * k - 0.1, 0.2 + 1.3 * k], [y + 0.5] * 2, color="black", lw=3)
            if p:  # the slow network to the same device of the process before
                x = 0.7 + 1.3 * k
                ax.plot([x, x], [y - 0.7, y + 0.1], color="tab:red", lw=1.2, ls="--")
    right = 1.3 * local + 0.5
    inner = ", ".join(axis for axis in mesh if axis != "replica")
    for crosses, y, title in [
        (False, 0.1, f"fast links inside a host: {inner}"),
        (True, 1.6 * processes - 0.6, "the slow network across hosts: replica"),
    ]:
        lines = [
            f"{kind} over {' and '.join(axes)}: {size:,} B"
            for kind, axes, size, across, _ in crossing.rows
            if across == crosses
        ]
        colour = "tab:red" if crosses else "black"
        ax.text(right, y, "\n".join([title, *lines]), fontsize=7, va="top", color=colour)
    ax.set_xlim(-0.1, right + 3.4)
    ax.set_ylim(1.6 * processes, -0.1)
    ax.axis("off")
    fig.tight_layout()
    return fig
