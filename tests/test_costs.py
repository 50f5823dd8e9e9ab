"""The cost model against the book's Transformer, its layouts and its compiled programs."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from nnxscale import (
    TINY,
    Config,
    Trainer,
    activations,
    costs,
    create,
    pipeline,
    schedules,
    trainer_for,
)
from nnxscale.analysis.comm import ring_bytes
from nnxscale.analysis.hlo import collectives, dot_flops
from nnxscale.core.memory import CompiledMemory
from nnxscale.costs import sizes_of
from nnxscale.costs.planner import TOLERANCE
from nnxscale.model import count_params
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_70B, MIXTRAL_8X7B
from nnxscale.placement.catalogue import STRATEGIES
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import resolve
from nnxscale.placement.rules import strategy_mesh
from nnxscale.runtime.devices import FAST_COMPILE, OPTIMIZED
from nnxscale.train import compile_all
from nnxscale.train.data import Batches, arithmetic_text, encode

CORPUS = encode(arithmetic_text(4000))
BATCHES = Batches(CORPUS, batch_size=8, length=32)
H100 = costs.HARDWARE["H100"]
PLAIN = TINY.replace(dropout=0.0)


def trainer(name: str, devices: int, cfg: Config = PLAIN, micro_batches: int = 1) -> Trainer:
    return trainer_for(
        STRATEGIES[name], devices, cfg, tx=optax.adam(1e-3), dropout=False,
        micro_batches=micro_batches, compiler_options=FAST_COMPILE,
    )  # fmt: skip


def setup_of(run: Trainer, cfg: Config = PLAIN) -> costs.Setup:
    return costs.Setup.of(
        run.layout.rules, dict(run.layout.mesh.shape), run.options.micro_batches, cfg.remat
    )


def compiled_peak(program: jax.stages.Compiled) -> int:
    return CompiledMemory.of(program).held


@pytest.mark.slow
@pytest.mark.parametrize("name", ["FSDP+TP", "FSDP+CP"])
def test_fast_compile_changes_only_a_few_hundred_bytes_of_temporaries(name: str) -> None:
    programs = []
    for options in (OPTIMIZED, FAST_COMPILE):
        rules = STRATEGIES[name]
        run = Trainer.create(
            create(TINY), optax.adam(1e-3), rules, strategy_mesh(rules, 4),
            compiler_options=options,
        )  # fmt: skip
        programs.append(run.compile(run.batch(BATCHES)))
    slow, fast = (CompiledMemory.of(p) for p in programs)
    assert (slow.argument, slow.output, slow.alias) == (fast.argument, fast.output, fast.alias)
    assert abs(fast.temp - slow.temp) <= 1024
    assert collectives(programs[0]).summary() == collectives(programs[1]).summary()
    assert dot_flops(programs[0]) == dot_flops(programs[1])


MIXTURE = PLAIN.replace(experts=8, top_k=2, capacity_factor=2.0, scan_layers=True)
"""The chapters' mixture of experts, with its layers scanned as the planner's models are."""

DROPLESS = MIXTURE.replace(routing="dropless", expert_block=4)
"""The same experts, dropless, in blocks of 4 rows."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        TINY.replace(layers=3, mlp=96, heads=2, vocab=40, max_len=16),
        MIXTURE.replace(top_k=1),
        MIXTURE.replace(routing="dropless", shared_experts=2, bias_rate=1e-3),
    ],
)
def test_counts_match_the_model(cfg: Config) -> None:
    assert costs.counts(cfg).total == count_params(create(cfg))


@pytest.mark.slow
def test_a_dropless_mixtures_flops_equal_the_compiled_dots() -> None:
    """Dropless experts: the router, every row of the blocks (the tokens' k copies and the
    padding, `rows`), the weighted sum of the k copies (a product only for k > 1) and the
    shared experts, forward, backward and rebuilt, exactly as compiled. Blocks of at least 2
    rows: XLA compiles a block of one row as a matrix-vector product, not a dot."""
    cases = [(False, 1, 0, 8), (False, 2, 1, 8), ("full", 2, 1, 4), ("dots", 1, 2, 2)]
    mixture = PLAIN.replace(experts=8, routing="dropless", scan_layers=True)
    configs = [
        mixture.replace(top_k=k, shared_experts=shared, expert_block=block, remat=remat)
        for remat, k, shared, block in cases
    ]
    runs = [trainer("DP", 1, cfg) for cfg in configs]
    programs = compile_all([(run, run.batch(BATCHES)) for run in runs])
    for cfg, program in zip(configs, programs, strict=True):
        assert dot_flops(program) == costs.step_flops(cfg, 8, 32, remat=cfg.remat), cfg


def test_the_worked_models_have_their_sizes() -> None:
    assert costs.counts(LLAMA3_8B).total == 8_030_261_248  # Llama 3 8B
    assert costs.counts(LLAMA3_70B).total == 70_553_706_496  # Llama 3 70B


@pytest.mark.parametrize(
    "name",
    [
        "DP",
        "ZeRO-1",
        "ZeRO-2",
        "FSDP",
        "TP",
        "FSDP+TP",
        "HSDP",
        "HSDP+TP",
        "CP",
        "FSDP+CP",
        "FSDP+CP+TP",
        "FSDP+TP+SP",
        "ZeRO-1+TP",
    ],
)
def test_the_derived_state_equals_the_placed_state(name: str) -> None:
    run = trainer(name, 8)
    cost = costs.step_cost(PLAIN, setup_of(run), H100, 8, 32)
    arrays = [p for p in run.layout.placements if p.shape and not p.dtype.startswith("key")]
    assert sum(p.bytes_per_device for p in arrays) == cost.state


@pytest.mark.parametrize("devices", [256, 4096])
@pytest.mark.parametrize(
    "name, inner", [("FSDP", {}), ("FSDP+TP", {"model": 8}), ("HSDP", {"replica": 16}),
                    ("ZeRO-2", {}), ("PP+FSDP", {"stage": 16}),
                    ("PP+FSDP+TP", {"stage": 16, "model": 8}),
                    ("PP+FSDP+CP+TP", {"stage": 4, "context": 4, "model": 4}),
                    ("PP+ZeRO-1+TP", {"stage": 16, "model": 8})],
)  # fmt: skip
def test_the_formulas_equal_the_layout_on_an_abstract_mesh(name: str, inner, devices: int) -> None:
    """At 4,096 devices the abstract layout costs no memory: resolved at the real sizes, it
    holds exactly what the formulas derived on size-1 axes say."""
    rules = STRATEGIES[name]
    rest = devices // math.prod(inner.values())
    shape = {
        a: inner.get(a, rest if a not in inner and size == -1 else 1)
        for a, size in zip(rules.axes, rules.sizes, strict=True)
    }
    mesh = AbstractMesh(tuple(shape.values()), rules.axes, axis_types=(AxisType.Auto,) * len(shape))
    cfg = LLAMA3_70B.replace(layers=64, vocab=32768)  # sizes the axes divide
    params = nnx.state(abstract(lambda: create(cfg)), nnx.Param)
    held = {
        role: resolve(params, rules, mesh, role=role, warn_bytes=math.inf).bytes_per_device()
        for role in ("params", "optimizer")
    }
    schedule = "1F1B" if costs.unpriced(rules, 0) else "lockstep"  # a ring inside stages
    setup = costs.Setup.of(rules, shape, micro_batches=shape.get("stage", 1), schedule=schedule)
    assert costs.unsuitable(cfg, setup, 4096 * 4, 4096) == ""
    cost = costs.step_cost(cfg, setup, "TPU v5p", 4096 * 4, 4096)
    assert cost.memory["parameters"] == held["params"]
    assert cost.memory["optimizer state"] == costs.OPTIMIZER_COPIES * held["optimizer"]


