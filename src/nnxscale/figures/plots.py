"""Figures drawn from real objects: array blocks per device, meshes, collectives, timelines."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nnxscale.analysis.comm import ring_bytes
from nnxscale.checkpoint.store import chunks_read
from nnxscale.core.memory import CompiledMemory
from nnxscale.costs.model import LEDGER_PARTS, Hardware, Setup, hardware, ledger, step_cost
from nnxscale.model.context import Ring
from nnxscale.model.moe import Routing
from nnxscale.model.transformer import Config, create
from nnxscale.parallelism.schedules import (
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
from nnxscale.placement.init import InitPrograms, abstract
from nnxscale.placement.layout import Layout, ReplicationWarning, resolve
from nnxscale.placement.rules import FSDP, TP, Rules, strategy_mesh
from nnxscale.profiling.profiles import Placed, Timed, attainable, ridge
from nnxscale.runtime.events import Start
from nnxscale.train.step import ROLE_NAMES, role_bytes

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


def plot_ring(ring: Ring) -> Figure:
    """Ring attention step by step, from the ring's own hop (`Ring.permutation`): each
    device's query chunks (left) stay put while the K/V shards move one hop per step
    (arrows); a cell is coloured by the device that owns the K/V shard held there, and its
    small grid marks the (query chunk, key chunk) pairs a causal mask needs (filled) or lets
    the device skip (empty)."""
    n = ring.devices
    chunks = np.array(ring.chunks()).reshape(n, -1)
    per = chunks.shape[1]
    width, gap = 1.0, 0.6
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * n, 0.9 + 0.9 * n))

    def column(step: int) -> float:
        return 1.6 + step * (width + gap)

    for device in range(n):
        label = "Q " + ",".join(map(str, chunks[device]))
        _box(ax, 0, device + 0.15, 1.2, 0.7, _device_colour(device, n), label, 8, "black")
    side = 0.5 / per
    for step in range(n):
        x = column(step)
        for device, owner in enumerate(ring.holding(step)):
            colour = _device_colour(owner, n)
            ax.text(
                x + width / 2,
                device + 0.22,
                "K/V " + ",".join(map(str, chunks[owner])),
                ha="center",
                va="center",
                fontsize=7,
            )
            for row, query in enumerate(chunks[device]):
                for col, key in enumerate(chunks[owner]):
                    face = colour if query >= key else "white"
                    left, top = x + width / 2 - per * side / 2 + col * side, device + 0.4
                    _box(ax, left, top + row * side, side, side, face, edgecolor=colour)
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
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
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
    fig, (left, right) = plt.subplots(
        1,
        2,
        figsize=(2.5 + 0.45 * (tokens + groups * slots), 1.0 + 0.8 * experts),
        width_ratios=[tokens, groups * slots],
    )
    rows = k + 1.5  # a device's rows on the left: its tokens, their k choices, a gap
    for g in range(groups):
        top = g * rows
        for t in range(tokens):
            _box(left, t, top, 1, 1, _device_colour(g, devices), f"t{t}", 7, "black")
            for c, e in enumerate(chosen[g, t]):
                colour = _device_colour(int(e) // per, devices)
                if kept[g, t, e]:
                    _box(left, t, top + 1 + c, 1, 1, colour, f"e{e}", 7)
                else:
                    _box(left, t, top + 1 + c, 1, 1, "white", f"e{e}", 7, colour, 1.0, "////")
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
                    colour = _device_colour(g, devices)
                    _box(right, g * (slots + 0.5) + c, y, 1, 1, colour, f"t{filled[0]}", 7, "black")
                else:
                    _box(right, g * (slots + 0.5) + c, y, 1, 1, "white", "", 7, "0.6")
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
        ax.tick_params(length=0, labelsize=8)
        for spine in ax.spines.values():
            spine.set_visible(False)
    fig.tight_layout()
    return fig


def plot_ledger(
    cfg: Config, hw: Hardware | str, setups: Mapping[str, Setup], batch: int, seq: int | None = None
) -> Figure:
    """A device's memory ledger under each setup, as the cost model counts it: one bar per
    setup of its four parts (`costs.ledger`), a tick at the step's peak (`costs.step_cost`)
    and the device's memory as a dashed line, so one sees what fits and which part does not."""
    hw = hardware(hw)
    fig, ax = plt.subplots(figsize=(8.5, 0.55 * len(setups) + 1.5))
    for i, setup in enumerate(setups.values()):
        parts = ledger(cfg, setup, batch, seq)
        left = 0.0
        for j, part in enumerate(LEDGER_PARTS):
            size = parts[part] / 1e9
            ax.barh(i, size, left=left, height=0.6, color=f"C{j}", label=None if i else part)
            left += size
        peak = step_cost(cfg, setup, hw, batch, seq).peak / 1e9
        tick = None if i else "the step's peak"
        ax.plot([peak] * 2, [i - 0.42, i + 0.42], color="black", linewidth=2.5, label=tick)
    memory = f"{hw.name} memory"
    ax.axvline(hw.memory / 1e9, color="black", linestyle="--", linewidth=1, label=memory)
    ax.set_yticks(range(len(setups)), list(setups))
    ax.invert_yaxis()
    ax.set_xlabel("GB per device")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def matrix_view(array: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A 1-D or 2-D stand-in for an array's layout, which `plot_sharding` can draw: an N-D
    array's dimensions grouped into rows and columns, each group split (if at all) along its
    first dimension only, so that every shard stays one block; the squarest such grouping."""
    shape = tuple(array.shape)
    if len(shape) <= 2:
        return array
    sharding = array.sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    views = []
    for k in range(1, len(shape)):
        if any(spec[i] is not None for i in (*range(1, k), *range(k + 1, len(shape)))):
            continue  # a dimension split inside a group: its shards would not be blocks
        rows, cols = int(np.prod(shape[:k])), int(np.prod(shape[k:]))
        views.append((abs(np.log(rows / cols)), (rows, cols), (spec[0], spec[k])))
    if not views:
        raise ValueError(
            f"no 2-D view of shape {shape} keeps each shard of {sharding.spec} one block"
        )
    _, view, axes = min(views, key=lambda v: v[0])
    placed = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*axes))
    return jax.ShapeDtypeStruct(view, array.dtype, sharding=placed)


def plot_layouts(layouts: Mapping[str, Layout], paths: Sequence[str]) -> Figure:
    """The same weights under several layouts, a row per layout and a column per path: each
    weight drawn as a matrix (`matrix_view`) of blocks coloured and labelled by the devices
    that hold them, titled with its shape and where each dimension goes."""
    fig, axes = plt.subplots(
        len(layouts), len(paths), figsize=(2.9 * len(paths), 2.8 * len(layouts)), squeeze=False
    )
    for row, (name, layout) in zip(axes, layouts.items(), strict=True):
        for ax, path in zip(row, paths, strict=True):
            array = layout.array_at(path)
            spec = tuple(layout[path].spec)
            plot_sharding(matrix_view(array), ax, f"{path}\n{tuple(array.shape)} -> {spec}")
            ax.title.set_fontsize(8)
        row[0].set_ylabel(name, fontsize=9)
    fig.tight_layout()
    return fig


def plot_restore(
    model: nnx.Module | Config,
    path: str,
    restored: Mapping[str, tuple[Rules, int | None]] | None = None,
    saved: tuple[Rules, int | None] = (FSDP, None),
    device: int = 0,
) -> Figure:
    """One weight as a checkpoint holds it and as restores onto other layouts read it back:
    why a restore never gathers an array, and when it reads more than it keeps.

    The first panel is the saved layout (`saved`: a rule set and a device count, None for
    all devices), each block written as its own chunk. Each other panel is a layout of
    `restored` (default: TP, and FSDP on half the devices), with `device`'s shard outlined in
    red and the saved chunks it reads hatched (`nnxscale.checkpoint.chunks_read`). Layouts
    are resolved from the abstract model (a `Config` is the book's Transformer): no memory.
    """
    if restored is None:
        half = max(1, jax.device_count() // 2)
        restored = {"restored under TP": (TP, None), f"FSDP on {half} devices": (FSDP, half)}
    shapes = abstract(lambda: create(model)) if isinstance(model, Config) else model

    def placed(rules: Rules, devices: int | None) -> jax.ShapeDtypeStruct:
        with warnings.catch_warnings():  # a layout that splits nothing is drawn, not warned of
            warnings.simplefilter("ignore", ReplicationWarning)
            return resolve(shapes, rules, strategy_mesh(rules, devices)).array_at(path)

    old = placed(*saved)
    chunk = old.sharding.shard_shape(old.shape)
    itemsize = np.dtype(old.dtype).itemsize
    fig, axes = plt.subplots(1, 1 + len(restored), figsize=(3.9 * (1 + len(restored)), 3.3))
    mesh = dict(old.sharding.mesh.shape)
    title = f"saved: {saved[0].name}, mesh {mesh}\n{tuple(old.sharding.spec)}"
    plot_sharding(old, axes[0], f"{title}\none chunk on disk per block")
    for ax, (name, (rules, devices)) in zip(axes[1:], restored.items(), strict=True):
        new = placed(rules, devices)
        plot_sharding(new, ax)
        reads = chunks_read(chunk, new, device)
        height, width = (1, *chunk) if len(chunk) == 1 else chunk
        for index in reads:
            row, col = (0, *index) if len(index) == 1 else index
            ax.add_patch(
                plt.Rectangle(
                    (col * width, row * height),
                    width,
                    height,
                    fill=False,
                    hatch="///",
                    edgecolor="0.15",
                    linewidth=0.8,
                )
            )
        (r0, r1, c0, c1), _ = next(
            (block, ids) for block, ids in shard_blocks(new).items() if device in ids
        )
        ax.add_patch(
            plt.Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor="red", linewidth=3)
        )
        held = int(np.prod(new.sharding.shard_shape(new.shape))) * itemsize
        read = len(reads) * int(np.prod(chunk)) * itemsize
        mesh = dict(new.sharding.mesh.shape)
        ax.set_title(
            f"{name}, mesh {mesh}\n{tuple(new.sharding.spec)}\n"
            f"device {device} keeps {held:,} B, reads {read:,} B",
            fontsize=9,
        )
    fig.tight_layout()
    return fig


def plot_on_mesh(array: jax.Array | jax.ShapeDtypeStruct) -> Figure:
    """The mesh an array is laid out on beside the array cut into its blocks, in the same
    colours: which device holds which block, at a glance."""
    mesh = array.sharding.mesh
    ids = mesh.device_ids if mesh.devices.ndim == 2 else mesh.device_ids.reshape(1, -1)
    fig, (left, right) = plt.subplots(
        1,
        2,
        figsize=(7.5, 3.2),
        gridspec_kw={"width_ratios": [max(1.2, ids.shape[1] / ids.shape[0] * 1.6), 3]},
    )
    plot_mesh(mesh, left)
    left.set_title(f"{ids.size} devices as a mesh", fontsize=10)
    spec = getattr(array.sharding, "spec", "")
    plot_sharding(array, right, f"one array {tuple(array.shape)}, cut by {spec}")
    fig.tight_layout()
    return fig


def plot_ring_costs(counted: Mapping[str, tuple[int, float]], max_devices: int = 64) -> Figure:
    """Bytes each device sends over P, against the ring's device count N: the ring formulas as
    lines, and `counted` (collective kind -> (N, bytes sent / P), read off compiled programs)
    as dots on them."""

    counts = np.arange(2, max_devices + 1)
    fig, ax = plt.subplots(figsize=(6, 3))
    lines = {"all-gather, reduce-scatter": "all-gather", "all-reduce": "all-reduce"}
    for label, kind in lines.items():
        ax.plot(counts, [ring_bytes(kind, 1.0, int(k)) for k in counts], label=label)
    for devices, share in counted.values():
        ax.plot(devices, share, "ko")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.set_ylabel("bytes sent per device / P")
    ax.set_title(
        "Ring collectives: formulas (lines), programs counted (dots)",
        fontsize=10,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_rule_sets(tree: Any, rule_sets: Mapping[str, Any], path: str) -> Figure:
    """One array of `tree` (a model, abstract or not, an nnx State or a pytree) laid out by
    each rule set on the mesh it is meant for (`strategy_mesh`): how a strategy cuts a weight.
    An array of more than two dimensions is drawn as its `matrix_view`."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    fig, axes = plt.subplots(1, len(rule_sets), figsize=(3.2 * len(rule_sets), 2.9), squeeze=False)
    for ax, (name, rules) in zip(axes[0], rule_sets.items(), strict=True):
        mesh = strategy_mesh(rules)
        array = resolve(tree, rules, mesh).array_at(path)
        shape = " x ".join(f"{a} {s}" for a, s in mesh.shape.items())
        plot_sharding(matrix_view(array), ax, f"{name}, mesh {shape}\n{array.sharding.spec}")
    fig.suptitle(f"{path} {tuple(array.shape)}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_shares(shares: Mapping[tuple[str, int], float], devices: int) -> Figure:
    """Share of a model each device holds, `shares[(rule set, model-axis size)]`, as bars
    grouped by rule set, a colour per mesh shape, against the ideal 1/N (dashed)."""
    names = list(dict.fromkeys(name for name, _ in shares))
    sizes = sorted({m for _, m in shares})
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(sizes)
    for j, m in enumerate(sizes):
        for i, name in enumerate(names):
            if (name, m) not in shares:
                continue
            share = shares[name, m]
            label = f"mesh ({devices // m}, {m})" if i == 0 else None
            bar = ax.bar(i + j * width, 100 * share, width, color=f"C{j}", label=label)
            ax.bar_label(bar, [f"{share:.0%}"], fontsize=7)
    ideal = f"ideal 1/{devices} = {1 / devices:.0%}"
    ax.axhline(100 / devices, color="black", linestyle="--", linewidth=1, label=ideal)
    ax.set_xticks(np.arange(len(names)) + width * (len(sizes) - 1) / 2, names)
    ax.set_ylabel("% of the model per device")
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def _byte_unit(largest: float) -> tuple[float, str]:
    """A divisor and its name that show `largest` bytes as a number of a readable size."""
    for divisor, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= 4 * divisor:
            return divisor, name
    return 1, "bytes"


def plot_init_memory(programs: InitPrograms) -> Figure:
    """What each device holds while a model is created, from XLA's memory analysis of the two
    programs `programs` compiled: built whole on device 0 and then split (left), or created
    straight into its shards (right). Each bar stacks the program's outputs (the weights) on
    its temporaries; dashed outlines mark what each device keeps after the split."""

    whole = CompiledMemory.of(programs.whole)
    sharded = CompiledMemory.of(programs.sharded)
    devices = programs.layout.mesh.devices.size
    divisor, unit = _byte_unit(whole.output + whole.temp)
    ids = np.arange(devices)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    panels = [
        (left, "built whole on device 0, then split", [whole] + [None] * (devices - 1)),
        (right, "created straight into its shards", [sharded] * devices),
    ]
    for ax, title, held in panels:
        weights = np.array([m.output if m else 0 for m in held]) / divisor
        temps = np.array([m.temp if m else 0 for m in held]) / divisor
        ax.bar(ids, weights, color="C0", label="weights (outputs)")
        tops = ax.bar(ids, temps, bottom=weights, color="C1", label="temporaries")
        first = [f"{weights[0] + temps[0]:,.0f}"] + [""] * (devices - 1)
        ax.bar_label(tops, first, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(ids, [str(i) for i in ids], fontsize=8 if devices <= 16 else 6)
        ax.set_xlabel("device")
        ax.set_xlim(-0.75, max(devices, 4) - 0.25)
    left.bar(
        ids,
        sharded.output / divisor,
        fill=False,
        edgecolor="black",
        linestyle="--",
        label="kept after the split",
    )
    left.set_ylim(0, 1.3 * (whole.output + whole.temp) / divisor)
    left.set_ylabel(f"{unit} per device while it runs")
    left.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_zero_stages(cfg: Config, rule_sets: Sequence[Rules]) -> Figure:
    """What each device holds of the book's Transformer (`cfg`) and its AdamW state under each
    rule set on all devices, role by role (`nnxscale.train.role_bytes`): parameters, gradients
    and optimizer state stacked, DP's replication beside what ZeRO's stages and FSDP split."""

    with warnings.catch_warnings():  # arrays a rule set cannot split show in the bars
        warnings.simplefilter("ignore", ReplicationWarning)
        held = role_bytes(lambda: create(cfg), rule_sets)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract(lambda: create(cfg)))))
    divisor, unit = _byte_unit(max(sum(h.values()) for h in held.values()))
    names = list(held)
    tall = 0.07 * max(sum(h.values()) for h in held.values()) / divisor  # room for a label
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bottom = np.zeros(len(names))
    for j, (role, words) in enumerate(ROLE_NAMES.items()):
        sizes = np.array([held[name][role] for name in names]) / divisor
        bars = ax.bar(names, sizes, bottom=bottom, color=f"C{j}", label=words)
        ax.bar_label(bars, [f"{s:,.0f}" if s > tall else "" for s in sizes], label_type="center")
        bottom += sizes
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:,.0f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.15 * max(bottom))
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(
        f"{count / 1e6:.1f} M parameters, float32, with AdamW, on {jax.device_count()} devices",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_data_parallel(devices: int, rows: int, grad_bytes: int, sent: float) -> Figure:
    """One data-parallel step on `devices` devices: each computes the gradients of its own
    rows of a batch of `rows`, an all-reduce sums them (`grad_bytes` each, `sent` bytes sent
    per device, as counted), and every device applies the same update to its replica."""
    fig, ax = plt.subplots(figsize=(9, 0.42 * devices + 1.3))
    per = rows // devices
    for d in range(devices):
        colour = _device_colour(d, devices)
        first = f"rows {d * per}-{(d + 1) * per - 1}" if per > 1 else f"row {d * per}"
        _box(ax, 0.0, d, 1.7, 0.8, colour, first, 8)
        _box(ax, 2.0, d, 1.9, 0.8, "0.85", "forward, backward", 8)
        _box(ax, 4.2, d, 1.5, 0.8, colour, f"gradients g{d}", 8)
        _box(ax, 7.5, d, 2.2, 0.8, "C2", "sum, same update", 8)
        for x in (1.7, 3.9, 5.7, 7.1):
            ax.annotate("", (x + 0.3, d + 0.4), (x, d + 0.4), arrowprops={"arrowstyle": "->"})
    label = f"all-reduce\nof {grad_bytes:,}\nbytes"
    _box(ax, 6.0, 0.0, 1.1, devices - 0.2, "C3", label, 8)
    ax.set_xlim(-0.1, 9.8)
    ax.set_ylim(devices + 0.1, -0.3)
    ax.axis("off")
    ax.set_title(
        f"Data parallelism on {devices} devices: each sends {sent:,.0f} bytes per step "
        "(2(N-1)/N of the gradients, counted)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_tensor_parallel_mlp(layout: Layout, rows: int, block: int = 0) -> Figure:
    """The book's MLP under tensor parallelism, drawn from `layout`: the up projection split
    by columns and the down projection by rows over the mesh axis that splits `mlp`, so the
    hidden activations need no communication and the output is a sum of partial products, one
    all-reduce; `rows` is the batch's rows, split as the layout splits batches."""

    path = next(p.path for p in layout.placements if p.path.endswith(f"blocks/{block}/mlp/up"))
    up = layout.array_at(path)
    down = layout.array_at(path[: -len("up")] + "down")
    embed, hidden = up.shape
    batch = layout.batch_sharding.spec[0] if layout.batch_sharding.spec else None
    split = up.sharding.spec[1] if len(up.sharding.spec) > 1 else None

    def activation(width: int, axis: object) -> jax.ShapeDtypeStruct:
        sharding = NamedSharding(layout.mesh, PartitionSpec(batch, axis))
        return jax.ShapeDtypeStruct((rows, width), up.dtype, sharding=sharding)

    panels = {
        f"x {(rows, embed)}\nbatch rows split": activation(embed, None),
        f"W_up {tuple(up.shape)}\ncolumns split": up,
        "h = gelu(x W_up)\nno communication": activation(hidden, split),
        f"W_down {tuple(down.shape)}\nrows split": down,
        "y = h W_down: partial sums,\nall-reduced over the split": activation(embed, None),
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.1))
    for ax, (title, array) in zip(axes, panels.items(), strict=True):
        plot_sharding(array, ax, title)
        ax.title.set_fontsize(8)
    shape = ", ".join(f"{a} {s}" for a, s in layout.mesh.shape.items())
    fig.suptitle(
        f"The MLP of block {block} under {layout.rules.name}, mesh {shape}: one all-reduce in "
        "the forward pass (y), one in the backward pass (the gradient of x)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_strategy_costs(
    state: Mapping[str, int],
    temp: Mapping[str, int],
    sent: Mapping[str, float],
    formulas: Mapping[str, float],
    ideal: float,
) -> Figure:
    """Per strategy, memory per device of a compiled step (left: the train state and the
    step's temporaries, stacked, against `ideal`, the state over N) and bytes each device
    sends per step (right, against `formulas`: a dashed line each)."""
    names = list(state)
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(9, 3.2))
    held = np.array([state[k] for k in names]) / 1024
    ax_mem.bar(names, held, color="C0", label="train state")
    temps = [temp[k] / 1024 for k in names]
    ax_mem.bar(names, temps, bottom=held, color="C1", label="step temporaries")
    ax_mem.axhline(ideal / 1024, color="black", linestyle="--", linewidth=1, label="state / N")
    ax_mem.set_ylabel("KiB per device")
    ax_mem.legend(fontsize=8)
    colours = [f"C{i}" for i in range(len(names))]
    ax_comm.bar(names, [sent[k] / 1024 for k in names], color=colours)
    for style, (label, value) in zip((":", "--", "-."), formulas.items(), strict=False):
        ax_comm.axhline(value / 1024, color="black", linestyle=style, linewidth=1, label=label)
    ax_comm.set_ylabel("KiB sent per device per step")
    ax_comm.legend(fontsize=8)
    fig.tight_layout()
    return fig


