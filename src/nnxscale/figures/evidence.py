"""The cost model against measured runs, drawn: the Ultra-Scale Playbook grid's predictions
against its measurements, and the model's first pick against the measured best."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nnxscale.evidence.grid import FIT_NODES, MODELS, WITHIN, Group, Priced

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_grid(priced: Sequence[Priced]) -> Figure:
    """Predicted against measured tokens per second per GPU, one panel per model, on log
    axes: the runs the time model was fitted on (1 to 8 nodes) in grey, those it was not
    (16 to 64 nodes) coloured by node count; the diagonal and the band of `WITHIN`."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(10, 3.6))
    nodes = sorted({p.run.nodes for p in priced if p.run.nodes not in FIT_NODES})
    for ax, model in zip(axes, MODELS, strict=True):
        mine = [p for p in priced if p.run.model == model]
        low = min(min(p.tokens, p.run.tokens) for p in mine) / 1.5
        high = max(max(p.tokens, p.run.tokens) for p in mine) * 1.5
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        for factor in (WITHIN, 1 / WITHIN):
            ax.plot([low, high], [low * factor, high * factor], "k:", linewidth=0.8)
        fitted = [p for p in mine if p.run.fit]
        ax.scatter(
            [p.run.tokens for p in fitted],
            [p.tokens for p in fitted],
            s=8,
            color="0.6",
            label="fitted on: 1 to 8 nodes",
        )
        for i, n in enumerate(nodes):
            tested = [p for p in mine if p.run.nodes == n]
            ax.scatter(
                [p.run.tokens for p in tested],
                [p.tokens for p in tested],
                s=10,
                marker="o^s"[i % 3],
                color=f"C{i}",
                label=f"test: {n} nodes",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_title(f"{model}: {len(mine)} runs", fontsize=10)
        ax.set_xlabel("measured tokens/s per GPU")
    axes[0].set_ylabel("predicted tokens/s per GPU")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_picks(groups: Sequence[Group]) -> Figure:
    """Per model, against node count: the best throughput measured, and what the model's
    first pick measured (`nnxscale.evidence.grid.rank`); the test split shaded."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(10, 3.2))
    for ax, model in zip(axes, MODELS, strict=True):
        mine = sorted((g for g in groups if g.model == model), key=lambda g: g.nodes)
        nodes = [g.nodes for g in mine]
        ax.plot(nodes, [g.best for g in mine], "o-", color="black", label="measured best")
        ax.plot(
            nodes,
            [g.pick.tokens for g in mine],
            "s--",
            color="C3",
            label="the model's first pick, measured",
        )
        ax.axvspan(max(FIT_NODES) * 1.4, max(nodes) * 1.4, color="0.92", zorder=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("nodes of 8 H100s (test split shaded)")
    axes[0].set_ylabel("tokens/s per GPU")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig
