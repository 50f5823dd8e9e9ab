"""Figures are drawn from real objects: shards, collective results, schedules, worker events."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale import TINY
from nnxscale.figures import (
    SUM,
    block_sources,
    plot_bubbles,
    plot_collectives,
    plot_dispatch,
    plot_fsdp_timeline,
    plot_mesh,
    plot_restore,
    plot_ring,
    plot_saves,
    plot_sharding,
    plot_shardings,
    plot_temporaries,
    plot_timeline,
    plot_timelines,
    plot_topology,
    shard_blocks,
)
from nnxscale.model.configs import LLAMA3_8B
from nnxscale.model.context import Ring
from nnxscale.model.moe import route_groups
from nnxscale.parallelism.schedules import (
    bubble_formula,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_formula,
)
from nnxscale.placement.catalogue import FSDP, TP
from nnxscale.placement.mesh import make_mesh
from nnxscale.runtime.events import Start

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


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_ring_is_drawn_from_its_own_hops(layout) -> None:
    ring = Ring("context", 4, layout)
    per = len(ring.chunks()) // 4
    ax = plot_ring(ring).axes[0]
    chunks = np.array(ring.chunks()).reshape(4, -1)
    labels = [t.get_text() for t in ax.texts if t.get_text().startswith("K/V")]
    expected = [
        "K/V " + ",".join(map(str, chunks[(d - t) % 4])) for t in range(4) for d in range(4)
    ]
    assert labels == expected  # device d holds d - t's shard at step t
    arrows = [t for t in ax.texts if isinstance(t, matplotlib.text.Annotation)]
    assert len(arrows) == 3 * len(ring.permutation())
    squares = ax.patches[4:]  # after one box of queries per device
    assert len(squares) == 16 * per * per
    pairs = [
        (q, k) for d in range(4) for t in range(4) for q in chunks[d] for k in chunks[(d - t) % 4]
    ]
    needed = sum(q >= k for q, k in pairs)
    filled = [p for p in squares if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    assert len(filled) == needed
    matplotlib.pyplot.close("all")


def test_the_dispatch_is_drawn_from_the_routing() -> None:
    logits = jnp.array([[[3.0, 0, 0, 0]] * 3 + [[0, 0, 0, 3.0]], [[0, 3.0, 0, 0]] * 4])
    routing = route_groups(logits, top_k=1, slots=2)  # 2 groups of 4 tokens, 4 experts
    fig = plot_dispatch(routing, devices=2)
    left, right = fig.axes
    assert len(left.patches) == 2 * 4 * 2  # each token and its one choice
    hatched = [p for p in left.patches if p.get_hatch()]
    assert len(hatched) == int((routing.wanted - routing.kept).sum()) == 1 + 2
    assert len(right.patches) == 4 * 2 * 2  # each expert's slots for each group
    filled = sorted(t.get_text() for t in right.texts)
    assert filled == ["t0", "t0", "t1", "t1", "t3"]  # e0: t0, t1; e3: t3; e1: t0, t1
    with pytest.raises(ValueError, match="one group of tokens per device"):
        plot_dispatch(routing, devices=4)
    matplotlib.pyplot.close("all")


def test_the_ledger_draws_four_parts_per_setup_from_the_cost_model() -> None:
    from nnxscale import costs
    from nnxscale.figures import plot_ledger
    from nnxscale.placement.catalogue import STRATEGIES

    on = {"data": 8}
    setups = {n: costs.Setup.of(STRATEGIES[n], on, 1, "full") for n in ("DP", "ZeRO-2", "FSDP")}
    fig = plot_ledger(LLAMA3_8B, "H100", setups, batch=8, seq=4096)
    (ax,) = fig.axes
    bars = [p.get_width() for p in ax.patches]
    assert len(bars) == len(costs.LEDGER_PARTS) * len(setups)
    for i, setup in enumerate(setups.values()):
        parts = costs.ledger(LLAMA3_8B, setup, 8, 4096)
        expected = [parts[p] / 1e9 for p in costs.LEDGER_PARTS]
        assert bars[4 * i : 4 * i + 4] == pytest.approx(expected)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(setups)


def test_an_n_dimensional_layout_is_drawn_as_a_matrix_of_whole_shards(mesh) -> None:
    from nnxscale import TINY, create
    from nnxscale.figures import matrix_view, plot_layouts
    from nnxscale.placement.catalogue import TP
    from nnxscale.placement.init import abstract
    from nnxscale.placement.layout import resolve

    layout = resolve(abstract(lambda: create(TINY)), TP, mesh)
    query = layout.array_at("blocks/0/attention/query")  # (embed, heads, head_dim)
    view = matrix_view(query)
    assert view.shape == (64, 64) and view.sharding.spec == P(None, "model")
    out = matrix_view(layout.array_at("blocks/0/attention/out"))  # (heads, head_dim, embed)
    assert out.shape == (64, 64) and out.sharding.spec == P("model", None)
    assert len(shard_blocks(view)) == 2  # each half of the heads held by four devices
    paths = ["blocks/0/attention/query", "blocks/0/mlp/up"]
    fig = plot_layouts({"TP": layout, "again": layout}, paths)
    assert len(fig.axes) == 4
    with pytest.raises(ValueError, match="one block"):
        matrix_view(put(mesh, P(None, "data", None, "model"), (2, 4, 2, 2)))


def test_an_array_is_drawn_beside_its_mesh_in_the_same_colours(mesh) -> None:
    from nnxscale.figures import plot_on_mesh

    fig = plot_on_mesh(put(mesh, P("data", "model")))
    grid, blocks = fig.axes
    assert sorted(box[4] for box in drawn(grid)) == [str(d) for d in range(8)]
    assert sorted(box[4] for box in drawn(blocks)) == [str(d) for d in range(8)]
    colour = {
        t.get_text(): p.get_facecolor() for t, p in zip(grid.texts, grid.patches, strict=True)
    }
    for text, patch in zip(blocks.texts, blocks.patches, strict=True):
        assert patch.get_facecolor() == colour[text.get_text()]  # device d: one colour
    assert "P('data', 'model')" in blocks.get_title()


def test_ring_costs_draw_the_formulas_and_the_counted_points() -> None:
    from nnxscale.figures import plot_ring_costs

    ax = plot_ring_costs({"all-gather": (8, 7 / 8), "all-reduce": (8, 14 / 8)}, 16).axes[0]
    formulas, dots = ax.get_lines()[:2], ax.get_lines()[2:]
    assert [line.get_ydata()[-1] for line in formulas] == [15 / 16, 30 / 16]  # at N = 16
    assert [(d.get_xdata()[0], d.get_ydata()[0]) for d in dots] == [(8, 7 / 8), (8, 14 / 8)]


def test_rule_sets_cut_one_weight_on_their_own_meshes() -> None:
    from flax import nnx

    from nnxscale import TINY, create
    from nnxscale.figures import plot_rule_sets
    from nnxscale.placement.catalogue import FSDP, TP
    from nnxscale.placement.init import abstract

    shapes = abstract(lambda: create(TINY))
    fig = plot_rule_sets(shapes, {"FSDP": FSDP, "TP": TP}, "blocks/0/mlp/up")
    fsdp, tp = fig.axes
    assert len(drawn(fsdp)) == 8 and len(drawn(tp)) == 2  # rows over 8; columns over 2
    assert "data 8" in fsdp.get_title() and "model 2" in tp.get_title()
    state = nnx.state(shapes, nnx.Param)  # a State draws as the module does
    assert len(plot_rule_sets(state, {"TP": TP}, "blocks/0/attention/query").axes) == 1


def test_shares_are_bars_per_rule_set_and_mesh_against_the_ideal() -> None:
    from nnxscale.figures import plot_shares

    shares = {("DP", 1): 1.0, ("FSDP", 1): 0.125, ("DP", 2): 1.0, ("FSDP", 2): 0.25}
    ax = plot_shares(shares, 8).axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [12.5, 25.0, 100.0, 100.0]
    (ideal,) = ax.get_lines()
    assert list(ideal.get_ydata()) == [12.5, 12.5]


def test_a_restore_figure_outlines_the_readers_shard_and_hatches_what_it_reads() -> None:
    """Block 0's `up` saved under FSDP on 8 devices is 8 bands of rows, one chunk each. Under
    TP device 0 keeps the left half of the columns, outlined, and reads all 8 bands; under
    FSDP on 4 devices it keeps and reads the first 2."""
    restored = {"TP": (TP, None), "FSDP on 4": (FSDP, 4)}
    saved, tp, half = plot_restore(TINY, "blocks/0/mlp/up", restored).axes

    def hatched(ax) -> list:
        return [p for p in ax.patches if p.get_hatch()]

    def outlined(ax) -> list:
        return [p for p in ax.patches if tuple(p.get_edgecolor()[:3]) == (1.0, 0.0, 0.0)]

    assert len(saved.patches) == 8 and not hatched(saved)
    assert len(hatched(tp)) == 8 and len(hatched(half)) == 2
    (box,) = outlined(tp)
    assert (box.get_x(), box.get_y(), box.get_width(), box.get_height()) == (0, 0, 128, 64)
    assert "keeps 32,768 B, reads 65,536 B" in tp.get_title()
    assert "keeps 16,384 B, reads 16,384 B" in half.get_title()


def test_init_memory_draws_device_0_alone_against_every_device_s_shards() -> None:
    from nnxscale import Config, create
    from nnxscale.core.memory import CompiledMemory
    from nnxscale.figures import plot_init_memory
    from nnxscale.placement.catalogue import FSDP
    from nnxscale.placement.init import InitPrograms

    small = Config(vocab=16, embed=8, heads=2, head_dim=4, mlp=16, layers=1, max_len=8)
    programs = InitPrograms.compile(lambda: create(small), FSDP)
    fig = plot_init_memory(programs)
    left, right = fig.axes
    devices = jax.device_count()
    whole = CompiledMemory.of(programs.whole)
    heights = [bar.get_height() for bar in left.patches[: 2 * devices]]
    # device 0 alone holds the whole build's outputs and temporaries; the others nothing
    assert heights[0] + heights[devices] == pytest.approx((whole.output + whole.temp) / 1024)
    assert not any(heights[1:devices]) and not any(heights[devices + 1 :])
    tops = {round(bar.get_height(), 6) for bar in right.patches}
    assert len(tops) == 2  # every device the same weights and temporaries


def test_zero_stages_stack_each_role_s_bytes_per_rule_set() -> None:
    from nnxscale import Config, create
    from nnxscale.figures import plot_zero_stages
    from nnxscale.placement.catalogue import DP, FSDP, ZERO1, ZERO2
    from nnxscale.train import role_bytes

    small = Config(vocab=16, embed=8, heads=2, head_dim=4, mlp=16, layers=1, max_len=8)
    rule_sets = [DP, ZERO1, ZERO2, FSDP]
    fig = plot_zero_stages(small, rule_sets)
    (ax,) = fig.axes
    bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
    assert len(bars) == 3 * len(rule_sets)  # parameters, gradients, optimizer state
    held = role_bytes(lambda: create(small), rule_sets)
    totals = [sum(h.values()) for h in held.values()]
    heights = np.array([b.get_height() for b in bars]).reshape(3, len(rule_sets)).sum(0)
    assert heights / heights[0] == pytest.approx(np.array(totals) / totals[0])


def test_data_parallel_draws_a_row_per_device_and_one_all_reduce() -> None:
    from nnxscale.figures import plot_data_parallel

    fig = plot_data_parallel(devices=4, rows=8, grad_bytes=1000, sent=1500.0)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.texts]
    assert sum(label.startswith("gradients g") for label in labels) == 4
    assert sum("all-reduce" in label for label in labels) == 1
    assert "1,500 bytes" in ax.get_title()


def test_tensor_parallel_mlp_is_drawn_from_the_layout() -> None:
    from flax import nnx

    from nnxscale import TINY, create
    from nnxscale.figures import plot_tensor_parallel_mlp
    from nnxscale.placement.catalogue import TP
    from nnxscale.placement.init import abstract
    from nnxscale.placement.layout import resolve
    from nnxscale.placement.rules import strategy_mesh

    layout = resolve(nnx.state(abstract(lambda: create(TINY))), TP, strategy_mesh(TP))
    fig = plot_tensor_parallel_mlp(layout, rows=16)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 5  # x, W_up, h, W_down, y
    model = strategy_mesh(TP).shape["model"]
    assert len(axes[1].patches) == len(axes[3].patches) == model  # split over model
    data = strategy_mesh(TP).shape["data"]
    assert len(axes[2].patches) == data * model  # h: batch rows by columns


def test_strategy_costs_draw_memory_and_traffic_per_strategy() -> None:
    from nnxscale.figures import plot_strategy_costs

    fig = plot_strategy_costs(
        state={"DP": 4096, "FSDP": 1024},
        temp={"DP": 2048, "FSDP": 2048},
        sent={"DP": 3072, "FSDP": 4096},
        formulas={"DP formula": 3072},
        ideal=512,
    )
    memory, traffic = fig.axes
    assert [p.get_height() for p in memory.patches] == [4.0, 1.0, 2.0, 2.0]
    assert [p.get_height() for p in traffic.patches] == [3.0, 4.0]


def test_the_links_each_axis_crosses_are_drawn_from_the_recorded_report() -> None:
    from nnxscale.costs import crossing
    from nnxscale.figures import plot_links

    ax = plot_links(crossing.compare("HSDP", crossing.recorded("HSDP"))).axes[0]
    texts = {t.get_text(): t.get_color() for t in ax.texts}
    inside, across = [t for t in texts if t.startswith(("fast", "the slow"))]
    assert "all-gather over data: 559,616 B" in inside and texts[inside] == "black"
    assert "all-reduce over replica: 131,072 B" in across and texts[across] == "tab:red"
    assert "replica" not in inside.split("\n", 1)[1]  # nothing over replica stays inside
    assert "replica=1\ndata=3" in texts and "process 1 (a host)" in texts
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(dashed) == 4  # one slow link for each device of the second process


def test_sequence_parallelism_joins_its_regions_as_its_rules_say() -> None:
    from nnxscale.figures import plot_sequence_parallel
    from nnxscale.placement.catalogue import SP, TP

    fig = plot_sequence_parallel([TP, SP], model=4)
    tp, sp = ([t.get_text() for t in ax.texts] for ax in fig.axes)
    assert tp.count("all-reduce") == 2 and "all-gather" not in tp  # partial sums added
    assert sp.count("all-gather") == 2 and sp.count("reduce-scatter") == 2
    # SP's residual regions hold a quarter of the sequence a device, TP's all of it
    heights = [
        {round(p.get_height(), 3) for p in ax.patches if p.get_facecolor()[:3] != (0.92,) * 3}
        for ax in fig.axes
    ]
    assert heights == [{1.0}, {1.0, 0.25}]
    matplotlib.pyplot.close(fig)


def test_the_collective_matmul_passes_each_block_once_around_the_ring() -> None:
    from nnxscale.figures import plot_collective_matmul

    fig = plot_collective_matmul(4)
    held = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("rows of")]
    by_step = [held[4 * s : 4 * s + 4] for s in range(4)]
    assert by_step[0] == [f"rows of {d}" for d in range(4)]  # its own rows first
    assert by_step[1] == ["rows of 3", "rows of 0", "rows of 1", "rows of 2"]
    assert all(sorted(row) == sorted(by_step[0]) for row in by_step)  # each block once a step
    assert len(fig.axes[0].patches) == 16
    matplotlib.pyplot.close(fig)


def test_the_grid_is_drawn_one_panel_a_model_with_every_priced_run() -> None:
    from nnxscale.evidence import grid
    from nnxscale.figures import plot_grid, plot_picks

    priced = grid.priced()
    fig = plot_grid(priced)
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == list(grid.MODELS)
    drawn = sum(len(c.get_offsets()) for ax in fig.axes for c in ax.collections)
    assert drawn == len(priced)
    matplotlib.pyplot.close(fig)
    groups = grid.rank(priced)
    fig = plot_picks(groups)
    picked = [y for ax in fig.axes for y in ax.lines[1].get_ydata()]
    assert sorted(picked) == sorted(g.pick.tokens for g in groups)
    matplotlib.pyplot.close(fig)
