"""Helpers for trees of arrays that every strategy uses: paths, random keys, placement, differences.

A neutral home: any module may import it without importing a strategy, a trainer or a model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding


def path_str(key_path: tuple[Any, ...]) -> str:
    """A key path as the `/`-joined string the library names arrays by (`blocks/mlp/up`)."""
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def flat(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf of `tree`; NNX variables are leaves, not their values."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return [(path_str(key_path), leaf) for key_path, leaf in leaves]


def is_key(x: Any) -> bool:
    """Whether `x` (an array or abstract array) holds typed random keys."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(x: jax.Array) -> jax.Array:
    """The integer data of random keys, or `x` itself if it holds no keys."""
    return jax.random.key_data(x) if is_key(x) else x


def shapes_of(tree: Any) -> Any:
    """`tree` with every array as its shape and dtype (`jax.ShapeDtypeStruct`), variables kept."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def stand_in(x: Any) -> Any:
    """A zero array shaped like abstract array `x` (random keys included); other leaves as
    they are. Inside `jax.eval_shape` it costs no memory: what an abstract model needs to be
    used where a concrete one is expected."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return x
    if is_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        zeros = jnp.zeros(data.shape, data.dtype)
        return jax.random.wrap_key_data(zeros, impl=jax.random.key_impl(x))
    return jnp.zeros(x.shape, x.dtype)


def place(values: Any, shardings: Any) -> Any:
    """Copy host or local arrays onto their shardings; with several processes, each builds
    only the shards its own devices hold (the values must be the same in every process).
    Arrays already on their sharding are kept as they are."""
    if jax.process_count() == 1:
        return jax.tree.map(_put, values, shardings)

    def one(x: jax.Array, sharding: Sharding) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x  # already placed, possibly across processes: nothing to copy
        host = np.asarray(key_data(x))
        placed = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        if not is_key(x):
            return placed
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))

    return jax.tree.map(one, values, shardings)


def _put(x: Any, sharding: Sharding) -> Any:
    """`x` on `sharding`. An array on one device goes through host memory: JAX would otherwise
    compile a resharding program for every shape and sharding, which costs more than the copy."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) > 1 or x.sharding == sharding:
        return jax.device_put(x, sharding)
    placed = jax.device_put(np.asarray(key_data(x)), sharding)
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x)) if is_key(x) else placed


def largest_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees of arrays, wherever they live."""

    def host(x: jax.Array) -> np.ndarray:
        return np.asarray(key_data(x), dtype=np.float64)

    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(np.max(np.abs(host(x) - host(y)))) for x, y in pairs), default=0.0)


def check_alive(tree: Any, what: str) -> None:
    """Raise ValueError if an array of `tree` was deleted, before XLA reads freed memory (it
    can crash the process): a state read from a trainer that trained since, which gave each
    step the arrays to update in place (donated)."""
    values = [(path, x.get_value() if isinstance(x, nnx.Variable) else x) for path, x in flat(tree)]
    deleted = [path for path, x in values if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
        raise ValueError(
            f"{what}: {len(deleted)} of its arrays were deleted (first: {deleted[0]}). It was "
            "read from a trainer before train() ran, and each train step takes the state's "
            "arrays and updates them in place (donation). Read trainer.state again after "
            "train(), or keep a copy taken before: jax.tree.map(jnp.copy, trainer.state)."
        )
