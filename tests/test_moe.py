"""Routing keeps its promises, the dispatched layer equals the dense reference, and expert
parallelism by hand equals both, with the all-to-alls the formula predicts."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnxscale as nx
from nnxscale import moe
from nnxscale.analysis.hlo import collectives
from nnxscale.placement.mesh import make_mesh

D, F, E = 16, 32, 8


def layer(top_k: int = 1, factor: float = 2.0, experts: int = E) -> moe.MoE:
    with nnx.use_eager_sharding(False):
        return moe.MoE(D, F, experts, top_k=top_k, capacity_factor=factor, rngs=nnx.Rngs(0))


def tokens(groups: int = 8, per_group: int = 32) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (groups, per_group, D))


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_routing_respects_capacity_and_accounts_for_every_assignment(top_k, factor) -> None:
    layer_ = layer(top_k, factor)
    routing = layer_.routing(tokens())
    slots = moe.capacity(32, E, top_k, factor)
    assert routing.dispatch.shape == (8, 32, E, slots)
    per_slot = routing.dispatch.sum(axis=1)  # tokens in each slot of each expert
    assert per_slot.max() <= 1
    per_token = routing.dispatch.sum(axis=(2, 3))
    assert per_token.max() <= top_k
    assert (routing.wanted.sum(axis=-1) == 32 * top_k).all()
    assert (routing.kept == routing.dispatch.sum(axis=(1, 3))).all()
    assert (routing.kept <= slots).all() and (routing.kept <= routing.wanted).all()
    gates = routing.combine.sum(axis=(2, 3))
    kept_all = per_token == top_k
    if top_k > 1:  # renormalised gates of a token that kept every choice sum to one
        assert jnp.allclose(jnp.where(kept_all, gates, 1.0), 1.0, atol=1e-6)
    dropped = float(routing.dropped)
    assert 0 <= dropped < 1
    # chosen: k distinct experts per token, exactly where dispatch put it (or dropped it)
    assert routing.chosen.shape == (8, 32, top_k)
    asked = jax.nn.one_hot(routing.chosen, E).sum(axis=2)  # (groups, tokens, experts)
    assert (asked.max() == 1) and (routing.dispatch.sum(axis=3) <= asked).all()
    assert (asked.sum(axis=1) == routing.wanted).all()


def test_a_tighter_capacity_drops_more() -> None:
    x = tokens()
    loose, tight = (float(layer(2, f).routing(x).dropped) for f in (2.0, 1.0))
    assert tight > loose


@pytest.mark.parametrize("top_k", [1, 2])
def test_dispatched_equals_the_dense_reference(top_k) -> None:
    layer_ = layer(top_k, 1.0)
    x = tokens()
    y, routing = layer_(x)
    reference = moe.dense_reference(x, routing, *layer_.experts())
    # the same products; dispatch adds exact zeros, so float32 differs by rounding only
    assert jnp.abs(y - reference).max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_expert_parallelism_by_hand_equals_one_device(devices, top_k) -> None:
    mesh = make_mesh((devices,), ("expert",), devices=jax.devices()[:devices])
    layer_ = layer(top_k, 1.5)
    x, w = tokens(), jax.random.normal(jax.random.key(2), (8, 32, D))

    graphdef, state = nnx.split(layer_)

    def on_one(state, x):
        y, routing = nnx.merge(graphdef, state)(x)
        return (y * w).sum() + routing.aux_loss

    def by_hand(state, x):
        y, aux = moe.expert_parallel(nnx.merge(graphdef, state), x, mesh)
        return (y * w).sum() + aux

    grad = partial(jax.value_and_grad, argnums=(0, 1))
    (a, ga), (b, gb) = (jax.jit(grad(f))(state, x) for f in (on_one, by_hand))
    # float32 sums of the same products in another order: the loss sums 4,096 of them
    # (rounding grows like sqrt(n) ulps, ~4e-6 relative); gradients a few ulps of their largest
    assert abs(float(a - b)) <= 1e-5 * abs(float(a))
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        assert jnp.abs(u - v).max() <= 1e-6 * jnp.abs(u).max()


def test_expert_parallelism_sends_two_all_to_alls_of_the_slots() -> None:
    mesh = make_mesh((8,), ("expert",))
    layer_ = layer(2, 1.0)
    x = tokens()
    program = jax.jit(lambda x: moe.expert_parallel(layer_, x, mesh)[0]).lower(x).compile()
    report = collectives(program)
    slots = moe.capacity(32, E, 2, 1.0)
    array = E * slots * D * 4  # one group's slots of every expert, float32
    assert report.count("all-to-all") == 2
    assert report.array_bytes("all-to-all") == 2 * array
    assert report.bytes("all-to-all") == 2 * array * 7 / 8


def test_an_expert_count_the_axis_cannot_split_is_named() -> None:
    mesh = make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    with pytest.raises(moe.MoEError, match="6 experts cannot be split evenly over the 4"):
        moe.expert_parallel(layer(experts=6), tokens(), mesh)
    with pytest.raises(moe.MoEError, match="top_k=3 with 2 experts"):
        moe.route(jnp.zeros((4, 2)), 3, 4)


def moe_config():
    import nnxscale as nx

    return nx.TINY.replace(dropout=0.0, experts=8, top_k=2, capacity_factor=2.0)


def moe_trainer(rules, devices=None):
    import nnxscale as nx

    mesh = nx.strategy_mesh(rules, devices)
    return nx.Trainer.create(
        nx.create(moe_config()),
        nx.adamw(),
        rules,
        mesh,
        dropout=False,
        compiler_options=nx.devices.FAST_COMPILE,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["EP", "FSDP+EP"])
def test_one_step_under_expert_parallelism_equals_one_device(name) -> None:
    import optax

    import nnxscale as nx

    batches = nx.book_batches(16)

    def weights_moved(rules, devices=None):
        # plain SGD with rate 1: the weights move by exactly the gradient (AdamW would
        # magnify rounding in gradients near zero)
        mesh = nx.strategy_mesh(rules, devices)
        trainer = nx.Trainer.create(
            nx.create(moe_config()), optax.sgd(1.0), rules, mesh, dropout=False
        )

        def weights():  # copied off the devices: the step donates its state
            return [np.asarray(w) for w in jax.tree.leaves(nnx.state(trainer.model(), nnx.Param))]

        before = weights()
        loss = trainer.train(batches, 1)[0]
        return loss, [b - a for a, b in zip(weights(), before, strict=True)]

    (loss, grads), (ref_loss, ref_grads) = (
        weights_moved(nx.catalogue.STRATEGIES[name]),
        weights_moved(nx.DP, 1),
    )
    # the same weights route the same way: float32 rounding, relative to the largest entry
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    # the moved amount is read as a difference of float32 weights below 8 in size, each
    # rounded to within 1e-6; the gradients themselves agree to rounding (1e-5 relative)
    for u, v in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_compilers_expert_parallelism_moves_slots_by_all_to_all() -> None:
    import nnxscale as nx

    trainer = moe_trainer(nx.EP)
    cfg, n = moe_config(), trainer.layout.mesh.shape["expert"]
    report = collectives(trainer.compile(trainer.batch(nx.book_batches(16))))
    slots = moe.capacity(32, cfg.experts, cfg.top_k, cfg.capacity_factor)
    array = 16 // n * cfg.experts * slots * cfg.embed * 4  # local groups' slots, float32
    # per layer: to the experts and back, forward and backward
    assert report.count("all-to-all") == 4 * cfg.layers
    assert report.array_bytes("all-to-all") == 4 * cfg.layers * array
    assert not [c for c in report.collectives if c.kind == "all-gather" and "64]" in c.shape]
    # each device routes its own tokens: nothing but the slots' all-to-alls and the
    # replicated weights' gradient reduction (no gather of the batch's router scores)
    assert set(report.summary()) == {"all-to-all", "all-reduce"}


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_largest_is_top_k_in_values_order_ties_and_gradients(k) -> None:
    x = jax.random.normal(jax.random.key(0), (64, 16, 8))
    x = x.at[0, 0, 3].set(x[0, 0, 5])  # a tie: the lower index first, as lax.top_k
    for a, b in zip(jax.lax.top_k(x, k), moe.largest(x, k), strict=True):
        assert a.dtype == b.dtype and (a == b).all()
    grads = [
        jax.grad(lambda x, f=f: (f(x, k)[0] ** 2).sum())(x) for f in (jax.lax.top_k, moe.largest)
    ]
    assert (grads[0] == grads[1]).all()


@pytest.mark.slow
def test_hand_written_strategies_refuse_a_mixture_of_experts() -> None:
    import nnxscale as nx
    from nnxscale import fsdp, pipeline, schedules

    model = nx.create(moe_config().replace(scan_layers=True))
    mesh = make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tokens = jnp.zeros((4, 33), jnp.int32)
    with pytest.raises(ValueError, match="load-balancing loss"):
        fsdp.loss_and_grads(model, tokens, None, mesh=mesh)
    stages = pipeline.pipeline_mesh(2)
    with pytest.raises(ValueError, match="load-balancing loss"):
        pipeline.grads_fn(schedules.gpipe(2, 2), stages)(model, tokens, None)


def test_an_expert_count_the_rules_cannot_split_is_an_error() -> None:
    import nnxscale as nx

    with pytest.raises(nx.rules.RuleError, match="experts=6"):
        nx.Trainer.create(
            nx.create(moe_config().replace(experts=6)),
            nx.adamw(),
            nx.EP,
            nx.strategy_mesh(nx.EP, 8),
        )


def test_the_models_routings_are_each_layers_routing_compiled_once() -> None:
    """`Transformer.routings` runs as one program and gives what the blocks give one by one."""
    model = nx.create(nx.TINY.replace(dropout=0.0, experts=4, top_k=2))
    ids = nx.book_batches(2).rows(0)[:, :8]
    found = model.routings(ids)
    x = model.embed_tokens(ids)
    for block, routing in zip(model.blocks, found, strict=True):
        x, expected = block.with_routing(x, None)
        assert (routing.dispatch == expected.dispatch).all()
        assert (routing.chosen == expected.chosen).all()
    with pytest.raises(ValueError, match="experts > 0"):
        nx.create(nx.TINY).routings(ids)
