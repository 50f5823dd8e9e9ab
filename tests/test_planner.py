"""The planner: its search, its verdicts, and the input it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from nnxscale import TINY, costs, plan, planner
from nnxscale.evidence import runs, table
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_405B
from nnxscale.placement.catalogue import STRATEGIES


@pytest.fixture(scope="module")
def seven() -> planner.Plan:
    return plan(LLAMA3_8B, 8, "H100", global_batch=64, seq=4096)


def test_every_factorisation_is_tried() -> None:
    assert sorted(planner.factorisations(8, 2)) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert len(list(planner.factorisations(256, 3))) == 45  # (8 + 2 choose 2)


def test_tensor_parallelism_stays_inside_a_host() -> None:
    meshes = list(planner.meshes(STRATEGIES["TP"], 64, domain=8))
    assert {m["model"] for m in meshes} == {2, 4, 8}
    assert all(m["data"] * m["model"] == 64 for m in meshes)


def test_a_fitting_plan_fits_with_the_headroom(seven: planner.Plan) -> None:
    assert seven.ranked and seven.best.fits
    for option in seven.ranked:
        assert option.cost.peak * planner.HEADROOM <= 72e9  # a tuned trainer's 90% of 80 GB
    times = [o.cost.step_time for o in seven.ranked]
    assert times == sorted(times)
    assert {o.strategy for o in seven.ranked} >= {"FSDP", "FSDP+TP", "TP"}


def test_a_gpu_plan_fits_the_share_its_runtime_gives_and_says_so(seven: planner.Plan) -> None:
    """Planned for a tuned trainer (the fused ledger), a GPU gives arrays 90% of its memory;
    planned for this library's own program, JAX's default 75%: ZeRO-2 and the pipeline fit
    an H100's 80 GB but not its 60, and the plan names the variable that changes it."""
    assert seven.memory == 0.9 * 80e9 and "a tuned trainer's 90%" in seven._repr_markdown_()
    assert "by the fused ledger" in seven._repr_markdown_()
    own = plan(LLAMA3_8B, 8, "H100", global_batch=64, seq=4096,
                       ledger="program", precision=costs.Precision())  # fmt: skip
    assert own.memory == 0.75 * 80e9 and not own["ZeRO-2"].fits and not own["PP"].fits
    assert "JAX's default 75%" in own._repr_markdown_()
    assert "XLA_CLIENT_MEM_FRACTION" in own._repr_markdown_()
    whole = plan(LLAMA3_8B, 8, "H100", global_batch=64, seq=4096,
                         memory_per_device=80e9, ledger="program",
                         precision=costs.Precision())  # fmt: skip
    assert whole["ZeRO-2"].fits and whole["PP"].fits
    assert "XLA_CLIENT_MEM_FRACTION" not in whole._repr_markdown_()
    tpu = plan(LLAMA3_8B, 8, "TPU v5p", global_batch=64, seq=4096)
    assert tpu.memory == costs.HARDWARE["TPU v5p"].memory


def test_rejections_name_the_leanest_option_and_the_memory(seven: planner.Plan) -> None:
    assert seven.rejected["DP"].startswith("needs 133.1 GB per device at its leanest (DP on data 8")
    assert "of 72 GB" in seven.rejected["DP"]
    assert "| rank |" in seven._repr_markdown_()
    with pytest.raises(KeyError, match="no option of rule set 'ZeRO-1'"):
        seven["ZeRO-1"]


def test_the_planner_searches_degrees_micro_batches_and_remat(seven: planner.Plan) -> None:
    tp = [o for o in seven.options if o.strategy == "TP" and o.cost]
    assert {dict(o.setup.mesh)["model"] for o in tp} == {2, 4, 8}
    assert {o.setup.remat for o in tp} == {False, "dots", "full"}
    assert {o.setup.micro_batches for o in tp} >= {1, 2, 4, 8}
    pp = [o for o in seven.options if o.strategy == "PP"]
    assert all(o.setup.micro_batches >= 8 for o in pp)  # 1F1B: a micro-batch per stage


def test_a_model_too_large_for_any_plan_says_why() -> None:
    tiny_memory = plan(TINY, 8, "H100", global_batch=8, seq=32, memory_per_device=1e3)
    with pytest.raises(ValueError, match="no plan fits 8 x H100") as error:
        _ = tiny_memory.best
    assert "FSDP: needs" in str(error.value)


