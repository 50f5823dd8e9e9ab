"""Dropless experts compute every token's k choices, equal the dense reference, and cost the
tokens' products plus at most one block of padding per expert, linear in the tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscale import moe
from nnxscale.analysis.hlo import dot_flops
from nnxscale.core.memory import CompiledMemory
from nnxscale.model import MLP, TINY, dropless

D, F, E = 16, 24, 5


def weights(experts: int = E) -> tuple[jax.Array, ...]:
    """A router and the experts' gate, up and down matrices, scaled to keep outputs near 1."""
    k = jax.random.split(jax.random.key(0), 4)
    return (
        jax.random.normal(k[0], (D, experts)),
        jax.random.normal(k[1], (experts, D, F)) / 4,
        jax.random.normal(k[2], (experts, D, F)) / 4,
        jax.random.normal(k[3], (experts, F, D)) / 5,
    )


def tokens(count: int = 20) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (count, D))


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("block", [1, 4])
def test_the_layer_equals_the_dense_reference_in_output_and_gradients(top_k, block) -> None:
    """float32 sums of the same products in another order: a few ulps of values near 1."""
    x, w = tokens(), weights()

    def run(fn):
        def loss(args):
            return jnp.sum(fn(*args) ** 2)

        return jax.jit(fn)(x, *w), jax.jit(jax.grad(loss))((x, *w))

    y, grads = run(lambda *a: dropless.dropless(*a, top_k=top_k, block=block)[0])
    ref, ref_grads = run(lambda *a: dropless.dense_reference(*a, top_k=top_k))
    np.testing.assert_allclose(y, ref, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-5)


def test_no_copy_is_dropped_where_gshards_capacity_drops_some() -> None:
    x, (router, *_) = tokens(64), weights()
    _, routed = dropless.dropless(x, *weights(), top_k=2, block=4)
    assert float(routed.dropped) == 0.0 and int(routed.load.sum()) == 64 * 2
    assert routed.load.max() > 64 * 2 // E  # unbalanced: a capacity of the even share drops
    gshard = moe.route_tokens(x[None], router, top_k=2, capacity_factor=1.0)
    assert float(gshard.dropped) > 0


def test_a_wrong_layout_is_seen_as_dropped_copies() -> None:
    rows = jnp.array([[0, 1], [1, 5]])  # row 1 taken twice, row 5 outside 4 rows
    assert float(dropless.lost(rows, 4)) == 2 / 4
    assert float(dropless.lost(jnp.array([[-1, 3], [0, 1]]), 4)) == 1 / 4  # -1: outside only


