"""Bytes autodiff keeps for the backward pass, found by tracing alone."""

from __future__ import annotations

import jax.numpy as jnp

from nnxscale.memory import saved_bytes


def test_saved_bytes_are_the_residuals_of_the_backward_pass():
    x = jnp.ones((4, 8), jnp.float32)
    # sin(sin(x)) keeps cos(x) and cos(sin(x)): two arrays like x
    assert saved_bytes(lambda x: jnp.sin(jnp.sin(x)).sum(), x) == 2 * x.nbytes
    # a linear function keeps nothing that grows with x (only its constant, 3)
    wide = jnp.ones((40, 8), jnp.float32)
    assert saved_bytes(lambda x: (3 * x).sum(), x) == saved_bytes(lambda x: (3 * x).sum(), wide)
