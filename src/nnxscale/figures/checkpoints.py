"""Checkpoints drawn: saves over time, and a restore onto another mesh, chunk by chunk."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from nnxscale.checkpoint.restoring import chunks_read
from nnxscale.figures.drawing import box
from nnxscale.figures.layouts import plot_sharding, shard_blocks
from nnxscale.model.config import Config
from nnxscale.model.transformer import create
from nnxscale.placement.catalogue import FSDP, TP
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import ReplicationWarning, resolve
from nnxscale.placement.rules import Rules, strategy_mesh

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_saves(steps: Mapping[int, tuple[float, float]], saves: Mapping[int, Any]) -> Figure:
    """Training steps and asynchronous saves on one measured time axis (milliseconds).

    `steps` maps a step number to its (start, end) times; `saves` maps a step to the times a
    save of it started, handed control back, and had its files written (`Checkpoints.times`).
    Training waits only while a save copies the arrays off the devices; the files are written
    in the background while the next steps run.
    """
    import matplotlib.pyplot as plt

    origin = min(min(s for s, _ in steps.values()), *(t.started for t in saves.values()))

    def ms(t: float) -> float:
        return 1e3 * (t - origin)

    fig, ax = plt.subplots(figsize=(10, 2.2))
    for k, (start, end) in steps.items():
        box(ax, ms(start), -0.4, ms(end) - ms(start), 0.8, "C0", str(k))
    for step, t in saves.items():
        box(ax, ms(t.started), -0.4, ms(t.returned) - ms(t.started), 0.8, "C3")
        if t.written is not None:
            box(ax, ms(t.returned), 0.6, ms(t.written) - ms(t.returned), 0.8, "C1")
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


def _outline_reads(
    ax: Axes,
    new: jax.ShapeDtypeStruct,
    chunk: tuple[int, ...],
    reads: list[tuple[int, ...]],
    device: int,
) -> None:
    """Hatch the saved chunks `device` reads, and outline in red the shard it keeps."""
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
        _outline_reads(ax, new, chunk, reads, device)
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
