"""A pytree of arrays as an NNX module, so that models written without Flax train and checkpoint.

The trainer and checkpoints work on NNX modules (the optimizer updates `nnx.Param`s). A model
written as plain functions over a dict or list of arrays is wrapped once: `Params(tree)` makes
every array an `nnx.Param` at the same path (under `tree/`), and `arrays()` gives the plain
pytree back to the reader's apply function inside the loss.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


class Params(nnx.Module):
    """Every array of a pytree as an `nnx.Param`, at its path under `tree`."""

    def __init__(self, tree: Any) -> None:
        leaves = jax.tree.leaves(tree)
        if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
            raise TypeError(
                "Params needs a pytree (dict, list, tuple) whose leaves are all arrays; got "
                f"{type(tree).__name__} with leaves {[type(x).__name__ for x in leaves][:4]}."
            )
        self.tree = nnx.data(jax.tree.map(nnx.Param, tree))

    def arrays(self) -> Any:
        """The pytree of arrays (the parameters' current values)."""
        return jax.tree.map(lambda p: p[...], self.tree, is_leaf=lambda x: isinstance(x, nnx.Param))
