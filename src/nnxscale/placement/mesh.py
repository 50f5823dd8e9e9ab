"""Device meshes with checks that name the problem and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXIS_TYPES = {
    "auto": "the compiler propagates shardings from the inputs and places every operation "
    "itself; a model may add `jax.lax.with_sharding_constraint`, and must not pass "
    "`out_sharding=` (JAX refuses Auto axis names there)",
    "explicit": "every array's sharding is part of its type and each operation's follows "
    "from its inputs' by fixed rules; a model passes `out_sharding=` (or calls "
    "`jax.sharding.reshard`) where they leave a choice, such as a matmul between arrays "
    "split over the same axis; `with_sharding_constraint` becomes an assert",
}
"""The two kinds of mesh axes the library places arrays on, and what each asks of a model."""


def grid_shape(devices: int, inner: int = 2) -> tuple[int, int]:
    """A 2-D mesh shape (devices // k, k) for any device count: k is the largest divisor of
    `devices` up to `inner`, so an odd count gets one column when `inner` is 2."""
    if devices < 1 or inner < 1:
        raise ValueError(f"a grid needs positive sizes, got {devices} devices, inner {inner}")
    k = max(d for d in range(1, min(inner, devices) + 1) if devices % d == 0)
    return devices // k, k


def make_mesh(
    shape: Sequence[int],
    names: Sequence[str],
    *,
    explicit: bool = False,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """`jax.make_mesh` over all (or the given) devices, with Auto axes unless `explicit`.

    Which type a model needs depends on how it is written (`AXIS_TYPES`): Auto for a model
    that leaves placement to the compiler (`with_sharding_constraint`, any unannotated
    model); Explicit for one that says where its operations' outputs go (`out_sharding=`,
    `jax.sharding.reshard`), in the explicit-sharding style of JAX's guide. The book's
    Transformer says so and runs on both, as do the library's rule sets, placement,
    initialisation, trainer and checkpoints. `jax.make_mesh` itself defaults to Explicit axes.
    """
    shape, names = tuple(shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} names {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must be distinct, got {names}")
    if any(size < 1 for size in shape):
        raise ValueError(f"mesh axis sizes must be positive, got {shape}")
    pool = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(pool):
        raise ValueError(
            f"mesh shape {shape} needs {math.prod(shape)} devices but {len(pool)} are available. "
            f"Use a shape whose sizes multiply to {len(pool)} (for example "
            f"{grid_shape(len(pool))}), or emulate "
            f"{math.prod(shape)} devices (NNXSCALE_DEVICES={math.prod(shape)}) and restart."
        )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=pool)


def hybrid_mesh(
    inside: Sequence[int], across: Sequence[int], names: Sequence[str], *, explicit: bool = False
) -> Mesh:
    """A mesh across processes (hosts, or slices): each axis `inside` x `across` devices long,
    the `inside` part within a process, over its fast links, and the `across` part over the
    processes, on the slow network between them (JAX's `create_hybrid_device_mesh`, with a
    process for a slice). Put the axes whose collectives are many and large inside (FSDP's
    gathers, TP's all-reduces) and data parallelism's one reduction a step across."""
    inside, across, names = tuple(inside), tuple(across), tuple(names)
    if not len(inside) == len(across) == len(names):
        raise ValueError(
            f"inside {inside}, across {across} and names {names}: give each one entry per "
            "mesh axis (1 where an axis lies wholly inside, or wholly across, processes)."
        )
    local, processes = jax.local_device_count(), jax.process_count()
    if math.prod(inside) != local or math.prod(across) != processes:
        raise ValueError(
            f"inside {inside} must multiply to the {local} devices of each process and across "
            f"{across} to the {processes} processes: e.g. inside (1, {local}) and across "
            f"({processes}, 1) for data parallelism across processes and FSDP inside each."
        )
    grid = mesh_utils.create_hybrid_device_mesh(
        inside, across, devices=jax.devices(), process_is_granule=True
    )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(grid, names, axis_types=(kind,) * len(names))


def axis_kind(mesh: Mesh) -> str:
    """ "explicit" or "auto": the type of every axis of `mesh`; a mix is refused, since a
    constraint (`constrain_to`) and Flax's variables need one kind throughout."""
    kinds = {AxisType.Explicit: "explicit", AxisType.Auto: "auto"}
    found = {kinds.get(t, str(t)) for t in mesh.axis_types}
    if len(found) != 1 or not found <= set(AXIS_TYPES):
        types = dict(zip(mesh.axis_names, map(str, mesh.axis_types), strict=True))
        raise ValueError(
            f"mesh {dict(mesh.shape)} has axes of types {types}: the library places arrays on "
            "meshes whose axes are all Auto or all Explicit. Build it with "
            "nx.make_mesh(shape, names, explicit=...) (or nx.strategy_mesh(rules, explicit=...))."
        )
    return found.pop()


def constrain_to(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` placed as `sharding` says inside a traced function, on either kind of mesh: a
    constraint the compiler honours on Auto axes, a reshard (part of the type) on Explicit.
    On Explicit axes an `x` already split so is left as it is, reduced type included (a
    weight read as `reduced`, whose gradient stays unreduced: `train.unreduced_grads`)."""
    if axis_kind(sharding.mesh) != "explicit":
        return jax.lax.with_sharding_constraint(x, sharding)
    if partitions(jax.typeof(x).sharding.spec, x.ndim) == partitions(sharding.spec, x.ndim):
        return x
    return jax.sharding.reshard(x, sharding)


def partitions(spec: PartitionSpec, ndim: int) -> tuple[Any, ...]:
    """The mesh axes splitting each of `ndim` dimensions (None: whole), as `spec` says them:
    trailing dimensions it leaves out are whole; reduced and unreduced axes are not splits."""
    entries = tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    return tuple((e,) if isinstance(e, str) else (tuple(e) or None if e else None) for e in entries)


class AxisTypeError(ValueError):
    """A model written for one kind of mesh axes (`AXIS_TYPES`) traced on the other."""


def axis_type_error(error: Exception, mesh: Mesh) -> AxisTypeError | None:
    """The error to raise instead of `error`, JAX's, when it comes from tracing a model on a
    mesh whose axis type the model was not written for; None when it does not."""
    text = f"{type(error).__name__}: {error}"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if "of type Auto" in text and "cannot contain axis names" in text:
        return AxisTypeError(
            f"the model passes out_sharding= (or reshards) with mesh axis names, which JAX takes "
            f"on Explicit axes only, and mesh {dict(mesh.shape)} has Auto axes. Build the mesh "
            "with explicit=True: nx.strategy_mesh(rules, explicit=True) or nx.make_mesh(shape, "
            f"names, explicit=True). (JAX said: {first})"
        )
    if "acts as an assert when all axes of mesh are of type `Explicit`" in text:
        return AxisTypeError(
            f"the model constrains an array with with_sharding_constraint, which JAX takes as "
            f"an assert on Explicit axes, and mesh {dict(mesh.shape)} has Explicit axes: build "
            "it with Auto axes (nx.strategy_mesh(rules) or nx.make_mesh(shape, names)), or "
            f"use jax.sharding.reshard in the model. (JAX said: {first})"
        )
    if "ShardingTypeError" in text and axis_kind(mesh) == "explicit":
        return AxisTypeError(
            f"on mesh {dict(mesh.shape)}, whose axes are Explicit, JAX could not decide where an "
            "operation of the model puts its output: its inputs are split in ways that leave a "
            "choice (typically a weight split over the batch's axis, as FSDP splits it). "
            "Either build the mesh with Auto axes (nx.strategy_mesh(rules) or "
            "nx.make_mesh(shape, names)), which lets the compiler choose, or pass "
            f"out_sharding= to that operation. (JAX said: {first})"
        )
    return None
