"""Parameters stored in bfloat16, with and without a float32 master copy in the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnxscale as nx

CFG = nx.TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")


def trained(tx: optax.GradientTransformation, steps: int = 2) -> nx.Trainer:
    mesh = nx.strategy_mesh(nx.FSDP)
    trainer = nx.Trainer.create(nx.create(CFG), tx, nx.FSDP, mesh, dropout=False)
    losses = trainer.train(nx.book_batches(8), steps)
    assert np.isfinite(losses).all()
    return trainer


@pytest.mark.slow
def test_the_parameters_are_the_master_copy_rounded_and_split_as_the_state() -> None:
    trainer = trained(nx.train.master_weights(nx.adamw()))
    params = dict(nnx.to_flat_state(nnx.state(trainer.state.model, nnx.Param)))
    state = list(nnx.to_flat_state(trainer.state.optimizer.opt_state))
    masters = {path[1:]: v[...] for path, v in state if path[0] == "master"}
    moments = {path[3:]: v[...] for path, v in state if path[:3] == ("inner", 0, "mu")}
    assert set(masters) == set(params) == set(moments)
    for path, param in params.items():
        master = masters[path]
        assert param[...].dtype == jnp.bfloat16 and master.dtype == jnp.float32
        np.testing.assert_array_equal(param[...], master.astype(jnp.bfloat16))
        assert master.sharding.spec == moments[path].sharding.spec  # split as the state is


def test_the_master_copy_keeps_updates_that_bfloat16_parameters_lose() -> None:
    """A step of 1e-4 on weights near 1 is below half a bfloat16 step (2^-8): lost in place,
    kept by the master copy, which crosses a bfloat16 step after enough of them."""
    params = {"w": jnp.ones((4,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4,), jnp.bfloat16)}
    for tx, moved in ((optax.sgd(1e-4), False), (nx.train.master_weights(optax.sgd(1e-4)), True)):
        state, p = tx.init(params), params
        for _ in range(40):
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        assert p["w"].dtype == jnp.bfloat16
        assert bool((p["w"] < 1).all()) == moved, tx


def test_a_master_copy_needs_the_parameters() -> None:
    tx = nx.train.master_weights(optax.sgd(0.1))
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(params, tx.init(params))


@pytest.mark.slow
def test_bfloat16_parameters_train_without_a_master_copy() -> None:
    trainer = trained(nx.adamw())
    leaves = jax.tree.leaves(nnx.state(trainer.state.model, nnx.Param))
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
