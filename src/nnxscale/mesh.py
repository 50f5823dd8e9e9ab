"""Device meshes with checks that name the problem and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from nnxscale.rules import RuleError, Rules


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


def mesh_shape(rules: Rules, devices: int, model: int = 2) -> tuple[int, int]:
    """The (data, model) mesh a rule set is meant for: `model` devices on `model` if it uses it."""
    if "model" not in rules.mesh_axes():
        return devices, 1
    if devices % model:
        raise RuleError(
            f"rule set {rules.name!r} puts {model} devices on 'model', which does not divide "
            f"{devices} devices; pick a model size that divides {devices}."
        )
    return devices // model, model


def strategy_mesh(rules: Rules, devices: int | None = None, model: int = 2) -> Mesh:
    """The (data, model) mesh, with Auto axes, that a rule set is meant for.

    It spans the first `devices` devices (all by default); on one device it is (1, 1).
    """
    pool = jax.devices()[: devices or jax.device_count()]
    shape = mesh_shape(rules, len(pool), model) if len(pool) > 1 else (1, 1)
    return make_mesh(shape, ("data", "model"), explicit=False, devices=pool)
