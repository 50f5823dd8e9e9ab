"""Figures drawn from real objects: array blocks per device, mesh layouts, pipeline timelines."""

from __future__ import annotations

from collections import defaultdict

import jax
import matplotlib.pyplot as plt
from jax.sharding import Mesh
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nnxscale.schedules import FORWARD, Timeline


def _device_colour(device_id: int, total: int) -> tuple[float, float, float, float]:
    return plt.get_cmap("tab20" if total > 10 else "tab10")(device_id % 20)


def shard_blocks(array: jax.Array) -> dict[tuple[int, int, int, int], list[int]]:
    """Blocks (row0, row1, col0, col1) of a 1-D or 2-D array mapped to the devices holding them."""
    if array.ndim not in (1, 2):
        raise ValueError(f"can only draw 1-D or 2-D arrays, got shape {array.shape}")
    rows, cols = (1, array.shape[0]) if array.ndim == 1 else array.shape
    blocks: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
    for shard in array.addressable_shards:
        index = ((slice(None),) if array.ndim == 1 else ()) + tuple(shard.index)
        r0, r1, _ = index[0].indices(rows)
        c0, c1, _ = index[1].indices(cols)
        blocks[(r0, r1, c0, c1)].append(shard.device.id)
    return {block: sorted(ids) for block, ids in sorted(blocks.items())}


def plot_sharding(array: jax.Array, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Draw the array as a grid of blocks, each coloured and labelled by the devices holding it."""
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    rows, cols = (1, array.shape[0]) if array.ndim == 1 else array.shape
    total = len(array.sharding.device_set)
    for (r0, r1, c0, c1), ids in shard_blocks(array).items():
        ax.add_patch(
            plt.Rectangle(
                (c0, r0),
                c1 - c0,
                r1 - r0,
                facecolor=_device_colour(ids[0], total),
                edgecolor="black",
                linewidth=1.5,
                alpha=0.85,
            )
        )
        label = "\n".join(",".join(str(i) for i in ids[k : k + 4]) for k in range(0, len(ids), 4))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    spec = getattr(array.sharding, "spec", None)
    ax.set_title(title or f"{tuple(array.shape)}  {spec}", fontsize=9)
    return ax


def plot_shardings(arrays: dict[str, jax.Array], columns: int = 4) -> Figure:
    """One `plot_sharding` panel per named array, side by side."""
    n = len(arrays)
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(
        rows, min(n, columns), figsize=(3.2 * min(n, columns), 2.6 * rows), squeeze=False
    )
    for ax, (name, array) in zip(axes.flat, arrays.items(), strict=False):
        plot_sharding(array, ax, f"{name}\n{tuple(array.shape)}  {array.sharding.spec}")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_mesh(mesh: Mesh, ax: Axes | None = None) -> Axes:
    """Draw a 1-D or 2-D mesh: the device id at each position, axes named."""
    ids = mesh.device_ids if mesh.devices.ndim == 2 else mesh.device_ids.reshape(1, -1)
    names = mesh.axis_names if mesh.devices.ndim == 2 else ("", mesh.axis_names[0])
    ax = ax or plt.subplots(figsize=(0.7 * ids.shape[1] + 1, 0.7 * ids.shape[0] + 0.8))[1]
    for (r, c), device in zip(
        [(r, c) for r in range(ids.shape[0]) for c in range(ids.shape[1])], ids.flat, strict=True
    ):
        ax.add_patch(
            plt.Rectangle(
                (c, r),
                1,
                1,
                facecolor=_device_colour(int(device), ids.size),
                edgecolor="black",
                alpha=0.85,
            )
        )
        ax.text(c + 0.5, r + 0.5, str(device), ha="center", va="center", fontsize=9)
    ax.set_xlim(0, ids.shape[1])
    ax.set_ylim(ids.shape[0], 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"axis '{names[1]}' (size {ids.shape[1]})", fontsize=9)
    if names[0]:
        ax.set_ylabel(f"axis '{names[0]}' (size {ids.shape[0]})", fontsize=9)
    ax.set_aspect("equal")
    return ax


def plot_timeline(timeline: Timeline, ax: Axes | None = None) -> Axes:
    """A Gantt chart of a simulated schedule: a row per device, a box per task, idle left blank.

    Forward passes are light and backward passes dark, coloured by micro-batch; with virtual
    stages, the label gives the micro-batch and the stage.
    """
    schedule = timeline.schedule
    ax = ax or plt.subplots(figsize=(9, 0.45 * schedule.devices + 0.9))[1]
    colours = plt.get_cmap("tab10")
    for d, runs in enumerate(timeline.runs):
        for task, start, end in runs:
            forward = task.kind == FORWARD
            colour = colours(task.micro % 10)
            ax.add_patch(
                plt.Rectangle(
                    (start, d - 0.4),
                    end - start,
                    0.8,
                    facecolor=colour,
                    alpha=0.45 if forward else 1,
                    edgecolor="black",
                    linewidth=0.5,
                    hatch=None if forward else "//",
                )
            )
            label = f"{task.micro}" if schedule.virtual == 1 else f"{task.micro}.{task.stage}"
            ax.text((start + end) / 2, d, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(schedule.devices - 0.5, -0.5)
    ax.set_yticks(range(schedule.devices), [f"device {d}" for d in range(schedule.devices)])
    ax.set_xlabel("time (a forward pass through one device's layers = 1)")
    ax.set_title(
        f"{schedule.name}: p={schedule.devices}, m={schedule.micro_batches}; "
        f"idle {timeline.bubble():.1%} (light: forward, hatched: backward)",
        fontsize=9,
    )
    return ax
