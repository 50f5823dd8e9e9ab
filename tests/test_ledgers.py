"""The two memory ledgers (`nnxscale.costs.ledgers`): this library's program, and a trainer
with fused kernels, against the field's formulas and a layout that ran."""

from __future__ import annotations

import pytest

from nnxscale import costs
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_405B
from nnxscale.placement.catalogue import STRATEGIES

DP = STRATEGIES["DP"]


def kept(ledger: str, remat: bool | str = False, seq: int = 4096, **setup) -> float:
    """The bytes Llama 3 8B's layers keep for one sequence under `ledger`."""
    chosen = costs.Setup.of(DP, {"data": 1}, 1, remat, ledger=ledger, **setup)
    return costs.ledger_terms(LLAMA3_8B, chosen, 1, seq)["the layers' kept values"]


def test_the_fused_layer_keeps_korthikantis_34_sbh() -> None:
    """Llama 3 8B's fused layer keeps 4E + 2HD + 2KD + 3F values per token in bfloat16,
    which for its shape is exactly Korthikanti et al.'s 34 s b h (flash attention keeps no
    score, only a float32 log-sum-exp per query and head); this library's program keeps
    2.3 times as much (float32 norm intermediates, unfused SwiGLU products)."""
    s, h, heads, layers = 4096, LLAMA3_8B.embed, LLAMA3_8B.heads, LLAMA3_8B.layers
    lse = 4 * s * heads * layers
    assert kept("fused") == 34 * s * h * layers + lse
    assert kept("fused") == pytest.approx(18.27e9, rel=1e-3)  # the "about 18 GB"
    assert kept("program") / kept("fused") == pytest.approx(2.26, abs=0.01)


def test_the_dots_policy_keeps_the_products_outputs_and_full_remat_the_inputs() -> None:
    """Under the dots policy a layer keeps its input and the two output projections' outputs
    (3E), queries, keys, values and attention's output (2HD + 2KD), gate and up (2F); under
    full remat, its input alone (E)."""
    c, s = LLAMA3_8B, 4096
    e, hd, kd, f = c.embed, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.mlp
    lse = 4 * s * c.heads
    assert kept("fused", "dots") == c.layers * (2 * s * (3 * e + 2 * hd + 2 * kd + 2 * f) + lse)
    assert kept("fused", "full") == c.layers * 2 * s * e


def test_sequence_parallelism_splits_the_stream_and_kept_gathers_stay_whole() -> None:
    """FSDP+TP+SP over 8: the residual stream's values split over the tensor axis too; a
    trainer that keeps each product's gathered input (`regather=False`) holds 2E per token
    more, whole."""
    c, s = LLAMA3_8B, 4096
    mesh = {"data": 1, "model": 8}

    def layers(rules: str, regather: bool = True) -> float:
        setup = costs.Setup.of(STRATEGIES[rules], mesh, ledger="fused", regather=regather)
        return costs.ledger_terms(c, setup, 1, s)["the layers' kept values"]

    plain, split = layers("FSDP+TP"), layers("FSDP+TP+SP")
    assert plain - split == pytest.approx(c.layers * 2 * s * 4 * c.embed * (1 - 1 / 8))
    assert layers("FSDP+TP+SP", regather=False) - split == c.layers * 2 * s * 2 * c.embed


def test_a_loss_on_float32_logits_keeps_two_float32_copies_more() -> None:
    c, s = LLAMA3_8B, 4096
    logits = {
        loss: costs.ledger_terms(
            c, costs.Setup.of(DP, {"data": 1}, ledger="fused", loss=loss), 1, s
        )["logits"]
        for loss in costs.LOSSES
    }
    assert logits["fused"] == 2 * s * c.vocab
    assert logits["float32"] == (2 + 8) * s * c.vocab
    with pytest.raises(ValueError, match="loss='soft'"):
        costs.Setup.of(DP, {"data": 1}, loss="soft")


def test_meta_layout_fits_80_gb_under_the_fused_ledger_and_not_the_programs() -> None:
    """Llama 3 405B at 8k tokens as Meta ran it (16 stages of 1F1B, FSDP 64, TP 8 with
    sequence parallelism, one sequence a micro-batch, no activation checkpointing): the
    fused ledger's peak fits the 80 GB it ran in; this library's program would need more
    than three times as much."""
    mesh = {"stage": 16, "fsdp": 64, "model": 8}
    rules = STRATEGIES["PP+FSDP+TP"]
    peak = {}
    for ledger in costs.LEDGERS:
        setup = costs.Setup.of(rules, mesh, 32, False, costs.PLANNING, "1F1B", ledger=ledger)
        peak[ledger] = costs.step_cost(LLAMA3_405B, setup, "H100", 2048, 8192).peak
    assert peak["fused"] <= 80 * 2**30 and peak["program"] > 3 * peak["fused"]


def test_the_fused_ledger_prices_pipelines_as_frameworks_run_them() -> None:
    """One program per stage: the first stage holds its micro-batches in flight, the last
    its one micro-batch and the loss; the book's lockstep executor is the program's alone."""
    mesh = {"stage": 4, "fsdp": 2}
    rules = STRATEGIES["PP+FSDP"]
    setup = costs.Setup.of(rules, mesh, 8, False, schedule="1F1B", ledger="fused")
    phases = costs.step_cost(LLAMA3_8B, setup, "H100", 16, 4096).phases
    assert set(phases) == {
        "the first stage's backward starts",
        "the last stage's backward starts",
        "a layer's backward",
        "update",
    }
    first, last = (
        phases["the first stage's backward starts"],
        phases["the last stage's backward starts"],
    )
    assert first > last  # four micro-batches of eight layers against one, and the logits
    lockstep = costs.Setup.of(rules, mesh, 8, ledger="fused")
    assert "ledger='program'" in costs.unsuitable(LLAMA3_8B, lockstep, 16, 4096)


def test_a_fused_optimizer_updates_in_place_from_one_gradient_buffer() -> None:
    """The fused ledger's update holds the gradients once (the buffer that summed the
    micro-batches); the program's, the gradients, their running sum and the update."""
    update = {}
    for ledger in costs.LEDGERS:
        setup = costs.Setup.of(DP, {"data": 1}, 4, ledger=ledger)
        update[ledger] = costs.step_cost(LLAMA3_8B, setup, "H100", 4, 4096).phases["update"]
    grads = 4 * costs.counts(LLAMA3_8B).total
    assert update["fused"] == grads and update["program"] == 3 * grads
