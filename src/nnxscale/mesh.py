"""Device meshes with checks that name the problem and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


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

    Auto is what every strategy of the library uses (the compiler propagates shardings, and
    `with_sharding_constraint` works); `jax.make_mesh` itself defaults to Explicit axes.
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
