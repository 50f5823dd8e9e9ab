"""The cost model against published runs (`nnxscale.costs.runs`)."""

from __future__ import annotations

import dataclasses

import pytest

from nnxscale import costs
from nnxscale.costs import runs


def test_the_model_reproduces_at_least_40_published_runs_within_the_stated_factor() -> None:
    found = runs.runs()
    priced = [r for r in found if not r.problem()]
    assert len(priced) >= 40 and len({r.source for r in found}) >= 5
    factor, run = runs.worst(found)
    assert factor <= runs.WORST, run.name
    assert {r.quantity for r in found} <= set(runs.QUANTITIES)


def test_a_run_the_model_cannot_express_says_why_and_stays_in_the_table() -> None:
    table = {row[0]: row for row in runs.rows()}
    palm = table["PaLM 540B, 6,144 TPU v4"]
    assert "key/value head" in palm[8] and palm[6] == ""
    assert len(table) == len(runs.runs())


def test_a_run_the_model_is_known_to_miss_is_shown_and_truly_missed() -> None:
    """A run marked `misses` is priced and shown with its reason, and kept out of `worst`
    only while the model really misses it by more than `WORST`."""
    missed = [r for r in runs.runs() if r.misses]
    assert missed and all(not r.problem() for r in missed)
    for run in missed:
        assert max(run.ratio, 1 / run.ratio) > runs.WORST, run.name
    table = {row[0]: row for row in runs.rows()}
    long = table["1B-long, one H200 (this book)"]
    assert long[6] and long[8].startswith("misses: attention at 8,192 tokens")
    assert runs.worst()[1] not in missed


def test_each_calibrating_run_gives_the_efficiency_the_library_states() -> None:
    calibrating = [r for r in runs.runs() if r.calibrates and not r.problem()]
    assert {r.hardware for r in calibrating} == {
        "TPU v5e",
        "TPU v5p",
        "TPU v6e",
        "H200",
        "H100",
        "A100",
    }
    for run in calibrating:
        efficiency = runs.calibrate(run)
        assert costs.HARDWARE[run.hardware].efficiency == pytest.approx(efficiency, abs=0.005)
        assert run.predicted(efficiency) == pytest.approx(run.published, rel=1e-6)
    uncalibrated = {hw.name for hw in costs.HARDWARE.values()} - {r.hardware for r in calibrating}
    for name in uncalibrated:
        assert not costs.HARDWARE[name].efficiency_source.startswith("calibrated")


def test_maxtexts_scaled_models_have_the_sizes_their_names_say() -> None:
    for scale in (16, 32, 64, 128, 256, 512, 1024):
        total = costs.counts(runs.maxtext(scale)).total
        assert 0.9 * scale * 1e9 <= total <= 1.05 * scale * 1e9, (scale, total)


def test_a_multislice_run_talks_across_slices_over_the_data_centre_network() -> None:
    """Two v5p slices of 64 chips fit in one v5p fast domain, but are two slices: the
    replicas' all-reduce crosses DCN, the gathers inside a slice stay on ICI."""
    run = {r.name: r for r in runs.runs()}["MaxText 32B, 2 x v5p-128"]
    hw = dataclasses.replace(costs.HARDWARE[run.hardware], domain=run.slice)
    cost = costs.step_cost(run.cfg, run.setup(), hw, run.batch, run.seq)
    links = {c.transfer.axes: c.link for c in cost.collectives}
    assert links[("replica",)] == "slow" and links[("data",)] == "fast"
    assert run.slice == 64
    assert costs.counts(runs.MEGATRON_1T).total == pytest.approx(1.0e12, rel=0.02)


def test_tp_inside_pipeline_stages_reproduces_llama_3_and_megatron() -> None:
    """TP x PP x DP on a 1F1B schedule: Llama 3 405B on 16,384 H100s at 8k and 131k tokens
    (its efficiency calibrated on 8,192 at 8k) and Megatron-LM's 1T model are priced, Llama
    3's within `WORST`."""
    table = {r.name: r for r in runs.runs()}
    llama = table["Llama 3.1 405B, 16,384 H100s, 8k"]
    assert not llama.problem() and llama.setup().rules.name == "PP+FSDP+TP"
    assert 1 / runs.WORST <= llama.ratio <= runs.WORST
    long = table["Llama 3.1 405B, 16,384 H100s, 131k"]  # and a context ring of 16 in stages
    assert not long.problem() and long.setup().rules.name == "PP+FSDP+CP+TP"
    assert abs(long.ratio - 1) < 0.1
    megatron = table["Megatron-LM 1T, 3,072 A100s"]
    assert megatron.calibrates and abs(megatron.ratio - 1) < 0.01


def test_maxtexts_older_attention_count_differs_by_under_3_percent_of_a_step() -> None:
    """MaxText's README tables count attention without the causal mask, 12 L b s^2 H D, where
    the book counts 7 L b H D (s^2 + s block): at their 2,048 tokens the gap stays under 3%
    of a step's FLOPs, small beside the factor the table holds (`runs._V5E`)."""
    gaps = []
    for run in runs.runs():
        if run.source == "maxtext2025" and run.quantity == "TFLOP/s per device":
            c, b, s = run.cfg, run.batch, run.seq
            attention = c.layers * b * c.heads * c.head_dim * s * s
            gaps.append((12 - 7) * attention / costs.step_flops(c, b, s))
    assert len(gaps) >= 40 and 0.02 < max(gaps) < 0.03
