"""Bytes autodiff keeps for the backward pass, found by tracing alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.core.memory import CompiledMemory, residual_arrays, saved_bytes


def test_saved_bytes_are_the_residuals_of_the_backward_pass():
    x = jnp.ones((4, 8), jnp.float32)
    # sin(sin(x)) keeps cos(x) and cos(sin(x)): two arrays like x
    assert saved_bytes(lambda x: jnp.sin(jnp.sin(x)).sum(), x) == 2 * x.nbytes
    # a linear function keeps nothing that grows with x (only its constant, 3)
    wide = jnp.ones((40, 8), jnp.float32)
    assert saved_bytes(lambda x: (3 * x).sum(), x) == saved_bytes(lambda x: (3 * x).sum(), wide)


def test_residual_arrays_leave_out_the_programs_constants():
    """A table the function closes over (a constant) exists whatever autodiff keeps."""
    table = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = jnp.ones((8, 8), jnp.float32)
    kept = residual_arrays(lambda x: jnp.sin(x * jnp.asarray(table)).sum(), x)
    assert [a.shape for a in kept] == [(8, 8)]  # cos(x * table), not the table


def test_residual_arrays_carry_their_placement_on_explicit_axes():
    """On Explicit mesh axes each kept array's type says where it lies (what the ledger
    reads to find sequence parallelism's split stream); elsewhere there is none to carry."""
    mesh = AbstractMesh((1,), ("model",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    with jax.sharding.use_abstract_mesh(mesh):
        (kept,) = residual_arrays(lambda x: jnp.sin(x).sum(), x)
    assert kept.sharding.spec == P("model", None)
    (plain,) = residual_arrays(lambda x: jnp.sin(x).sum(), jnp.ones((4, 8)))
    assert plain.sharding is None


def test_held_counts_donated_buffers_once_and_adds_the_temporaries():
    x = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x), donate_argnums=0)
    memory = CompiledMemory.of(step.lower(x).compile())
    # the output reuses the donated input: one buffer of x, not two, beside the temporaries
    assert memory.alias == x.nbytes
    assert memory.held == x.nbytes + memory.temp
