"""Collectives: their ring-algorithm costs (the book's convention) and the gathers that the
hand-written strategies (`nnxscale.fsdp`, `nnxscale.pipeline`) run inside `jax.shard_map`."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def ring_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends for a collective over `group_size` devices on a ring.

    `nbytes` is the size of the full (unsharded) array: the all-gather's output, the
    reduce-scatter's input, the all-reduce's array, the all-to-all's buffer; for
    collective-permute it is the buffer each device sends to its neighbour.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    n = group_size
    if kind == "collective-permute":
        return float(nbytes)
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return factor * nbytes


GATHERED = "fsdp_gathered"
"""The name that marks gathered weights for remat policies."""


def gather(shard: jax.Array, spec: PartitionSpec, axis: str) -> jax.Array:
    """The whole array from this device's shard: an all-gather along the dimension `axis` splits."""
    dims = [d for d, entry in enumerate(spec) if entry == axis]
    if not dims:
        return shard  # replicated: every device already holds all of it
    return checkpoint_name(jax.lax.all_gather(shard, axis, axis=dims[0], tiled=True), GATHERED)


def gather_tree(shards: nnx.State, specs: nnx.State, axis: str) -> nnx.State:
    """`gather` applied to every array of a state, each with its spec from the layout."""
    return jax.tree.map(lambda x, s: gather(x, s, axis), shards, specs)
