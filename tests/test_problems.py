"""The checks that judge the reader's answers: right, a hint, never a traceback."""

from __future__ import annotations

import math

import pytest

from nnxscale.core import problems


def test_a_number_within_tolerance_is_right_and_others_get_the_hint() -> None:
    check = problems.number("2.1", 4096, hint="divide by the pieces", unit=" B")
    assert check(4096).right and check(4096.0).right
    wrong = check(32768)
    assert not wrong.right
    assert "32,768 B is too large" in wrong.text and "divide by the pieces" in wrong.text
    assert "too small" in check(1).text
    loose = problems.number("6.2", 1.0, hint="h", rel=0.01)
    assert loose(1.005).right and not loose(1.02).right


def test_an_unanswered_problem_asks_for_an_answer_without_judging() -> None:
    verdict = problems.number("1.1", 8, hint="h")(None)
    assert not verdict.right
    assert "write your answer" in verdict.text and "Hint" not in verdict.text


@pytest.mark.parametrize("answer", ["8", True, math.nan, math.inf, [8], object()])
def test_answers_of_the_wrong_kind_are_refused_with_words(answer) -> None:
    verdict = problems.number("1.1", 8, hint="a whole number of devices")(answer)
    assert not verdict.right
    assert "a whole number of devices" in verdict.text


def test_a_near_miss_is_named_by_what_it_mistook() -> None:
    check = problems.number("2.1", 4096, hint="h", near={32768: "that is the whole array"})
    assert "that is the whole array" in check(32768).text
    assert "too large" in check(32769).text


def test_a_choice_ignores_case_and_order_and_names_an_unknown_option() -> None:
    check = problems.choice("2.2", "FSDP+TP", options=["DP", "FSDP", "TP", "FSDP+TP"], hint="h")
    assert check("fsdp+tp").right and check("`FSDP+TP`").right
    assert not check("TP").right
    assert "'zero' is not one of" in check("ZeRO").text
    several = problems.choice("2.3", {"TP", "FSDP"}, options=["DP", "FSDP", "TP"], hint="h")
    assert several(["fsdp", "tp"]).right is False  # a list is an order, a set is not
    assert several({"fsdp", "tp"}).right
    assert not several({"tp"}).right


def test_a_function_is_judged_on_every_case_and_a_raising_one_gets_words() -> None:
    check = problems.function("7.1", lambda p, m: (p - 1) / (m + p - 1), [(4, 8), (2, 1)],
                              hint="count idle slots")  # fmt: skip
    assert check(lambda p, m: (p - 1) / (m + p - 1)).right
    off = check(lambda p, m: (p - 1) / m)
    assert "on (4, 8) it gives 0.375" in off.text
    raising = check(lambda p, m: 1 / 0)
    assert "ZeroDivisionError" in raising.text and not raising.right
    assert "is not a function" in check(0.2).text


def test_proves_takes_the_solution_and_refuses_every_wrong_answer() -> None:
    check = problems.number("2.1", 4096, hint="h", near={32768: "whole"})
    shown = check.proves(4096, 4097, 2048, why="**4,096 bytes**: a share of 32,768")
    assert shown.startswith("**4,096 bytes**") and "refuses 3 wrong ones" in shown
    with pytest.raises(AssertionError, match="fails its own check"):
        check.proves(4000, why="")
    loose = problems.number("6.2", 100, hint="h", rel=0.1)
    with pytest.raises(AssertionError, match=r"takes wrong answers \[105\]"):
        loose.proves(100, 105, 120, why="")
    with pytest.raises(ValueError, match="at least one wrong answer"):
        problems.number("2.1", 1, hint="h").proves(1, why="")
    # a mistake that makes no difference here (on one device, say) is passed over
    assert "refuses 2 wrong ones" in check.proves(4096, 4096, 1, why="")
    with pytest.raises(ValueError, match="at least one wrong answer"):
        problems.number("2.1", 1, hint="h").proves(1, 1.0, why="")


def test_a_try_it_check_judges_against_what_the_readers_cell_gives() -> None:
    """The expected answer follows the reader's edit: the same answer is right for one
    edit and wrong for another, and the solution is proven against the solution's edit."""
    check = problems.number("2.4", lambda devices: 32768 // devices, hint="h")
    assert check(4096, 8).right and not check(4096, 4).right
    assert check(8192, 4).right
    assert "refuses 1" in check.proves(8192, 4096, why="", given=(4,))
    names = problems.choice("2.4", lambda rule: {"mlp"} if rule else {"mlp", "embed"},
                            options=["mlp", "embed"], hint="h")  # fmt: skip
    assert names({"mlp"}, True).right and not names({"mlp"}, False).right


def test_a_check_refuses_to_expect_a_number_that_is_not_finite() -> None:
    with pytest.raises(ValueError, match="not finite"):
        problems.number("9.9", math.nan, hint="h")
    with pytest.raises(ValueError, match="at least one case"):
        problems.function("9.9", abs, [], hint="h")


def test_an_exact_answer_compares_lists_and_tuples_alike() -> None:
    check = problems.exact("8.1", [128, 192], hint="h", near={(0, 64): "host 0's rows"})
    assert check((128, 192)).right and check([128, 192]).right
    assert not check([128, 191]).right and "host 0's rows" in check([0, 64]).text
    edited = problems.exact("8.4", lambda plan: plan[3], hint="h")
    assert edited([6, 8], [[0, 2], [2, 4], [4, 6], [6, 8]]).right
