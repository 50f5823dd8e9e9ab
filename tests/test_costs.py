"""The cost model against the book's Transformer, its layouts and its compiled programs."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import optax
import pytest

from nnxscale import calculator, costs
from nnxscale.comm import ring_bytes
from nnxscale.data import Batches, arithmetic_text, encode
from nnxscale.hlo import collectives, dot_flops
from nnxscale.memory import CompiledMemory
from nnxscale.model import TINY, Config, count_params, create
from nnxscale.rules import STRATEGIES, strategy_mesh
from nnxscale.train import Trainer

BATCHES = Batches(encode(arithmetic_text(2000)), batch_size=8, length=32)
H100 = costs.HARDWARE["H100"]


def trainer(name: str, devices: int, cfg: Config = TINY) -> Trainer:
    rules = STRATEGIES[name]
    mesh = strategy_mesh(rules, devices)
    return Trainer.create(create(cfg), optax.adam(1e-3), rules, mesh, dropout=False)


def test_fast_compile_changes_no_count() -> None:
    from nnxscale.train import FAST_COMPILE

    programs = []
    for options in (None, FAST_COMPILE):
        rules = STRATEGIES["FSDP+TP"]
        run = Trainer.create(
            create(TINY), optax.adam(1e-3), rules, strategy_mesh(rules, 4),
            compiler_options=options,
        )  # fmt: skip
        programs.append(run.compile(BATCHES(0, run.batch)))
    slow, fast = programs
    assert CompiledMemory.of(slow) == CompiledMemory.of(fast)
    assert collectives(slow).summary() == collectives(fast).summary()
    assert dot_flops(slow) == dot_flops(fast)


@pytest.mark.parametrize(
    "cfg", [TINY, TINY.replace(layers=3, mlp=96, heads=2, vocab=40, max_len=16)]
)
def test_counts_match_the_model(cfg: Config) -> None:
    assert costs.counts(cfg).total == count_params(create(cfg))


def test_the_worked_models_have_their_sizes() -> None:
    assert round(costs.counts(costs.SEVEN_B).total / 1e9, 1) == 6.7
    assert round(costs.counts(costs.SEVENTY_B).total / 1e9) == 70


@pytest.mark.parametrize("name", ["DP", "ZeRO-1", "ZeRO-2", "FSDP", "TP", "FSDP+TP", "HSDP"])
def test_the_ledger_equals_the_placed_state(name: str) -> None:
    run = trainer(name, 4)
    mesh = dict(run.layout.mesh.shape)
    cost = costs.step_cost(TINY, name, 4, H100, 8, 32, mesh=mesh)
    arrays = [p for p in run.layout.placements if p.shape and not p.dtype.startswith("key")]
    placed = sum(p.bytes_per_device for p in arrays)
    assert placed == cost.memory["parameters"] + cost.memory["optimizer state"]


def test_matmul_flops_equal_the_compiled_dots() -> None:
    from nnxscale.train import compile_all

    configs = (TINY, TINY.replace(scan_layers=True, remat=True))
    runs = [trainer("DP", 1, cfg) for cfg in configs]
    programs = compile_all([(run, BATCHES(0, run.batch)) for run in runs])
    assert programs[0] is runs[0].compiled and programs[1] is runs[1].compiled
    for cfg, program in zip(configs, programs, strict=True):
        assert dot_flops(program) == costs.step_flops(cfg, 8, 32, remat=cfg.remat)


def test_dp_and_zero_bytes_against_the_compiled_steps() -> None:
    full = costs.counts(TINY).total * costs.STATE_BYTES
    for name in ("DP", "ZeRO-2"):
        run = trainer(name, 4)
        report = collectives(run.compile(BATCHES(0, run.batch)))
        (transfer, *_) = costs.transfers(TINY, name, {"data": 4}, 8, 32)
        if name == "DP":
            assert report.array_bytes("all-reduce") == transfer.array_bytes + 4  # the loss
        else:
            assert report.array_bytes("all-gather") == full
            reduced = report.bytes("all-reduce") + report.bytes("reduce-scatter")
            assert ring_bytes("reduce-scatter", full, 4) <= reduced
            assert reduced <= ring_bytes("all-reduce", full + 4, 4)


def test_zero2_splits_the_accumulated_gradients() -> None:
    """With micro-batches the running sum of gradients lives across the step: ZeRO-2 holds a
    1/N slice of it where DP holds it whole."""
    temps = {}
    for name in ("DP", "ZeRO-2"):
        rules = STRATEGIES[name]
        run = Trainer.create(
            create(TINY),
            optax.adam(1e-3),
            rules,
            strategy_mesh(rules, 4),
            dropout=False,
            micro_batches=2,
        )
        temps[name] = CompiledMemory.of(run.compile(BATCHES(0, run.batch))).temp
    full = costs.counts(TINY).total * costs.STATE_BYTES
    saving = temps["DP"] - temps["ZeRO-2"]
    assert saving == pytest.approx(3 / 4 * full, rel=0.01)


def test_a_custom_gradient_function_cannot_run_zero2() -> None:
    rules = STRATEGIES["ZeRO-2"]
    with pytest.raises(ValueError, match="places the gradients apart"):
        Trainer.create(
            create(TINY),
            optax.adam(1e-3),
            rules,
            strategy_mesh(rules, 2),
            grads_fn=lambda model, batch, key, micro: (0.0, None),
        )


@pytest.mark.parametrize("name", ["ZeRO-1", "ZeRO-2", "HSDP"])
def test_new_strategies_train_like_one_device(name: str) -> None:
    reference = trainer("DP", 1).train(BATCHES, 3)
    losses = trainer(name, 4).train(BATCHES, 3)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)


def test_activations_lie_between_the_formula_and_autodiff() -> None:
    from flax import nnx

    from nnxscale.losses import next_token_loss
    from nnxscale.memory import saved_bytes

    graphdef, params, rest = nnx.split(create(TINY), nnx.Param, ...)

    def saved_for(tokens):
        return saved_bytes(
            lambda p: next_token_loss(nnx.merge(graphdef, p, rest), tokens, None), params
        )

    temps, saved = [], []
    for rows in (4, 8):
        run = trainer("DP", 1)
        batch = Batches(encode(arithmetic_text(2000)), batch_size=rows, length=32)
        temps.append(CompiledMemory.of(run.compile(batch(0, run.batch))).temp)
        saved.append(saved_for(batch.rows(0)))
    compiled = (temps[1] - temps[0]) / 4
    assert costs.activation_bytes(TINY, 1, 32) <= compiled <= (saved[1] - saved[0]) / 4


def test_transfers_follow_the_ring_formulas() -> None:
    mesh = {"data": 4, "model": 2}
    full = costs.counts(TINY).total * 4
    sent = {
        name: sum(x.sent(mesh) for x in costs.transfers(TINY, name, mesh, 8, 32))
        for name in ("DP", "ZeRO-1", "FSDP")
    }
    assert sent["DP"] == pytest.approx(2 * 3 / 4 * full)
    assert sent["ZeRO-1"] == pytest.approx(sent["DP"])
    assert sent["FSDP"] == pytest.approx(1.5 * sent["DP"])
    hsdp = costs.transfers(TINY, "HSDP", {"replica": 2, "data": 4}, 8, 32)
    assert [x.axis for x in hsdp] == ["data", "data", "replica"]
    assert hsdp[-1].array_bytes == full / 4


def test_links_are_fast_inside_a_domain_and_slow_across() -> None:
    mesh = {"replica": 4, "data": 8}
    assert costs.link_bandwidth("data", mesh, H100) == H100.fast
    assert costs.link_bandwidth("replica", mesh, H100) == H100.slow
    assert costs.mesh_for("HSDP", 32, H100) == {"replica": 4, "data": 8}
    assert costs.mesh_for("HSDP", 8, H100) == {"replica": 1, "data": 8}


def test_step_time_is_compute_or_communication() -> None:
    cost = costs.step_cost(costs.SEVEN_B, "FSDP", 8, H100, 64, 4096, remat=True)
    assert cost.step_time == max(cost.compute_time, cost.comm_time)
    serial = costs.step_cost(costs.SEVEN_B, "FSDP", 8, H100, 64, 4096, remat=True, overlap=False)
    assert serial.step_time == pytest.approx(cost.compute_time + cost.comm_time)
    flops = costs.step_flops(costs.SEVEN_B, 64, 4096, remat=True) / 8
    assert cost.compute_time == pytest.approx(flops / (H100.flops * costs.EFFICIENCY))
    crossover = costs.fsdp_crossover(costs.SEVEN_B, H100)
    small = costs.step_cost(costs.SEVEN_B, "FSDP", 8, H100, 8, int(crossover / 2) // 8 * 8)
    assert small.bound == "communication"


def test_pipeline_bubble_in_the_time_model() -> None:
    cost = costs.step_cost(costs.SEVEN_B, "PP", 8, H100, 64, 4096, remat=True)
    assert cost.bubble == pytest.approx(7 / (32 + 7))


def test_the_planner_ranks_what_fits_and_says_why_the_rest_does_not() -> None:
    plan = costs.plan(costs.SEVEN_B, 8, "H100", global_batch=64, seq=4096)
    assert plan.best.strategy == "ZeRO-2"
    assert "needs" in plan["DP"].reason and "GB" in plan["DP"].reason
    times = [o.cost.step_time for o in plan.ranked]
    assert times == sorted(times)
    odd = costs.plan(costs.SEVENTY_B, 256, "TPU v5p", global_batch=1000, seq=4096)
    assert "does not split" in odd["FSDP"].reason
    assert "stages do not divide 80 layers" in odd["PP"].reason
    assert "| rank |" in plan._repr_markdown_()
    tiny = costs.plan(TINY, 8, "H100", memory_per_device=1e3, global_batch=8, seq=32)
    with pytest.raises(ValueError, match="no strategy fits"):
        _ = tiny.best


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match="no cost model for strategy 'ZeRO-4'"):
        costs.step_cost(TINY, "ZeRO-4", 8, H100, 8)
    with pytest.raises(ValueError, match="has 4 devices, not 8"):
        costs.step_cost(TINY, "FSDP", 8, H100, 8, mesh={"data": 4})


def test_calculator_carries_the_library_constants() -> None:
    spec = calculator.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert [h["name"] for h in spec["hardware"]] == list(costs.HARDWARE)
    assert spec["constants"]["STATE_BYTES"] == costs.STATE_BYTES
    markup = calculator.widget()._repr_html_()
    assert "nnxscaleCalculator" in markup and 'name="strategy"' in markup
    assert math.isclose(spec["constants"]["EFFICIENCY"], costs.EFFICIENCY)


def test_hsdp_sends_only_a_shard_across_replicas() -> None:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    run = trainer("HSDP", 8)
    report = collectives(run.compile(BATCHES(0, run.batch)))
    groups = report.by_axes(run.layout.mesh)
    across = groups[("all-reduce", ("replica",))]
    inside = groups[("all-reduce", ("data",))]
    assert across * run.layout.mesh.shape["data"] == inside


def test_activations_split_along_the_sequence() -> None:
    from nnxscale.model import TINY

    whole = costs.activation_bytes(TINY, 4, 32)
    for c in (2, 4, 8):
        assert costs.activation_bytes(TINY, 4, 32, context=c) * c == whole
    tp = costs.activation_bytes(TINY, 4, 32, model=2)
    sp = costs.activation_bytes(TINY, 4, 32, model=2, sequence_parallel=True)
    assert tp - sp == TINY.layers * 4 * 32 * 4 * TINY.embed / 2 * 4  # 4E values, half
    flash = costs.activation_bytes(TINY, 4, 32, flash=True)
    assert whole - flash == TINY.layers * 4 * 32 * TINY.heads * 32 * 4  # the H s scores


def test_a_ring_hop_hides_its_transfer_above_a_chunk_length() -> None:
    h100 = costs.HARDWARE["H100"]
    c = costs.ring_hop_tokens(h100)
    # a hop: 4 c^2 H D FLOPs at EFFICIENCY of peak against 2 c H D bf16 values on one link
    for chunk in (c / 2, c, 2 * c):
        compute = 4 * chunk**2 / (h100.flops * costs.EFFICIENCY)
        send = 2 * chunk * 2 / h100.fast
        assert (compute >= send) == (chunk >= c) or abs(compute - send) < 1e-15
    assert round(c) == 1099
