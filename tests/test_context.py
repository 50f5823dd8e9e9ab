"""Ring attention equals dense attention, moves N-1 blocks of keys and values, splits evenly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnxscale as nx
from nnxscale import context, costs, layout
from nnxscale.hlo import collectives
from nnxscale.mesh import make_mesh

B, T, H, D = 2, 64, 4, 16


def arrays():
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, (B, T, H, D), jnp.float32) for k in keys]


@pytest.mark.parametrize("devices", [1, 4, 8])
@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_equals_dense_attention(devices, layout, causal) -> None:
    mesh = make_mesh((devices,), ("context",), devices=jax.devices()[:devices])
    q, k, v, w = arrays()

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    def ring(q, k, v):
        ring = context.Ring("context", devices, layout)
        return context.attention_in_order(q, k, v, mesh, ring, causal=causal)

    # float32 sums of at most 64 terms in a different order: a few ulps of values near 1
    assert jnp.abs(jax.jit(ring)(q, k, v) - dense(q, k, v)).max() < 1e-5
    grads = [
        jax.jit(jax.grad(lambda *a, f=f: (f(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
        for f in (dense, ring)
    ]
    for a, b in zip(*grads, strict=True):
        assert jnp.abs(a - b).max() < 1e-5


def test_keys_and_values_travel_n_minus_one_hops() -> None:
    mesh = make_mesh((8,), ("context",))
    split = NamedSharding(mesh, P(None, "context"))
    ring = context.Ring("context", 8)
    q, k, v, _ = (jax.device_put(context.to_layout(x, ring), split) for x in arrays())
    program = jax.jit(lambda q, k, v: context.ring_attention(q, k, v, mesh, ring))
    report = collectives(program.lower(q, k, v).compile())
    block = B * (T // 8) * H * D * 4
    assert report.count() == report.count("collective-permute") == 2 * 7
    assert report.bytes() == 7 * 2 * block


def test_zigzag_gives_every_device_the_same_causal_work() -> None:
    assert len(set(context.Ring("context", 8).causal_work(64))) == 1
    contiguous = context.Ring("context", 8, "contiguous").causal_work(64)
    assert contiguous == sorted(contiguous) and contiguous[-1] > 10 * contiguous[0]


def test_layout_round_trip() -> None:
    x = jnp.arange(2 * 32).reshape(2, 32)
    for name in context.LAYOUTS:
        ring = context.Ring("context", 4, name)
        assert (context.from_layout(context.to_layout(x, ring), ring) == x).all()
    zigzag = context.to_layout(x, context.Ring("context", 4))
    assert zigzag[0, :4].tolist() == [0, 1, 2, 3]
    assert zigzag[0, 4:8].tolist() == [28, 29, 30, 31]


def test_a_length_the_axis_cannot_split_is_named() -> None:
    mesh = make_mesh((4,), ("context",), devices=jax.devices()[:4])
    q = jnp.ones((1, 20, 2, 8))
    with pytest.raises(context.ContextError, match="20 tokens cannot be cut into 8 equal"):
        context.attention_in_order(q, q, q, mesh, context.Ring("context", 4))
    with pytest.raises(context.ContextError, match="unknown layout 'striped'"):
        context.Ring("context", 4, "striped")
    with pytest.raises(context.ContextError, match="splits it over None"):
        short = q[:, :16]
        context.ring_attention(short, short, short, mesh, context.Ring("context", 4), spec=P())


def cp_trainer(rules, devices=None, cfg=None):
    cfg = cfg or nx.TINY.replace(dropout=0.0)
    mesh = nx.strategy_mesh(rules, devices)
    fast = nx.train.FAST_COMPILE
    return nx.Trainer.create(
        nx.create(cfg), nx.adamw(), rules, mesh, dropout=False, compiler_options=fast
    )


@pytest.mark.parametrize("rules", [nx.CP, nx.FSDP_CP], ids=["CP", "FSDP+CP"])
def test_the_transformer_trains_with_context_parallelism_as_on_one_device(rules) -> None:
    batches = nx.book_batches(8)
    reference = cp_trainer(nx.DP, 1).train(batches, 4)
    trainer = cp_trainer(rules)
    assert trainer.layout.mesh.shape["context"] > 1
    # float32 losses of the same sums taken in another order: a few ulps of values near 4
    assert np.max(np.abs(np.array(trainer.train(batches, 4)) - reference)) < 1e-5


def test_the_step_passes_keys_and_values_around_the_ring_and_nothing_else_large() -> None:
    trainer = cp_trainer(nx.CP)
    n, cfg = trainer.layout.mesh.shape["context"], trainer.model().cfg
    batch = nx.book_batches(8)(0, trainer.batch)
    report = collectives(trainer.compile(batch))
    block = 8 * (cfg.max_len // n) * cfg.heads * cfg.head_dim * 4
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    floats = [c for c in permutes if c.shape.startswith("f32")]
    # forward: N-1 hops of K and V per layer; backward: their cotangents travel back
    assert len(floats) == 2 * cfg.layers * (n - 1) * 2
    assert {c.result_bytes for c in floats} == {block}
    # besides them only the targets' token ids, put in the order of the head's tokens
    assert all(c.shape.startswith("s32") for c in permutes if c not in floats)
    assert sum(c.result_bytes for c in permutes if c not in floats) < block / 16


def test_a_sequence_the_context_axis_cannot_split_is_named() -> None:
    trainer = cp_trainer(nx.CP, cfg=nx.TINY.replace(dropout=0.0, max_len=40))
    batches = nx.Batches(np.arange(2000) % 100, batch_size=8, length=20)
    with pytest.raises(nx.ContextError, match="20 tokens cannot be cut into 16 equal"):
        trainer.compile(batches(0, trainer.batch))


def test_activation_constraints_apply_only_under_rules_and_outside_shard_map() -> None:
    mesh = nx.strategy_mesh(nx.CP)
    x = jnp.ones((2, 16, 8))
    assert layout.constrain(x, ("batch", "length", "embed")) is x
    with nx.activation_rules(nx.CP, mesh):
        spec, _ = layout.activation_spec(x.shape, ("batch", "length", "unknown"))
        assert spec == P("data", "context", None)
        assert layout.activation_axis("length") == ("context", 8)
        assert layout.activation_axis("embed") is None

        def body(x):
            assert layout.activation_spec(x.shape, ("batch", "length", "embed")) is None
            return x

        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x)
        with nx.activation_rules(None):
            assert layout.constrain(x, ("batch", "length", "embed")) is x


def test_a_table_read_beside_the_batch_stays_off_the_batch_axes() -> None:
    table, beside = (128, 64), ((16, "batch"),)
    with nx.activation_rules(nx.FSDP, nx.strategy_mesh(nx.FSDP)):
        assert layout.activation_spec(table, ("vocab", None))[0] == P("data", None)
        assert layout.activation_spec(table, ("vocab", None), beside)[0] == P(None, None)
    with nx.activation_rules(nx.FSDP_TP, nx.strategy_mesh(nx.FSDP_TP)):
        assert layout.activation_spec(table, ("vocab", None), beside)[0] == P("model", None)


def test_fsdp_tp_is_tp_plus_one_gather_per_weight_use() -> None:
    """FSDP+TP's step: TP's collectives, array for array, and all-gathers of TP's weight
    shards over `data`, nothing else (no array of the whole batch, no all-to-all)."""
    batches = nx.book_batches(16)
    tp, both = cp_trainer(nx.TP), cp_trainer(nx.FSDP_TP)
    programs = nx.train.compile_all([(t, batches(0, t.batch)) for t in (tp, both)])
    mesh = both.layout.mesh
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    reports = [collectives(p) for p in programs]
    reduced = [nx.hlo.arrays_moved(r.along(mesh, "all-reduce", axes)) for r in reports
               for axes in (("data",), ("model",))]  # fmt: skip
    assert reduced[2:] == reduced[:2]  # TP's all-reduces, array for array
    shards = {p.shard_shape for p in tp.layout.placements}
    gathers = reports[1].along(mesh, "all-gather", ("data",))
    assert gathers and set(nx.hlo.arrays_moved(gathers)) <= shards
    assert len(gathers) + len(reports[0].collectives) == len(reports[1].collectives)


def test_sequence_parallelism_gathers_the_residual_stream_and_trains_as_tp() -> None:
    batches = nx.book_batches(8)
    tp, sp = cp_trainer(nx.TP), cp_trainer(nx.SP)
    tp_step, sp_step = nx.train.compile_all([(t, batches(0, t.batch)) for t in (tp, sp)])
    mesh, cfg = sp.layout.mesh, sp.model().cfg
    stream = f"f32[{8 // mesh.shape['data']},32,{cfg.embed}]"
    gathered = [
        c
        for c in collectives(sp_step).collectives
        if c.kind == "all-gather" and c.shape.startswith(stream)
    ]
    assert all(c.mesh_axes(mesh) == ("model",) for c in gathered)
    # forward before attention and the MLP, backward again for the weights' gradients
    assert len(gathered) == 4 * cfg.layers
    assert not [c for c in collectives(tp_step).collectives if c.kind == "all-gather"]
    piece = f"f32[{8 // mesh.shape['data']},16,{cfg.embed}]"

    def sliced(program):  # reduce-scatters in all-reduce form: read only as a slice
        return [
            c
            for c in collectives(program).collectives
            if c.kind == "all-reduce"
            and c.shape.startswith(stream)
            and {r.split("{")[0] for r in c.readers} == {piece}
        ]

    assert len(sliced(sp_step)) >= 2 * cfg.layers and not sliced(tp_step)
    saved = nx.CompiledMemory.of(tp_step).temp - nx.CompiledMemory.of(sp_step).temp
    sequences = 8 // mesh.shape["data"]
    formula = costs.activation_bytes(cfg, sequences, 32, model=2) - costs.activation_bytes(
        cfg, sequences, 32, model=2, sequence_parallel=True
    )
    assert 0 < saved <= formula
    reference = cp_trainer(nx.DP, 1).train(batches, 3)
    assert np.max(np.abs(np.array(sp.train(batches, 3)) - reference)) < 1e-5


def test_activations_left_to_the_compiler_give_fsdp_tp_another_program() -> None:
    batches = nx.book_batches(16)
    free = cp_trainer(nx.FSDP_TP)
    free = nx.Trainer.create(
        nx.create(free.model().cfg),
        nx.adamw(),
        nx.FSDP_TP,
        free.layout.mesh,
        dropout=False,
        activations=False,
    )
    named = cp_trainer(nx.FSDP_TP)
    sent = [collectives(t.compile(batches(0, t.batch))).bytes() for t in (free, named)]
    assert sent[0] > 2 * sent[1]
    assert not free.activations and named.activations


def test_evaluation_runs_under_the_same_rules() -> None:
    batches = nx.book_batches(8)
    single, cp = cp_trainer(nx.DP, 1), cp_trainer(nx.CP)
    batch = batches(0, cp.batch)
    assert (
        abs(float(cp.evaluate(cp.state, batch)) - float(single.evaluate(single.state, batch)))
        < 1e-5
    )
