"""Meshes: shapes that fit, and errors that say what to do when they do not."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from nnxscale.placement.catalogue import DP, FSDP, FSDP_TP, TP
from nnxscale.placement.mesh import grid_shape, hybrid_mesh, make_mesh
from nnxscale.placement.rules import strategy_mesh


@pytest.mark.parametrize(
    ("n", "inner", "shape"),
    [(4, 2, (2, 2)), (8, 2, (4, 2)), (16, 2, (8, 2)), (2, 2, (1, 2)), (1, 2, (1, 1)),
     (7, 2, (7, 1)), (6, 4, (2, 3)), (9, 4, (3, 3)), (3, 8, (1, 3))],
)  # fmt: skip
def test_grid_shape_fits_any_count(n: int, inner: int, shape: tuple[int, int]) -> None:
    assert grid_shape(n, inner) == shape


def test_grid_shape_rejects_sizes_below_one() -> None:
    with pytest.raises(ValueError, match="positive sizes"):
        grid_shape(0)


def test_auto_axes_unless_explicit_asked_for() -> None:
    assert make_mesh((4, 2), ("a", "b")).axis_types == (AxisType.Auto,) * 2
    assert make_mesh((8,), ("a",), explicit=True).axis_types == (AxisType.Explicit,)


def test_a_subset_of_devices() -> None:
    mesh = make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    assert mesh.devices.size == 4


def test_a_mesh_that_does_not_fit_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"needs 16 devices but 8 are available.*\(4, 2\).*=16"):
        make_mesh((4, 4), ("a", "b"))


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ((4, 2), ("a",), "has 2 axes but 1 names"),
        ((4, 2), ("a", "a"), "must be distinct"),
        ((8, 0), ("a", "b"), "must be positive"),
    ],
)
def test_malformed_meshes(shape, names, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_mesh(shape, names)


def test_mesh_shape_per_rule_set() -> None:
    assert DP.mesh_shape(8) == FSDP.mesh_shape(8) == (8, 1)
    assert TP.mesh_shape(8) == FSDP_TP.mesh_shape(8) == (4, 2)
    assert TP.replace(sizes=(-1, 4)).mesh_shape(16) == (4, 4)
    assert TP.replace(sizes=(-1, 4)).mesh_shape(6) == (2, 3)  # the largest that divides 6
    assert TP.mesh_shape(7) == (7, 1)  # odd: TP has one device on `model`


def test_strategy_mesh() -> None:
    assert strategy_mesh(TP).shape == {"data": 4, "model": 2}
    assert strategy_mesh(FSDP, 4).devices.size == 4
    assert strategy_mesh(TP, 1).shape == {"data": 1, "model": 1}
    assert strategy_mesh(DP).axis_types == (AxisType.Auto, AxisType.Auto)
    assert strategy_mesh(TP, 3).shape == {"data": 3, "model": 1}


def test_strategy_mesh_refuses_more_devices_than_there_are() -> None:
    with pytest.raises(ValueError, match=r"12 devices was asked for and JAX has 8.*=12"):
        strategy_mesh(FSDP, 12)


def test_a_hybrid_mesh_puts_its_across_part_over_processes_and_refuses_what_does_not_fit() -> None:
    local = jax.local_device_count()  # one process here: every axis lies inside it
    mesh = hybrid_mesh((1, local), (1, 1), ("replica", "data"))
    assert dict(mesh.shape) == {"replica": 1, "data": local}
    assert list(mesh.devices.flat) == jax.devices()
    with pytest.raises(ValueError, match=r"across \(2, 1\) to the 1 processes"):
        hybrid_mesh((1, local), (2, 1), ("replica", "data"))
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        hybrid_mesh((local,), (1, 1), ("replica", "data"))
