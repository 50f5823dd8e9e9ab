"""Drawing shared by the figures: a colour per device, labelled boxes, byte units, matrices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SUM = "Σ"
"""The label of a block that holds a sum over every device's block."""


def device_colour(device_id: int, total: int) -> tuple[float, float, float, float]:
    import matplotlib.pyplot as plt

    return plt.get_cmap("tab20" if total > 10 else "tab10")(device_id % 20)


def text_colour(background: Sequence[float]) -> str:
    """Black or white, whichever reads better on `background` (an RGB(A) colour)."""
    red, green, blue = background[:3]
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def box(
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
    import matplotlib
    import matplotlib.pyplot as plt

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
            color=text_colour(rgba),
        )


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


def byte_unit(largest: float) -> tuple[float, str]:
    """A divisor and its name that show `largest` bytes as a number of a readable size."""
    for divisor, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= 4 * divisor:
            return divisor, name
    return 1, "bytes"


def frameless(ax: Axes, labelsize: float | None = None) -> None:
    """`ax` without its frame (spines) or tick marks; tick labels in `labelsize` if given."""
    ax.tick_params(length=0, **({} if labelsize is None else {"labelsize": labelsize}))
    for spine in ax.spines.values():
        spine.set_visible(False)
