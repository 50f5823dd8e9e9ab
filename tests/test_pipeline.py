"""The pipeline executor computes what the unpipelined model computes, under every schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscale import PP, PP_FSDP, TINY, Trainer, adamw, create, pipeline
from nnxscale.analysis.hlo import branch_work, collectives
from nnxscale.core.memory import CompiledMemory
from nnxscale.parallelism.schedules import (
    ScheduleError,
    expected_bubble,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_v,
)
from nnxscale.placement.catalogue import DP
from nnxscale.placement.layout import resolve
from nnxscale.placement.rounds import group_layers, layer_rounds
from nnxscale.placement.rules import strategy_mesh
from nnxscale.train import loss_and_grads
from nnxscale.train.agree import order_ulps
from nnxscale.train.data import book_batches

CFG = TINY.replace(layers=8, scan_layers=True)
TOKENS = book_batches(batch_size=16).rows(0)


@pytest.fixture(scope="module")
def reference() -> tuple[jax.Array, nnx.State]:
    return jax.jit(lambda m, t: loss_and_grads(m, t, None))(create(CFG), TOKENS)


def placed(mesh, virtual: int = 1) -> nnx.Module:
    return pipeline.placed(create(CFG), mesh, virtual)


def test_placed_lays_the_model_out_by_the_rules_its_mesh_implies() -> None:
    for mesh, rules in ((pipeline.pipeline_mesh(2), PP),
                        (pipeline.pipeline_mesh(2, 2), PP_FSDP)):  # fmt: skip
        assert pipeline.rules_for(mesh) is rules
        state = nnx.state(placed(mesh))
        expected = resolve(state, rules, mesh).shardings()
        assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim),
                                         state, expected))  # fmt: skip


def test_interleaving_holds_the_layers_in_rounds_each_device_its_stages() -> None:
    model = create(CFG)
    mesh = pipeline.pipeline_mesh(4)
    interleaving = pipeline.placed(model, mesh, virtual=2)
    assert layer_rounds(nnx.state(interleaving)) == 2
    up = interleaving.blocks.mlp.up
    assert up.shape == (2, 4, *model.blocks.mlp.up.shape[1:])
    assert up.get_metadata()["out_sharding"][:2] == ("rounds", "layers")
    # device d holds one layer of each round: model layers d and d + 4, its two stages
    held = {s.device.id: s.index for s in up[...].addressable_shards}
    for position, device in enumerate(mesh.devices.flat):
        rows = np.arange(8).reshape(2, 4)[held[device.id][:2]]
        assert sorted(rows.flat) == [position, position + 4]
    # a reshape: the same layers in the model's order, which the model runs as it would
    plain = nnx.state(model, nnx.Param)
    back = group_layers(nnx.state(interleaving, nnx.Param), 1)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tokens = TOKENS[:, :-1]
    np.testing.assert_array_equal(np.asarray(interleaving(tokens)), np.asarray(model(tokens)))
    # placing again regroups: v = 1 gives the plain stacks back
    natural = pipeline.placed(interleaving, mesh, virtual=1)
    assert layer_rounds(nnx.state(natural)) == 1
    assert natural.blocks.mlp.up.shape == model.blocks.mlp.up.shape


CASES = [
    (gpipe(4, 8), (4, 0)), (one_f_one_b(4, 8), (4, 0)), (one_f_one_b(4, 2), (4, 0)),
    (one_f_one_b(2, 4), (2, 0)), (gpipe(4, 4), (4, 2)), (one_f_one_b(4, 8), (4, 2)),
    (one_f_one_b(2, 4), (2, 4)), (interleaved(4, 8, 2), (4, 0)), (interleaved(2, 4, 4), (2, 2)),
    (zero_bubble(4, 8), (4, 0)), (zero_bubble(4, 2), (4, 2)), (zero_bubble(1, 4), (1, 0)),
    (interleaved(1, 2, 2), (1, 0)), (zero_bubble_v(4, 8), (4, 0)), (zero_bubble_v(2, 4), (2, 2)),
    (zero_bubble_v(1, 2), (1, 0)),
]  # fmt: skip


IDS = [f"{s.name}-p{s.devices}-m{s.micro_batches}-fsdp{f}" for s, (_, f) in CASES]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "shape"), CASES, ids=IDS)
def test_pipelined_gradients_equal_the_unpipelined(reference, schedule, shape) -> None:
    mesh = pipeline.pipeline_mesh(*shape)
    model = placed(mesh, schedule.virtual)
    run = jax.jit(lambda m, t: pipeline.loss_and_grads(m, t, schedule, mesh))
    loss, grads = run(model, TOKENS)
    grads = group_layers(grads, 1)
    ref_loss, ref_grads = reference
    # the micro-batches' losses add up in another order
    tolerance = order_ulps(TOKENS[:, 1:].size) * np.spacing(np.float32(ref_loss))
    assert abs(float(loss) - float(ref_loss)) <= tolerance
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    compiled = run.lower(model, TOKENS).compile()
    report = collectives(compiled)
    ticks = pipeline.tick_table(schedule).count
    if jax.default_backend() == "cpu" and shape[0] > 1 and schedule.placement == "looped":
        assert report.count("collective-permute") == 2 * ticks  # one each way per tick
    elif jax.default_backend() == "cpu" and shape[0] > 1:  # a V sends both ways, both kinds,
        layers = len(jax.tree.leaves(ref_grads["blocks"]))  # and mirrors its second chunk
        assert report.count("collective-permute") == 4 * ticks + 2 * layers
    assert (report.bytes("collective-permute") > 0) == (shape[0] > 1)
    if shape[1]:  # FSDP inside the stages: each array gathered and reduce-scattered once a step
        arrays = len(jax.tree.leaves(ref_grads))
        assert report.count("all-gather") == report.count("reduce-scatter") == arrays
        assert report.bytes("all-gather") == report.bytes("reduce-scatter")


SCHEDULES = [gpipe(4, 8), one_f_one_b(4, 8), interleaved(4, 8, 2), zero_bubble(4, 8),
             gpipe(3, 5), one_f_one_b(2, 8), interleaved(2, 8, 3), zero_bubble(3, 6),
             zero_bubble_v(4, 8), zero_bubble_v(3, 5)]  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.name}-{s.devices}")
def test_the_tick_table_runs_every_task_once_and_idles_the_unit_cost_bubble(schedule) -> None:
    ticks = pipeline.tick_table(schedule)
    unit = simulate(schedule, lambda task: 1.0)
    assert ticks.count == unit.makespan
    assert ticks.idle_share() == pytest.approx(unit.bubble(), abs=1e-12)
    assert ticks.idle_share() == pytest.approx(expected_bubble(schedule), abs=1e-12)
    ran = sorted(
        (b.kind, int(ticks.micro[t, d]), int(d), int(ticks.chunk[t, d]))
        for t, d in zip(*np.nonzero(ticks.branch), strict=True)
        for b in [ticks.branches[ticks.branch[t, d] - 1]]
    )
    p = schedule.devices
    tasks = sorted(
        (task.kind, task.micro, schedule.device_of(task.stage), task.stage // p)
        for order in schedule.order
        for task in order
    )
    assert ran == tasks  # every task once, on its stage's device, as its chunk there


def test_slots_are_what_each_schedule_keeps_alive() -> None:
    p = 4
    for m in (8, 16):
        assert pipeline.tick_table(gpipe(p, m)).x_slots == m
        assert pipeline.tick_table(one_f_one_b(p, m)).x_slots == p
        zb = pipeline.tick_table(zero_bubble(p, m))
        assert (zb.x_slots, zb.g_slots) == (p, p - 1)  # device d defers d Ws
        assert pipeline.tick_table(one_f_one_b(p, m)).g_slots == 1


def test_receive_fills_the_slot_the_table_names_or_nothing() -> None:
    buffer = jnp.arange(6.0).reshape(3, 2)
    value = jnp.full(2, -1.0)
    got = pipeline.receive(buffer, value, jnp.int32(1))
    np.testing.assert_array_equal(got, [[0, 1], [-1, -1], [4, 5]])
    kept = pipeline.receive(buffer, value, jnp.int32(-1))  # nothing arrives this tick
    np.testing.assert_array_equal(kept, buffer)


@pytest.mark.slow
def test_stages_compute_only_their_part() -> None:
    schedule, mesh = zero_bubble(4, 8), pipeline.pipeline_mesh(4)
    run = jax.jit(lambda m, t: pipeline.loss_and_grads(m, t, schedule, mesh))
    work = branch_work(run.lower(placed(mesh), TOKENS).compile())
    ticks = pipeline.tick_table(schedule)
    by_name = {str(b): w for b, w in zip(ticks.branches, work[1:], strict=True)}
    assert work[0].flops == 0 and not work[0].opcodes.get("dot")  # idle
    head = 2 * 2 * 32 * CFG.embed * CFG.vocab  # a micro-batch of 2 rows x 32 tokens
    assert by_name["F first"].flops == by_name["F middle"].flops
    assert by_name["F last"].flops - by_name["F middle"].flops == head
    assert by_name["F first"].opcodes["gather"] > 0 == by_name["F middle"].opcodes["gather"]
    assert by_name["B(input) first"].flops == 0  # nothing before the first stage needs it
    for role in ("first", "middle", "last"):  # W redoes the stage to reach every layer's weights
        assert by_name[f"W {role}"].flops > by_name["F middle"].flops
    # Which device runs which branch is in the table: only the last device runs the head.
    last = [i + 1 for i, b in enumerate(ticks.branches) if b.last]
    assert set(np.nonzero(np.isin(ticks.branch, last))[1]) == {3}
    # and a simulation can cost each task by its branch's FLOPs
    cost = pipeline.branch_costs(schedule, run.lower(placed(mesh), TOKENS).compile())
    first_f = {d: next(t for t in schedule.order[d] if t.kind == "F") for d in (0, 1, 3)}
    assert [cost(first_f[d]) for d in (0, 1, 3)] == [
        by_name[f"F {role}"].flops for role in ("first", "middle", "last")
    ]


@pytest.mark.slow
def test_memory_follows_the_slots_the_table_keeps() -> None:
    mesh, act = pipeline.pipeline_mesh(4), 2 * 32 * CFG.embed * 4  # a micro-batch's stage input
    bases = {}
    for make in (gpipe, one_f_one_b, zero_bubble, lambda p, m: interleaved(p, m, 2)):
        for m in (8, 16):
            schedule = make(4, m)
            tokens = book_batches(batch_size=2 * m).rows(0)
            run = jax.jit(lambda mdl, t, s=schedule: pipeline.loss_and_grads(mdl, t, s, mesh))
            temp = CompiledMemory.of(run.lower(placed(mesh, schedule.virtual), tokens).compile())
            ticks = pipeline.tick_table(schedule)
            bases.setdefault(schedule.name, set()).add(
                temp.temp - (ticks.x_slots + ticks.g_slots) * act
            )
    assert all(len(b) == 1 for b in bases.values()), bases  # temporaries = base + slots x act
    assert bases["GPipe"] == bases["1F1B"]  # the same branches, only the slots differ


@pytest.mark.slow
def test_training_through_the_pipeline_equals_one_device() -> None:
    one = Trainer.create(create(CFG), adamw(), DP, strategy_mesh(DP, 1), dropout=False)
    batches = book_batches(batch_size=16)
    expected = one.train(batches, 3)
    for schedule, shape in ((one_f_one_b(4, 4), (4, 2)), (interleaved(4, 4, 2), (4, 0))):
        mesh = pipeline.pipeline_mesh(*shape)
        model = pipeline.placed(create(CFG), mesh, schedule.virtual)
        piped = Trainer.create(model, adamw(), pipeline.rules_for(mesh), mesh, dropout=False,
                               grads_fn=pipeline.grads_fn(schedule, mesh))  # fmt: skip
        np.testing.assert_allclose(piped.train(batches, 3), expected, rtol=0, atol=1e-5)


def test_bad_pipelines_are_refused(reference) -> None:
    mesh = pipeline.pipeline_mesh(4)
    model = placed(mesh)
    with pytest.raises(ScheduleError, match="8 layers cannot be split into 12"):
        pipeline.loss_and_grads(model, TOKENS, interleaved(4, 8, 3), mesh)
    with pytest.raises(ScheduleError, match="the schedule has 2 stages, the mesh 4"):
        pipeline.loss_and_grads(model, TOKENS, gpipe(2, 4), mesh)
    with pytest.raises(ScheduleError, match="16 rows cannot make 3 micro-batches"):
        pipeline.loss_and_grads(model, TOKENS, gpipe(4, 3), mesh)
    three = create(TINY.replace(layers=3, scan_layers=True))
    with pytest.raises(ScheduleError, match="3 layers cannot be split into 4"):
        pipeline.loss_and_grads(three, TOKENS, gpipe(4, 4), mesh)
    with pytest.raises(ScheduleError, match="needs 32 devices and there are 8"):
        pipeline.pipeline_mesh(8, 4)
    with pytest.raises(ValueError, match="dropout=False"):
        pipeline.grads_fn(gpipe(4, 4), mesh)(model, TOKENS, jax.random.key(0))
    # a model held in the rounds of one interleaving is refused by another
    two = placed(mesh, virtual=2)
    with pytest.raises(ScheduleError, match=r"holds its layers in 2 round.*virtual=1"):
        pipeline.loss_and_grads(two, TOKENS, gpipe(4, 4), mesh)
    with pytest.raises(ScheduleError, match=r"in 1 round.*virtual=2"):
        pipeline.loss_and_grads(model, TOKENS, interleaved(4, 8, 2), mesh)
    with pytest.raises(ScheduleError, match="8 layers cannot be split into 12"):
        pipeline.placed(create(CFG), mesh, virtual=3)
    with pytest.raises(ScheduleError, match=r"in 1 round.*virtual=2"):  # a V holds two
        pipeline.loss_and_grads(model, TOKENS, zero_bubble_v(4, 8), mesh)