@pytest.mark.slow
def test_matmul_flops_equal_the_compiled_dots() -> None:
    configs = (
        PLAIN,
        PLAIN.replace(scan_layers=True, remat=True),
        PLAIN.replace(scan_layers=True, remat="dots"),
    )
    runs = [trainer("DP", 1, cfg) for cfg in configs]
    programs = compile_all([(run, run.batch(BATCHES)) for run in runs])
    for cfg, program in zip(configs, programs, strict=True):
        assert dot_flops(program) == costs.step_flops(cfg, 8, 32, remat=cfg.remat)
        assert costs.step_cost(
            cfg, costs.Setup.of(STRATEGIES["DP"], {"data": 1}, 1, cfg.remat), H100, 8, 32
        ).flops == dot_flops(program)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["CP", "FSDP+CP"])
@pytest.mark.parametrize("remat", [False, "full", "dots"])
def test_the_rings_flops_equal_the_compiled_dots(name: str, remat) -> None:
    """Per device: the zig-zag ring's share of attention's pairs, and its custom VJP's five
    products backward, exactly as compiled."""
    cfg = PLAIN.replace(scan_layers=bool(remat), remat=remat)
    run = trainer(name, 8, cfg)
    program = run.compile(run.batch(Batches(CORPUS, 16, 32)))
    setup = costs.Setup.of(STRATEGIES[name], dict(run.layout.mesh.shape), 1, remat)
    assert costs.step_cost(cfg, setup, H100, 16, 32).flops == dot_flops(program)


@pytest.mark.slow
def test_dp_and_zero_bytes_against_the_compiled_steps() -> None:
    full = costs.counts(TINY).total * costs.STATE_BYTES
    for name in ("DP", "ZeRO-2"):
        run = trainer(name, 4)
        report = collectives(run.compile(run.batch(BATCHES))).without_flags()
        derived = costs.step_cost(PLAIN, setup_of(run), H100, 8, 32).collectives
        if name == "DP":
            (reduce,) = derived
            assert report.array_bytes("all-reduce") == reduce.array_bytes + 4  # the loss
        else:
            assert report.array_bytes("all-gather") == full
            reduced = report.bytes("all-reduce") + report.bytes("reduce-scatter")
            assert ring_bytes("reduce-scatter", full, 4) <= reduced
            assert reduced <= ring_bytes("all-reduce", full + 4, 4)


@pytest.mark.slow
def test_fsdp_gathers_the_compute_dtype_copy() -> None:
    """Under bfloat16 compute each device casts its shards before FSDP gathers them: the
    matrices' gathers move half the bytes, counted in the compiled step as derived."""
    found = {}
    for dtype in ("float32", "bfloat16"):
        cfg = PLAIN.replace(compute_dtype=dtype)
        run = trainer("FSDP", 8, cfg)
        report = collectives(run.compile(run.batch(BATCHES)))
        setup = setup_of(run, cfg)
        derived = costs.step_cost(cfg, setup, H100, 8, 32).collectives
        (gathers,) = [c for c in derived if c.transfer.kind == "all-gather"]
        found[dtype] = (report.array_bytes("all-gather"), gathers.array_bytes)
    counted_32, derived_32 = found["float32"]
    counted_16, derived_16 = found["bfloat16"]
    matrices = 4 * (costs.counts(TINY).matmul)  # float32 bytes of the products' weights
    assert derived_32 - derived_16 == matrices / 2
    assert counted_32 - counted_16 == matrices / 2  # the rest (tables, norms) stays float32


@pytest.mark.slow
def test_zero1_compiles_to_zero2s_program() -> None:
    """XLA's partitioner splits a gradient that only the split optimizer update reads: with
    one micro-batch or two, ZeRO-1's step holds and sends what ZeRO-2's does, and its running
    sum of gradients is split in the loop, as ZeRO-2's is. DP's is whole: (N-1)/N of the
    gradient more."""
    found = {}
    for micro in (1, 2):
        for name in ("DP", "ZeRO-1", "ZeRO-2"):
            run = trainer(name, 4, micro_batches=micro)
            program = run.compile(run.batch(BATCHES))
            moved = collectives(program).without_flags().summary()  # finite flags aside
            found[name, micro] = (CompiledMemory.of(program), moved)
            # the loop over the micro-batches: its trip count is theirs
            carried = [
                line
                for line in program.as_text().splitlines()
                if " while(" in line and '"known_trip_count":{"n":"2"}' in line
            ]
            if micro == 2:
                assert len(carried) == 1, name
                assert ("f32[16,4,16]" in carried[0]) == (name != "DP"), name  # query's 1/4
    for micro in (1, 2):
        assert found["ZeRO-1", micro] == found["ZeRO-2", micro]
    full = costs.counts(TINY).total * costs.STATE_BYTES
    saving = found["DP", 2][0].temp - found["ZeRO-2", 2][0].temp
    assert saving == pytest.approx(3 / 4 * full, rel=0.01)
    for micro in (1, 2):
        zero1, zero2 = (
            costs.step_cost(PLAIN, costs.Setup.of(STRATEGIES[n], {"data": 4}, micro), H100, 8, 32)
            for n in ("ZeRO-1", "ZeRO-2")
        )
        assert zero1.memory == zero2.memory and zero1.sent == zero2.sent


