"""Layouts drawn from real arrays: blocks per device, meshes, rule sets, collectives, init
memory."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nnxscale.analysis.comm import ring_bytes
from nnxscale.core.memory import CompiledMemory
from nnxscale.figures.drawing import SUM, box, byte_unit, device_colour, matrix_view
from nnxscale.placement.init import InitPrograms
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.rules import strategy_mesh

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(4, 3))[1]
    rows, cols = (1, array.shape[0]) if len(array.shape) == 1 else array.shape
    total = len(array.sharding.device_set)
    for (r0, r1, c0, c1), ids in shard_blocks(array).items():
        label = "\n".join(",".join(str(i) for i in ids[k : k + 4]) for k in range(0, len(ids), 4))
        box(ax, c0, r0, c1 - c0, r1 - r0, device_colour(ids[0], total), label, 9, "black", 1.5)
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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

    ids = mesh.device_ids if mesh.devices.ndim == 2 else mesh.device_ids.reshape(1, -1)
    names = mesh.axis_names if mesh.devices.ndim == 2 else ("", mesh.axis_names[0])
    ax = ax or plt.subplots(figsize=(0.7 * ids.shape[1] + 1.2, 0.7 * ids.shape[0] + 0.8))[1]
    for (r, c), device in np.ndenumerate(ids):
        box(ax, c, r, 1, 1, device_colour(int(device), ids.size), str(device), 10, "black")
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
    import matplotlib.pyplot as plt

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
                colour = (0.6, 0.6, 0.6, 1.0) if summed else device_colour(source, devices)
                label = str(source) if len(row) <= 8 or summed else ""
                box(ax, k, d, 1, 0.85, colour, label)
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


def plot_layouts(layouts: Mapping[str, Layout], paths: Sequence[str]) -> Figure:
    """The same weights under several layouts, a row per layout and a column per path: each
    weight drawn as a matrix (`matrix_view`) of blocks coloured and labelled by the devices
    that hold them, titled with its shape and where each dimension goes."""
    import matplotlib.pyplot as plt

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


def plot_on_mesh(array: jax.Array | jax.ShapeDtypeStruct) -> Figure:
    """The mesh an array is laid out on beside the array cut into its blocks, in the same
    colours: which device holds which block, at a glance."""
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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


def plot_init_memory(programs: InitPrograms) -> Figure:
    """What each device holds while a model is created, from XLA's memory analysis of the two
    programs `programs` compiled: built whole on device 0 and then split (left), or created
    straight into its shards (right). Each bar stacks the program's outputs (the weights) on
    its temporaries; dashed outlines mark what each device keeps after the split."""
    import matplotlib.pyplot as plt

    whole = CompiledMemory.of(programs.whole)
    sharded = CompiledMemory.of(programs.sharded)
    devices = programs.layout.mesh.devices.size
    divisor, unit = byte_unit(whole.output + whole.temp)
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
