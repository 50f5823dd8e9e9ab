"""Sharded initialisation: abstract models, and creation straight into the target shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from nnxscale.layout import Layout, resolve
from nnxscale.rules import Rules
from nnxscale.trees import place

T = TypeVar("T")


def abstract(create: Callable[[], T]) -> T:
    """What `create()` would build, with shapes and dtypes but no memory (`nnx.eval_shape`)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(create)


def compile_init(
    create: Callable[[], T], rules: Rules, mesh: Mesh
) -> tuple[jax.stages.Compiled, nnx.GraphDef | None, Layout]:
    """Compile `create` so that every array it makes lands directly in its shards on `mesh`.

    `create` may return an NNX module (or any NNX object), an `nnx.State` or any pytree of
    arrays. The layout comes from resolving `rules` against the abstract result; the compiled
    program's outputs are sharded by it, so XLA partitions the initialisers themselves and
    no device ever holds an unsharded array. Random numbers use JAX's partitionable threefry
    whatever the global setting: only with it are the values the same on every mesh and
    generated shard by shard. The graph definition is None when `create` returns a pytree.
    """
    shapes = abstract(create)
    graphdef, state = nnx.split(shapes)
    if not jax.tree.leaves(state):  # no NNX variables in it: a pytree of arrays
        graphdef, state = None, shapes
    if not jax.tree.leaves(state):
        raise ValueError(
            f"create() returned a {type(shapes).__name__} holding no arrays: return an NNX "
            "module, an nnx.State, or a pytree (dict, list, tuple) of arrays."
        )
    layout = resolve(state, rules, mesh)

    def make() -> nnx.State:
        with nnx.use_eager_sharding(False):
            made = create()
            return made if graphdef is None else nnx.split(made)[1]

    with jax.threefry_partitionable(True):
        lowered = jax.jit(make, out_shardings=layout.shardings()).lower()
    return lowered.compile(), graphdef, layout


def init_sharded(create: Callable[[], T], rules: Rules, mesh: Mesh) -> tuple[T, Layout]:
    """Run `create` with every array created in its shards; returns the result and its layout.

    Works alike for NNX modules, `nnx.State`s and raw pytrees of arrays.
    """
    compiled, graphdef, layout = compile_init(create, rules, mesh)
    made = compiled()
    return (made if graphdef is None else nnx.merge(graphdef, made)), layout


def shard(tree: T, rules: Rules, mesh: Mesh) -> tuple[T, Layout]:
    """`tree` (an NNX module, an `nnx.State` or any pytree of arrays) copied into the layout
    `rules` give it on `mesh`: every device receives only its shards. Returns it and the layout.
    """
    graphdef, state = nnx.split(tree)
    if jax.tree.leaves(state):  # NNX modules or variables
        layout = resolve(state, rules, mesh)
        return nnx.merge(graphdef, place(state, layout.shardings())), layout
    layout = resolve(tree, rules, mesh)
    return place(tree, layout.shardings()), layout