def test_a_device_count_that_divides_nothing_gets_reasons() -> None:
    odd = plan(LLAMA3_8B, 7, "H100", global_batch=7, seq=4096)
    assert odd.rejected["FSDP"].startswith("the data axis (7) does not divide")
    assert "does not divide" in odd.rejected["TP"] or "does not split" in odd.rejected["TP"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=0), "devices must be a positive integer"),
        (dict(devices=2.5), "devices must be a positive integer"),
        (dict(global_batch=0), "global_batch must be a positive integer"),
        (dict(seq=-1), "seq must be a positive integer"),
        (dict(seq=16384), "exceeds the model's max_len"),
        (dict(hw="A99"), "no hardware named 'A99'"),
        (dict(memory_per_device=-1.0), "memory_per_device must be positive"),
        (dict(strategies=["ZeRO-4"]), "no rule set named 'ZeRO-4'"),
        (dict(cfg=dict(experts=-1)), "experts=-1: use 0 for a dense MLP"),
        (dict(cfg=dict(experts=2, top_k=3)), "top_k=3 with 2 experts"),
        (dict(cfg=dict(experts=2, capacity_factor=0.0)), "capacity factor must"),
    ],
)
def test_bad_input_is_refused_with_the_fix(kwargs: dict, message: str) -> None:
    """A mixture that cannot run (`cfg`: the changes to the model) is refused when the
    `Config` is made, before anything is priced."""
    args = dict(cfg={}, devices=8, hw="H100", global_batch=64, seq=4096)
    args.update(kwargs)
    changes, devices, hw = args.pop("cfg"), args.pop("devices"), args.pop("hw")
    with pytest.raises(ValueError, match=message):
        plan(LLAMA3_8B.replace(**changes), devices, hw, **args)


def test_a_setup_says_itself_in_words() -> None:
    fsdp = costs.Setup.of(STRATEGIES["FSDP"], {"data": 8}, 4, "dots")
    assert fsdp.describe() == "FSDP on data 8, 4 micro-batches, the dots policy"
    one = costs.Setup.of(STRATEGIES["DP"], {"data": 1}, 1, True)
    assert one.describe() == "DP on one device, 1 micro-batch, full remat"


MIXTURE = LLAMA3_8B.replace(experts=8, top_k=2, capacity_factor=1.25, mlp=21504)


def test_a_mixture_is_planned_with_expert_parallelism() -> None:
    """A mixture adds EP, FSDP+EP and PP+FSDP+EP, whose meshes put experts on an `expert`
    axis that divides them; rule sets the cost model does not price for a mixture (context
    axes) are not tried, and a plan that names one says why; pipelines are priced on 1F1B,
    not on the book's lockstep executor (nor, unless asked, on zero-bubble schedules)."""
    mixed = plan(MIXTURE, 64, "H100", global_batch=512, seq=4096)
    assert planner.planned(MIXTURE) == (
        *("DP", "ZeRO-2", "FSDP", "HSDP", "TP", "FSDP+TP", "PP", "PP+FSDP", "PP+FSDP+TP"),
        *("EP", "FSDP+EP", "PP+FSDP+EP"),
    )
    staged = [o for o in mixed.options if o.strategy.startswith("PP") and o.cost]
    assert staged and all(o.setup.schedule == "1F1B" for o in staged)
    tried = {o.strategy for o in mixed.options}
    assert {"EP", "FSDP+EP", "TP"} <= tried and "CP" not in tried
    ep = [o for o in mixed.options if o.strategy == "EP"]
    assert {dict(o.setup.mesh)["expert"] for o in ep if o.cost} == {1, 2, 4, 8}
    assert all("does not divide experts (8)" in o.reason for o in ep if not o.cost)
    assert mixed.best.fits and mixed.best.strategy in tried
    asked = plan(MIXTURE, 8, "H100", global_batch=64, seq=4096, strategies=["CP", "EP"])
    assert asked.rejected["CP"].startswith("rule set 'CP' splits the sequence")
    with pytest.raises(ValueError, match="CP: rule set 'CP' splits the sequence"):
        _ = plan(MIXTURE, 8, "H100", global_batch=64, seq=4096, strategies=["CP"]).best


