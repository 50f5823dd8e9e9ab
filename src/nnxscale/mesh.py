"""Device meshes with checks that name the problem and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


def grid_shape(devices: int, inner: int = 2) -> tuple[int, int]:
    """A 2-D mesh shape (devices // inner, inner) for any device count `inner` divides."""
    if inner < 1 or devices % inner:
        raise ValueError(
            f"{devices} devices cannot form a grid with {inner} devices on the inner axis: "
            f"choose an inner size that divides {devices}."
        )
    return devices // inner, inner


def make_mesh(
    shape: Sequence[int],
    names: Sequence[str],
    *,
    explicit: bool = True,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """`jax.make_mesh` over all (or the given) devices, with Explicit or Auto axes."""
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
            f"{grid_shape(len(pool), 2 if len(pool) % 2 == 0 else 1)}), or emulate "
            f"{math.prod(shape)} devices (NNXSCALE_DEVICES={math.prod(shape)}) and restart."
        )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=pool)
