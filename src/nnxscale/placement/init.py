"""Sharded initialisation: abstract models, and creation straight into the target shards."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscale.core.memory import CompiledMemory
from nnxscale.core.trees import place
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.mesh import make_mesh
from nnxscale.placement.rules import Rules, strategy_mesh


def abstract[T](create: Callable[[], T]) -> T:
    """What `create()` would build, with shapes and dtypes but no memory (`nnx.eval_shape`)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(create)


def compile_init[T](
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


def compile_whole(create: Callable[[], Any]) -> jax.stages.Compiled:
    """`create` compiled the usual way, without shardings: the program that builds every
    array whole on one device, as a model built first and split afterwards is built. Its
    random numbers are `compile_init`'s (partitionable), so the two give the same values."""

    def make() -> Any:
        with nnx.use_eager_sharding(False):
            made = create()
            state = nnx.split(made)[1]
            return state if jax.tree.leaves(state) else made

    with jax.threefry_partitionable(True):
        lowered = jax.jit(make).lower()
    return lowered.compile()


@dataclasses.dataclass(frozen=True)
class InitPrograms[T]:
    """One constructor compiled two ways, to compare what a device holds while it runs:
    `whole`, without shardings (build on one device, split afterwards), and `sharded`, by
    `compile_init` straight into `layout`'s shards."""

    whole: jax.stages.Compiled
    sharded: jax.stages.Compiled
    graphdef: nnx.GraphDef | None
    layout: Layout

    @classmethod
    def compile(
        cls, create: Callable[[], T], rules: Rules, mesh: Mesh | None = None
    ) -> InitPrograms[T]:
        """Both programs for `create`, laid out by `rules` on `mesh` (default: the rule set's
        mesh on every device, `strategy_mesh`)."""
        mesh = mesh if mesh is not None else strategy_mesh(rules)
        sharded, graphdef, layout = compile_init(create, rules, mesh)
        return cls(compile_whole(create), sharded, graphdef, layout)

    def memory(self) -> dict[str, CompiledMemory]:
        """XLA's per-device memory analysis of each program, by name."""
        return {"whole": CompiledMemory.of(self.whole), "sharded": CompiledMemory.of(self.sharded)}

    def create(self) -> T:
        """Run the sharded program: what `create` builds, every array in its shards."""
        made = self.sharded()
        return made if self.graphdef is None else nnx.merge(self.graphdef, made)


def init_sharded[T](create: Callable[[], T], rules: Rules, mesh: Mesh) -> tuple[T, Layout]:
    """Run `create` with every array created in its shards; returns the result and its layout.

    Works alike for NNX modules, `nnx.State`s and raw pytrees of arrays.
    """
    compiled, graphdef, layout = compile_init(create, rules, mesh)
    made = compiled()
    return (made if graphdef is None else nnx.merge(graphdef, made)), layout


def shard[T](tree: T, rules: Rules, mesh: Mesh) -> tuple[T, Layout]:
    """`tree` (an NNX module, an `nnx.State` or any pytree of arrays) copied into the layout
    `rules` give it on `mesh`: every device receives only its shards. Returns it and the layout.
    """
    graphdef, state = nnx.split(tree)
    if jax.tree.leaves(state):  # NNX modules or variables
        layout = resolve(state, rules, mesh)
        return nnx.merge(graphdef, place(state, layout.shardings())), layout
    layout = resolve(tree, rules, mesh)
    return place(tree, layout.shardings()), layout


@dataclasses.dataclass(frozen=True)
class SplitDraw:
    """One draw of `jax.random.normal` with its first dimension split over `devices`: how it
    was split, and whether its values are the ones a single device draws."""

    devices: int
    rows: str
    split: str
    identical: bool


def draws_by_split(shape: tuple[int, ...], counts: Sequence[int], seed: int = 0) -> list[SplitDraw]:
    """`jax.random.normal` of `shape` drawn with its first dimension split over each of
    `counts` devices (an Auto mesh over the first devices), compared with one device's draw.

    A count that divides the dimension splits the output itself; JAX refuses to store an
    uneven split (`IndivisibleError`), so for a count that does not divide it the split is
    made inside the program, where the compiler pads the last shard, and the output is
    whole. JAX issue 40232 reports values that depend on the shard count; the partitionable
    generator (`jax_threefry_partitionable`, forced here as `compile_init` forces it) gives
    each element from its index alone."""
    key = jax.random.key(seed)
    whole = shape[0]
    with jax.threefry_partitionable(True):
        reference = np.asarray(jax.random.normal(key, shape))
        draws = []
        for n in counts:
            mesh = make_mesh((n,), ("split",), devices=jax.devices()[:n])
            by_rows = NamedSharding(mesh, PartitionSpec("split"))
            replicated = NamedSharding(mesh, PartitionSpec())
            if whole % n == 0:
                out = jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=by_rows)(key)
                how, per = "the output", f"{whole // n}"
            else:

                def padded(k: jax.Array, by_rows: NamedSharding = by_rows) -> jax.Array:
                    drawn = jax.lax.with_sharding_constraint(jax.random.normal(k, shape), by_rows)
                    return drawn * 1.0  # computed on while split

                out = jax.jit(padded, out_shardings=replicated)(key)
                how, per = "inside the program (padded)", f"{whole / n:.1f}"
            draws.append(SplitDraw(n, per, how, bool(np.array_equal(np.asarray(out), reference))))
    return draws