def test_a_dropless_mixture_is_planned_without_expert_parallelism_and_says_why() -> None:
    """Dropless routing is priced under data parallelism, FSDP and pipelines; the rule sets
    with an expert or tensor axis are listed as rejected, each with the reason."""
    dropless = MIXTURE.replace(routing="dropless", expert_block=512)
    found = plan(dropless, 256, "H100", global_batch=1024, seq=4096)
    assert found.best.fits and found.best.strategy in ("DP", "ZeRO-2", "FSDP", "HSDP", "PP+FSDP")
    for name in ("EP", "FSDP+EP"):
        assert "not price for a dropless mixture" in found.rejected[name]
    assert "TP" not in {o.strategy for o in found.options}


@pytest.mark.parametrize("devices", [8, 64])
def test_a_4k_sequence_is_not_split_on_h100s(devices: int) -> None:
    """With blockwise attention a device does no more work per token on a whole sequence
    than a ring does on its chunk, so at 4,096 tokens splitting the sequence only adds
    hops: the fastest plan for Llama 3 8B keeps sequences whole (so did Llama 3's own
    pre-training at 8,192 tokens)."""
    found = plan(LLAMA3_8B, devices, "H100", global_batch=4 * devices, seq=4096)
    assert not planner.splits_the_sequence(found.best)
    assert any(planner.splits_the_sequence(o) for o in found.options if o.cost)  # CP priced


def test_context_parallelism_wins_once_sequences_are_long() -> None:
    lengths = [4096 * 2**i for i in range(4)]
    first, plans = planner.context_wins_from(LLAMA3_8B, 64, "H100", 1 << 21, lengths)
    assert first is not None and first > 4096
    assert planner.splits_the_sequence(plans[first].best)
    assert not any(planner.splits_the_sequence(plans[n].best) for n in lengths if n < first)


def test_the_headline_plans_are_what_practitioners_run_and_near_ones_are_tied() -> None:
    """Llama 3 8B at 4,096 tokens: FSDP on one host of eight H100s, hybrid sharding on
    eight hosts; options within `TIE` of the fastest are tied, and each loser says why."""
    practised = {"FSDP", "HSDP", "ZeRO-1", "ZeRO-2"}
    one = plan(LLAMA3_8B, 8, "H100", global_batch=64, seq=4096)
    eight = plan(LLAMA3_8B, 64, "H100", global_batch=512, seq=4096)
    assert one.best.strategy in practised and eight.best.strategy in practised
    for found in (one, eight):
        tied = found.tied
        assert tied[0] is found.best and len(tied) < len(found.ranked)
        limit = found.best.cost.step_time * planner.TIE
        assert all(o.cost.step_time <= limit for o in tied)
        assert all(o.cost.step_time > limit for o in found.ranked[len(tied) :])
        for option in found.ranked[1:]:
            assert found.behind(option).startswith(
                f"{option.cost.step_time / found.best.cost.step_time:.2f} x"
            )
    assert "fits, tied" in one._repr_markdown_()


def test_the_tie_is_the_models_spread_between_layouts_of_one_model() -> None:
    factor, a, b = runs.spread(table.runs())
    assert (a.cfg, a.hardware) == (b.cfg, b.hardware) and a.mesh != b.mesh
    assert {a.name, b.name} == {"MaxText 1024B, 1 x v5p-2048", "MaxText 1024B, 1 x v5p-4096"}
    assert factor <= planner.TIE < factor + 0.01
    with pytest.raises(ValueError, match="no two runs of one model in two layouts"):
        runs.spread([a])


def test_a_device_count_no_plan_fits_is_refused_naming_counts_that_work() -> None:
    """Llama 3 8B on 7 H100s in this library's program: nothing divides 7 but a pipeline,
    which the program runs on its lockstep executor only with a micro-batch per stage."""
    odd = plan(LLAMA3_8B, 7, "H100", global_batch=7, seq=4096,
                       ledger="program", precision=costs.Precision())  # fmt: skip
    with pytest.raises(ValueError, match=r"Device counts near 7 that have a plan .*: 8\."):
        _ = odd.best
    assert odd.nearest() == [8]


