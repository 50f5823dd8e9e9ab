"""Where a layer's activations live: sequence parallelism's regions, and the blocks a
collective matmul passes around its ring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from nnxscale.figures.drawing import box, device_colour
from nnxscale.placement.rules import Rules
from nnxscale.profiling.overlap import held_block

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REGIONS = (
    ("norm and residual", None),
    ("attention, split by heads", "heads"),
    ("norm and residual", None),
    ("MLP, split by hidden units", "mlp"),
    ("norm and residual (next layer)", None),
)
"""One layer's regions in order, and the name a tensor-parallel region splits by."""


def joining(sums: bool, split_before: bool, split_after: bool) -> str:
    """The collective between two regions over `model`: one that leaves partial sums
    (`sums`) adds them (all of them, or each device its part of the sequence); one that
    enters a region needing the whole sequence gathers it where it was split."""
    if sums:
        return "reduce-scatter" if split_after else "all-reduce"
    return "all-gather" if split_before else "nothing: every device holds it whole"


def plot_sequence_parallel(rule_sets: Sequence[Rules], model: int = 4) -> Figure:
    """One layer on the `model` devices under each rule set, side by side: in each region a
    bar per device, the sequence from top to bottom, filled where the device holds it; and
    between regions the collective that joins them, read off the rules (the residual
    stream split along the sequence over `model` where `residual_length` maps there)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rule_sets), figsize=(4.4 * len(rule_sets), 6.4))
    for ax, rules in zip(np.atleast_1d(axes), rule_sets, strict=True):
        split = "model" in (rules.logical.get("residual_length") or ())
        for k, (name, by) in enumerate(REGIONS):
            y, parted = 1.7 * k, split and by is None
            for d in range(model):
                x, colour = 0.55 * d, device_colour(d, model)
                box(ax, x, y, 0.4, 1.0, "0.92", edgecolor="0.6")  # the whole sequence
                top, height = (y + d / model, 1 / model) if parted else (y, 1.0)
                box(ax, x, top, 0.4, height, colour, f"1/{model}" if by else "", 6)
            said = "sequence split" if parted else "whole sequence"
            ax.text(0.55 * model + 0.1, y + 0.5, f"{name}\n({said})", fontsize=8, va="center")
            if k + 1 < len(REGIONS):
                after = split and REGIONS[k + 1][1] is None
                label = joining(by is not None, parted, after)
                ax.annotate(
                    "",
                    (0.27 * model, y + 1.6),
                    (0.27 * model, y + 1.05),
                    arrowprops={"arrowstyle": "->"},
                )
                ax.text(
                    0.27 * model + 0.12,
                    y + 1.33,
                    label,
                    fontsize=7,
                    va="center",
                    color="tab:red" if label[0] != "n" else "0.4",
                )
        ax.set_title(f"{rules.name} on {model} devices of model", fontsize=10)
        ax.set_xlim(-0.1, 0.55 * model + 3.2)
        ax.set_ylim(1.7 * len(REGIONS), -0.2)
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_collective_matmul(devices: int) -> Figure:
    """The collective matmul's ring (`nx.overlap.collective_matmul`): a row per step, a
    column per device, each cell the block of rows the device multiplies at that step in
    the colour of the device that started with it, and an arrow where it is sent on."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.0 * devices + 1.6, 0.62 * devices + 0.8))
    for step in range(devices):
        for d in range(devices):
            owner = int(held_block(d, step, devices))
            colour = device_colour(owner, devices)
            box(ax, d, 0.62 * step, 0.72, 0.42, colour, f"rows of {owner}", 6)
            if step < devices - 1:  # sent on to the next device while multiplied here
                ax.annotate(
                    "",
                    ((d + 1) % devices + 0.1, 0.62 * step + 0.55),
                    (d + 0.62, 0.62 * step + 0.45),
                    arrowprops={"arrowstyle": "->", "color": "0.45", "lw": 0.8},
                )
        ax.text(devices + 0.05, 0.62 * step + 0.21, f"step {step}", fontsize=7, va="center")
    for d in range(devices):
        ax.text(d + 0.36, -0.15, f"device {d}", fontsize=7, ha="center")
    ax.set_xlim(-0.1, devices + 0.9)
    ax.set_ylim(0.62 * devices, -0.35)
    ax.axis("off")
    ax.set_title("Each device multiplies one block a step and passes it on", fontsize=9)
    fig.tight_layout()
    return fig
