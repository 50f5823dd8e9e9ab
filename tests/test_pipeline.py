"""The pipeline executor computes what the unpipelined model computes, under every schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscale import pipeline
from nnxscale.data import book_batches
from nnxscale.hlo import collectives
from nnxscale.layout import resolve
from nnxscale.model import TINY, create
from nnxscale.rules import DP, strategy_mesh
from nnxscale.schedules import ScheduleError, gpipe, interleaved, one_f_one_b
from nnxscale.train import Trainer, adamw, loss_and_grads

CFG = TINY.replace(layers=4, scan_layers=True)
TOKENS = book_batches(batch_size=16).rows(0)


@pytest.fixture(scope="module")
def reference() -> tuple[jax.Array, nnx.State]:
    return jax.jit(lambda m, t: loss_and_grads(m, t, None))(create(CFG), TOKENS)


def placed(mesh) -> nnx.Module:
    return pipeline.placed(create(CFG), mesh)


def test_placed_lays_the_model_out_by_the_rules_its_mesh_implies() -> None:
    for mesh, rules in ((pipeline.pipeline_mesh(2), pipeline.PP),
                        (pipeline.pipeline_mesh(2, 2), pipeline.PP_FSDP)):  # fmt: skip
        assert pipeline.rules_for(mesh) is rules
        state = nnx.state(placed(mesh))
        expected = resolve(state, rules, mesh).shardings()
        assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim),
                                         state, expected))  # fmt: skip


CASES = [
    (gpipe(4, 8), (4, 0)), (one_f_one_b(4, 8), (4, 0)), (one_f_one_b(4, 2), (4, 0)),
    (one_f_one_b(2, 4), (2, 0)), (gpipe(4, 4), (4, 2)), (one_f_one_b(4, 8), (4, 2)),
    (one_f_one_b(2, 4), (2, 4)),
]  # fmt: skip


IDS = [f"{s.name}-p{s.devices}-m{s.micro_batches}-fsdp{f}" for s, (_, f) in CASES]


@pytest.mark.parametrize(("schedule", "shape"), CASES, ids=IDS)
def test_pipelined_gradients_equal_the_unpipelined(reference, schedule, shape) -> None:
    mesh = pipeline.pipeline_mesh(*shape)
    model = placed(mesh)
    run = jax.jit(lambda m, t: pipeline.loss_and_grads(m, t, schedule, mesh))
    loss, grads = run(model, TOKENS)
    ref_loss, ref_grads = reference
    assert abs(float(loss) - float(ref_loss)) <= 1e-6
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    report = collectives(run.lower(model, TOKENS).compile())
    assert report.count("collective-permute") > 0
    if shape[1]:  # FSDP inside the stages: each array gathered and reduce-scattered once a step
        arrays = len(jax.tree.leaves(ref_grads))
        assert report.count("all-gather") == report.count("reduce-scatter") == arrays
        assert report.bytes("all-gather") == report.bytes("reduce-scatter")


def test_the_tick_table_runs_every_task_once() -> None:
    what, micro = pipeline.tick_table(one_f_one_b(4, 8))
    assert what.shape == (2 * (8 + 4 - 1), 4)
    for d in range(4):
        for kind in (pipeline.RUN_FORWARD, pipeline.RUN_BACKWARD):
            assert sorted(micro[what[:, d] == kind, d]) == list(range(8))


def test_receive_fills_the_micro_batch_slot_only_for_a_real_hand_over() -> None:
    buffer = jnp.arange(6.0).reshape(3, 2)  # 3 slots: micro-batch i goes to slot i % 3
    value = jnp.full(2, -1.0)
    got = pipeline.receive(buffer, value, jnp.int32(4), jnp.bool_(True))
    np.testing.assert_array_equal(got, [[0, 1], [-1, -1], [4, 5]])
    kept = pipeline.receive(buffer, value, jnp.int32(4), jnp.bool_(False))  # from an idle stage
    np.testing.assert_array_equal(kept, buffer)


def test_training_through_the_pipeline_equals_one_device() -> None:
    mesh = pipeline.pipeline_mesh(4, 2)
    one = Trainer.create(create(CFG), adamw(), DP, strategy_mesh(DP, 1), dropout=False)
    piped = Trainer.create(create(CFG), adamw(), pipeline.PP_FSDP, mesh, dropout=False,
                           grads_fn=pipeline.grads_fn(one_f_one_b(4, 4), mesh))  # fmt: skip
    batches = book_batches(batch_size=16)
    np.testing.assert_allclose(piped.train(batches, 3), one.train(batches, 3), rtol=0, atol=1e-5)


def test_bad_pipelines_are_refused(reference) -> None:
    mesh = pipeline.pipeline_mesh(4)
    model = placed(mesh)
    with pytest.raises(ScheduleError, match="GPipe or 1F1B"):
        pipeline.loss_and_grads(model, TOKENS, interleaved(4, 8, 2), mesh)
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
