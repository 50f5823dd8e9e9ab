"""Sharding figures are drawn from the arrays' real shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.figures import plot_mesh, plot_sharding, plot_shardings, plot_timeline, shard_blocks
from nnxscale.mesh import make_mesh
from nnxscale.schedules import interleaved, one_f_one_b, simulate

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((4, 2), ("data", "model"))


def put(mesh, spec, shape=(8, 4)):
    return jax.device_put(jnp.zeros(shape), NamedSharding(mesh, spec))


def test_blocks_of_a_two_axis_sharding(mesh) -> None:
    blocks = shard_blocks(put(mesh, P("data", "model")))
    assert len(blocks) == 8
    assert blocks[(0, 2, 0, 2)] == [0] and blocks[(6, 8, 2, 4)] == [7]


def test_replicated_blocks_list_every_holder(mesh) -> None:
    assert shard_blocks(put(mesh, P(None, None))) == {(0, 8, 0, 4): list(range(8))}
    assert shard_blocks(put(mesh, P("data", None)))[(0, 2, 0, 4)] == [0, 1]


def test_one_dimensional_arrays_are_one_row(mesh) -> None:
    blocks = shard_blocks(put(mesh, P(("data", "model")), shape=(16,)))
    assert sorted(blocks) == [(0, 1, 2 * i, 2 * i + 2) for i in range(8)]


def test_three_dimensional_arrays_are_refused(mesh) -> None:
    with pytest.raises(ValueError, match="1-D or 2-D"):
        shard_blocks(put(mesh, P(), shape=(2, 2, 2)))


def test_plots_draw_one_patch_per_block(mesh) -> None:
    ax = plot_sharding(put(mesh, P("data", None)))
    assert len(ax.patches) == 4
    fig = plot_shardings({"a": put(mesh, P()), "b": put(mesh, P("data", "model"))}, columns=3)
    assert [len(a.patches) for a in fig.axes if a.get_visible()] == [1, 8]
    assert len(plot_mesh(mesh).patches) == 8
    assert len(plot_mesh(make_mesh((8,), ("ring",))).patches) == 8


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 8), interleaved(4, 8, 2)], ids=["1F1B", "v2"])
def test_timeline_draws_a_box_per_task(schedule) -> None:
    timeline = simulate(schedule)
    ax = plot_timeline(timeline)
    assert len(ax.patches) == 2 * schedule.micro_batches * schedule.stages
    assert ax.get_xlim() == (0, timeline.makespan)
    assert f"idle {timeline.bubble():.1%}" in ax.get_title()
