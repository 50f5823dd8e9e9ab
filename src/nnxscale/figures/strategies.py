"""Training strategies drawn: data and tensor parallelism, ZeRO stages, FSDP's timeline, costs."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnxscale.costs.counts import Setup
from nnxscale.costs.hardware import Hardware, hardware
from nnxscale.costs.steps import LEDGER_PARTS, ledger, step_cost
from nnxscale.figures.drawing import box, byte_unit, device_colour
from nnxscale.figures.layouts import plot_sharding
from nnxscale.model.config import Config
from nnxscale.model.transformer import create
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import Layout, ReplicationWarning
from nnxscale.placement.rules import Rules
from nnxscale.train.step import ROLE_NAMES, role_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_temporaries(measured: Mapping[str, Mapping[int, int]]) -> Figure:
    """Compiled temporary bytes per device against micro-batches m, a line per schedule:
    `measured[schedule name][m]`."""
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

    layers = len(layer_bytes)
    unit = max(layer_bytes)
    fig, ax = plt.subplots(figsize=(10, 2.3))
    t = 0.0
    rows = {"communication": 0, "computation": 1}
    colours = {"all-gather": "C0", "reduce-scatter": "C3", "forward": "C2", "backward": "C1"}

    def span(row: str, start: float, width: float, kind: str, label: str) -> None:
        box(ax, start, rows[row] - 0.4, width, 0.8, colours[kind], label)

    for i, size in enumerate(layer_bytes):
        span("communication", t, size / unit, "all-gather", f"AG{i}")
        t += size / unit
        span("computation", t, 1.0, "forward", f"F{i}")
        t += 1.0
    for i in reversed(range(layers)):
        size = layer_bytes[i] / unit
        if gather_again:
            span("communication", t, size, "all-gather", f"AG{i}")
            t += size
        span("computation", t, 2.0, "backward", f"B{i}")
        t += 2.0
        span("communication", t, size, "reduce-scatter", f"RS{i}")
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


def plot_ledger(
    cfg: Config, hw: Hardware | str, setups: Mapping[str, Setup], batch: int, seq: int | None = None
) -> Figure:
    """A device's memory ledger under each setup, as the cost model counts it: one bar per
    setup of its four parts (`costs.ledger`), a tick at the step's peak (`costs.step_cost`)
    and the device's memory as a dashed line, so one sees what fits and which part does not."""
    import matplotlib.pyplot as plt

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


def plot_zero_stages(cfg: Config, rule_sets: Sequence[Rules]) -> Figure:
    """What each device holds of the book's Transformer (`cfg`) and its AdamW state under each
    rule set on all devices, role by role (`nnxscale.train.role_bytes`): parameters, gradients
    and optimizer state stacked, DP's replication beside what ZeRO's stages and FSDP split."""
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():  # arrays a rule set cannot split show in the bars
        warnings.simplefilter("ignore", ReplicationWarning)
        held = role_bytes(lambda: create(cfg), rule_sets)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract(lambda: create(cfg)))))
    divisor, unit = byte_unit(max(sum(h.values()) for h in held.values()))
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
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.42 * devices + 1.3))
    per = rows // devices
    for d in range(devices):
        colour = device_colour(d, devices)
        first = f"rows {d * per}-{(d + 1) * per - 1}" if per > 1 else f"row {d * per}"
        box(ax, 0.0, d, 1.7, 0.8, colour, first, 8)
        box(ax, 2.0, d, 1.9, 0.8, "0.85", "forward, backward", 8)
        box(ax, 4.2, d, 1.5, 0.8, colour, f"gradients g{d}", 8)
        box(ax, 7.5, d, 2.2, 0.8, "C2", "sum, same update", 8)
        for x in (1.7, 3.9, 5.7, 7.1):
            ax.annotate("", (x + 0.3, d + 0.4), (x, d + 0.4), arrowprops={"arrowstyle": "->"})
    label = f"all-reduce\nof {grad_bytes:,}\nbytes"
    box(ax, 6.0, 0.0, 1.1, devices - 0.2, "C3", label, 8)
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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
