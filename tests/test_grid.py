"""The Ultra-Scale Playbook's grid (`nnxscale.evidence.grid`): the data, the checks that set
runs aside before any prediction, and how the cost model ranks what it was not fitted to."""

from __future__ import annotations

import math
import statistics

import pytest

from nnxscale import costs
from nnxscale.costs.hardware import GPU_FIT
from nnxscale.evidence import grid


@pytest.fixture(scope="module")
def priced() -> list[grid.Priced]:
    return grid.priced()


def test_the_grid_holds_the_1b_3b_and_80b_runs_and_not_the_held_out_8b() -> None:
    found = grid.runs()
    assert len(found) == 2453 and sum(r.ok for r in found) == 1265
    assert {r.model for r in found} == set(grid.MODELS) == {"1B", "3B", "80B"}
    assert all(r.sequences == r.gbs or r in grid.anomalies(found) for r in found if r.ok)


def test_the_models_reproduce_the_mfu_the_source_reports() -> None:
    """From each run's tokens per second, nanotron's count (its tied embedding counted twice
    in some campaigns, once in others) gives the MFU the source prints, to its rounding."""
    peak = costs.HARDWARE["H100"].flops
    shown = [r for r in grid.runs() if r.ok and r.mfu >= 0.05]
    matched = 0
    for r in shown:
        cfg = grid.MODELS[r.model]
        counts = (grid.nanotron_flops(cfg, tied_twice=t) for t in (True, False))
        rounding = 0.0005 / r.mfu + 0.002
        matched += any(abs(r.tokens * f / peak / r.mfu - 1) <= rounding for f in counts)
    assert len(shown) > 700 and matched >= 0.97 * len(shown)


def test_the_anomalies_are_found_without_the_model() -> None:
    """A recorded batch not the grid's, or a twin more than `TWIN` times as fast: each set
    aside with its reason, from the measurements alone."""
    why = grid.anomalies(grid.runs())
    batch = [r for r, reason in why.items() if reason.startswith("ran ")]
    twins = [r for r, reason in why.items() if "its twin" in reason]
    assert len(batch) + len(twins) == len(why) and batch and twins
    assert all(r.sequences != r.gbs for r in batch)
    for r in twins:
        factor = float(why[r].split(" ran ")[1].split(" x")[0])
        assert factor > grid.TWIN


def test_spearman_ranks_ties_by_their_mean_rank() -> None:
    assert grid.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert grid.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert grid.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert grid.spearman([1, 1], [1, 2]) == 0.0


def test_the_fitted_constants_are_the_fits_optimum() -> None:
    """`GPU_FIT` is where the fit split's median miss is least: a step of 1.4 either way on
    any fitted field misses more."""
    h100 = costs.HARDWARE["H100"]
    found = [
        r
        for r in grid.runs()
        if r.ok and r.fit and not grid.problem(r) and r not in grid.anomalies(grid.runs())
    ]
    best = grid.miss(h100, found)
    for name in grid.FITTED:
        assert getattr(h100, name) == GPU_FIT[name]
        for factor in (1.4, 1 / 1.4):
            moved = h100.replace(**{name: getattr(h100, name) * factor})
            assert grid.miss(moved, found) > best, (name, factor)


def test_the_model_ranks_the_runs_it_was_not_fitted_on(priced: list) -> None:
    """On the test split (16 to 64 nodes), per model and node count: the median rank
    correlation with the measured throughput is at least 0.7. Where the test split starts
    (16 nodes) the planner's first pick for the 1B and 3B models runs within 1.35 of the
    measured best; the fit split's predictions lie within 1.5 times for 60% of its runs and
    its memory within 1.3 for 80%."""
    groups = grid.rank(priced)
    test = [g for g in groups if g.nodes not in grid.FIT_NODES]
    assert {g.nodes for g in test} == {16, 32, 64} and len(test) == 9
    for g in groups:
        mine = [p.run.tokens for p in priced if (p.run.model, p.run.nodes) == (g.model, g.nodes)]
        assert g.best == max(mine) and g.regret == g.best / g.pick.tokens
    assert grid.split(groups, fitted=False)["median rank"] >= 0.7
    assert all(g.regret <= 1.35 for g in test if g.nodes == 16 and g.model != "80B")
    fit = grid.split(groups, fitted=True)
    assert fit["within 1.5x"] >= 0.6 and fit["memory within 1.3x"] >= 0.8
    assert fit["median rank"] == statistics.median(g.rank for g in groups if g.nodes <= 8)


def test_twins_share_a_model_nodes_layout_and_batch() -> None:
    for group in grid.twins(grid.runs()):
        layouts = {(r.model, r.nodes, r.dp, r.tp, r.pp, r.mbs, r.gradacc) for r in group}
        assert len(layouts) == 1 and all(r.ok for r in group)
    assert sum(map(len, grid.twins(grid.runs()))) == sum(r.ok for r in grid.runs())


def test_the_planners_headroom_covers_the_fit_splits_measured_memory(priced: list) -> None:
    """The planner asks a plan's predicted peak times `HEADROOM` to fit: on the fit split,
    the fused ledger's prediction times it covers what 93% of the runs measured."""
    from nnxscale import planner

    ratios = [1 / p.memory_ratio for p in priced if p.run.fit]
    covered = sum(r <= planner.HEADROOM for r in ratios) / len(ratios)
    assert covered >= 0.93
