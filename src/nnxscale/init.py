"""Sharded initialisation: abstract models, and creation straight into the target shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from nnxscale.layout import Layout, resolve
from nnxscale.rules import Rules

T = TypeVar("T")


def abstract(create: Callable[[], T]) -> T:
    """What `create()` would build, with shapes and dtypes but no memory (`nnx.eval_shape`)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(create)


def compile_init(
    create: Callable[[], T], rules: Rules, mesh: Mesh
) -> tuple[jax.stages.Compiled, nnx.GraphDef, Layout]:
    """Compile `create` so that every array it makes lands directly in its shards on `mesh`.

    The layout comes from resolving `rules` against the abstract result; the compiled
    program's outputs are sharded by it, so XLA partitions the initialisers themselves and
    no device ever holds an unsharded array. Random numbers use JAX's partitionable threefry
    whatever the global setting: only with it are the values the same on every mesh and
    generated shard by shard.
    """
    graphdef, state = nnx.split(abstract(create))
    layout = resolve(state, rules, mesh)

    def make() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.split(create())[1]

    with jax.threefry_partitionable(True):
        lowered = jax.jit(make, out_shardings=layout.shardings()).lower()
    return lowered.compile(), graphdef, layout


def init_sharded(create: Callable[[], T], rules: Rules, mesh: Mesh) -> tuple[T, Layout]:
    """Run `create` with every array created in its shards; returns the result and its layout."""
    compiled, graphdef, layout = compile_init(create, rules, mesh)
    return nnx.merge(graphdef, compiled()), layout
