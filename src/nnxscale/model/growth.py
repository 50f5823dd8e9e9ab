"""How the model's compiled step grows with the sequence: the check that attention never holds
the whole score matrix, on the program the compiler makes (compiled only, nothing runs)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.model.config import Config
from nnxscale.model.transformer import create
from nnxscale.runtime.devices import FAST_COMPILE


def _temporaries(cfg: Config, length: int, sequences: int, options: Mapping[str, Any]) -> int:
    """Bytes of temporaries of the compiled gradient of `cfg`'s loss on one device."""
    model = nnx.eval_shape(lambda: create(cfg.replace(max_len=max(cfg.max_len, length))))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((sequences, length + 1), jnp.int32)

    def loss(p: nnx.State, t: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, p, rest).loss(t)

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile(dict(options))
    return compiled.memory_analysis().temp_size_in_bytes


def step_temporaries(
    cfg: Config,
    lengths: list[int],
    sequences: int = 2,
    compiler_options: Mapping[str, Any] = FAST_COMPILE,
) -> dict[int, int]:
    """Bytes of temporaries of the compiled forward and backward pass of `cfg`'s loss on one
    device, for `sequences` sequences of each of `lengths` tokens: the kept activations and
    the attention kernel's working set, what grows with the sequence. Compiled with the
    backend's optimisations off by default (the same temporaries here, and faster)."""
    return {n: _temporaries(cfg, n, sequences, compiler_options) for n in lengths}


def growth(temporaries: dict[int, int]) -> list[float]:
    """How many times the temporaries grow from each length to the next."""
    sizes = [temporaries[n] for n in sorted(temporaries)]
    return [b / a for a, b in itertools.pairwise(sizes)]
