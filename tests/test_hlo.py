"""The HLO collective counter on programs whose answer is known."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.analysis.hlo import (
    arrays_moved,
    branch_work,
    collectives,
    compiler_passes,
    dot_flops,
    result_types,
    shape_bytes,
)
from nnxscale.placement.mesh import make_mesh

from conftest import ROOT

N = 8
BLOCK = 4  # f32 elements per device
FULL = N * BLOCK * 4  # bytes of the whole vector


@pytest.fixture(scope="module")
def ring():
    return make_mesh((N,), ("ring",))


@pytest.fixture(scope="module")
def vector(ring):
    return jax.device_put(jnp.arange(N * BLOCK, dtype=jnp.float32), NamedSharding(ring, P("ring")))


def compiled(ring, vector, fn):
    smap = jax.shard_map(fn, mesh=ring, in_specs=P("ring"), out_specs=P("ring"))
    return jax.jit(smap).lower(vector).compile()


@pytest.mark.parametrize(
    ("kind", "fn", "expected_bytes"),
    [
        ("all-gather", lambda b: jax.lax.all_gather(b, "ring", tiled=True), 7 / 8 * FULL),
        ("reduce-scatter", lambda b: jax.lax.psum_scatter(jnp.tile(b, N), "ring", tiled=True),
         7 / 8 * FULL),
        ("all-reduce", lambda b: jax.lax.psum(b, "ring"), 2 * 7 / 8 * FULL / N),
        ("collective-permute",
         lambda b: jax.lax.ppermute(b, "ring", [(i, (i + 1) % N) for i in range(N)]), FULL / N),
        ("all-to-all", lambda b: jax.lax.all_to_all(jnp.tile(b, N), "ring", 0, 0, tiled=True),
         7 / 8 * FULL),
    ],
)  # fmt: skip
def test_each_collective_is_found_once_with_ring_bytes(ring, vector, kind, fn, expected_bytes):
    report = collectives(compiled(ring, vector, fn))
    assert report.count() == 1
    assert report.count(kind) == 1
    assert report.bytes(kind) == pytest.approx(expected_bytes)
    assert report.collectives[0].group_size == N


def test_a_permute_from_every_device_to_itself_sends_nothing():
    text = """HloModule m, num_partitions=2

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %p = f32[8]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,0},{1,1}}
}
"""
    report = collectives(text)
    assert report.count("collective-permute") == 1 and report.bytes() == 0
    moving = collectives(text.replace("{{0,0},{1,1}}", "{{0,1},{1,1}}"))
    assert moving.bytes() == 32


def test_no_collectives_in_a_local_program(ring, vector):
    report = collectives(compiled(ring, vector, lambda b: jnp.sin(b) * 2))
    assert report.count() == 0 and report.bytes() == 0
    assert report.summary() == {}
    assert "no collectives" in repr(report)


def test_a_collective_in_a_scan_counts_once_per_iteration(ring, vector):
    def fn(b):
        def body(carry, _):
            return carry + jax.lax.psum(carry, "ring"), None

        return jax.lax.scan(body, b, None, length=6)[0]

    report = collectives(compiled(ring, vector, fn))
    assert report.count("all-reduce") == 6
    assert report.array_bytes("all-reduce") == 6 * FULL // N
    assert report.bytes() == pytest.approx(6 * 2 * 7 / 8 * FULL / N)


def test_nested_loops_multiply_their_trip_counts(ring, vector):
    def fn(b):
        def inner(carry, _):
            return carry + jax.lax.psum(carry, "ring"), None

        def outer(carry, _):
            return jax.lax.scan(inner, carry, None, length=3)[0], None

        return jax.lax.scan(outer, b, None, length=4)[0]

    assert collectives(compiled(ring, vector, fn)).count("all-reduce") == 12


def test_groups_on_a_two_dimensional_mesh_use_the_axis_size():
    mesh = make_mesh((4, 2), ("a", "b"))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("a", "b")))
    fn = jax.shard_map(
        lambda blk: jax.lax.psum(blk, "b") + jax.lax.all_gather(blk, "a", tiled=True)[:2],
        mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"),
    )  # fmt: skip
    report = collectives(jax.jit(fn).lower(x).compile())
    sizes = {c.kind: c.group_size for c in report.collectives}
    assert sizes == {"all-reduce": 2, "all-gather": 4}
    block = 2 * 4 * 4  # a (2, 4) f32 block
    assert report.bytes("all-reduce") == 2 * 1 / 2 * block
    assert report.bytes("all-gather") == 3 / 4 * 4 * block


def test_compiler_inserted_collectives_are_counted():
    mesh = make_mesh((4, 2), ("data", "model"), explicit=True)
    lhs = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "model")))
    rhs = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("model", None)))
    out = NamedSharding(mesh, P("data", None))
    fn = jax.jit(lambda a, b: jnp.matmul(a, b, out_sharding=out))
    report = collectives(fn.lower(lhs, rhs).compile())
    assert report.count() == 1
    assert report.bytes("all-reduce") == 2 * 1 / 2 * (4 * 4 * 4)  # (4, 4) f32 over model pairs


ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%addb (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}
"""

