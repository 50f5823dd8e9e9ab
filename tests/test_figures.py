"""Figures are drawn from real objects: shards, collective results, schedules, worker events."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.events import Start
from nnxscale.figures import (
    SUM,
    block_sources,
    plot_bubbles,
    plot_collectives,
    plot_fsdp_timeline,
    plot_mesh,
    plot_saves,
    plot_sharding,
    plot_shardings,
    plot_temporaries,
    plot_timeline,
    plot_timelines,
    plot_topology,
    shard_blocks,
)
from nnxscale.mesh import make_mesh
from nnxscale.schedules import (
    bubble_formula,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_formula,
)

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


def drawn(ax) -> list[tuple[float, float, float, float, str]]:
    """Each box an axes shows, as (x, y, width, height, its label), in drawing order."""
    labels = {(t.get_position()): t.get_text() for t in ax.texts}
    boxes = []
    for patch in ax.patches:
        x, y, w, h = patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()
        boxes.append((x, y, w, h, labels.get((x + w / 2, y + h / 2), "")))
    return boxes


def test_a_sharding_is_drawn_as_its_shards_labelled_with_their_devices(mesh) -> None:
    array = put(mesh, P("data", None))
    expected = {(c0, r0, c1 - c0, r1 - r0, ",".join(map(str, ids)))
                for (r0, r1, c0, c1), ids in shard_blocks(array).items()}  # fmt: skip
    assert set(drawn(plot_sharding(array))) == expected
    assert {box[4] for box in drawn(plot_sharding(array))} == {"0,1", "2,3", "4,5", "6,7"}
    fig = plot_shardings({"a": put(mesh, P()), "b": put(mesh, P("data", "model"))}, columns=3)
    whole, split = (a for a in fig.axes if a.get_visible())
    assert [box[4] for box in drawn(whole)] == ["0,1,2,3\n4,5,6,7"]  # every device, whole
    assert sorted(box[4] for box in drawn(split)) == [str(d) for d in range(8)]
    positions = {box[4]: box[:2] for box in drawn(plot_mesh(mesh))}
    assert positions == {str(d): (d % 2, d // 2) for d in range(8)}  # (column, row)


SCHEDULES = [one_f_one_b(4, 8), interleaved(4, 8, 2), zero_bubble(4, 8)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["1F1B", "v2", "ZB"])
def test_timeline_draws_each_task_where_the_simulation_ran_it(schedule) -> None:
    timeline = simulate(schedule)
    ax = plot_timeline(timeline)
    boxes = sorted((round(x, 9), round(w, 9), round(y + h / 2)) for x, y, w, h, _ in drawn(ax))
    runs = sorted(
        (round(start, 9), round(end - start, 9), d)
        for d, tasks in enumerate(timeline.runs)
        for _, start, end in tasks
    )
    assert boxes == runs  # each box is a task: its device's row, its start and its length
    hatched = [patch for patch in ax.patches if patch.get_hatch()]
    assert len(hatched) == (schedule.micro_batches * schedule.stages if schedule.split else 0)
    assert ax.get_xlim() == (0, timeline.makespan)
    assert f"idle {timeline.bubble():.1%}" in ax.get_title(loc="left")


def test_abstract_arrays_draw_like_placed_ones(mesh) -> None:
    spec = P("data", "model")
    abstract = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, spec))
    assert shard_blocks(abstract) == shard_blocks(put(mesh, spec))


def test_collective_pieces_are_named_by_their_source() -> None:
    blocks = np.arange(12.0).reshape(3, 4)
    gathered = np.tile(blocks.reshape(-1), (3, 1))
    summed = np.tile(blocks.sum(axis=0), (3, 1))
    assert block_sources(blocks, gathered) == [[0, 1, 2]] * 3
    assert block_sources(blocks, summed) == [[SUM]] * 3
    assert block_sources(blocks, np.roll(blocks, 1, axis=0)) == [[2], [0], [1]]
    assert block_sources(blocks, blocks + 0.5) == [["?"]] * 3
    fig = plot_collectives(blocks, {"all-gather": gathered, "all-reduce": summed})
    before, after_gather, after_sum = ([box[4] for box in drawn(ax)] for ax in fig.axes)
    assert before == ["0", "1", "2"]
    assert after_gather == ["0", "1", "2"] * 3  # each device holds every block, in order
    assert after_sum == [SUM] * 3


def test_timelines_share_one_time_axis() -> None:
    schedules = [gpipe(4, 8), interleaved(4, 8, 2)]
    fig = plot_timelines(schedules)
    longest = max(simulate(s).makespan for s in schedules)
    assert {ax.get_xlim() for ax in fig.axes} == {(0, longest)}
    assert simulate(schedules[1]).makespan < longest  # interleaving ends first, visibly
    ticks = plot_timelines(schedules, ticks=True)  # the executor's clock: one tick per task
    longest = max(simulate(s, lambda t: 1.0).makespan for s in schedules)
    assert {ax.get_xlim() for ax in ticks.axes} == {(0, longest)}


def test_bubbles_are_simulated_on_the_formula() -> None:
    ax = plot_bubbles(4, [4, 8], [1, 2]).axes[0]
    points = [
        (x, y)
        for line in ax.get_lines()
        if len(line.get_xdata()) == 1
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
    ]
    assert len(points) == 3 * 2 + 2  # GPipe, 1F1B, ZB-H1 at m = 4 and 8, interleaved at both
    formulas = {bubble_formula(4, int(x), v) for x, _ in points for v in (1, 2)}
    formulas |= {zero_bubble_formula(4, int(x)) for x, _ in points}
    assert all(any(abs(y - f) < 1e-12 for f in formulas) for _, y in points)


def test_temporaries_draw_a_line_per_schedule() -> None:
    ax = plot_temporaries({"GPipe": {8: 2**20, 16: 2**21}, "1F1B": {8: 2**20, 16: 2**20}}).axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[1.0, 2.0], [1.0, 1.0]]


@pytest.mark.parametrize("again", [True, False])
def test_fsdp_timeline_draws_each_layer_s_collectives_and_passes_in_order(again: bool) -> None:
    ax = plot_fsdp_timeline([10, 10, 20, 10], gather_again=again).axes[0]
    boxes = sorted(drawn(ax))  # by start time
    forward = ["AG0", "F0", "AG1", "F1", "AG2", "F2", "AG3", "F3"]
    backward = [
        step for i in (3, 2, 1, 0) for step in ([f"AG{i}"] if again else []) + [f"B{i}", f"RS{i}"]
    ]
    assert [box[4] for box in boxes] == forward + backward
    widths = {box[4]: box[2] for box in boxes}
    assert widths["AG2"] == widths["RS2"] == 1.0 and widths["AG0"] == 0.5  # bytes / largest
    assert widths["F0"] == 1.0 and widths["B0"] == 2.0  # a backward pass is two forward passes
    rows = {box[4][:2].rstrip("0123456789"): box[1] + box[3] / 2 for box in boxes}
    assert rows["AG"] == rows["RS"] == 0 and rows["F"] == rows["B"] == 1


def test_topology_places_each_device_in_its_process(mesh) -> None:
    starts = [
        Start(
            process=p,
            processes=2,
            local_devices=4,
            devices=8,
            device_ids=list(range(4 * p, 4 * p + 4)),
            mesh_axes=["data", "model"],
            mesh_device_ids=mesh.device_ids.tolist(),
            rows=[8 * p, 8 * p + 8],
            batch_size=16,
        )
        for p in (1, 0)
    ]
    ax = plot_topology(starts).axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert texts[0] == "process 0" and "device 0\ndata=0, model=0" in texts
    assert "device 7\ndata=3, model=1" in texts and "loads batch rows 8-15" in texts


def test_saves_are_drawn_against_the_steps_they_overlap() -> None:
    from nnxscale.checkpoint import SaveTimes

    steps = {1: (0.0, 0.01), 2: (0.02, 0.03), 3: (0.03, 0.04)}
    saves = {1: SaveTimes(0.01, 0.02, 0.035), 3: SaveTimes(0.04, 0.045, None)}
    ax = plot_saves(steps, saves).axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches if p.get_width() > 0)
    assert widths == [5.0, 10.0, 10.0, 10.0, 10.0, 15.0]  # 3 steps, 2 waits, 1 write, in ms
    assert [t.get_text() for t in ax.texts] == ["1", "2", "3", "step 1"]