CASES = [
    ("DP", PLAIN, 1), ("ZeRO-1", PLAIN, 1), ("ZeRO-2", PLAIN, 2), ("FSDP", PLAIN, 1),
    ("TP", PLAIN, 1), ("FSDP+TP", PLAIN, 1), ("HSDP", PLAIN, 1),
    ("FSDP", PLAIN.replace(scan_layers=True), 1), ("TP", PLAIN.replace(scan_layers=True), 1),
    ("DP", PLAIN.replace(scan_layers=True, remat=True), 2),
    ("FSDP+TP", PLAIN.replace(scan_layers=True, remat="dots"), 1),
    ("CP", PLAIN, 1), ("FSDP+CP", PLAIN.replace(scan_layers=True, remat=True), 1),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name, cfg, micro", CASES)
@pytest.mark.parametrize("rows", [16, 64])
def test_the_peak_lies_within_the_tolerance_of_the_compiled_step(name, cfg, micro, rows) -> None:
    run = trainer(name, 8, cfg, micro)
    program = run.compile(run.batch(Batches(CORPUS, rows, 32)))
    predicted = costs.step_cost(cfg, setup_of(run, cfg), H100, rows, 32).peak
    low, high = TOLERANCE
    assert low <= compiled_peak(program) / predicted <= high


def test_sequence_parallelism_splits_what_the_ledger_keeps_on_the_stream() -> None:
    """TP+SP keeps what TP keeps less (1 - 1/t) of what lies on the residual stream
    (`Kept.stream`, traced): the ledger sees `residual_length`, and nothing else changes."""
    cfg, mesh = PLAIN.replace(scan_layers=True), {"data": 4, "model": 2}
    tp, sp = (costs.Setup.of(STRATEGIES[n], mesh) for n in ("TP", "TP+SP"))
    ledgers = [costs.ledger(cfg, s, 64, 32) for s in (tp, sp)]
    k = activations.kept()
    stream = (k.on_stream("layer") * "layers" + k.on_stream("model"))(sizes_of(cfg, tp, 64, 32))
    split = ledgers[0]["activations"] - ledgers[1]["activations"]
    assert split == pytest.approx(stream / mesh["data"] * (1 - 1 / mesh["model"]), rel=1e-12)
    assert {k: v for k, v in ledgers[0].items() if k != "activations"} == {
        k: v for k, v in ledgers[1].items() if k != "activations"
    }


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("rows", [16, 64])
def test_sequence_parallelisms_saving_against_the_compiled_step(remat: bool, rows: int) -> None:
    """What TP+SP saves over TP, priced, against what the compiled step's temporaries save,
    with layers scanned as the ledger traces them: within the peak's tolerance (the
    temporaries are XLA's schedule's peak, the price the arrays autodiff keeps)."""
    cfg = PLAIN.replace(scan_layers=True, remat=remat)
    temp, priced = [], []
    for name in ("TP", "TP+SP"):
        run = trainer(name, 8, cfg)
        program = run.compile(run.batch(Batches(CORPUS, rows, 32)))
        temp.append(CompiledMemory.of(program).temp)
        priced.append(costs.ledger(cfg, setup_of(run, cfg), rows, 32)["activations"])
        peak = costs.step_cost(cfg, setup_of(run, cfg), H100, rows, 32).peak
        assert TOLERANCE[0] <= compiled_peak(program) / peak <= TOLERANCE[1]
    low, high = TOLERANCE
    assert temp[0] > temp[1] and low <= (priced[0] - priced[1]) / (temp[0] - temp[1]) <= high


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, cfg", [("CP", PLAIN), ("FSDP+CP", PLAIN.replace(scan_layers=True, remat=True))]
)
def test_the_rings_hops_equal_the_compiled_steps(name: str, cfg: Config) -> None:
    """K and V: N-1 hops forward (twice with remat), N-2 more backward; dK and dV: N hops in
    float32. Float32 only: the CPU sends a bfloat16 block as float32."""
    run = trainer(name, 8, cfg)
    program = run.compile(run.batch(Batches(CORPUS, 16, 32)))
    sent = sum(
        c.sent_bytes
        for c in collectives(program).collectives
        if c.kind == "collective-permute" and c.dtypes == ("f32",)
    )
    cost = costs.step_cost(cfg, setup_of(run, cfg), H100, 16, 32)
    ring = [c.sent for c in cost.collectives if c.transfer.kind == "collective-permute"]
    assert sent == sum(ring) > 0


@pytest.mark.slow
@pytest.mark.parametrize("stages, fsdp", [(8, 0), (4, 2)])
def test_the_pipelines_peak_and_hand_overs_against_the_compiled_executor(stages, fsdp) -> None:
    cfg = PLAIN.replace(layers=8, scan_layers=True)
    mesh = pipeline.pipeline_mesh(stages, fsdp)
    m = 2 * stages
    schedule = schedules.one_f_one_b(stages, m)
    rules = pipeline.rules_for(mesh)
    run = Trainer.create(
        pipeline.placed(create(cfg), mesh), optax.adam(1e-3), rules, mesh, dropout=False,
        grads_fn=pipeline.grads_fn(schedule, mesh), compiler_options=FAST_COMPILE,
    )  # fmt: skip
    rows = 2 * m * max(fsdp, 1)
    program = run.compile(run.batch(Batches(CORPUS, rows, 32)))
    cost = costs.step_cost(cfg, costs.Setup.of(rules, dict(mesh.shape), m), H100, rows, 32)
    low, high = TOLERANCE
    assert low <= compiled_peak(program) / cost.peak <= high
    report = collectives(program)
    (permutes,) = [c for c in cost.collectives if c.transfer.kind == "collective-permute"]
    assert report.bytes("collective-permute") == permutes.sent
    if fsdp:
        (gathers,) = [c for c in cost.collectives if c.transfer.kind == "all-gather"]
        assert report.array_bytes("all-gather") == gathers.array_bytes


@pytest.mark.slow
def test_a_bfloat16_step_lies_within_the_band_of_the_bfloat16_ledger() -> None:
    """A scanned bfloat16 step keeps bfloat16 values, as the bfloat16 ledger counts them, and
    not float32 copies: below the float32 ledger. (jaxlib 0.10.2's CPU computed bfloat16 values
    in float32 inside its fusions, and its step lay above the bfloat16 ledger's band.)"""
    cfg = PLAIN.replace(scan_layers=True, compute_dtype="bfloat16")
    run = trainer("FSDP", 8, cfg)
    got = compiled_peak(run.compile(run.batch(Batches(CORPUS, 64, 32))))
    setup = setup_of(run, cfg)
    narrow = costs.step_cost(cfg, setup, H100, 64, 32).peak
    wide = costs.step_cost(cfg.replace(compute_dtype="float32"), setup, H100, 64, 32).peak
    assert TOLERANCE[0] <= got / narrow <= TOLERANCE[1]
    assert got < wide


def test_the_state_at_rest_and_the_textbook_activations_fail_the_tolerance() -> None:
    """A wrong ledger fails: the state alone (what a step holds between steps), and the
    textbook's activations where attention's scores matter (128-token sequences)."""
    cfg = PLAIN.replace(max_len=128, scan_layers=True)
    run = trainer("DP", 8, cfg)
    got = compiled_peak(run.compile(run.batch(Batches(CORPUS, 64, 128))))
    cost = costs.step_cost(cfg, setup_of(run, cfg), H100, 64, 128)
    textbook = cost.state + 4 * costs.counts(cfg).total + costs.activation_bytes(cfg, 8, 128)
    low, high = TOLERANCE
    assert low <= got / cost.peak <= high
    assert got / cost.state > high and got / textbook > high


