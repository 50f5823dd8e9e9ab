"""Figures drawn from real objects: array blocks per device, meshes, collectives, timelines."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nnxscale.events import Start
from nnxscale.schedules import (
    FORWARD,
    WEIGHTS,
    Schedule,
    Timeline,
    bubble_formula,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_formula,
)

SUM = "Σ"
"""The label of a block that holds a sum over every device's block."""


def _device_colour(device_id: int, total: int) -> tuple[float, float, float, float]:
    return plt.get_cmap("tab20" if total > 10 else "tab10")(device_id % 20)


def _text_colour(background: Sequence[float]) -> str:
    """Black or white, whichever reads better on `background` (an RGB(A) colour)."""
    red, green, blue = background[:3]
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def _box(
    ax: Axes,
    x: float,
    y: float,
    width: float,
    height: float,
    colour: object,
    label: str = "",
    fontsize: float = 8,
    edgecolor: str = "white",
    linewidth: float = 1.0,
    hatch: str | None = None,
) -> None:
    """A filled rectangle with its label centred in a colour that reads on it."""
    ax.add_patch(
        plt.Rectangle(
            (x, y),
            width,
            height,
            facecolor=colour,
            edgecolor=edgecolor,
            linewidth=linewidth,
            hatch=hatch,
        )
    )
    if label:
        rgba = matplotlib.colors.to_rgba(colour)
        ax.text(
            x + width / 2,
            y + height / 2,
            label,
            ha="center",
            va="center",
            fontsize=fontsize,
            color=_text_colour(rgba),
        )


def shard_blocks(array: jax.Array | jax.ShapeDtypeStruct) -> dict[tuple[int, ...], list[int]]:
    """Blocks (row0, row1, col0, col1) of a 1-D or 2-D array mapped to the devices holding
    them; a `jax.ShapeDtypeStruct` with a sharding works too (a layout not yet created)."""
    if len(array.shape) not in (1, 2):
        raise ValueError(f"can only draw 1-D or 2-D arrays, got shape {array.shape}")
    rows, cols = (1, array.shape[0]) if len(array.shape) == 1 else array.shape
    blocks: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
    for device, index in array.sharding.devices_indices_map(tuple(array.shape)).items():
        index = ((slice(None),) if len(array.shape) == 1 else ()) + tuple(index)
        r0, r1, _ = index[0].indices(rows)
        c0, c1, _ = index[1].indices(cols)
        blocks[(r0, r1, c0, c1)].append(device.id)
    return {block: sorted(ids) for block, ids in sorted(blocks.items())}


def plot_sharding(
    array: jax.Array | jax.ShapeDtypeStruct, ax: Axes | None = None, title: str | None = None
) -> Axes:
    """Draw the array as a grid of blocks, each coloured and labelled by the devices holding it."""
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    rows, cols = (1, array.shape[0]) if len(array.shape) == 1 else array.shape
    total = len(array.sharding.device_set)
    for (r0, r1, c0, c1), ids in shard_blocks(array).items():
        label = "\n".join(",".join(str(i) for i in ids[k : k + 4]) for k in range(0, len(ids), 4))
        _box(ax, c0, r0, c1 - c0, r1 - r0, _device_colour(ids[0], total), label, 9, "black", 1.5)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    spec = getattr(array.sharding, "spec", None)
    ax.set_title(title or f"{tuple(array.shape)}  {spec}", fontsize=10)
    return ax


def plot_shardings(
    arrays: Mapping[str, jax.Array | jax.ShapeDtypeStruct], columns: int = 4
) -> Figure:
    """One `plot_sharding` panel per named array, side by side."""
    n = len(arrays)
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(
        rows, min(n, columns), figsize=(3.2 * min(n, columns), 2.6 * rows), squeeze=False
    )
    for ax, (name, array) in zip(axes.flat, arrays.items(), strict=False):
        spec = getattr(array.sharding, "spec", "")
        plot_sharding(array, ax, f"{name}\n{tuple(array.shape)}  {spec}")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_mesh(mesh: Mesh, ax: Axes | None = None) -> Axes:
    """Draw a 1-D or 2-D mesh: the device id at each position, axes named."""
    ids = mesh.device_ids if mesh.devices.ndim == 2 else mesh.device_ids.reshape(1, -1)
    names = mesh.axis_names if mesh.devices.ndim == 2 else ("", mesh.axis_names[0])
    ax = ax or plt.subplots(figsize=(0.7 * ids.shape[1] + 1.2, 0.7 * ids.shape[0] + 0.8))[1]
    for (r, c), device in np.ndenumerate(ids):
        _box(ax, c, r, 1, 1, _device_colour(int(device), ids.size), str(device), 10, "black")
    ax.set_xlim(0, ids.shape[1])
    ax.set_ylim(ids.shape[0], 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"axis '{names[1]}' (size {ids.shape[1]})", fontsize=10)
    if names[0]:
        ax.set_ylabel(f"axis '{names[0]}' (size {ids.shape[0]})", fontsize=10)
    ax.set_aspect("equal")
    return ax


