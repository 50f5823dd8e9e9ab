"""Chapter 8's recorded crossings hold against the cost model, and the check refuses a
report in which the program and the model disagree (a fresh two-process run is compared with
the recording in test_multi.py)."""

from __future__ import annotations

import dataclasses

import pytest

from nnxscale import TINY
from nnxscale.costs import crossing


@pytest.mark.parametrize("rules", crossing.SHOWN)
def test_each_recorded_crossing_agrees_with_the_cost_model(rules) -> None:
    compared = crossing.compare(rules, crossing.recorded(rules))
    compared.check()
    assert compared.slow == {("replica",)}
    crossing_rows = {(kind, axes) for kind, axes, _, crosses, _ in compared.rows if crosses}
    assert crossing_rows == {("all-reduce", ("replica",)), ("all-reduce", ("replica", "data"))}
    assert "| all-reduce | replica | 131,072 | yes | yes |" in compared.show()


def test_a_collective_that_crosses_where_the_model_says_fast_is_named() -> None:
    report = crossing.recorded("HSDP")
    moved = [[k, a, b, crosses or a == ["data"]] for k, a, b, crosses in report.moved]
    compared = crossing.compare("HSDP", dataclasses.replace(report, moved=moved))
    with pytest.raises(AssertionError, match=r"disagree on \[\('all-gather', \('data',\)\)"):
        compared.check()


def test_bytes_the_model_does_not_price_are_named() -> None:
    report = crossing.recorded("HSDP")
    moved = [[k, a, b * 2 if a == ["replica"] else b, c] for k, a, b, c in report.moved]
    with pytest.raises(AssertionError, match=r"1082624 bytes cross, the model prices 558336"):
        crossing.compare("HSDP", dataclasses.replace(report, moved=moved)).check()


def test_a_rule_set_not_recorded_is_named() -> None:
    with pytest.raises(KeyError, match=r"no recorded crossing for 'FSDP'; recorded: \['HSDP'"):
        crossing.recorded("FSDP")


def test_the_gradients_reduced_whole_over_both_axes_are_the_embedding_and_the_norms() -> None:
    """What chapter 8 says of the all-reduce over `replica` and `data` under HSDP: the
    embedding table's gradient and the five norm scales', whole, and the float32 loss."""
    report = crossing.recorded("HSDP")
    (whole,) = [b for k, a, b, _ in report.moved if a == ["replica", "data"]]
    floats = TINY.vocab * TINY.embed + (2 * TINY.layers + 1) * TINY.embed
    assert whole == 4 * floats + crossing.LOSS_BYTES