def test_links_latency_and_all_to_all() -> None:
    mesh = {"replica": 4, "data": 8}
    assert costs.link(["data"], mesh, H100) == (H100.fast, H100.hop)
    assert costs.link(["replica"], mesh, H100) == (H100.slow, H100.far_hop)
    v5p = costs.HARDWARE["TPU v5p"]
    assert costs.link(["replica"], mesh, v5p)[0] == v5p.fast  # one ICI domain
    # an all-gather pays n-1 steps of latency and (n-1)/n of the array over the link
    sent, seconds = costs.collective_seconds("all-gather", 8e6, 8, {"data": 8}, ["data"], H100)
    assert sent == 7e6 and seconds == pytest.approx(7 * H100.hop + 7e6 / H100.fast)
    # an all-to-all through a switch sends the others' pieces of its buffer; on a ring
    # (TPU ICI) it costs a quarter of an all-gather of every device's buffer (scaling book)
    _, switch = costs.collective_seconds("all-to-all", 8e6, 8, {"data": 8}, ["data"], H100)
    _, ring = costs.collective_seconds("all-to-all", 8e6, 8, {"data": 8}, ["data"], v5p)
    assert switch == pytest.approx(7 * H100.hop + 7e6 / H100.fast)
    assert ring == pytest.approx(7 * v5p.hop + 8 * 7e6 / 4 / v5p.fast)


def test_overlap_follows_the_steps_dependencies() -> None:
    """TP's all-reduces are exposed whole; FSDP's gathers and reductions hide behind compute
    at a large batch and are exposed at a small one, unless the step waits on its host's
    launches (a GPU's `launch`): then they hide behind those."""
    tp = costs.step_cost(
        LLAMA3_8B,
        costs.Setup.of(STRATEGIES["TP"], {"data": 4, "model": 2}, 1, "full"),
        H100,
        64,
        4096,
    )
    for c in tp.collectives:
        if c.transfer.overlap == "blocking":
            assert c.exposed == c.seconds > 0
    assert tp.step_time == pytest.approx(tp.compute_time + tp.exposed)
    fsdp = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8}, 1, "full")
    large = costs.step_cost(LLAMA3_8B, fsdp, H100, 64, 4096)
    assert large.exposed < 0.01 * large.step_time < large.comm_time
    small = costs.step_cost(LLAMA3_8B, fsdp, H100.replace(launch=0.0), 8, 256)
    assert small.exposed > 0.5 * small.step_time and small.bound == "communication"
    launched = costs.step_cost(LLAMA3_8B, fsdp, H100, 8, 256)
    # 32 layers, each launched forward, backward and (full remat) forward again
    assert launched.compute_time == pytest.approx(32 * 1.5 * H100.launch)
    assert launched.exposed < 0.3 * launched.step_time


def test_each_axis_of_a_torus_has_its_own_links() -> None:
    """On a TPU torus, collectives over disjoint mesh axes travel on different links and run
    side by side; those sharing an axis, directly or through a third, share its links; more
    groups of axes than the torus has dimensions share one lane; a switch's fast links
    (NVLink) and the slow network are one lane each."""
    found = costs.lanes(
        [
            (("data",), "fast"),
            (("model",), "fast"),
            (("replica", "data"), "fast"),
            (("x",), "slow"),
        ],
        torus=True,
    )
    assert found == ["fast: data x replica", "fast: model", "fast: data x replica", "slow"]
    bridged = costs.lanes([(("a",), "fast"), (("b",), "fast"), (("a", "b"), "fast")], True)
    assert bridged == ["fast: a x b"] * 3
    three = [(("a",), "fast"), (("b",), "fast"), (("c",), "fast")]
    assert costs.lanes(three, True, dimensions=2) == ["fast"] * 3
    assert len(set(costs.lanes(three, True, dimensions=3))) == 3
    assert costs.lanes([(("data",), "fast"), (("model",), "fast")], torus=False) == ["fast"] * 2
    # HSDP+TP on a 4 x 4 x 8 v5p slice: on the torus the TP all-reduces, the replica
    # all-reduce and FSDP's gathers each have their own lane; through a switch, or on a
    # v5e's two dimensions, they add up
    setup = costs.Setup.of(STRATEGIES["HSDP+TP"], {"replica": 4, "data": 8, "model": 4}, 1, "full")
    v5p = costs.HARDWARE["TPU v5p"]
    torus = costs.step_cost(LLAMA3_8B, setup, v5p, 16, 4096)
    switch = costs.step_cost(LLAMA3_8B, setup, v5p.replace(ring=False), 16, 4096)
    assert {c.lane for c in torus.collectives} == {"fast: data", "fast: model", "fast: replica"}
    assert {c.lane for c in switch.collectives} == {"fast"}
    assert torus.comm_time == switch.comm_time and torus.exposed < switch.exposed
    flat = costs.step_cost(LLAMA3_8B, setup, v5p.replace(dimensions=2), 16, 4096)
    assert {c.lane for c in flat.collectives} == {"fast"} and flat.exposed == switch.exposed


def test_collectives_on_one_link_add_up_before_they_hide() -> None:
    """FSDP over 64 H100s in 8 hosts, each host with one network adapter for its 8 GPUs: the
    gathers and the reductions share the network, and together take longer than the step
    computes, though each alone would fit. Whatever exceeds the compute is exposed, and the
    crossover agrees that it is communication-bound. With an adapter per GPU (`H100`'s
    `slow`), the group's 8 GPUs per host send on 8 adapters at once and all of it hides."""
    fsdp = costs.Setup.of(STRATEGIES["FSDP"], {"data": 64}, 1, "full")
    # the H100s, at 40% MFU, sharing one adapter per host
    h100 = dataclasses.replace(H100, efficiency=0.40, slow=H100.slow / 8)
    step = costs.step_cost(LLAMA3_8B, fsdp, h100, 96, 4096)
    assert {c.link for c in step.collectives} == {"slow"}
    assert all(c.seconds < step.compute_time for c in step.collectives) and (
        step.comm_time > step.compute_time
    )
    assert step.exposed >= step.comm_time - step.compute_time
    assert step.bound == "communication"
    assert costs.crossover(LLAMA3_8B, fsdp, h100, 4096) > 96 * 4096 / 64
    rails = costs.step_cost(LLAMA3_8B, fsdp, h100.replace(slow=H100.slow), 96, 4096)
    assert step.comm_time / 8 < rails.comm_time < step.comm_time / 7  # plus the hops
    assert rails.bound == "compute"


def test_hide_sums_a_links_collectives_against_each_window() -> None:
    window = {"gather": 10.0, "reduce": 6.0, "ring": 1.0}
    assert costs.hide(
        [4.0, 4.0], ["gather", "reduce"], [math.inf, math.inf], window
    ) == pytest.approx(0.0)
    assert costs.hide(
        [6.0, 6.0], ["gather", "reduce"], [math.inf, math.inf], window
    ) == pytest.approx(2.0)
    assert costs.hide(
        [1.0, 7.0], ["gather", "reduce"], [math.inf, math.inf], window
    ) == pytest.approx(1.0)
    assert costs.hide([2.0], ["ring"], [4], window) == pytest.approx(1.0 + 0.5)
    assert costs.hide([30.0], ["gather"], [1], window) == 30.0  # never more than it takes


