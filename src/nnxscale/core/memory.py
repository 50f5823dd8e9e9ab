"""Memory measured, not estimated: bytes on each device, and a compiled program's footprint."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax


def device_bytes(tree: Any) -> dict[int, int]:
    """Bytes each device holds for the arrays of `tree`, summed over their addressable shards."""
    held: Counter[int] = Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device.id] += shard.data.nbytes
    return dict(sorted(held.items()))


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of a compiled program, from XLA's memory analysis."""

    argument: int
    output: int
    temp: int
    alias: int
    peak: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> CompiledMemory:
        """Read the memory analysis of a compiled program (`jax.jit(f).lower(...).compile()`)."""
        stats = compiled.memory_analysis()
        return cls(
            argument=stats.argument_size_in_bytes,
            output=stats.output_size_in_bytes,
            temp=stats.temp_size_in_bytes,
            alias=stats.alias_size_in_bytes,
            peak=stats.peak_memory_in_bytes,
        )

    @property
    def held(self) -> int:
        """Arguments + outputs - what they share (donated buffers) + temporaries: the most
        the program holds at once (on the CPU `peak` leaves the temporaries out)."""
        return self.argument + self.output - self.alias + self.temp


def residual_arrays(fn: Callable[..., Any], *args: Any) -> list[jax.ShapeDtypeStruct]:
    """The arrays JAX's autodiff keeps from the forward pass of `fn` at `args` for its backward
    pass, leaving out `args` themselves and the program's constants (they exist anyway),
    found by tracing alone: shapes and dtypes, no values, so it costs no memory whatever the
    sizes. Traced on Explicit mesh axes, each array carries its placement (`.sharding`)."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
    count = len(jax.tree.leaves(shapes[1]))
    inputs = {id(v) for v in (*closed.jaxpr.invars, *closed.jaxpr.constvars)}
    kept = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - count :]
    return [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=_placed(v.aval))
        for v in kept
        if id(v) not in inputs and v.aval.size  # inputs, the program's constants; empty markers
    ]


def _placed(aval: Any) -> jax.sharding.NamedSharding | None:
    """An array's placement where its type has one (on Explicit mesh axes), else None."""
    sharding = getattr(aval, "sharding", None)
    return sharding if sharding is not None and sharding.mesh.axis_names else None


def saved_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes JAX's autodiff keeps from the forward pass of `fn` at `args` for its backward pass:
    the residuals `jax.vjp` closes over, arguments among them, found by tracing alone. It is
    what a compiler is asked to hold, before it fuses, recomputes or frees any of it."""
    backward = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)  # shapes only: no compute
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backward))