def test_a_leaner_optimizer_state_lets_more_plans_fit() -> None:
    eight_bit = costs.PRECISIONS["bfloat16 + float32 master, 8-bit Adam"]
    own = dict(global_batch=64, seq=4096, ledger="program")
    book = plan(LLAMA3_8B, 8, "H100", precision=costs.Precision(), **own)
    lean = plan(LLAMA3_8B, 8, "H100", precision=eight_bit, **own)
    assert not book["ZeRO-2"].fits and lean["ZeRO-2"].fits
    assert lean.best.setup.precision == eight_bit


def test_llama_3_405b_on_16384_h100s_is_planned_within_the_stated_factor() -> None:
    """Llama 3 405B at 8k tokens on 16,384 H100s: the best plan predicts the published 400
    TFLOP/s per GPU (the field's count) within `runs.WORST`. Meta's own layout (16 stages,
    FSDP 128, TP 8, no activation checkpointing) holds a peak that fits the 80 GB it ran
    in, but not with the planner's headroom, and the plan says so."""
    found = plan(LLAMA3_405B, 16_384, "H100", global_batch=2048, seq=8192)
    flops = costs.model_flops(LLAMA3_405B, 2048, 8192) / 16_384
    tflops = flops / found.best.cost.step_time / 1e12
    assert 400 / runs.WORST <= tflops <= 400 * runs.WORST
    meta = [
        o
        for o in found.options
        if o.cost
        and o.setup.sizes == {"stage": 16, "fsdp": 128, "model": 8}
        and o.setup.remat is False
        and o.setup.virtual == 1
    ]
    assert meta and all(o.cost.peak <= 80 * 2**30 and not o.fits for o in meta)
    assert all(o.reason == "needs more memory" for o in meta)


@pytest.mark.slow
def test_asked_for_a_context_ring_in_stages_the_planner_finds_llama_3s_shape_at_131k() -> None:
    """Llama 3 405B at 131k tokens on 16,384 H100s: with PP+FSDP+CP+TP offered, the best
    plan is Llama 3's shape (16 stages of 1F1B, a context ring, TP 8 in a host). At 8k
    tokens, asked for the zero-bubble schedules as well, the first plan runs ZB-V, and says
    it needs a runtime of one program per stage."""
    offered = (*planner.PLANNED, "PP+FSDP+CP+TP")
    long = LLAMA3_405B.replace(max_len=131_072)
    found = plan(long, 16_384, "H100", global_batch=128, seq=131_072, strategies=offered)
    best = found.best
    assert best.strategy == "PP+FSDP+CP+TP" and best.setup.schedule == "1F1B"
    assert best.setup.sizes["stage"] == 16 and best.setup.sizes["model"] == 8
    assert planner.splits_the_sequence(best)
    short = plan(
        LLAMA3_405B,
        16_384,
        "H100",
        global_batch=2048,
        seq=8192,
        strategies=offered,
        schedules=("1F1B", "ZB-H1", "ZB-V"),
    )
    assert short.best.setup.schedule == "ZB-V"
    assert "needs a runtime of one program per stage" in short.best.setup.describe()
    default = plan(LLAMA3_405B, 16_384, "H100", global_batch=2048, seq=8192)
    assert all(o.setup.schedule in planner.SCHEDULED for o in default.options)


def test_the_planner_reduces_once_a_step_where_the_weights_fit_whole() -> None:
    """A 4-layer Llama 3 8B on 32 H100s, 1,024 sequences: accumulating 32 micro-batches and
    reducing once a step (DDP's `no_sync`) leaves less exposed than reducing each one, and
    holds more (the weights gathered whole)."""
    cfg = LLAMA3_8B.replace(layers=4)
    best = plan(cfg, 32, "H100", global_batch=1024, seq=4096).best
    assert best.setup.reduce_once and best.setup.micro_batches > 1
    each = dataclasses.replace(best.setup, reduce_once=False)
    every = costs.step_cost(cfg, each, "H100", 1024, 4096)
    assert every.exposed > best.cost.exposed and every.peak < best.cost.peak


