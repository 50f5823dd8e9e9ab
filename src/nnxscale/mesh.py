"""Device meshes with checks that name the problem and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from nnxscale.rules import Rules


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
            f"{grid_shape(len(pool))}), or emulate "
            f"{math.prod(shape)} devices (NNXSCALE_DEVICES={math.prod(shape)}) and restart."
        )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=pool)


def mesh_shape(rules: Rules, devices: int, model: int = 2) -> tuple[int, int]:
    """The (data, model) mesh a rule set is meant for: up to `model` devices on `model` if it
    uses that axis (the largest count that divides `devices`, see `grid_shape`), else none."""
    if "model" not in rules.mesh_axes():
        return devices, 1
    return grid_shape(devices, model)


def strategy_mesh(rules: Rules, devices: int | None = None, model: int = 2) -> Mesh:
    """The (data, model) mesh, with Auto axes, that a rule set is meant for.

    It spans the first `devices` devices (all by default). With an odd count and the default
    `model=2`, the `model` axis has one device: tensor parallelism then splits nothing.
    """
    available = jax.device_count()
    if devices is not None and not 1 <= devices <= available:
        raise ValueError(
            f"a mesh of {devices} devices was asked for and JAX has {available}: pass at most "
            f"{available}, or emulate more (NNXSCALE_DEVICES={devices}) and restart."
        )
    pool = jax.devices()[: devices or available]
    shape = mesh_shape(rules, len(pool), model)
    return make_mesh(shape, ("data", "model"), explicit=False, devices=pool)