def test_routing_takes_the_top_k_of_the_softmax_and_renormalises_the_gates() -> None:
    logits = jax.random.normal(jax.random.key(2), (30, E))
    gates, chosen, _ = dropless.route(logits, 3)
    probs = jax.nn.softmax(logits, axis=-1)
    top, index = jax.lax.top_k(probs, 3)
    np.testing.assert_array_equal(chosen, index)
    np.testing.assert_allclose(gates, top / top.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_the_blocks_hold_any_balance(block: int) -> None:
    """Each expert's run padded to whole blocks never needs more than `blocks` blocks, and
    the rows the layout gives are distinct and inside them, for balanced and skewed loads."""
    experts, k = 5, 2
    for seed in range(20):
        chosen = jax.random.randint(jax.random.key(seed), (13, k), 0, experts - seed % 3)
        placed = dropless.sort_by_expert(chosen, jnp.ones((13, k)), experts, block)
        n = dropless.blocks(13 * k, experts, block)
        needed = int(np.sum(-(-np.asarray(placed.load) // block)))
        assert needed <= n == placed.owner.shape[0]
        assert float(dropless.lost(placed.rows, n * block)) == 0.0
        owners = np.asarray(placed.owner)[np.asarray(placed.rows) // block]
        np.testing.assert_array_equal(owners, chosen)  # each copy in a block of its expert


@pytest.mark.parametrize("block", [1, 4])
def test_the_compiled_products_are_the_tokens_k_copies_and_the_router(block: int) -> None:
    """k T copies through one expert's SwiGLU (3 products of 2 d f a row), the padding
    (a block's rows of products for each block past ceil(k T / b)), the router (2 d E a
    token) and the gates' weighted sum (2 k d a token): counted in the compiled program,
    loops included. No capacity, no E-fold work."""
    count, top_k = 40, 2
    x, w = tokens(count), weights()
    program = jax.jit(lambda x, *w: dropless.dropless(x, *w, top_k=top_k, block=block)[0])
    found = dot_flops(program.lower(x, *w).compile())
    rows = dropless.blocks(count * top_k, E, block) * block
    assert found == rows * 3 * 2 * D * F + count * 2 * D * E + count * 2 * top_k * D
    if block == 1:
        assert rows == count * top_k + E - 1  # one row of slack per expert but the first


def temporaries(count: int, block: int, w: tuple[jax.Array, ...]) -> int:
    """Temporaries of the layer's forward and backward pass on `count` tokens."""
    grad = jax.grad(lambda x, *w: jnp.sum(dropless.dropless(x, *w, top_k=2, block=block)[0]))
    return CompiledMemory.of(jax.jit(grad).lower(tokens(count), *w).compile()).temp


def test_the_temporaries_grow_linearly_with_the_tokens() -> None:
    temp = [temporaries(n, 4, weights()) for n in (256, 512, 1024)]
    assert temp[1] <= 2.2 * temp[0] and temp[2] <= 2.2 * temp[1]


def test_the_backward_pass_keeps_no_expert_weights_per_block() -> None:
    """Eight times the blocks (of an eighth the rows) hold about the same temporaries: a
    block's weights are sliced again in the backward pass, not kept (kept, 8-row blocks of
    these experts held 1.7 times what 64-row blocks did)."""
    router, gate, up, down = weights()
    wide = (router, *(jnp.tile(w, (1, 1, 16)) for w in (gate, up)), jnp.tile(down, (1, 16, 1)))
    assert temporaries(1024, 8, wide) <= 1.1 * temporaries(1024, 64, wide)


def test_shared_experts_add_one_mlp_every_token_passes_through() -> None:
    with nnx.use_eager_sharding(False):
        shared = MLP(TINY.replace(embed=D, mlp=F), rngs=nnx.Rngs(1))
        layer = dropless.Dropless(D, F, E, top_k=2, shared=shared, block=4, rngs=nnx.Rngs(0))
    x = jnp.stack([tokens(), 2 * tokens()])
    y, routed = layer(x)
    shared = layer.shared(x)
    routed_only = jax.vmap(
        lambda g: dropless.dropless(
            g, layer.router[...], layer.gate[...], layer.up[...], layer.down[...],
            top_k=2, block=4,
        )[0]
    )(x)  # fmt: skip
    np.testing.assert_allclose(y, routed_only + shared, atol=1e-5)
    assert routed.aux_loss.shape == () and float(routed.z_loss) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(experts=4, top_k=5), "top_k=5 with 4 experts"),
        (dict(experts=0, top_k=1), "at least one expert"),
        (dict(experts=4, top_k=2, block=0), "at least one row"),
    ],
)
def test_a_layer_that_cannot_route_is_refused(kwargs, message) -> None:
    experts = kwargs.pop("experts")
    with nnx.use_eager_sharding(False), pytest.raises(moe.MoEError, match=message):
        dropless.Dropless(D, F, experts, rngs=nnx.Rngs(0), **kwargs)


def dropless_trainer(rules, devices=None):
    import nnxscale as nx

    cfg = nx.TINY.replace(
        dropout=0.0, experts=8, top_k=2, routing="dropless", shared_experts=1, z_weight=1e-3
    )
    mesh = nx.strategy_mesh(rules, devices)
    return nx.Trainer.create(
        nx.create(cfg), nx.adamw(), rules, mesh, dropout=False,
        compiler_options=nx.train.FAST_COMPILE,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DP", "FSDP"])
def test_a_dropless_transformer_trains_as_on_one_device(name: str) -> None:
    """float32 losses of the same sums in another order: a few ulps of values near 4."""
    import nnxscale as nx

    batches = nx.book_batches(8)
    reference = dropless_trainer(nx.DP, 1).train(batches, 3)
    losses = dropless_trainer(nx.rules.STRATEGIES[name]).train(batches, 3)
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses, reference, atol=1e-5)


def test_the_z_loss_enters_the_training_loss_with_its_weight() -> None:
    import nnxscale as nx

    cfg = nx.TINY.replace(dropout=0.0, experts=4, top_k=2, routing="dropless")
    tokens = jnp.asarray(nx.book_batches(2).rows(0))
    losses = [float(nx.create(cfg.replace(z_weight=w)).loss(tokens)) for w in (0.0, 0.1, 0.2)]
    assert losses[1] - losses[0] == pytest.approx(losses[2] - losses[1], rel=1e-4)
    assert losses[1] > losses[0]


@pytest.mark.parametrize("name", ["EP", "FSDP+EP"])
def test_rules_that_split_the_experts_are_refused_with_the_way_out(name: str) -> None:
    import nnxscale as nx

    trainer = dropless_trainer(nx.rules.STRATEGIES[name])
    with pytest.raises(moe.MoEError, match="no token exchange for dropless routing"):
        trainer.train(nx.book_batches(8), 1)


def test_the_cost_model_refuses_a_dropless_mixture_by_name() -> None:
    import nnxscale as nx
    from nnxscale import costs

    cfg = nx.TINY.replace(experts=4, top_k=2, routing="dropless")
    with pytest.raises(ValueError, match="not a dropless mixture's blocks"):
        costs.step_cost(cfg, costs.Setup.of(nx.DP, {"data": 1}), "H100", 8, 32)
