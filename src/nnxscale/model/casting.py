"""Weights read in the compute dtype, cast where they are stored: each device casts its own
shard before any gather, so a strategy that gathers weights moves the narrow copy."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from nnxscale.placement.constraints import weight_layout
from nnxscale.placement.mesh import axis_kind, constrain_to
from nnxscale.placement.rounds import names_of

CAST_WEIGHTS = ("query", "key", "value", "out", "gate", "up", "down", "head")
"""The parameters the model reads through `compute_copy`: its matrix products' weights."""


def compute_copy(param: nnx.Param, dtype: Any) -> jax.Array:
    """The weight in the compute dtype, cast where it is stored: each device casts its own
    shard, so a strategy that gathers weights (FSDP) gathers the compute-dtype copy, half the
    bytes of float32 for bfloat16. The gradient flows back in the parameter's dtype, so it is
    reduced in float32. On Explicit axes the weight is read in its read layout (gathered over
    the axes that split the tokens, as FSDP's are): a product of rows split over `data` with a
    weight split over `data` has no layout JAX could choose."""
    value = param[...]
    names = names_of(param) or None
    if names is not None:  # inside a scan over stacked layers, a slice: drop the stacked names
        names = names[len(names) - value.ndim :]
    placed = weight_layout(value.shape, names)
    if value.dtype != jnp.dtype(dtype):
        return _cast_where_stored(value, jnp.dtype(dtype), placed, value.dtype)
    if placed is None or axis_kind(placed[2]) != "explicit":
        return value
    _, read, mesh = placed
    return constrain_to(value, NamedSharding(mesh, read))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_where_stored(value: jax.Array, dtype: Any, placed: Any, stored: Any) -> jax.Array:
    """`value` cast to `dtype` on its stored layout, then gathered to its read layout. The
    gather moves the cast value's bits as unsigned integers of its width: the same bytes, and
    a CPU compiler, which widens low-precision floating-point collectives to float32, keeps
    them."""
    copy = value.astype(dtype)
    if placed is None:
        return copy
    stored, read, mesh = placed
    bits = jax.lax.bitcast_convert_type(copy, jnp.dtype(f"uint{8 * copy.dtype.itemsize}"))
    bits = constrain_to(bits, NamedSharding(mesh, stored))
    bits = constrain_to(bits, NamedSharding(mesh, read))
    return jax.lax.bitcast_convert_type(bits, dtype)


def _cast_forward(value: jax.Array, dtype: Any, placed: Any, stored: Any) -> tuple[jax.Array, None]:
    return _cast_where_stored(value, dtype, placed, stored), None


def _cast_backward(dtype: Any, placed: Any, stored: Any, _: None, grad: jax.Array) -> tuple:
    grad = grad.astype(stored)
    if placed is not None and axis_kind(placed[2]) == "explicit":  # the type of the weight
        grad = jax.sharding.reshard(grad, NamedSharding(placed[2], placed[0]))
    return (grad,)


_cast_where_stored.defvjp(_cast_forward, _cast_backward)
