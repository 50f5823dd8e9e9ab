"""Ring attention equals dense attention, moves N-1 blocks of keys and values, splits evenly."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnxscale as nx
from nnxscale import constraints, context, costs
from nnxscale.analysis.hlo import collectives
from nnxscale.evidence import memory as published
from nnxscale.placement.mesh import make_mesh

B, T, H, D = 2, 64, 4, 16


def arrays():
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, (B, T, H, D), jnp.float32) for k in keys]


def dense(q, k, v, causal=True):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def ring_in_order(devices, layout="zigzag", causal=True, **options):
    mesh = make_mesh((devices,), ("context",), devices=jax.devices()[:devices])
    ring = context.Ring("context", devices, layout)

    def attend(q, k, v):
        moved = [context.to_layout(x, ring) for x in (q, k, v)]
        out = context.ring_attention(*moved, mesh, ring, causal=causal, **options)
        return context.from_layout(out, ring)

    return attend


def output_and_grads(attend, q, k, v, w):
    def both(q, k, v, w):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, *pullback(w)

    return jax.jit(both)(q, k, v, w)


def largest_gap(a, b) -> float:
    return max(float(jnp.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_and_its_custom_vjp_equal_dense_attention(devices, layout, causal) -> None:
    q, k, v, w = arrays()
    ours = output_and_grads(ring_in_order(devices, layout, causal), q, k, v, w)
    theirs = output_and_grads(partial(dense, causal=causal), q, k, v, w)
    # float32 sums of at most 64 terms in a different order: a few ulps of values near 1
    assert largest_gap(ours, theirs) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, length, block", [(3, 60, 5), (5, 40, 2), (6, 48, 1), (7, 70, None)]
)
def test_device_counts_that_divide_nothing_and_blocks_below_a_chunk(devices, length, block):
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, w = (jax.random.normal(key, (2, length, 4, 8)) for key in keys)
    ours = output_and_grads(ring_in_order(devices, block=block), q, k, v, w)
    assert largest_gap(ours, output_and_grads(dense, q, k, v, w)) < 1e-5  # as above


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_dense_attention_is() -> None:
    """bfloat16 keeps 8 bits of mantissa: both kernels round their inputs and products
    there, so each lies about 2^-8 of the values' size from the float32 result; the ring's
    float32 accumulators keep it no further than dense attention's own error, doubled."""
    q, k, v, w = arrays()
    exact = output_and_grads(dense, q, k, v, w)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v, w)]
    ours = [x.astype(jnp.float32) for x in output_and_grads(ring_in_order(4), *low)]
    theirs = [x.astype(jnp.float32) for x in output_and_grads(dense, *low)]
    assert largest_gap(ours, exact) <= 2 * largest_gap(theirs, exact)


@pytest.mark.slow
def test_the_custom_vjp_equals_autodiff_through_its_own_loops() -> None:
    q, k, v, w = arrays()
    flash = output_and_grads(ring_in_order(4, block=4), q, k, v, w)
    autodiff = output_and_grads(ring_in_order(4, block=4, autodiff=True), q, k, v, w)
    assert largest_gap(flash, autodiff) < 1e-5  # the same sums, the backward's in another order


