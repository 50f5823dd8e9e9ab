"""Loss functions, and the two shapes of function a train step calls: a loss, or loss and grads.

A loss function is `loss_fn(model, batch, rngs)`: any NNX module, a batch that is any pytree of
arrays, and an `nnx.Rngs` with a `dropout` stream (None when evaluating or without dropout); it
returns the mean loss, a scalar. A gradient function (`GradsFn`) is how a step gets the loss and
the parameter gradients; `nnxscale.train.loss_and_grads` derives one from any loss function,
and `nnxscale.fsdp` and `nnxscale.pipeline` write their own for the book's Transformer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from nnxscale.placement.mesh import axis_kind

type LossFn = Callable[[nnx.Module, Any, "nnx.Rngs | None"], jax.Array]
"""`loss_fn(model, batch, rngs) -> scalar`: the mean loss of `model` on `batch`."""

type GradsFn = Callable[[nnx.Module, Any, "jax.Array | None", int], tuple[jax.Array, nnx.State]]
"""`grads_fn(model, batch, dropout_key, micro_batches) -> (loss, parameter gradients)`."""


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer `targets` under `logits`.

    Picking each target's log-probability is a gather (`take_along_axis`), which JAX refuses
    on Explicit axes when the vocabulary is split (tensor parallelism's logits): it cannot
    tell where the picked values should go. There the pick is a product with the targets'
    one-hot vectors, split as the logits are, and a sum over the split vocabulary instead: the
    same values (every other term is an exact zero), with an all-reduce of one number per
    token."""
    sharding = getattr(jax.typeof(logits), "sharding", None)
    spec = () if sharding is None else tuple(sharding.spec)
    if len(spec) != logits.ndim or spec[-1] is None or axis_kind(sharding.mesh) != "explicit":
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    picks = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype, out_sharding=sharding)
    return -(jax.nn.log_softmax(logits) * picks).sum(-1).mean()


def next_token_loss(model: nnx.Module, tokens: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
    """The book's loss: mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1],
    plus, for a mixture of experts, the layers' weighted auxiliary losses.

    The Transformer splits one dropout key into a key per layer itself, so it is given the
    stream's key as it is (the step's key), not a draw from it.
    """
    key = None if rngs is None else rngs.dropout.key[...]
    return model.loss(tokens, None if key is None else model.layer_keys(key))