def block_sources(blocks: np.ndarray, output: np.ndarray) -> list[list[int | str]]:
    """For each device's output, which input block each of its pieces is: a device index,
    `SUM` for the sum of every device's block, or "?" for anything else.

    `blocks` is (devices, block) - row i is device i's input - and `output` is (devices, k *
    block): what each device holds after the collective.
    """
    devices, size = blocks.shape
    total = blocks.sum(axis=0)
    sources = []
    for row in output.reshape(devices, -1, size):
        found: list[int | str] = []
        for piece in row:
            same = [i for i in range(devices) if np.array_equal(piece, blocks[i])]
            found.append(same[0] if same else SUM if np.allclose(piece, total) else "?")
        sources.append(found)
    return sources


def plot_collectives(blocks: np.ndarray, outputs: Mapping[str, np.ndarray]) -> Figure:
    """What each device holds before and after each collective, read off the real results:
    a piece is coloured by the device whose block it is, or grey when it is a sum over all."""
    devices = blocks.shape[0]
    panels = {"before (each device's block)": np.arange(devices)[:, None].tolist()}
    panels |= {name: block_sources(blocks, out) for name, out in outputs.items()}
    width = max(len(row) for sources in panels.values() for row in sources)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(2.0 * len(panels) + 0.6, 0.34 * devices + 1.0),
        gridspec_kw={"width_ratios": [max(len(r) for r in s) + 1 for s in panels.values()]},
    )
    for ax, (name, sources) in zip(axes, panels.items(), strict=True):
        for d, row in enumerate(sources):
            for k, source in enumerate(row):
                summed = not isinstance(source, int)
                colour = (0.6, 0.6, 0.6, 1.0) if summed else _device_colour(source, devices)
                label = str(source) if len(row) <= 8 or summed else ""
                _box(ax, k, d, 1, 0.85, colour, label)
        ax.set_xlim(0, max(len(row) for row in sources))
        ax.set_ylim(devices, 0)
        ax.set_xticks([])
        ax.set_yticks(np.arange(devices) + 0.43, [str(d) for d in range(devices)], fontsize=8)
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        ax.set_title(name, fontsize=10)
    axes[0].set_ylabel("device")
    fig.suptitle(
        f"Blocks of a vector on {devices} devices; {SUM}: the sum of every device's block "
        f"(at most {width} pieces per device)",
        fontsize=10,
        y=0.02,
        va="bottom",
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_timeline(timeline: Timeline, ax: Axes | None = None, makespan: float = 0.0) -> Axes:
    """A Gantt chart of a simulated schedule: a row per device, a box per task, idle left blank.

    Forward passes are light and backward passes dark (a split backward's weight-gradient
    pass W hatched), coloured by micro-batch and labelled with it (and the virtual stage, as
    a subscript, when there are several per device). `makespan` sets a common time axis
    when several charts are compared.
    """
    schedule = timeline.schedule
    ax = ax or plt.subplots(figsize=(10, 0.5 * schedule.devices + 1))[1]
    colours = plt.get_cmap("tab20")
    for d, runs in enumerate(timeline.runs):
        for task, start, end in runs:
            forward = task.kind == FORWARD
            colour = colours(2 * (task.micro % 10) + (1 if forward else 0))
            label = f"{task.micro}" if schedule.virtual == 1 else f"{task.micro}$_{task.stage}$"
            size = 8 if end - start >= 0.9 else 6.5
            hatch = "///" if task.kind == WEIGHTS else None
            _box(
                ax,
                start,
                d - 0.42,
                end - start,
                0.84,
                colour,
                label,
                size,
                linewidth=0.8,
                hatch=hatch,
            )
    ax.set_xlim(0, max(makespan, timeline.makespan))
    ax.set_ylim(schedule.devices - 0.5, -0.5)
    ax.set_yticks(range(schedule.devices), [f"device {d}" for d in range(schedule.devices)])
    ax.axvline(timeline.makespan, color="black", linewidth=1.5)
    ax.set_title(
        f"{schedule.name}: p={schedule.devices}, m={schedule.micro_batches}"
        + (f", v={schedule.virtual}" if schedule.virtual > 1 else "")
        + f"; ends at {timeline.makespan:g}, idle {timeline.bubble():.1%}",
        fontsize=10,
        loc="left",
    )
    return ax


def plot_timelines(schedules: Sequence[Schedule], ticks: bool = False) -> Figure:
    """Schedules simulated and drawn one above the other on one time axis (where each ends is
    marked), forward light and backward dark; with `ticks`, one tick per task, as the
    executor runs them."""
    timelines = [simulate(s, (lambda task: 1.0) if ticks else None) for s in schedules]
    longest = max(t.makespan for t in timelines)
    rows = sum(s.devices for s in schedules)
    fig, axes = plt.subplots(
        len(schedules),
        1,
        figsize=(10, 0.42 * rows + 1.1 * len(schedules) + 0.4),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [s.devices for s in schedules]},
    )
    for ax, timeline in zip(axes[:, 0], timelines, strict=True):
        plot_timeline(timeline, ax, makespan=longest)
    axes[-1, 0].set_xlabel(
        "executor clock ticks (one task per tick)"
        if ticks
        else "time (a forward pass through one device's layers = 1, a backward pass = 2, B = W = 1)"
    )
    fig.tight_layout()
    return fig