def test_the_custom_vjp_passes_a_numerical_gradient_check() -> None:
    small = [x[:1, :16, :2, :4] for x in arrays()[:3]]
    attend = jax.jit(ring_in_order(2, block=2))
    # float32 central differences with step 1e-3: agreement to about 1e-2 relative
    jax.test_util.check_grads(attend, small, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_the_schedule_scores_each_needed_pair_once_and_pads_with_masked_ones() -> None:
    for name, causal in [("zigzag", True), ("contiguous", True), ("zigzag", False)]:
        ring = context.Ring("context", 4, name)
        length, block = 64, 4
        positions = ring.positions(length)
        steps = context.schedule(ring, length, block, causal)
        for me in range(4):
            seen = set()
            for t, pairs in enumerate(steps):
                held = positions[(me - t) % 4]
                for qb, kb in pairs[me].tolist():
                    qs, ks = positions[me][qb * block], held[kb * block]
                    needed = not causal or qs + block - 1 >= ks
                    assert (qs, ks) not in seen or not needed  # padding may repeat
                    seen.add((qs, ks))
            needed_pairs = {
                (qs, ks)
                for qs in positions[me][::block]
                for ks in range(0, length, block)
                if not causal or qs + block - 1 >= ks
            }
            assert needed_pairs <= seen


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_zigzag_scores_about_half_of_full_attention_and_contiguous_all_of_it(devices) -> None:
    """Read off the compiled forward: the FLOPs of its products (loop trip counts
    included) are the schedule's, the same program on every device; zig-zag's causal
    schedule is (2N+1)/(4N) of full attention with one block per chunk, and closer to
    a half with smaller blocks; the contiguous layout's is all of it."""
    length, h, d = 16 * devices, 2, 16
    ring = context.Ring("context", devices)

    def flops(block, causal=True, layout="zigzag"):
        options = {"heads": h, "head_dim": d, "grad": False, "causal": causal}
        if layout == "zigzag":
            program = context.compiled_attention(devices, length, block=block, **options)
            return nx.hlo.dot_flops(program)
        other = context.Ring("context", devices, layout)
        return 4 * h * d * context.scored_pairs(other, length, block, causal)

    full = flops(8, causal=False)
    assert full == 4 * h * d * length * length // devices
    for block in (8, 2):
        assert flops(block) == 4 * h * d * context.scored_pairs(ring, length, block, True)
    assert flops(8) / full == (2 * devices + 1) / (4 * devices)
    assert 0.5 < flops(2) / full < flops(8) / full
    assert flops(16, layout="contiguous") == full
    work = ring.causal_work(length)
    assert len(set(work)) == 1 and 2 * work[0] * devices > length * length


@pytest.mark.slow
def test_memory_per_device_grows_linearly_with_the_sequence_and_not_with_the_ring() -> None:
    """Compiled temporaries of forward and backward per device: the custom VJP's grow by
    the same bytes per token at every length (linear); autodiff through the loops keeps
    every block's probabilities (quadratic); at fixed tokens per device the ring's size
    changes nothing once a loop runs the middle steps (4 devices and up)."""

    def temp(devices, length, **options):
        program = context.compiled_attention(devices, length, block=32, **options)
        return nx.CompiledMemory.of(program).temp

    lengths = [1024, 2048, 4096, 8192]
    flash = [temp(8, s) for s in lengths]
    per_token = [
        (b - a) / (s - r)
        for a, b, r, s in zip(flash, flash[1:], lengths, lengths[1:], strict=False)
    ]
    assert max(per_token) / min(per_token) < 1.05
    kept = [temp(8, s, autodiff=True) for s in lengths[:3]]
    assert kept[2] - kept[1] > 3.5 * (kept[1] - kept[0])  # quadruples as the length doubles
    at = [temp(n, 256 * n) for n in (2, 4, 8)]
    assert abs(at[2] - at[1]) < 0.02 * at[1] and at[0] <= at[1]


def test_keys_and_values_travel_n_minus_one_hops_and_their_gradients_n() -> None:
    """Forward: N-1 hops of K and of V. Backward: K and V again, N-1 hops, and dK and dV
    in float32 with them plus one hop home, N hops; the compiler sends the backward's first
    hop of K and V once for both passes (the same operands, the same permutation)."""
    mesh = make_mesh((8,), ("context",))
    split = NamedSharding(mesh, P(None, "context"))
    ring = context.Ring("context", 8)
    q, k, v, _ = (jax.device_put(context.to_layout(x, ring), split) for x in arrays())
    program = jax.jit(lambda q, k, v: context.ring_attention(q, k, v, mesh, ring))
    report = collectives(program.lower(q, k, v).compile())
    block = B * (T // 8) * H * D * 4
    assert report.count() == report.count("collective-permute") == 2 * 7
    assert report.bytes() == 7 * 2 * block
    backward = jax.jit(
        jax.grad(lambda *a: context.ring_attention(*a, mesh, ring).sum(), argnums=(0, 1, 2))
    )
    report = collectives(backward.lower(q, k, v).compile())
    hops = 2 * 7 + 2 * (7 - 1) + 2 * 8
    assert report.count() == report.count("collective-permute") == hops
    assert report.bytes() == hops * block


def test_zigzag_gives_every_device_the_same_causal_work() -> None:
    assert len(set(context.Ring("context", 8).causal_work(64))) == 1
    contiguous = context.Ring("context", 8, "contiguous").causal_work(64)
    assert contiguous == sorted(contiguous) and contiguous[-1] > 10 * contiguous[0]


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_the_ring_hops_as_its_permutation_says(devices) -> None:
    """Device d holds d - t's shard at step t, and the compiled kernel's permutes send
    exactly the ring's pairs: what the chapter's picture draws is what runs."""
    ring = context.Ring("context", devices)
    held = [ring.holding(t) for t in range(devices + 1)]
    assert held == [[(d - t) % devices for d in range(devices)] for t in range(devices + 1)]
    text = context.compiled_attention(devices, 8 * devices, grad=False).as_text()
    pairs = re.findall(r"source_target_pairs=\{(\{[\d,{}]*\})\}", text)
    sent = {tuple(tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", ps)) for ps in pairs}
    assert sent == {tuple(ring.permutation())}


def test_layout_round_trip() -> None:
    x = jnp.arange(2 * 32).reshape(2, 32)
    for name in context.LAYOUTS:
        ring = context.Ring("context", 4, name)
        assert (context.from_layout(context.to_layout(x, ring), ring) == x).all()
    zigzag = context.to_layout(x, context.Ring("context", 4))
    assert zigzag[0, :4].tolist() == [0, 1, 2, 3]
    assert zigzag[0, 4:8].tolist() == [28, 29, 30, 31]


def test_bad_input_is_named_with_its_fix() -> None:
    mesh = make_mesh((4,), ("context",), devices=jax.devices()[:4])
    ring = context.Ring("context", 4)
    q = jnp.ones((1, 20, 2, 8))
    with pytest.raises(context.ContextError, match="20 tokens cannot be cut into 8 equal"):
        context.attention_in_order(q, q, q, mesh, ring)
    with pytest.raises(context.ContextError, match="unknown layout 'striped'"):
        context.Ring("context", 4, "striped")
    short = q[:, :16]
    with pytest.raises(context.ContextError, match="splits it over None"):
        context.ring_attention(short, short, short, mesh, ring, spec=P())
    with pytest.raises(
        context.ContextError, match=r"keys and values of one shape .* kv_heads dividing heads"
    ):
        context.ring_attention(short, short[:, :, :1], short, mesh, ring)
    with pytest.raises(context.ContextError, match="blocks of 3 tokens do not cut the chunks"):
        context.ring_attention(short, short, short, mesh, ring, block=3)
    with pytest.raises(context.ContextError, match=r"mesh's axis 'context' has 4 devices"):
        context.ring_attention(short, short, short, mesh, context.Ring("context", 2))
    both = make_mesh((2, 4), ("model", "context"))
    three = jnp.ones((1, 16, 3, 8))
    with pytest.raises(context.ContextError, match=r"heads \(3\) does not divide over mesh"):
        context.ring_attention(three, three, three, both, ring, spec=P(None, "context", "model"))


def cp_trainer(rules, devices=None, cfg=None):
    cfg = cfg or nx.TINY.replace(dropout=0.0)
    mesh = nx.strategy_mesh(rules, devices)
    fast = nx.devices.FAST_COMPILE
    return nx.Trainer.create(
        nx.create(cfg), nx.adamw(), rules, mesh, dropout=False, compiler_options=fast
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "rules", [nx.CP, nx.FSDP_CP, nx.catalogue.FSDP_CP_TP], ids=["CP", "FSDP+CP", "FSDP+CP+TP"]
)
def test_the_transformer_trains_with_context_parallelism_as_on_one_device(rules) -> None:
    batches = nx.book_batches(8)
    reference = cp_trainer(nx.DP, 1).train(batches, 4)
    trainer = cp_trainer(rules)
    assert trainer.layout.mesh.shape["context"] > 1
    # float32 losses of the same sums taken in another order: a few ulps of values near 4
    assert np.max(np.abs(np.array(trainer.train(batches, 4)) - reference)) < 1e-5


@pytest.mark.slow
def test_the_step_passes_keys_and_values_around_the_ring_and_nothing_else_large() -> None:
    trainer = cp_trainer(nx.CP)
    n, cfg = trainer.layout.mesh.shape["context"], trainer.model().cfg
    batch = trainer.batch(nx.book_batches(8))
    report = collectives(trainer.compile(batch))
    # keys and values travel with their kv_heads
    block = 8 * (cfg.max_len // n) * cfg.kv_heads * cfg.head_dim * 4
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    floats = [c for c in permutes if c.dtypes == ("f32",)]
    # forward: N-1 hops of K and V per layer; backward: K and V again, N-1 hops (the first
    # shared with the forward's), their gradients with them and one hop home, N
    assert sum(c.executions for c in floats) == 2 * cfg.layers * (3 * n - 3)
    assert {c.result_bytes for c in floats} == {block}
    # besides them only the targets' token ids, put in the order of the head's tokens
    assert all(c.dtypes == ("s32",) for c in permutes if c not in floats)
    assert sum(c.result_bytes for c in permutes if c not in floats) < block / 16


def test_a_sequence_the_context_axis_cannot_split_is_named() -> None:
    trainer = cp_trainer(nx.CP, cfg=nx.TINY.replace(dropout=0.0, max_len=40))
    batches = nx.Batches(np.arange(2000) % 100, batch_size=8, length=20)
    with pytest.raises(nx.context.ContextError, match="20 tokens cannot be cut into 16 equal"):
        trainer.compile(trainer.batch(batches))


def test_activation_constraints_apply_only_under_rules_and_outside_shard_map() -> None:
    mesh = nx.strategy_mesh(nx.CP)
    x = jnp.ones((2, 16, 8))
    assert constraints.constrain(x, ("batch", "length", "embed")) is x
    with nx.constraints.activation_rules(nx.CP, mesh):
        spec, _ = constraints.activation_spec(x.shape, ("batch", "length", "unknown"))
        assert spec == P("data", "context", None)
        assert constraints.activation_axis("length") == ("context", 8)
        assert constraints.activation_axis("embed") is None

        def body(x):
            assert constraints.activation_spec(x.shape, ("batch", "length", "embed")) is None
            return x

        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x)
        with nx.constraints.activation_rules(None):
            assert constraints.constrain(x, ("batch", "length", "embed")) is x


def test_a_table_read_beside_the_batch_stays_off_the_batch_axes() -> None:
    table, beside = (128, 64), ((16, "batch"),)
    with nx.constraints.activation_rules(nx.FSDP, nx.strategy_mesh(nx.FSDP)):
        assert constraints.activation_spec(table, ("vocab", None))[0] == P("data", None)
        assert constraints.activation_spec(table, ("vocab", None), beside)[0] == P(None, None)
    with nx.constraints.activation_rules(nx.FSDP_TP, nx.strategy_mesh(nx.FSDP_TP)):
        assert constraints.activation_spec(table, ("vocab", None), beside)[0] == P("model", None)


@pytest.mark.slow
def test_fsdp_tp_is_tp_plus_one_gather_per_weight_use() -> None:
    """FSDP+TP's step: TP's collectives, array for array, and all-gathers of TP's weight
    shards over `data`, nothing else (no array of the whole batch, no all-to-all)."""
    batches = nx.book_batches(16)
    tp, both = cp_trainer(nx.TP), cp_trainer(nx.FSDP_TP)
    programs = nx.train.compile_all([(t, t.batch(batches)) for t in (tp, both)])
    mesh = both.layout.mesh
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    reports = [collectives(p).without_flags() for p in programs]  # finite flags aside
    reduced = [nx.hlo.arrays_moved(r.along(mesh, "all-reduce", axes)) for r in reports
               for axes in (("data",), ("model",))]  # fmt: skip
    assert reduced[2:] == reduced[:2]  # TP's all-reduces, array for array
    shards = {p.shard_shape for p in tp.layout.placements}
    gathers = reports[1].along(mesh, "all-gather", ("data",))
    assert gathers and set(nx.hlo.arrays_moved(gathers)) <= shards
    assert len(gathers) + len(reports[0].collectives) == len(reports[1].collectives)


@pytest.mark.slow
def test_sequence_parallelism_gathers_the_residual_stream_and_trains_as_tp() -> None:
    batches = nx.book_batches(8)
    tp, sp = cp_trainer(nx.TP), cp_trainer(nx.SP)
    tp_step, sp_step = nx.train.compile_all([(t, t.batch(batches)) for t in (tp, sp)])
    mesh, cfg = sp.layout.mesh, sp.model().cfg
    stream = (8 // mesh.shape["data"], 32, cfg.embed)
    gathered = [
        c
        for c in collectives(sp_step).collectives
        if c.kind == "all-gather" and c.arrays[0] == stream
    ]
    assert all(c.mesh_axes(mesh) == ("model",) for c in gathered)
    # forward before attention and the MLP, backward again for the weights' gradients
    assert len(gathered) == 4 * cfg.layers
    assert not [c for c in collectives(tp_step).collectives if c.kind == "all-gather"]
    piece = (8 // mesh.shape["data"], 16, cfg.embed)

    def sliced(program):  # reduce-scatters in all-reduce form: read only as a slice
        return [
            c
            for c in collectives(program).collectives
            if c.kind == "all-reduce" and c.arrays[0] == stream and set(c.reader_arrays) == {piece}
        ]

    assert len(sliced(sp_step)) >= 2 * cfg.layers and not sliced(tp_step)
    saved = nx.CompiledMemory.of(tp_step).temp - nx.CompiledMemory.of(sp_step).temp
    sequences = 8 // mesh.shape["data"]
    formula = costs.activation_bytes(cfg, sequences, 32, model=2) - costs.activation_bytes(
        cfg, sequences, 32, model=2, sequence_parallel=True
    )
    # SP splits the residual stream over `model`: at least the textbook's 4E values a
    # token, at most half of what the ledger says the stream and its norms keep (the model
    # computes RMSNorm in float32 and keeps its intermediates)
    stream = published.ledger_by_part(cfg, 32, sequences)["norms"]  # per layer
    assert formula <= saved <= cfg.layers * stream / 2
    reference = cp_trainer(nx.DP, 1).train(batches, 3)
    assert np.max(np.abs(np.array(sp.train(batches, 3)) - reference)) < 1e-5


@pytest.mark.slow
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
    sent = [collectives(t.compile(t.batch(batches))).bytes() for t in (free, named)]
    assert sent[0] > 2 * sent[1]
    assert not free.options.activations and named.options.activations


def test_evaluation_runs_under_the_same_rules() -> None:
    batches = nx.book_batches(8)
    single, cp = cp_trainer(nx.DP, 1), cp_trainer(nx.CP)
    batch = cp.batch(batches)
    assert (
        abs(float(cp.evaluate(cp.state, batch)) - float(single.evaluate(single.state, batch)))
        < 1e-5
    )


def grouped_arrays(length: int, kv: int):
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (B, length, H, D), jnp.float32)
    k, v = (jax.random.normal(x, (B, length, kv, D), jnp.float32) for x in keys[1:3])
    w = jax.random.normal(keys[3], (B, length, H, D), jnp.float32)
    return q, k, v, w


def dense_grouped(q, k, v):
    """Grouped-query attention by repeating each key/value head for its query heads."""
    groups = q.shape[2] // k.shape[2]
    return dense(q, jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2))


@pytest.mark.parametrize(("length", "kv", "block"), [(64, 2, None), (64, 1, 16), (37, 4, 8)])
def test_flash_attention_equals_dense_attention_with_grouped_heads(length, kv, block) -> None:
    """One device's blockwise kernel, keys and values read by their groups of query heads,
    and a length the block does not divide (padded with keys no query sees): output and
    gradients equal dense attention to float32 rounding (sums of 64 products in another
    order, values of order 1)."""
    q, k, v, w = grouped_arrays(length, kv)
    got = output_and_grads(partial(context.flash_attention, block=block), q, k, v, w)
    want = output_and_grads(dense_grouped, q, k, v, w)
    assert got[2].shape == k.shape and got[3].shape == v.shape
    assert largest_gap(got, want) < 2e-5


def test_ring_attention_reads_grouped_heads_as_dense_attention_does() -> None:
    q, k, v, w = grouped_arrays(64, 2)
    got = output_and_grads(ring_in_order(4), q, k, v, w)
    want = output_and_grads(dense_grouped, q, k, v, w)
    assert largest_gap(got, want) < 2e-5


def test_flash_attention_skips_the_masked_blocks_and_keeps_no_scores() -> None:
    """Eight blocks: 36 of the 64 block pairs scored, the formula's (s^2 + s b) / 2 pairs;
    the backward's temporaries hold a few blocks of scores whatever the length."""
    block = 16

    def compiled(length):
        q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in grouped_arrays(length, 2))
        loss = partial(context.flash_attention, block=block)
        grad = jax.grad(lambda *a: loss(*a).sum(), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, v).compile()

    program = compiled(8 * block)
    s = 8 * block
    pairs = (s * s + s * block) // 2
    assert nx.hlo.dot_flops(program) == 14 * B * H * D * pairs  # 4 forward, 10 backward
    temps = [compiled(n).memory_analysis().temp_size_in_bytes for n in (8 * block, 32 * block)]
    assert temps[1] < 4.5 * temps[0]  # four times the tokens: linear, not 16 times


@pytest.mark.slow
def test_the_models_step_grows_linearly_with_the_sequence() -> None:
    """Beyond one block (512 tokens) the kernel's working set stays the same size; up to it,
    the one block is the whole sequence and grows with its square."""
    temps = nx.growth.step_temporaries(nx.TINY, [1024, 2048, 4096])
    assert max(nx.growth.growth(temps)) <= 2.2
    short = nx.growth.step_temporaries(nx.TINY, [256, 512])
    assert nx.growth.growth(short)[0] > 2.2
