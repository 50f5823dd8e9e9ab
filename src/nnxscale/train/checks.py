"""Checks made before a step consumes the train state: the loss, the kind of mesh axes, and
the batch's shapes, split and tokens."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnxscale.core.trees import flat, is_key
from nnxscale.placement.mesh import (
    AXIS_TYPES,
    AxisTypeError,
    axis_kind,
)
from nnxscale.train.data import check_batch_splits
from nnxscale.train.state import TrainOptions


def batch_kind(batch: Any) -> tuple[object, ...]:
    """What a compiled step fixes of a batch: each array's path, shape, dtype and sharding."""
    return tuple(
        (
            path,
            tuple(getattr(x, "shape", ())),
            str(getattr(x, "dtype", type(x).__name__)),
            getattr(x, "sharding", None),
        )
        for path, x in flat(batch)
    )


def check_loss(options: TrainOptions, model: nnx.Module) -> None:
    """Raise a clear error when no loss is given for a model the book's loss cannot train:
    `next_token_loss` calls the book's Transformer's `loss` and `layer_keys`."""
    default = options.loss_fn is None and options.grads_fn is None
    lacks = [name for name in ("loss", "layer_keys") if not hasattr(model, name)]
    if default and lacks:
        raise TypeError(
            f"no loss_fn given, and the default (the book's next-token loss) needs the "
            f"book's Transformer, whose {' and '.join(lacks)} {type(model).__name__} lacks: pass "
            "loss_fn=f with f(model, batch, rngs) returning the mean loss (rngs is the "
            "dropout stream, or None)."
        )


def check_axis_type(model: nnx.Module, mesh: Mesh) -> None:
    """Raise a clear error when `model` declares the kind of mesh axes it is written for
    (an `AXIS_TYPE` of "auto" or "explicit", as the book's Transformer does) and `mesh` has
    the other kind; a model that declares nothing is checked when its step is traced."""
    declared, kind = getattr(model, "AXIS_TYPE", None), axis_kind(mesh)
    if declared in AXIS_TYPES and declared != kind:
        raise AxisTypeError(
            f"{type(model).__name__} is written for {declared.title()} mesh axes "
            f"({AXIS_TYPES[declared]}), and mesh {dict(mesh.shape)} has {kind.title()} axes: "
            f"build it with nx.strategy_mesh(rules, explicit={declared == 'explicit'}) or "
            f"nx.make_mesh(shape, names, explicit={declared == 'explicit'})."
        )


def check_batch(batch: Any, sharding: NamedSharding, micro_batches: int = 1) -> None:
    """Raise a clear error unless every array of `batch` can be split as the step splits it."""
    leaves = flat(batch)
    if not leaves:
        raise ValueError("the batch holds no arrays: pass a pytree of arrays, one row per example")
    rows = set()
    for path, x in leaves:
        where = f"batch array {path!r}" if path else "the batch"
        if not hasattr(x, "shape") or is_key(x) or len(x.shape) == 0:
            raise ValueError(
                f"{where} is {type(x).__name__} {getattr(x, 'shape', '')}: every array of a "
                "batch needs a first dimension of examples (rows) to split over the data axes."
            )
        rows.add(x.shape[0])
        if x.shape[0] % micro_batches:
            raise ValueError(
                f"{where} has {x.shape[0]} rows, which cannot be cut into {micro_batches} "
                f"micro-batches: use a batch size that is a multiple of {micro_batches}."
            )
        what = f"each of {micro_batches} micro-batches" + (f" of {where}" if path else "")
        what = where if micro_batches == 1 else what
        check_batch_splits(x.shape[0] // micro_batches, sharding, what)
    if len(rows) > 1:
        raise ValueError(
            f"the batch's arrays have different numbers of rows {sorted(rows)}: every array "
            "needs the same first dimension, one row per example."
        )


def check_same_kind(first: tuple[object, ...], kind: tuple[object, ...]) -> None:
    """Raise a clear error when a batch's arrays, or their dtypes, differ from the first
    batch's (another shape is another program; another structure or dtype is a bug)."""
    was = {path: dtype for path, _, dtype, _ in first}
    now = {path: dtype for path, _, dtype, _ in kind}
    if set(was) != set(now):
        raise ValueError(
            f"this batch holds the arrays {sorted(now)}, the first batch {sorted(was)}: "
            "give every step a batch of the same structure."
        )
    changed = sorted(f"{path or 'the batch'} ({was[path]} -> {now[path]})" for path in was
                     if was[path] != now[path])  # fmt: skip
    if changed:
        raise ValueError(
            f"the batch changed dtype since the first step: {', '.join(changed)}. Convert it "
            "to the first batch's dtypes (integer token ids stay int32)."
        )


@jax.jit
def _bounds(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x.min(), x.max()


def check_tokens(batch: Any, vocab: int) -> None:
    """Raise a clear error unless every array of `batch` holds integer token ids in
    [0, vocab): an id outside would read no embedding row, and poison the step."""
    for path, x in flat(batch):
        where = f"batch array {path!r}" if path else "the batch"
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(
                f"{where} has shape {x.shape}: the model reads rows of token ids, shape (rows, "
                "tokens) with at least 2 tokens a row, as it predicts each token from those "
                "before it."
            )
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{where} has dtype {x.dtype}: the model reads integer token ids (int32)."
            )
        low, high = (int(v) for v in jax.device_get(_bounds(x)))
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{where} holds token ids from {low} to {high}, outside the vocabulary of "
                f"{vocab} (ids 0 to {vocab - 1}): encode the data with the model's tokenizer, "
                "or build the model with a larger vocab."
            )