def plot_bubbles(devices: int, micro_batches: Sequence[int], virtual: Sequence[int]) -> Figure:
    """Idle share against micro-batches: the formula (p-1)/(vm+p-1) as lines, ZB-H1's
    (p-1)/(3m+p-1) dashed, and each schedule simulated as points on them (GPipe and 1F1B
    share v = 1)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ms = np.arange(1, max(micro_batches) + 1)
    for i, v in enumerate(virtual):
        ax.plot(
            ms,
            [bubble_formula(devices, int(m), v) for m in ms],
            color=f"C{i}",
            label=f"(p-1)/(vm+p-1), v={v}",
        )
    ax.plot(
        ms,
        [zero_bubble_formula(devices, int(m)) for m in ms],
        color="black",
        linestyle="--",
        label="ZB-H1: (p-1)/(3m+p-1)",
    )
    markers = {"GPipe": "o", "1F1B": "x", "ZB-H1": "^"}
    seen = set()
    for m in micro_batches:
        schedules = [gpipe(devices, m), one_f_one_b(devices, m), zero_bubble(devices, m)]
        schedules += [interleaved(devices, m, v) for v in virtual if v > 1 and m % devices == 0]
        for schedule in schedules:
            idle = simulate(schedule).bubble()
            colour = "black" if schedule.split else f"C{list(virtual).index(schedule.virtual)}"
            ax.plot(
                m,
                idle,
                markers.get(schedule.name, "s"),
                color=colour,
                markersize=7,
                fillstyle="none",
                label=None if schedule.name in seen else f"{schedule.name}, simulated",
            )
            seen.add(schedule.name)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle share of device time")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:.0%}"))
    ax.set_ylim(0, None)
    ax.set_title(f"Pipeline bubble, p = {devices} devices", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_temporaries(measured: Mapping[str, Mapping[int, int]]) -> Figure:
    """Compiled temporary bytes per device against micro-batches m, a line per schedule:
    `measured[schedule name][m]`."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for i, (name, by_m) in enumerate(measured.items()):
        ms = sorted(by_m)
        ax.plot(ms, [by_m[m] / 2**20 for m in ms], marker="os^dx"[i % 5], label=name)
    ax.set_xlabel("micro-batches m (each of the same size)")
    ax.set_ylabel("XLA temporaries per device (MiB)")
    ax.set_xticks(sorted({m for by_m in measured.values() for m in by_m}))
    ax.set_title("Memory of the executed schedules", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_fsdp_timeline(layer_bytes: Sequence[int], gather_again: bool) -> Figure:
    """One FSDP training step, layer by layer: what is communicated (all-gather of a layer's
    weights, reduce-scatter of its gradients) and what is computed, in order.

    Forward: gather layer i, compute it, drop the gathered weights. Backward, from the last
    layer: gather again (or keep from the forward pass), compute, reduce-scatter the gradient.
    Box widths are the bytes each layer moves, not measured times.
    """
    layers = len(layer_bytes)
    unit = max(layer_bytes)
    fig, ax = plt.subplots(figsize=(10, 2.3))
    t = 0.0
    rows = {"communication": 0, "computation": 1}
    colours = {"all-gather": "C0", "reduce-scatter": "C3", "forward": "C2", "backward": "C1"}

    def box(row: str, start: float, width: float, kind: str, label: str) -> None:
        _box(ax, start, rows[row] - 0.4, width, 0.8, colours[kind], label)

    for i, size in enumerate(layer_bytes):
        box("communication", t, size / unit, "all-gather", f"AG{i}")
        t += size / unit
        box("computation", t, 1.0, "forward", f"F{i}")
        t += 1.0
    for i in reversed(range(layers)):
        size = layer_bytes[i] / unit
        if gather_again:
            box("communication", t, size, "all-gather", f"AG{i}")
            t += size
        box("computation", t, 2.0, "backward", f"B{i}")
        t += 2.0
        box("communication", t, size, "reduce-scatter", f"RS{i}")
        t += size
    ax.set_xlim(0, t)
    ax.set_ylim(1.6, -0.6)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xticks([])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(
        handles,
        list(colours),
        ncols=4,
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        frameon=False,
    )
    ax.set_title(
        f"FSDP, {layers} layers, weights "
        + ("gathered again in the backward pass" if gather_again else "kept from the forward pass")
        + " (in sequence, without overlap)",
        fontsize=10,
        loc="left",
    )
    fig.tight_layout()
    return fig


def plot_topology(starts: Sequence[Start]) -> Figure:
    """Processes, their devices and the global mesh, from each worker's `Start` event: a box
    per process holding its devices, each labelled with its id and mesh position."""
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
            colour = _device_colour(int(device), grid.size)
            label = f"device {device}\n{where}"
            _box(ax, x + 0.3 + 1.2 * k, 0.55, 1.0, 1.1, colour, label, 7, "black")
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


def plot_saves(steps: Mapping[int, tuple[float, float]], saves: Mapping[int, Any]) -> Figure:
    """Training steps and asynchronous saves on one measured time axis (milliseconds).

    `steps` maps a step number to its (start, end) times; `saves` maps a step to the times a
    save of it started, handed control back, and had its files written (`Checkpoints.times`).
    Training waits only while a save copies the arrays off the devices; the files are written
    in the background while the next steps run.
    """
    origin = min(min(s for s, _ in steps.values()), *(t.started for t in saves.values()))

    def ms(t: float) -> float:
        return 1e3 * (t - origin)

    fig, ax = plt.subplots(figsize=(10, 2.2))
    for k, (start, end) in steps.items():
        _box(ax, ms(start), -0.4, ms(end) - ms(start), 0.8, "C0", str(k))
    for step, t in saves.items():
        _box(ax, ms(t.started), -0.4, ms(t.returned) - ms(t.started), 0.8, "C3")
        if t.written is not None:
            _box(ax, ms(t.returned), 0.6, ms(t.written) - ms(t.returned), 0.8, "C1")
            ax.text(ms(t.returned) + 2, 1.0, f"step {step}", va="center", fontsize=8)
    end = max([e for _, e in steps.values()] + [t.written or t.returned for t in saves.values()])
    ax.set_xlim(0, ms(end) * 1.01)
    ax.set_ylim(1.6, -0.6)
    ax.set_yticks([0, 1], ["training", "writing files"])
    ax.set_xlabel("milliseconds since the first step (measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C0", "C3", "C1")]
    labels = ["training step", "save: training waits", "save: written in the background"]
    ax.legend(
        handles,
        labels,
        ncols=3,
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.38),
        frameon=False,
    )
    fig.tight_layout()
    return fig