def test_zeros_gather_of_updated_parameters_is_exposed_whole() -> None:
    """One compiled step cannot prefetch into the next: the gather after the update waits."""
    zero = costs.Setup.of(STRATEGIES["ZeRO-1"], {"data": 8}, 1, "full")
    step = costs.step_cost(LLAMA3_8B, zero, H100, 64, 4096)
    (update,) = [c for c in step.collectives if c.transfer.overlap == "update"]
    assert update.exposed == update.seconds > 0


def test_each_device_computes_at_its_stated_efficiency() -> None:
    setup = costs.Setup.of(STRATEGIES["DP"], {"data": 1})
    for hw in costs.HARDWARE.values():
        assert 0.3 <= hw.efficiency <= 0.9 and hw.efficiency_source
        assumed = costs.step_cost(PLAIN, setup, hw, 8, 128, efficiency=hw.efficiency)
        assert costs.step_cost(PLAIN, setup, hw, 8, 128) == assumed
    with pytest.raises(
        ValueError, match=r"efficiency=1.5: .* \(0, 1\]; leave it out .* \(41%, calibrated"
    ):
        costs.step_cost(PLAIN, setup, H100, 8, 128, efficiency=1.5)


def test_a_pipeline_runs_lockstep_ticks() -> None:
    setup = costs.Setup.of(STRATEGIES["PP"], {"stage": 8}, 32)
    cost = costs.step_cost(LLAMA3_8B, setup, H100, 64, 4096)
    assert cost.bubble == pytest.approx(1 - 32 / (1.5 * (32 + 7)))


@pytest.mark.parametrize("remat", [False, "dots"])
def test_zero_bubble_schedules_are_priced_by_their_own_bubble_and_1f1b_s_memory(remat) -> None:
    """ZB-H1 and ZB-V hold what plain 1F1B holds (p stages in flight on the busiest device,
    as Qi et al. give for both), compute as much, and idle by their own formulas; ZB-V sends
    twice per micro-batch what ZB-H1 sends (two stages a device) and needs 2p - 1
    micro-batches; full remat, which rebuilds W's inputs inside B, is refused."""
    mesh, m = {"stage": 8, "fsdp": 2, "model": 8}, 32
    rules = STRATEGIES["PP+FSDP+TP"]
    priced = {
        s: costs.step_cost(
            LLAMA3_70B, costs.Setup.of(rules, mesh, m, remat, schedule=s), H100, 256, 4096
        )
        for s in ("1F1B", "ZB-H1", "ZB-V")
    }
    assert priced["ZB-H1"].bubble == schedules.zero_bubble_formula(8, m) == 7 / (3 * m + 7)
    assert priced["ZB-V"].bubble == schedules.zero_bubble_v_formula(8, m) == 7 / (6 * m + 7)
    assert priced["1F1B"].bubble == schedules.bubble_formula(8, m)
    for s in ("ZB-H1", "ZB-V"):
        assert priced[s].memory == priced["1F1B"].memory and priced[s].flops == priced["1F1B"].flops
    hand = {
        s: [c for c in priced[s].collectives if c.transfer.kind == "collective-permute"]
        for s in priced
    }
    assert hand["ZB-V"][0].seconds == pytest.approx(2 * hand["ZB-H1"][0].seconds)
    few = costs.Setup.of(rules, mesh, 14, remat, schedule="ZB-V")
    assert few.virtual == 2
    assert "2p - 1 = 15 micro-batches, not 14" in costs.unsuitable(LLAMA3_70B, few, 224, 4096)
    full = costs.Setup.of(rules, mesh, m, "full", schedule="ZB-H1")
    assert "full remat rebuilds them" in costs.unsuitable(LLAMA3_70B, full, 256, 4096)
    with pytest.raises(ValueError, match="ZB-V always runs two"):
        costs.Setup.of(rules, mesh, m, remat, schedule="ZB-H1", virtual=2)


def test_the_rings_threshold_follows_the_link_it_crosses() -> None:
    """A 64-device ring on 8-GPU hosts crosses the network; a TPU slice's stays on ICI. In
    bfloat16 the backward's hops bind (K, V and their float32 gradients against 2.5 times
    the forward's FLOPs): 2.4 F/W tokens under a causal mask, 1.2 F/W without; in float32
    the forward's, 4 F/W."""
    ring = {"data": 1, "context": 64}

    def reach(name: str, link: str, wrap: float = 1.0) -> float:
        hw = costs.HARDWARE[name]  # a GPU's flash attention runs at its `attention` share
        return hw.flops * (hw.attention or hw.efficiency) / (getattr(hw, link) * wrap)

    in_host = costs.ring_hop_tokens("H100", {"context": 8})
    assert in_host == pytest.approx(2.4 * reach("H100", "fast"))
    assert costs.ring_hop_tokens("H100", {"context": 8}, causal=False) == in_host / 2
    # grouped-query attention sends one K and V head per `groups` query heads
    assert costs.ring_hop_tokens("H100", {"context": 8}, groups=4) == pytest.approx(in_host / 4)
    in_float32 = costs.ring_hop_tokens("H100", {"context": 8}, dtype="float32")
    assert in_float32 == pytest.approx(4 * reach("H100", "fast"))
    assert costs.ring_hop_tokens("H100", ring) == pytest.approx(2.4 * reach("H100", "slow"))
    assert costs.ring_hop_tokens("B200", ring) == pytest.approx(2.4 * reach("B200", "slow"))
    assert costs.ring_hop_tokens("TPU v5p", ring) == pytest.approx(2.4 * reach("TPU v5p", "fast"))
    # 8 chips of a v5e axis have no wraparound (it closes at 16): a line, half the bandwidth
    line = costs.ring_hop_tokens("TPU v5e", {"context": 8})
    assert line == pytest.approx(2.4 * reach("TPU v5e", "fast", 0.5))
    assert costs.ring_hop_tokens("TPU v5e", {"context": 16}) == pytest.approx(line / 2)


def test_the_fsdp_crossover_is_where_transfers_stop_hiding() -> None:
    setup = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8}, 1, "full")
    tokens = costs.crossover(LLAMA3_8B, setup, H100, 1024)
    for scale, exposed in ((0.5, True), (2.0, False)):
        seq = int(scale * tokens)
        cost = costs.step_cost(LLAMA3_8B, setup, H100, 8, seq)
        weights = sum(c.seconds for c in cost.collectives)
        assert (weights > cost.compute_time) == exposed, (seq, weights, cost.compute_time)