def test_a_context_ring_inside_pipeline_stages_runs_its_stages_share() -> None:
    """PP+FSDP+CP+TP (Llama 3 at 131k tokens): each device sends its stage's ring hops and
    computes its stage's FLOPs, 1/p of the same ring without stages; with full remat it
    keeps each layer's input split over the ring and over TP's sequence parallelism."""
    staged = STRATEGIES["PP+FSDP+CP+TP"]
    cfg, batch, seq = LLAMA3_8B.replace(max_len=32_768), 16, 32_768
    inner = {"context": 4, "model": 2}
    one = costs.Setup.of(STRATEGIES["FSDP+CP+TP"], {"data": 2, **inner}, 8, "full")
    four = costs.Setup.of(
        staged, {"stage": 4, "fsdp": 2, **inner}, 8, "full", schedule="1F1B", virtual=2
    )
    steps = {s.rules.name: costs.step_cost(cfg, s, "H100", batch, seq) for s in (one, four)}

    def hops(step: costs.StepCost) -> float:
        return sum(
            c.sent
            for c in step.collectives
            if c.transfer.kind == "collective-permute" and c.transfer.axes == ("context",)
        )

    assert hops(steps["FSDP+CP+TP"]) == pytest.approx(4 * hops(steps["PP+FSDP+CP+TP"]))
    assert steps["FSDP+CP+TP"].flops == pytest.approx(4 * steps["PP+FSDP+CP+TP"].flops)
    kept = costs.ledger_terms(cfg, four, batch, seq)["the layers' kept values"]
    # L / p layers' inputs for p + (p - 1) / v micro-batches in flight, in bfloat16, of one
    # sequence per micro-batch and device, split over context x model
    assert kept == 32 / 4 * (4 + 3 / 2) * 1 * seq / (4 * 2) * cfg.embed * 2
    (handed,) = [c for c in steps["PP+FSDP+CP+TP"].collectives if c.transfer.axes == ("stage",)]
    assert handed.array_bytes == 1 * seq / (4 * 2) * cfg.embed * 2  # split as SP splits it
    lockstep = costs.Setup.of(staged, {"stage": 4, "fsdp": 2, **inner}, 8, "full")
    assert "schedule='1F1B'" in costs.unsuitable(cfg, lockstep, batch, seq)
    with pytest.raises(ValueError, match="lockstep executor does not"):
        costs.step_cost(cfg, lockstep, "H100", batch, seq)
    assert "for a mixture of experts" in costs.unpriced(staged, 1)  # not "use 1F1B"


def test_a_pipeline_is_priced_by_its_schedule() -> None:
    """1F1B idles (p - 1) / (v m + p - 1) of its step, the lockstep executor more; interleaving
    keeps more micro-batches in flight; a stage count the layers do not divide is padded."""
    rules = STRATEGIES["PP+FSDP+TP"]
    steps = {}
    for schedule, virtual in (("lockstep", 1), ("1F1B", 1), ("1F1B", 2)):
        mesh = {"stage": 4, "fsdp": 2, "model": 2}
        setup = costs.Setup.of(rules, mesh, 8, "full", schedule=schedule, virtual=virtual)
        steps[schedule, virtual] = costs.step_cost(LLAMA3_8B, setup, "H100", 16, 4096)
    assert steps["1F1B", 1].bubble == pytest.approx(3 / 11)
    assert steps["1F1B", 2].bubble == pytest.approx(3 / 19)
    assert steps["lockstep", 1].bubble > steps["1F1B", 1].bubble
    kept = {
        v: costs.ledger(LLAMA3_8B, steps["1F1B", v].setup, 16, 4096)["activations"] for v in (1, 2)
    }
    assert kept[2] > kept[1]
    padded = costs.Setup.of(rules, {"stage": 5, "fsdp": 2, "model": 2}, 8, "full", schedule="1F1B")
    assert costs.sizes_of(LLAMA3_8B, padded, 16, 4096)["layers"] == 35
    with pytest.raises(ValueError, match="only for the 1F1B schedule"):
        costs.Setup.of(rules, {"stage": 4}, 8, virtual=2)
    with pytest.raises(ValueError, match="schedule='ZB'"):
        costs.Setup.of(rules, {"stage": 4}, 8, schedule="ZB")


def test_the_device_counts_that_work_are_named_once() -> None:
    small = plan(LLAMA3_8B, 8, "H100", global_batch=64, seq=4096, memory_per_device=20e9)
    found = small.nearest()
    assert found == sorted(set(found)) and 16 in found
