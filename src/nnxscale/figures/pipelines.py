"""Pipeline schedules drawn from the schedule objects: timelines (Gantt charts) and bubbles."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from nnxscale.figures.drawing import box
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

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_timeline(timeline: Timeline, ax: Axes | None = None, makespan: float = 0.0) -> Axes:
    """A Gantt chart of a simulated schedule: a row per device, a box per task, idle left blank.

    Forward passes are light and backward passes dark (a split backward's weight-gradient
    pass W hatched), coloured by micro-batch and labelled with it (and the virtual stage, as
    a subscript, when there are several per device). `makespan` sets a common time axis
    when several charts are compared.
    """
    import matplotlib.pyplot as plt

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
            box(
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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