@pytest.mark.parametrize(
    "name, mesh, batch, seq, reason",
    [
        ("FSDP", {"data": 6}, 12, 32, "the data axis (6) does not divide embed (64)"),
        ("TP", {"data": 1, "model": 8}, 8, 32, "the model axis (8) does not divide heads (4)"),
        ("DP", {"data": 8}, 12, 32, "the batch of 12 sequences does not split into"),
        ("CP", {"data": 1, "context": 8}, 8, 24, "24 tokens do not cut into 2 x 8 chunks"),
        ("DP", {"data": 2}, 8, 64, "sequences of 64 tokens exceed the model's max_len (32)"),
        ("PP", {"stage": 4}, 8, 32, "2 layers do not fill 4 stages x 1 virtual stages"),
    ],
)
def test_what_cannot_run_is_named(name, mesh, batch, seq, reason) -> None:
    setup = costs.Setup.of(STRATEGIES[name], mesh, 4 if name == "PP" else 1)
    assert costs.unsuitable(TINY, setup, batch, seq).startswith(reason)


def test_nonsense_hardware_is_refused_naming_each_number() -> None:
    good = dataclasses.asdict(H100)
    for field, value in [("flops", -1.0), ("hbm", 0.0), ("slow", math.nan), ("memory", -80e9),
                         ("efficiency", 0.0), ("efficiency", 1e9), ("domain", 0),
                         ("dimensions", -1)]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"has {field}={value!r}.*positive finite"):
            costs.Hardware(**{**good, field: value})


def test_bad_setups_and_hardware_are_refused() -> None:
    with pytest.raises(ValueError, match="not axes of rule set 'FSDP'"):
        costs.Setup.of(STRATEGIES["FSDP"], {"stage": 4})
    with pytest.raises(ValueError, match="positive integers"):
        costs.Setup.of(STRATEGIES["FSDP"], {"data": 0})
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        costs.Setup.of(STRATEGIES["FSDP"], {"data": 2}, 2.5)
    with pytest.raises(ValueError, match="is not a remat policy"):
        costs.Setup.of(STRATEGIES["FSDP"], {"data": 2}, 1, "some")
    with pytest.raises(ValueError, match="no hardware named 'A99'"):
        costs.hardware("A99")
    with pytest.raises(ValueError, match="automatic FSDP"):
        from nnxscale.placement.rules import auto_fsdp

        costs.derive(auto_fsdp())


def test_activations_split_along_the_sequence() -> None:
    whole = costs.activation_bytes(TINY, 4, 32)
    for c in (2, 4, 8):
        assert costs.activation_bytes(TINY, 4, 32, context=c) * c == whole
    tp = costs.activation_bytes(TINY, 4, 32, model=2)
    sp = costs.activation_bytes(TINY, 4, 32, model=2, sequence_parallel=True)
    assert tp - sp == TINY.layers * 4 * 32 * 4 * TINY.embed / 2 * 4  # 4E values, half
    dense = costs.activation_bytes(TINY, 4, 32, flash=False)
    assert dense - whole == TINY.layers * 4 * 32 * TINY.heads * 32 * 4  # the H s scores


def test_hsdp_sends_only_a_shard_across_replicas() -> None:
    run = trainer("HSDP", 8)
    report = collectives(run.compile(run.batch(BATCHES))).without_flags()
    groups = report.by_axes(run.layout.mesh)
    across = groups[("all-reduce", ("replica",))]
    inside = groups[("all-reduce", ("data",))]
    assert across * run.layout.mesh.shape["data"] == inside
    assert report.across_processes(run.layout.mesh).collectives == []  # one process here


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ZeRO-1", "ZeRO-2", "HSDP"])
def test_new_strategies_train_like_one_device(name: str) -> None:
    reference = trainer("DP", 1).train(BATCHES, 3)
    losses = trainer(name, 4).train(BATCHES, 3)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_remat_saves_activations_with_or_without_a_scan() -> None:
    """Per added sequence, a step with remat keeps less than 80% of what it keeps without,
    its layers scanned or unrolled. (jaxlib 0.10.2's CPU scheduler rebuilt an unrolled layer
    as early as it liked, and the step kept within 5% of what it kept without remat.)"""
    growth = {}
    for label, cfg in (
        ("none", PLAIN),
        ("unrolled", PLAIN.replace(remat=True)),
        ("scanned", PLAIN.replace(remat=True, scan_layers=True)),
    ):
        runs = [(trainer("DP", 1, cfg), Batches(CORPUS, rows, 32)) for rows in (8, 16)]
        small, large = (
            CompiledMemory.of(p).temp for p in compile_all([(run, run.batch(b)) for run, b in runs])
        )
        growth[label] = (large - small) / 8
    assert growth["unrolled"] < 0.8 * growth["none"]
    assert growth["scanned"] < 0.8 * growth["none"]


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, "full"])
def test_compiled_activations_lie_between_the_textbook_and_the_ledger(remat) -> None:
    """Per added sequence on one device, the compiled step keeps at least the textbook's
    least and at most the ledger's: what autodiff keeps, with one layer rebuilt under remat,
    and a layer's backward working set (`Costs.rebuilt`: the attention kernel's score blocks
    and the MLP's gradients)."""
    cfg = PLAIN.replace(scan_layers=bool(remat), remat=remat)
    runs = [(trainer("DP", 1, cfg), Batches(CORPUS, rows, 32)) for rows in (8, 16)]
    small, large = (
        CompiledMemory.of(p).temp for p in compile_all([(r, r.batch(b)) for r, b in runs])
    )
    derived = costs.derive(STRATEGIES["DP"], "float32", remat)
    one = costs.sizes_of(cfg, costs.Setup.of(STRATEGIES["DP"], {"data": 1}), 1, 32)
    kept = derived.activations + derived.rebuilt
    ledger = kept(one) - kept({**one, "batch": 0})
    textbook = costs.activation_bytes(cfg, 1, 32, remat=bool(remat))
    assert textbook <= (large - small) / 8 <= ledger


MIXTURE_CASES = [
    ("DP", MIXTURE, 1, 1), ("FSDP", MIXTURE, 8, 1), ("EP", MIXTURE, 8, 1), ("EP", MIXTURE, 8, 2),
    ("FSDP+EP", MIXTURE, 8, 1), ("EP", MIXTURE.replace(remat="full"), 8, 1),
    ("FSDP+EP", MIXTURE.replace(remat="dots", top_k=1, capacity_factor=1.25), 8, 1),
    ("TP", MIXTURE, 8, 1), ("FSDP+TP", MIXTURE.replace(remat="dots"), 8, 2),
    ("TP+SP", MIXTURE.replace(remat="full"), 8, 1),
    ("FSDP", DROPLESS, 8, 1), ("FSDP", DROPLESS.replace(top_k=1, remat="dots"), 8, 2),
    ("DP", DROPLESS.replace(remat="full"), 8, 1),
]  # fmt: skip


