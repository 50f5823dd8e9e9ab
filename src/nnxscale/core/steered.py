"""Variables a train step moves by a rule of their own, not by the optimizer: the seam through
which a model supplies its own update, so the step stays one step for every model.

The dropless mixture's router biases are one (`nnxscale.dropless.RouterBias`, DeepSeek-V3's
balance without an auxiliary loss; torchtitan registers the same update as a hook after the
optimizer's step). A `Steered` variable is differentiated with the parameters, so its gradient
slot carries a statistic of the step, combined over micro-batches and devices as gradients
are (their mean);
after the optimizer's update, `steer` moves each one by its class's `steered(statistic)`.
"""

from __future__ import annotations

import jax
from flax import nnx


class Steered(nnx.Variable):
    """A variable the loss does not train: its gradient is a statistic of the step (the
    model's code makes it so, e.g. with a `jax.custom_vjp`), and a subclass says, in
    `steered`, where that statistic moves it."""

    def steered(self, statistic: jax.Array) -> jax.Array:
        """The variable's next value, from its value and the step's `statistic`."""
        raise NotImplementedError(
            f"{type(self).__name__} is a Steered variable and says nothing of how it moves: "
            "define steered(statistic) on it, returning its next value."
        )


def steer(model: nnx.Module, grads: nnx.State) -> None:
    """Move every `Steered` variable of `model` to its `steered` value, from the statistic in
    its gradient slot of `grads`."""
    statistics = dict(nnx.to_flat_state(nnx.state(grads, Steered)))
    moved = [
        (path, variable.replace(variable.steered(statistics[path][...])))
        for path, variable in nnx.to_flat_state(nnx.state(model, Steered))
    ]
    nnx.update(model, nnx.from_flat_state(moved))