ASYNC_HLO = (
    """HloModule jit_f, num_partitions=8

"""
    + ADD
    + """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %part = f32[1]{0} slice(%x), slice={[0:1]}
  %all-gather-start = (f32[1]{0}, f32[8]{0}) all-gather-start(%part), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[8]{0} all-gather-done(%all-gather-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %all-gather-done)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8], b: bf16[4,4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[4,4]{1,0} parameter(1)
  %all-reduce-start = bf16[4,4]{1,0} all-reduce-start(%b), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%addb
  %all-reduce-done = bf16[4,4]{1,0} all-reduce-done(%all-reduce-start)
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %looped = f32[8]{0} get-tuple-element(%w), index=1
  %sum = f32[8]{0} add(%cp-done, %looped)
  ROOT %r = f32[8]{0} add(%sum, %a)
}
"""
)


def test_async_start_done_pairs_count_once_with_the_done_shape():
    report = collectives(ASYNC_HLO)
    assert report.summary() == {
        "all-gather": (3, 3 * 7 / 8 * 32),
        "all-reduce": (1, 2 * 1 / 2 * 32),
        "collective-permute": (1, 32),
    }
    assert report.num_partitions == 8


def test_replica_group_spellings():
    text = (
        "HloModule m, num_partitions=8\n\n"
        + ADD
        + """
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %r1 = f32[8]{0} all-reduce(%a), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %r2 = f32[8]{0} all-reduce(%r1), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %r3 = f32[8]{0} all-reduce(%r2), channel_id=3, replica_groups={{0,1,2},{3,4,5}}, use_global_device_ids=true, to_apply=%add
  %r4 = f32[8]{0} all-reduce(%r3), channel_id=4, replica_groups=mesh['x'=2,'y'=2,'z'=2] {'x','z'}, use_global_device_ids=true, to_apply=%add
  ROOT %r5 = f32[8]{0} all-reduce(%r4), replica_groups={}, to_apply=%add
}"""
    )
    found = sorted(collectives(text).collectives, key=lambda c: c.name)
    assert [c.group_size for c in found] == [4, 2, 3, 4, 8]  # none listed: all partitions
    assert [c.groups for c in found] == [
        ((0, 1, 2, 3), (4, 5, 6, 7)),
        ((0, 4), (1, 5), (2, 6), (3, 7)),
        ((0, 1, 2), (3, 4, 5)),
        ((0, 1, 4, 5), (2, 3, 6, 7)),  # devices along x and z of a (2, 2, 2) mesh
        tuple([tuple(range(8))]),
    ]


@pytest.mark.parametrize(
    ("axes", "expected"),
    [("data", ("data",)), ("model", ("model",)), (("data", "model"), ("data", "model"))],
)
def test_a_collective_names_the_mesh_axes_it_runs_over(axes, expected):
    mesh = make_mesh((4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
    smap = jax.shard_map(lambda b: jax.lax.psum(b, axes), mesh=mesh, in_specs=P("data", "model"),
                         out_specs=P("data", "model"))  # fmt: skip
    (found,) = collectives(jax.jit(smap).lower(x).compile()).collectives
    assert found.mesh_axes(mesh) == expected
    every_device = ("ring",) if expected == ("data", "model") else None
    assert found.mesh_axes(make_mesh((8,), ("ring",))) == every_device


def test_shape_bytes():
    assert shape_bytes("f32[8,4]{1,0}") == 128
    assert shape_bytes("(f32[8]{0}, bf16[2,2]{1,0})") == 40
    assert shape_bytes("pred[3]") == 3
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("s4[8]") == 4
    assert shape_bytes("f32[<=16]") == 64
    assert shape_bytes("f8e4m3fn[16]") == 16
    assert shape_bytes("c128[2]") == 32
    assert shape_bytes("token[]") == 0
    with pytest.raises(ValueError, match="unknown HLO element type 'opaque'"):
        shape_bytes("opaque[2]")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="not an HLO module"):
        collectives("this is not HLO")
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collectives(ASYNC_HLO).count("broadcast")


def test_markdown_table():
    table = collectives(ASYNC_HLO)._repr_markdown_()
    assert "| all-gather | 3 | 84 |" in table


def test_result_types_count_the_element_types_a_program_produces():
    text = """HloModule m

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[8]{0} convert(%a)
  ROOT %c = f32[8]{0} convert(%b)
}
"""
    assert result_types(text) == {"bf16": 1, "f32": 2}


def test_dot_flops_count_every_product_and_loop_iteration():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
    program = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    assert dot_flops(program) == 2 * 8 * 4 * 16

    def looped(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, x: x @ (b @ b.T), a)

    program = jax.jit(looped).lower(a, b).compile()
    per_iteration = 2 * 16 * 16 * 4 + 2 * 8 * 16 * 16
    assert dot_flops(program) in (5 * per_iteration, 2 * 16 * 16 * 4 + 5 * 2 * 8 * 16 * 16)


def test_branch_work_reads_each_switch_branch_off_the_program() -> None:
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))

    def looped(a, b):
        return jax.lax.fori_loop(0, 3, lambda _, x: x @ (b @ b.T), a)[:, :4]

    def program(i, a, b):
        return jax.lax.switch(i, (lambda a, b: a[:, :4], lambda a, b: a @ b, looped), a, b)

    work = branch_work(jax.jit(program).lower(0, a, b).compile())
    assert [w.flops for w in work[:2]] == [0, 2 * 8 * 4 * 16]
    assert work[2].flops >= 3 * 2 * 8 * 16 * 16 and work[1].opcodes["dot"] == 1
    with pytest.raises(ValueError, match="no conditional"):
        branch_work(jax.jit(lambda a, b: a @ b).lower(a, b).compile())