@pytest.fixture(scope="module")
def mixtures() -> list[tuple[str, Config, Trainer, jax.stages.Compiled]]:
    runs = [(name, cfg, trainer(name, n, cfg, micro)) for name, cfg, n, micro in MIXTURE_CASES]
    batches = Batches(CORPUS, 64, 32)
    programs = compile_all([(run, run.batch(batches)) for _, _, run in runs])
    return [(*run, program) for run, program in zip(runs, programs, strict=True)]


@pytest.mark.slow
def test_a_mixtures_flops_state_all_to_alls_and_peak_against_its_compiled_steps(mixtures) -> None:
    """Expert and tensor parallelism's rule sets priced like any other, and dropless
    mixtures under data parallelism and FSDP: matmul FLOPs (router, dispatch, experts,
    combine; a dropless mixture's blocks) and the state exact, the slots' all-to-alls array
    for array, and the peak within the tolerance, with and without remat and micro-batches. Under a
    tensor axis every device routes its tokens whole, more FLOPs than the step's share,
    unless sequence parallelism splits them."""
    low, high = TOLERANCE
    for name, cfg, run, program in mixtures:
        setup = setup_of(run, cfg)
        cost = costs.step_cost(cfg, setup, H100, 64, 32)
        share = costs.step_flops(cfg, 64, 32, remat=cfg.remat) / run.layout.mesh.size
        assert dot_flops(program) == cost.flops, name
        whole = name in ("TP", "FSDP+TP")
        assert (cost.flops > share) if whole else (cost.flops == share), name
        held = [p for p in run.layout.placements if p.shape and not p.dtype.startswith("key")]
        assert sum(p.bytes_per_device for p in held) == cost.state, name
        report = collectives(program)
        moved = [c for c in cost.collectives if c.transfer.kind == "all-to-all"]
        sizes = costs.sizes_of(cfg, setup, 64, 32)
        assert report.array_bytes("all-to-all") == sum(
            c.array_bytes * c.transfer.passes(sizes) for c in moved
        ), name
        assert report.bytes("all-to-all") == sum(c.sent for c in moved), name
        assert bool(moved) == ("EP" in name), name
        assert low <= compiled_peak(program) / cost.peak <= high, (name, cfg.remat)


@pytest.mark.slow
def test_a_mixture_under_tensor_parallelism_reduces_its_slots(mixtures) -> None:
    """The experts' down-projection leaves partial sums over `model` in the slots, which are
    all-reduced before the combine: the compiled step reduces arrays of exactly the slots'
    size, and at least the bytes of Megatron-LM's count (one all-reduce per product and
    pass; XLA:CPU reduces the gate's and the up-projection's input gradients apart)."""
    for name, cfg, run, program in mixtures:
        if "TP" not in name:
            continue
        mesh = run.layout.mesh
        cost = costs.step_cost(cfg, setup_of(run, cfg), H100, 64, 32)
        formula = [c for c in cost.collectives if c.transfer.axes == ("model",)]
        (slots,) = [c for c in formula if c.transfer.what == "experts' slots"]
        compiled = collectives(program).along(mesh, "all-reduce", ("model",))
        assert slots.array_bytes in {c.result_bytes for c in compiled}, name
        sent = sum(c.sent_bytes for c in compiled)
        assert sent >= sum(c.sent for c in formula), name


@pytest.mark.slow
def test_a_mixture_on_a_context_ring_computes_its_experts_on_every_device() -> None:
    """Why the cost model refuses a mixture under CP: the layer routes whole sequences, so
    the ring's devices sum their chunks' dispatches and each computes the same slots: the
    compiled step does more than half the whole model's matmul FLOPs on each of 8 devices."""
    run = trainer("CP", 8, MIXTURE)
    program = run.compile(run.batch(Batches(CORPUS, 64, 32)))
    assert "every device of the ring" in costs.unpriced(STRATEGIES["CP"], 2)
    assert dot_flops(program) > costs.step_flops(MIXTURE, 64, 32) / 2


@pytest.mark.slow
def test_a_mixtures_unscanned_layers_keep_less_than_the_ledger() -> None:
    """A Python loop of layers lets XLA fuse the experts' GELU and keep its input alone: the
    compiled peak lies below the scanned model's ledger (the planner's), on the safe side."""
    cfg = MIXTURE.replace(scan_layers=False)
    run = trainer("EP", 8, cfg)
    got = compiled_peak(run.compile(run.batch(Batches(CORPUS, 64, 32))))
    assert got < costs.step_cost(cfg, setup_of(run, cfg), H100, 64, 32).peak


def test_a_dropless_mixture_is_priced_without_expert_or_tensor_axes() -> None:
    """Its exchange of copies (EP) and its blocks' partial sums (TP) are not traced; shared
    experts' FLOPs are priced (`step_flops`), not their state: each refused by name."""
    kind = activations.mixture(DROPLESS)
    assert kind == 4 and activations.mixture(DROPLESS.replace(top_k=1)) == 3
    for name in ("FSDP", "HSDP"):
        assert costs.unpriced(STRATEGIES[name], kind) == ""
    assert costs.unpriced(STRATEGIES["PP+FSDP"], kind, "1F1B") == ""
    for name in ("EP", "FSDP+EP", "TP", "FSDP+TP", "PP+FSDP+EP"):
        assert "not price for a dropless mixture" in costs.unpriced(STRATEGIES[name], kind, "1F1B")
    setup = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8})
    shared = DROPLESS.replace(shared_experts=1)
    assert costs.unsuitable(shared, setup, 8, 32).startswith("shared_experts=1: the cost model")
    with pytest.raises(ValueError, match="price the mixture without them"):
        costs.step_cost(shared, setup, H100, 8, 32)


def test_a_mixture_is_priced_without_context_axes() -> None:
    for name in ("FSDP+EP", "TP", "FSDP+TP"):
        assert costs.unpriced(STRATEGIES[name], 2) == ""
    for name in ("CP", "FSDP+CP", "PP+FSDP+CP+TP"):
        assert "does not price for a mixture of experts" in costs.unpriced(STRATEGIES[name], 1)
        with pytest.raises(ValueError, match="use data, FSDP, expert, tensor and pipeline"):
            costs.derive(STRATEGIES[name], moe=1, schedule="1F1B")
    for name in ("PP", "PP+FSDP+EP"):  # the book's executor returns no auxiliary loss
        assert "lockstep executor does not" in costs.unpriced(STRATEGIES[name], 1)
        assert costs.unpriced(STRATEGIES[name], 1, "1F1B") == ""
    setup = costs.Setup.of(STRATEGIES["EP"], {"expert": 8})
    assert costs.unsuitable(MIXTURE.replace(experts=6), setup, 8, 32).startswith(
        "the expert axis (8) does not divide experts (6)"
    )


