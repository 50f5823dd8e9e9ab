"""The book's figures, drawn from the library's own objects."""

from nnxscale.figures.activations import plot_collective_matmul, plot_sequence_parallel
from nnxscale.figures.checkpoints import plot_restore, plot_saves
from nnxscale.figures.drawing import SUM, matrix_view
from nnxscale.figures.evidence import plot_grid, plot_picks
from nnxscale.figures.failures import BREAKS, plot_failures
from nnxscale.figures.layouts import (
    block_sources,
    plot_collectives,
    plot_init_memory,
    plot_layouts,
    plot_mesh,
    plot_on_mesh,
    plot_ring_costs,
    plot_rule_sets,
    plot_sharding,
    plot_shardings,
    plot_shares,
    shard_blocks,
)
from nnxscale.figures.pipelines import plot_bubbles, plot_timeline, plot_timelines
from nnxscale.figures.profiles import KIND_COLOURS, plot_profile, plot_roofline
from nnxscale.figures.rings import plot_dispatch, plot_links, plot_ring, plot_topology
from nnxscale.figures.strategies import (
    plot_data_parallel,
    plot_fsdp_timeline,
    plot_ledger,
    plot_strategy_costs,
    plot_temporaries,
    plot_tensor_parallel_mlp,
    plot_zero_stages,
)

__all__ = [
    "BREAKS",
    "KIND_COLOURS",
    "SUM",
    "block_sources",
    "matrix_view",
    "plot_bubbles",
    "plot_collective_matmul",
    "plot_collectives",
    "plot_data_parallel",
    "plot_dispatch",
    "plot_failures",
    "plot_fsdp_timeline",
    "plot_grid",
    "plot_init_memory",
    "plot_layouts",
    "plot_ledger",
    "plot_links",
    "plot_mesh",
    "plot_on_mesh",
    "plot_picks",
    "plot_profile",
    "plot_restore",
    "plot_ring",
    "plot_ring_costs",
    "plot_roofline",
    "plot_rule_sets",
    "plot_saves",
    "plot_sequence_parallel",
    "plot_sharding",
    "plot_shardings",
    "plot_shares",
    "plot_strategy_costs",
    "plot_temporaries",
    "plot_tensor_parallel_mlp",
    "plot_timeline",
    "plot_timelines",
    "plot_topology",
    "plot_zero_stages",
    "shard_blocks",
]
