"""The train step's seam for a model's own updates: a `Steered` variable of any model moves by
its class's rule after the optimizer's update, and the optimizer leaves it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnxscale as nx
from nnxscale.core.steered import Steered, steer


class StepsSeen(Steered):
    """Counts the steps: its statistic is one in every micro-batch, and the step averages the
    micro-batches' gradients."""

    def steered(self, statistic: jax.Array) -> jax.Array:
        return self[...] + statistic


@jax.custom_vjp
def counted(x: jax.Array) -> jax.Array:
    return x


counted.defvjp(lambda x: (x, None), lambda _, g: (jnp.ones_like(g),))


def with_counter() -> nnx.Module:
    model = nx.create(nx.TINY.replace(dropout=0.0))
    model.seen = StepsSeen(jnp.zeros(()))
    return model


def counting_loss(model, batch, rngs):
    """The book's loss, plus nothing: the counter's gradient is one whatever the loss."""
    return nx.losses.next_token_loss(model, batch, rngs) + 0.0 * counted(model.seen[...])


def test_steer_moves_each_variable_by_its_own_rule() -> None:
    model = nnx.Module()
    model.seen = StepsSeen(jnp.asarray(2.0))
    model.w = nnx.Param(jnp.ones(3))
    grads = nnx.State({"seen": StepsSeen(jnp.asarray(5.0)), "w": nnx.Param(jnp.zeros(3))})
    steer(model, grads)
    assert float(model.seen[...]) == 7.0 and np.array_equal(model.w[...], np.ones(3))


def test_a_steered_variable_must_say_how_it_moves() -> None:
    with pytest.raises(NotImplementedError, match="define steered"):
        Steered(jnp.zeros(())).steered(jnp.ones(()))


@pytest.mark.slow
def test_the_train_step_moves_a_models_own_variable_after_the_optimizer() -> None:
    """Three steps of two micro-batches: the counter reads 3 (one a step: its gradient slot
    carries the micro-batches' mean, as every gradient does), and the model trains as without
    it."""
    trainer = nx.trainer_for(
        nx.DP, 1, with_counter, loss_fn=counting_loss, micro_batches=2, dropout=False,
        compiler_options=nx.devices.FAST_COMPILE,
    )  # fmt: skip
    plain = nx.trainer_for(
        nx.DP, 1, nx.TINY.replace(dropout=0.0), micro_batches=2, dropout=False,
        compiler_options=nx.devices.FAST_COMPILE,
    )  # fmt: skip
    data = nx.book_batches(8)
    losses = trainer.train(data, 3)
    assert float(trainer.model().seen[...]) == 3.0
    # a 0-times term leaves the loss and the parameters' gradients as they were
    np.testing.assert_allclose(losses, plain.train(nx.book_batches(8), 3), rtol=1e-6)