@pytest.mark.parametrize("schedule, remat", [("1F1B", False), ("1F1B", "full"), ("ZB-V", "dots")])
def test_a_mixture_in_pipeline_stages_is_priced_as_its_layers_outside_them(schedule, remat) -> None:
    """PP+FSDP+EP at Mixtral's sizes: the state per device is the layout's, resolved on an
    abstract mesh; the FLOPs are the step's over the devices; each device's all-to-alls
    carry what FSDP+EP's carry with the stages folded into `data` (a quarter of the layers
    for four times the tokens), and the stages hand over what a dense model's do."""
    cfg = MIXTRAL_8X7B.replace(capacity_factor=1.25, max_len=4096)
    shape, batch = {"stage": 4, "fsdp": 8, "expert": 8}, 1024
    rules = STRATEGIES["PP+FSDP+EP"]
    setup = costs.Setup.of(rules, shape, 16, remat, schedule=schedule)
    assert costs.unsuitable(cfg, setup, batch, 4096) == ""
    cost = costs.step_cost(cfg, setup, H100, batch, 4096)
    mesh = AbstractMesh(tuple(shape.values()), rules.axes, axis_types=(AxisType.Auto,) * 3)
    params = nnx.state(abstract(lambda: create(cfg)), nnx.Param)
    layout = resolve(params, rules, mesh, warn_bytes=math.inf)
    assert cost.memory["parameters"] == layout.bytes_per_device()
    assert cost.flops == costs.step_flops(cfg, batch, 4096, remat=remat) / 256
    folded = costs.Setup.of(STRATEGIES["FSDP+EP"], {"data": 32, "expert": 8}, 4, remat)
    outside = costs.step_cost(cfg, folded, H100, batch, 4096)

    def sent(c: costs.StepCost, kind: str) -> float:
        return sum(x.sent for x in c.collectives if x.transfer.kind == kind)

    assert sent(cost, "all-to-all") == sent(outside, "all-to-all") > 0
    dense = costs.step_cost(cfg.replace(experts=0), setup, H100, batch, 4096)
    assert sent(cost, "collective-permute") == sent(dense, "collective-permute") > 0


def test_the_ledger_holds_the_four_parts_of_the_state_and_the_step() -> None:
    setup = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8}, 1, "full")
    parts = costs.ledger(LLAMA3_8B, setup, 8, 4096)
    step = costs.step_cost(LLAMA3_8B, setup, H100, 8, 4096)
    assert tuple(parts) == costs.LEDGER_PARTS
    assert parts["parameters"] + parts["optimizer state"] == step.state
    assert parts["gradients"] == costs.STATE_BYTES * costs.counts(LLAMA3_8B).total / 8
    assert parts["optimizer state"] == costs.OPTIMIZER_COPIES * parts["gradients"]
    # what the backward pass keeps and remat rebuilds: part of the working memory, not all
    assert 0 < parts["activations"] < step.memory["working memory"]


def test_the_full_remat_ledger_term_by_term_keeps_korthikantis_2sbhl() -> None:
    """With full recompute each layer keeps only its 16-bit input, 2 s b h L bytes
    (Korthikanti et al. 2022, section 5); the terms add up to the ledger's activations."""
    setup = costs.Setup.of(STRATEGIES["DP"], {"data": 1}, 1, "full")
    for sequences, seq in ((1, 4096), (2, 1024)):
        terms = costs.ledger_terms(LLAMA3_8B, setup, sequences, seq)
        sbhl = 2 * seq * sequences * LLAMA3_8B.embed * LLAMA3_8B.layers
        assert terms["the layers' kept values"] == sbhl
        assert terms["logits"] == 4 * sequences * seq * LLAMA3_8B.vocab
        whole = costs.ledger(LLAMA3_8B, setup, sequences, seq)["activations"]
        assert sum(terms.values()) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("name", list(costs.PRECISIONS))
def test_the_state_holds_the_bytes_per_parameter_the_reader_chose(name: str) -> None:
    precision = costs.PRECISIONS[name]
    setup = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8}, 1, "full", precision)
    ledger = costs.ledger(LLAMA3_8B, setup, 8, 4096)
    per_parameter = {k: 8 * v / costs.counts(LLAMA3_8B).total for k, v in ledger.items()}
    assert per_parameter["parameters"] == pytest.approx(precision.parameters)
    assert per_parameter["optimizer state"] == pytest.approx(precision.optimizer)
    assert per_parameter["gradients"] == pytest.approx(precision.gradients)
    book = costs.step_cost(
        LLAMA3_8B, setup.__class__.of(setup.rules, setup.sizes, 1, "full"), H100, 8, 4096
    )
    assert costs.step_cost(LLAMA3_8B, setup, H100, 8, 4096).state <= book.state


def test_a_precision_of_nonsense_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes per parameter must be finite"):
        costs.Precision(moments=-8)
    with pytest.raises(ValueError, match="gradients' positive"):
        costs.Precision(gradients=0)


@pytest.mark.parametrize("name", ["DP", "FSDP"])
def test_gradients_reduced_once_a_step_are_priced_as_unreduced_grads_runs(name: str) -> None:
    """`Setup(reduce_once=True)`: one reduction of P bytes a step instead of one per
    micro-batch, exposed (nothing follows it); FSDP holds the weights whole for the step,
    DP already does."""
    priced = {}
    for once in (False, True):
        setup = costs.Setup.of(STRATEGIES[name], {"data": 8}, 4, reduce_once=once)
        sizes = costs.sizes_of(PLAIN, setup, 32, 32)
        cost = costs.step_cost(PLAIN, setup, H100, 32, 32)
        grads = [c for c in cost.collectives if c.transfer.what == "gradients"]
        reduced = sum(c.array_bytes * c.transfer.passes(sizes) for c in grads)
        priced[once] = (reduced, cost, grads)
    p = costs.STATE_BYTES * costs.counts(PLAIN).total
    assert priced[True][0] == p and priced[False][0] == 4 * p
    assert all(c.exposed == c.seconds for c in priced[True][2])
    grew = priced[True][1].peak > priced[False][1].peak
    assert grew == (name == "FSDP")


def test_a_measured_step_calibrates_the_efficiency_that_reproduces_it() -> None:
    setup, hw = costs.Setup.of(STRATEGIES["DP"], {"data": 1}), costs.hardware("H100")
    with pytest.raises(
        ValueError, match=r"launch its layers \(0.00436 s, `launched`\) at any efficiency above"
    ):
        costs.fitted_efficiency(hw.launch * 2, TINY, setup, hw, 16)  # TINY's two layers
    hw = hw.replace(launch=0.0)
    target = costs.step_cost(TINY, setup, hw, 16, efficiency=0.37).step_time
    fitted = costs.fitted_efficiency(target, TINY, setup, hw, 16)
    assert fitted == pytest.approx(0.37, rel=1e-9)
    fastest = costs.step_cost(TINY, setup, hw, 16, efficiency=1.0).step_time
    with pytest.raises(ValueError, match="faster than the time model at H100's peak"):
        costs.fitted_efficiency(0.5 * fastest, TINY, setup, hw, 16)
