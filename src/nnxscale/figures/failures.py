"""Where a run breaks: the errors a reader meets, placed at the stage of a run that raises
them and coloured by what raises them (JAX, the library, the launcher)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nnxscale.figures.drawing import box

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RAISERS = {
    "JAX": ("#4c72b0", "raised by JAX"),
    "nnxscale": ("#55a868", "raised by nnxscale"),
    "launcher": ("#c44e52", "raised by the launcher or a cluster engine"),
    "none": ("#8c8c8c", "nothing raised"),
}
"""The colour and legend of each kind of raiser; "none" is a fault that raises nothing."""

BREAKS: dict[str, list[tuple[str, str]]] = {
    "starting JAX": [
        ("EmulationTooLateError", "nnxscale"),
        ("mesh too big", "nnxscale"),
    ],
    "placing": [("ReplicationWarning", "nnxscale")],
    "tracing": [("ShardingTypeError", "JAX")],
    "stepping": [
        ("batch rows", "nnxscale"),
        ("TRACING CACHE MISS", "JAX"),
        ("NonFiniteError", "nnxscale"),
        ("Array has been deleted", "JAX"),
        ("one busy device", "none"),
        ("random values", "none"),
    ],
    "memory": [("RESOURCE_EXHAUSTED", "JAX")],
    "checkpoints": [
        ("CheckpointMismatchError", "nnxscale"),
        ("SaveError", "nnxscale"),
        ("DirectoryLockedError", "nnxscale"),
    ],
    "processes": [
        ("LaunchError", "launcher"),
        ("DEADLINE_EXCEEDED", "JAX"),
        ("process count", "nnxscale"),
        ("no srun", "nnxscale"),
        ("a task died", "launcher"),
        ("NCCL error", "JAX"),
    ],
}
"""Appendix A2's errors, by the stage of a run that raises them: the map its figure draws."""


def plot_failures(stages: Mapping[str, Sequence[tuple[str, str]]]) -> Figure:
    """One column per stage of a run, left to right, holding the errors raised there, each a
    box (name, raiser) coloured as `RAISERS[raiser]` says."""
    import matplotlib.pyplot as plt

    unknown = {r for errors in stages.values() for _, r in errors} - set(RAISERS)
    if unknown:
        raise ValueError(f"raisers {sorted(unknown)} unknown; use those of {sorted(RAISERS)}")
    rows = max(len(errors) for errors in stages.values())
    fig, ax = plt.subplots(figsize=(2.1 * len(stages), 0.5 * rows + 1.2))
    for column, (stage, errors) in enumerate(stages.items()):
        ax.text(column + 0.45, rows + 0.2, stage, ha="center", va="bottom", fontsize=9)
        for row, (name, raiser) in enumerate(errors):
            box(ax, column, rows - row - 1, 0.9, 0.85, RAISERS[raiser][0], name, fontsize=7)
    ax.annotate(
        "",
        xy=(len(stages) - 0.1, -0.35),
        xytext=(0, -0.35),
        arrowprops={"arrowstyle": "->", "color": "0.4"},
    )
    ax.text(len(stages) / 2, -0.75, "a run, in order", ha="center", fontsize=8, color="0.3")
    used = [r for r in RAISERS if any(r == x for e in stages.values() for _, x in e)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=RAISERS[r][0]) for r in used]
    labels = [RAISERS[r][1] for r in used]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.05), ncol=len(used))
    ax.set_xlim(-0.1, len(stages))
    ax.set_ylim(-1, rows + 0.8)
    ax.axis("off")
    fig.tight_layout()
    return fig
