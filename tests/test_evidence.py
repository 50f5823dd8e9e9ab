"""The cost model against published runs (`nnxscale.evidence`): the protocol, the runs it
cannot express, the runs it is known to miss, and the calibrators."""

from __future__ import annotations

import dataclasses

import pytest

from nnxscale import costs
from nnxscale.evidence import gpu, runs, table, tpu


@pytest.fixture(scope="module")
def found() -> list[runs.Run]:
    return table.runs()


def test_the_table_holds_100_runs_from_6_sources_and_30_gpu_tests(found: list) -> None:
    """At least 100 runs from 6 sources, 30 of them GPU runs that calibrate nothing; every
    test within `WORST`, and the known misses at most `MISSES` of the runs."""
    assert len(found) >= 100 and len({r.source for r in found}) >= 6
    gpu_tests = [r for r in runs.tests(found) if not r.hardware.startswith("TPU")]
    assert len(gpu_tests) >= 30 and len({r.source for r in gpu_tests}) >= 6
    factor, run = runs.worst(found)
    assert factor <= runs.WORST, run.name
    assert sum(bool(r.misses) for r in found) <= runs.MISSES * len(found)
    assert {r.quantity for r in found} <= set(runs.QUANTITIES)


def test_the_summary_counts_each_run_once_per_device_and_per_family(found: list) -> None:
    for by in ("hardware", "family"):
        tallies = runs.summary(found, by=by)
        assert sum(t.runs for t in tallies) == len(found)
        assert sum(t.tests for t in tallies) == len(runs.tests(found))
        assert all(t.calibrators <= 1 for t in tallies) or by == "family"
    per_device = {t.group: t for t in runs.summary(found)}
    assert per_device["A100"].tests >= 30 and per_device["H100"].tests >= 30
    assert all(t.worst <= runs.WORST for t in per_device.values() if t.tests)


def test_a_run_the_model_cannot_express_says_why_and_stays_in_the_table(found: list) -> None:
    rows = {row[0]: row for row in runs.rows(found)}
    palm = rows["PaLM 540B, 6,144 TPU v4"]
    assert "key/value head" in palm[9] and palm[6] == ""
    assert len(rows) == len(found)


def test_a_run_the_model_is_known_to_miss_is_shown_and_truly_missed(found: list) -> None:
    """A run marked `misses` is priced and shown with its reason, and kept out of `worst`
    only while the model really misses it by more than `WORST`."""
    missed = [r for r in found if r.misses]
    assert missed and all(not r.problem() for r in missed)
    for run in missed:
        assert runs.factor(run) > runs.WORST, run.name
    rows = {row[0]: row for row in runs.rows(found)}
    long = rows["1B-long, one H200 (this book)"]
    assert long[7] == "known miss" and long[9].startswith("attention at 8,192 tokens")
    assert runs.worst(found)[1] not in missed


def test_each_device_has_at_most_one_calibrator_and_it_gives_the_stated_efficiency(
    found: list,
) -> None:
    calibrating = [r for r in found if r.calibrates and not r.problem()]
    kinds = [r.hardware for r in calibrating]
    assert sorted(kinds) == sorted(set(kinds))  # one per kind of device
    assert set(kinds) == {"TPU v5e", "TPU v5p", "TPU v6e", "H200", "H100", "A100"}
    for run in calibrating:
        efficiency = runs.calibrate(run)
        assert costs.HARDWARE[run.hardware].efficiency == pytest.approx(efficiency, abs=5e-4)
        assert run.predicted(efficiency) == pytest.approx(run.published, rel=1e-6)
    uncalibrated = {hw.name for hw in costs.HARDWARE.values()} - set(kinds)
    for name in uncalibrated:
        assert not costs.HARDWARE[name].efficiency_source.startswith("calibrated")


def test_every_run_on_80_gb_devices_fits_them_under_the_fused_ledger(found: list) -> None:
    """They ran, so the fused ledger's peak must fit their memory (as the card counts it:
    80 GiB); this library's own program needs more than some of them had."""
    eighty = [r for r in found if not r.problem() and r.device().memory == 80e9]
    assert len(eighty) >= 100 and all(r.fits for r in eighty)
    assert all(r.ledger == "fused" for r in eighty if r.hardware != "H200")
    program = [dataclasses.replace(r, ledger="program") for r in eighty if r.schedule != "1F1B"]
    assert sum(not r.fits for r in program) >= 10


def test_maxtexts_scaled_models_have_the_sizes_their_names_say() -> None:
    for scale in (16, 32, 64, 128, 256, 512, 1024):
        total = costs.counts(tpu.maxtext(scale)).total
        assert 0.9 * scale * 1e9 <= total <= 1.05 * scale * 1e9, (scale, total)
    assert costs.counts(gpu.MEGATRON_1T).total == pytest.approx(1.0e12, rel=0.02)


def test_a_multislice_run_talks_across_slices_over_the_data_centre_network(found: list) -> None:
    """Two v5p slices of 64 chips fit in one v5p fast domain, but are two slices: the
    replicas' all-reduce crosses DCN, the gathers inside a slice stay on ICI."""
    run = {r.name: r for r in found}["MaxText 32B, 2 x v5p-128"]
    cost = costs.step_cost(run.cfg, run.setup(), run.device(), run.batch, run.seq)
    links = {c.transfer.axes: c.link for c in cost.collectives}
    assert links[("replica",)] == "slow" and links[("data",)] == "fast"
    assert run.slice == 64


def test_tp_inside_pipeline_stages_prices_llama_3_and_megatron(found: list) -> None:
    """TP x PP x DP on a 1F1B schedule: Llama 3 405B at 8k and 131k tokens is priced in
    Meta's layout and fits 80 GB without activation checkpointing at 8k, but the model is
    known to miss it (its interleaving is not given and, with two virtual stages, does not
    fit); Megatron-LM's 1T model is a test within `WORST`."""
    named = {r.name: r for r in found}
    llama = named["Llama 3.1 405B, 16,384 H100s, 8k"]
    assert not llama.problem() and llama.setup().rules.name == "PP+FSDP+TP"
    assert llama.remat is False and llama.fits and llama.misses
    assert llama.ratio < 1 / runs.WORST
    two = dataclasses.replace(llama, virtual=2)
    assert not two.problem() and not two.fits
    long = named["Llama 3.1 405B, 16,384 H100s, 131k"]  # and a context ring of 16 in stages
    assert not long.problem() and long.setup().rules.name == "PP+FSDP+CP+TP"
    megatron = named["Megatron-LM 1T, 3,072 A100s"]
    assert megatron.role == "test" and runs.factor(megatron) <= runs.WORST


def test_maxtexts_older_attention_count_differs_by_under_4_percent_of_a_step(
    found: list,
) -> None:
    """MaxText's README tables count attention without the causal mask, 12 L b s^2 H D, where
    the field counts it once under the mask, 6 L b s^2 H D (`costs.model_flops`): at their
    2,048 tokens the gap stays under 4% of a step's model FLOPs, small beside `WORST`."""
    gaps = []
    for run in found:
        if run.source == "maxtext2025" and run.quantity == "TFLOP/s per device":
            c, b, s = run.cfg, run.batch, run.seq
            attention = c.layers * b * c.heads * c.head_dim * s * s
            gaps.append((12 - 6) * attention / costs.model_flops(c, b, s))
    assert len(gaps) >= 40 and 0.03 < max(gaps) < 0.04