def test_a_collective_keeps_its_result_shape(ring, vector):
    program = jax.jit(lambda x: jnp.sum(x)).lower(vector).compile()
    (found,) = collectives(program).collectives
    assert found.shape.startswith("f32[]") and found.dtypes == ("f32",) and found.arrays == ((),)
    assert found.signature == "f32[]"


def test_a_collective_knows_the_dimensions_of_each_array_it_moves() -> None:
    mesh = make_mesh((4,), ("x",), devices=jax.devices()[:4])
    body = jax.shard_map(
        lambda a, b: (jax.lax.all_gather(a, "x", tiled=True), jax.lax.psum((a, b), "x")),
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=(P("x"), P()),
    )
    report = collectives(jax.jit(body).lower(jnp.ones((8, 3)), jnp.ones(5)).compile())
    arrays = {c.kind: c.arrays for c in report.collectives}
    assert arrays == {"all-gather": ((8, 3),), "all-reduce": ((2, 3), (5,))}
    assert [c.kind for c in report.along(mesh, "all-reduce", ("x",))] == ["all-reduce"]
    assert report.along(mesh, "all-to-all", ("x",)) == []
    assert arrays_moved(report.collectives) == {(8, 3): 1, (2, 3): 1, (5,): 1}


def test_a_collective_knows_the_shapes_that_read_it() -> None:
    mesh = make_mesh((4,), ("x",), devices=jax.devices()[:4])
    body = jax.shard_map(
        lambda a: jax.lax.psum(a, "x")[:2] * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    report = collectives(jax.jit(body).lower(jnp.ones(16)).compile())
    (reduced,) = [c for c in report.collectives if c.kind == "all-reduce"]
    assert set(reduced.reader_arrays) == {(2,)}


def test_the_cpu_compiler_keeps_an_all_reduce_that_each_device_slices() -> None:
    """XLA's CPU pipeline, from its own dump: the partitioner writes an all-reduce that each
    device slices, and no pass after it changes that into a reduce-scatter."""
    dump = compiler_passes("cpu", 4)
    assert dump.platform == "cpu" and "spmd-partitioning" in dump.passes
    kinds = [{c.kind for c in collectives(module).collectives} for _, module in dump.steps]
    first = next(i for i, found in enumerate(kinds) if found)
    assert dump.steps[first][0] == "spmd-partitioning" and first < len(kinds) - 1
    assert all(found == {"all-reduce"} for found in kinds[first:])
    (reduced,) = collectives(dump.program).collectives
    assert reduced.kind == "all-reduce" and reduced.arrays == ((16,),)
    assert set(reduced.reader_arrays) == {(4,)}
    with pytest.raises(RuntimeError, match="compiling on nowhere failed"):
        compiler_passes("nowhere")


def test_the_passes_are_dumped_where_a_compilation_cache_holds_the_program(
    tmp_path, monkeypatch
) -> None:
    """A persistent compilation cache (the book's build shares one) holding the program
    would skip the compiler, and with it the dump: the passes are read all the same."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    from nnxscale_book import shared_compilation

    for name, value in shared_compilation(tmp_path).items():
        monkeypatch.setenv(name, value)
    first, second = compiler_passes("cpu", 4), compiler_passes("cpu", 4)
    assert second.passes == first.passes and "spmd-partitioning" in second.passes
