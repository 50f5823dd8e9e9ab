"""Profiles drawn: each device's timeline of ops, and ops on the roofline."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from nnxscale.costs.hardware import Hardware, hardware
from nnxscale.profiling.profiles import Placed, Timed, attainable, ridge

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KIND_COLOURS = {"matmul": "C0", "collective": "C3", "other": "0.6"}
"""The colour of each kind of op in profiles and rooflines."""


def plot_profile(rows: Sequence[Timed], title: str = "", named: int = 3) -> Figure:
    """A profiled step as a timeline: a row per device, a box per op from its start to its
    end, coloured by kind (matrix product, collective, other), the optimizer's ops hatched;
    the `named` longest ops of the first device labelled with their HLO names."""
    import matplotlib.pyplot as plt

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
            spans,
            (lane - 0.4, 0.8),
            facecolors=KIND_COLOURS[kind],
            edgecolor="none",
            hatch="////" if optimizer else None,
        )
    first = [r for r in rows if r.device == devices[0]]
    for r in sorted(first, key=lambda r: -r.wall)[:named]:
        start = (r.starts[0] - origin) / 1e3
        ax.annotate(
            r.name,
            (start + r.durations[0] / 2e3, -0.4),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=7,
            rotation=20,
        )
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
    import matplotlib.pyplot as plt

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
            f"{ridge(h):.0f} FLOP/B",
            (ridge(h), h.flops),
            xytext=(3, 3),
            textcoords="offset points",
            fontsize=7,
            color=colour,
        )
    for label, intensity in marks.items():
        ax.annotate(
            label,
            (intensity, attainable(intensity, hw)),
            xytext=(0, -28),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "linewidth": 0.8},
        )
    longest = max([p.seconds for p in placed] + [1e-9])
    for kind, colour in KIND_COLOURS.items():
        mine = [p for p in placed if p.kind == kind]
        if mine:
            ax.scatter(
                [p.intensity for p in mine],
                [p.achieved for p in mine],
                s=[10 + 200 * p.seconds / longest for p in mine],
                color=colour,
                alpha=0.7,
                label=f"{kind} ops",
                edgecolor="k",
                linewidth=0.3,
            )
    ax.set(xscale="log", yscale="log", ylabel="FLOP/s")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
