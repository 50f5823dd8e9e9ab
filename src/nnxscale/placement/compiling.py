"""Compiling under a layout, in one place: a function traced under the layout's mesh with its
rule set placing the activations, and errors raised there that name the fix."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from nnxscale.core.trees import check_alive
from nnxscale.placement.constraints import activation_rules
from nnxscale.placement.layout import Layout
from nnxscale.placement.mesh import axis_type_error


@cache
def accepts(platform: str, option: str, value: Any) -> bool:
    """Whether the backend of `platform` compiles a program with `option` set to `value`:
    XLA refuses an option it does not know, and each release adds and removes some."""
    where = jax.sharding.SingleDeviceSharding(jax.devices(platform)[0])
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=where))
    try:
        probe.compile(compiler_options={option: value})
    except jax.errors.JaxRuntimeError:  # "No such compile option", or a value it cannot read
        return False
    return True


def two_at_a_time(calls: list[Callable[[], Any]]) -> list[Any]:
    """The results of `calls` (each a trace and a compilation), two at a time: XLA compiles
    in native threads, so one call's compilation overlaps the next one's Python tracing."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: call(), calls))


@contextlib.contextmanager
def under(layout: Layout, activations: bool) -> Iterator[None]:
    """Trace under `layout`: its mesh set (`jax.set_mesh`, so a model's own sharding
    constraints apply) and, when `activations`, its rule set placing the activations."""
    rules = layout.rules if activations else None
    with jax.set_mesh(layout.mesh), activation_rules(rules, layout.mesh):
        yield


def compile_under(
    jitted: Any,
    layout: Layout,
    *args: Any,
    activations: bool,
    compiler_options: Mapping[str, Any] | None = None,
) -> jax.stages.Compiled:
    """`jitted` (a `jax.jit` function) lowered for `args` under `layout` (`under`) and compiled
    with `compiler_options`; tracing errors name their fix (`traced`)."""
    with under(layout, activations):
        lowered = traced(jitted.lower, layout.mesh, layout)(*args)
        return lowered.compile(compiler_options=dict(compiler_options or {}) or None)


def run_under(
    fn: Callable[..., jax.Array], layout: Layout, activations: bool
) -> Callable[..., jax.Array]:
    """`fn`, traced and run under `layout` (`under`), its tracing errors naming their fix, and
    arguments deleted by a train step since they were read refused (`check_alive`)."""

    def run(*args: Any) -> jax.Array:
        check_alive(args, "the state or batch given")
        with under(layout, activations):
            return traced(fn, layout.mesh)(*args)

    return run


def traced(fn: Callable[..., Any], mesh: Mesh, layout: Layout | None = None) -> Callable[..., Any]:
    """`fn`, whose errors from a model written for the other kind of mesh axes are raised as
    `AxisTypeError`s that name the fix (`nnxscale.mesh.axis_type_error`), and whose errors
    from a split the mesh cannot make name the arrays the rules kept whole for that reason:
    those whose logical names asked for a split no candidate divides, not unnamed ones.
    Tracing comes before the train state is handed to the step, so nothing is lost."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:
            better = axis_type_error(error, mesh)
            unsplit = layout.unsplit() if layout is not None else []
            short = [p for p in unsplit if p.fallback and p.logical is not None]
            if better is None and short and "evenly divide" in str(error):
                listed = "; ".join(f"{p.path} {p.shape}: {p.reason}" for p in short[:4])
                better = ValueError(
                    f"the model asks for a split that mesh {dict(mesh.shape)} cannot make "
                    f"(JAX said: {str(error).splitlines()[0]}). The rule set kept these "
                    f"arrays whole for the same reason: {listed}. Use a mesh whose axes "
                    "divide those dimensions, or let the model not ask for that split."
                )
            if better is None:
                raise
            raise better from error

    return call
