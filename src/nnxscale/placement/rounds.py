"""Stacked layers held in rounds: the reshape an interleaved (virtual-stage) pipeline needs.

A model's stacked layers (logical names `layers, ...`) can be held as (rounds, layers / rounds,
...), named `rounds, layers, ...`: the pipeline splits the second dimension over its stages, so
each device holds one run of layers per round. Checkpoints and checksums regroup any holding
into the plain stack. Works on any model's state by logical names, not on the book's model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.mesh import constrain_to

ROUNDS = "rounds"
"""The logical name of the leading dimension of stacked layers held in rounds: an array of
shape (rounds, layers / rounds, ...) whose layer k of round r is model layer
r * layers / rounds + k, the model's own order (`group_layers`)."""


def names_of(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The variable's logical names (Flax's `out_sharding` metadata); () if it has none."""
    return tuple(variable.get_metadata().get("out_sharding") or ())


def _reshaped(value: Any, shape: tuple[int, ...]) -> Any:
    """`value` (an array, or an abstract one) reshaped: the same elements in the same order."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, value.dtype)
    return jnp.reshape(value, shape)


def _regrouped(variable: Any, rounds: int) -> Any:
    """A stacked-layer variable held in `rounds` rounds (1: the plain stack); others as they are."""
    if not isinstance(variable, nnx.Variable):
        return variable
    names, value = names_of(variable), variable.get_value()
    if names[:1] == (ROUNDS,):
        names, shape = names[1:], (value.shape[0] * value.shape[1], *value.shape[2:])
    elif names[:1] == ("layers",):
        shape = tuple(value.shape)
    else:
        return variable
    if shape[0] % rounds:
        raise ValueError(
            f"{shape[0]} stacked layers cannot be held in {rounds} equal rounds: use a number "
            f"of rounds (virtual stages) that divides {shape[0]}."
        )
    if rounds > 1:
        names, shape = (ROUNDS, *names), (rounds, shape[0] // rounds, *shape[1:])
    if shape == tuple(value.shape):
        return variable
    held = variable.replace(_reshaped(value, shape))
    held.set_metadata(out_sharding=names)
    return held


def group_layers(tree: Any, rounds: int) -> Any:
    """`tree` (a model's state, a train state's, gradients) with every stacked-layer array
    (logical names `layers, ...`) held in `rounds` rounds: shape (rounds, layers / rounds,
    ...) named `rounds, layers, ...`; `rounds=1` gives the plain stacks back. The layers stay
    in the model's order, so this is a reshape: an interleaved pipeline splits the second
    dimension over its stages, and each device then holds one run of layers per round."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"rounds={rounds!r}: hold the layers in a whole number of rounds, 1 or more"
        )
    return jax.tree.map(
        lambda x: _regrouped(x, rounds), tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def layer_rounds(tree: Any) -> int:
    """In how many rounds `tree` holds its stacked layers (`group_layers`): 1 for plain stacks."""
    stacked = [
        x
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if isinstance(x, nnx.Variable) and names_of(x)[:1] in ((ROUNDS,), ("layers",))
    ]
    found = {x.get_value().shape[0] if names_of(x)[0] == ROUNDS else 1 for x in stacked}
    if len(found) > 1:
        raise ValueError(
            f"stacked layers held in different numbers of rounds: {sorted(found)} (1: a plain "
            "stack); regroup them all with group_layers(tree, rounds)"
        )
    return found.pop() if found else 1


def held_in(state: Any, rounds: int, layout: Layout) -> Any:
    """`state` with its stacked layers held in `rounds` rounds (`group_layers`), laid out by
    `layout`'s rules on its mesh: one program, compiled once per layout, in which the layers
    move between devices once. (Its input is not donated: the arrays change shape, so XLA
    could not reuse their buffers, and would warn.)"""
    return _regrouping(rounds, layout)(state)


@functools.lru_cache(maxsize=8)
def _regrouping(rounds: int, layout: Layout) -> Callable[[Any], Any]:
    """The jitted program of `held_in`."""

    def regroup(state: Any) -> Any:
        held = group_layers(state, rounds)
        placed = resolve(held, layout.rules, layout.mesh).shardings()
        return jax.tree.map(constrain_to, held, placed)

    return jax.jit(regroup)