KIND_COLOURS = {"matmul": "C0", "collective": "C3", "other": "0.6"}
"""The colour of each kind of op in profiles and rooflines."""


def plot_profile(rows: Sequence[Timed], title: str = "", named: int = 3) -> Figure:
    """A profiled step as a timeline: a row per device, a box per op from its start to its
    end, coloured by kind (matrix product, collective, other), the optimizer's ops hatched;
    the `named` longest ops of the first device labelled with their HLO names."""
    devices = sorted({r.device for r in rows})
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(devices) + 1.4))
    origin = min(s for r in rows for s in r.starts)
    boxes: dict[tuple[int, str, bool], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        spans = zip(r.starts, r.durations, strict=True)
        key = (devices.index(r.device), r.kind, r.phase == "optimizer")
        boxes[key] += [((start - origin) / 1e3, duration / 1e3) for start, duration in spans]
    for (lane, kind, optimizer), spans in boxes.items():
        ax.broken_barh(
            spans, (lane - 0.4, 0.8), facecolors=KIND_COLOURS[kind], edgecolor="none",
            hatch="////" if optimizer else None,
        )  # fmt: skip
    first = [r for r in rows if r.device == devices[0]]
    for r in sorted(first, key=lambda r: -r.wall)[:named]:
        start = (r.starts[0] - origin) / 1e3
        ax.annotate(
            r.name, (start + r.durations[0] / 2e3, -0.4), xytext=(0, 6),
            textcoords="offset points", ha="center", fontsize=7, rotation=20,
        )  # fmt: skip
    ax.set_ylim(len(devices) - 0.5, -1.3)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.set_xlabel("milliseconds since the step's first op")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="////", edgecolor="k"))
    ax.legend(handles, [*KIND_COLOURS, "optimizer"], fontsize=8, ncols=4, loc="lower right")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_roofline(
    placed: Sequence[Placed],
    hw: Hardware | str,
    others: Sequence[str] = (),
    marks: Mapping[str, float] | None = None,
) -> Figure:
    """Ops on the roofline of `hw` (log-log: FLOPs per byte against FLOP/s), a dot per op
    sized by its time and coloured by kind, with the roofs of the datasheet accelerators
    named in `others` dashed, every ridge point marked, and `marks` (name: FLOPs per byte)
    drawn as labelled arrows on the first roof."""
    hw, marks = hardware(hw), dict(marks or {})
    fig, ax = plt.subplots(figsize=(8, 4.2))
    lowest = min([p.intensity for p in placed] + list(marks.values()) + [0.5])
    highest = max([ridge(hardware(h)) for h in [hw, *others]] + list(marks.values()))
    span = np.geomspace(lowest / 2, 4 * highest, 200)
    for k, h in enumerate([hw, *(hardware(o) for o in others)]):
        style = "-" if k == 0 else "--"
        colour = "black" if k == 0 else f"C{k + 3}"
        ax.plot(span, [attainable(i, h) for i in span], style, color=colour, label=h.name)
        ax.axvline(ridge(h), color=colour, linestyle=":", linewidth=0.8)
        ax.annotate(
            f"{ridge(h):.0f} FLOP/B", (ridge(h), h.flops), xytext=(3, 3),
            textcoords="offset points", fontsize=7, color=colour,
        )  # fmt: skip
    for label, intensity in marks.items():
        ax.annotate(
            label, (intensity, attainable(intensity, hw)), xytext=(0, -28),
            textcoords="offset points", ha="center", fontsize=8,
            arrowprops={"arrowstyle": "->", "linewidth": 0.8},
        )  # fmt: skip
    longest = max([p.seconds for p in placed] + [1e-9])
    for kind, colour in KIND_COLOURS.items():
        mine = [p for p in placed if p.kind == kind]
        if mine:
            ax.scatter(
                [p.intensity for p in mine], [p.achieved for p in mine],
                s=[10 + 200 * p.seconds / longest for p in mine],
                color=colour, alpha=0.7, label=f"{kind} ops", edgecolor="k", linewidth=0.3,
            )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
