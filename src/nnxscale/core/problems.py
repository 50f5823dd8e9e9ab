"""Problems the reader answers in a cell of their own, and the checks that judge the answer.

A chapter builds one check per problem in a folded cell, from what its library computes. The
reader's cell holds `answer = None`, then `check(answer)`: it prints right, or a hint, and
never raises, so "Run all" goes on. The folded solution cell derives the answer another way
and calls `check.proves(solution, *wrong)`, which raises unless the check takes the solution
and refuses each wrong answer given; the book's build runs it, so every solution is proven
and every check is shown to reject a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nnxscale.core.show import Markdown


@dataclass(frozen=True)
class Verdict:
    """What a check says of one answer: right or not, and the words it shows the reader."""

    right: bool
    text: str

    def _repr_markdown_(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return self.right


@dataclass(frozen=True)
class Check:
    """One problem's check: `judge(answer, *given)` is None when right, else what is wrong.

    `given` is what a "try it" problem judges the answer against: the object the reader
    edited, passed by their cell. `hint` is said of any wrong answer; `near` names answers a
    reader may well give, each with what it mistook (the whole array's bytes where a device
    holds a share of them, say)."""

    problem: str
    judge: Callable[..., str | None]
    hint: str
    near: Mapping[Any, str] = field(default_factory=dict)

    def __call__(self, answer: Any, *given: Any) -> Verdict:
        """The verdict on the reader's `answer`, shown under their cell; never raises."""
        if answer is None:
            return Verdict(
                False,
                f"*Problem {self.problem}:* write your answer in the cell, then run it again.",
            )
        try:
            wrong = self.judge(answer, *given)
        except Exception as error:  # a reader's answer of any shape gets words, not a trace
            wrong = f"the check could not read this answer ({type(error).__name__}: {error})"
        if wrong is None:
            return Verdict(True, f"*Problem {self.problem}:* **right.**")
        said = next((words for value, words in self.near.items() if _same(value, answer)), None)
        detail = said or wrong
        return Verdict(False, f"*Problem {self.problem}:* not yet: {detail}. Hint: {self.hint}")

    def proves(self, solution: Any, *wrong: Any, why: str, given: tuple = ()) -> Markdown:
        """Assert that `solution` passes and that each of `wrong` and `near` is refused, then
        show the solution and `why` it holds (the book's build runs this for every problem).

        A wrong answer equal to the solution is passed over: a mistake that makes no difference
        at this device count (the whole array, on one device); at least one must remain."""
        verdict = self(solution, *given)
        if not verdict.right:
            raise AssertionError(
                f"problem {self.problem}: the solution {solution!r} fails "
                f"its own check: {verdict.text}"
            )
        refused = [answer for answer in (*wrong, *self.near) if not _same(answer, solution)]
        if not refused:
            raise ValueError(f"problem {self.problem}: give at least one wrong answer to refuse")
        taken = [answer for answer in refused if self(answer, *given).right]
        if taken:
            raise AssertionError(f"problem {self.problem}: the check takes wrong answers {taken}")
        ones = "one" if len(refused) == 1 else "ones"
        return Markdown(
            f"{why}\n\n*The check takes this answer and refuses {len(refused)} wrong {ones}.*"
        )


def _same(a: Any, b: Any) -> bool:
    """Whether two answers are the same value (numbers to 1 part in 10^9, text ignoring case)."""
    try:
        return _numbers_close(a, b, 1e-9)
    except (TypeError, ValueError):
        return _normal(a) == _normal(b)


def _numbers_close(expected: Any, answer: Any, rel: float) -> bool:
    """Whether `answer` is within `rel` of `expected`, both numbers (bool is not one)."""
    if isinstance(answer, bool | str) or isinstance(expected, bool | str):
        raise TypeError("not a number")
    answer, expected = float(answer), float(expected)
    return math.isfinite(answer) and math.isclose(answer, expected, rel_tol=rel, abs_tol=0)


def _normal(value: Any) -> Any:
    """An answer compared without regard to case, spaces, order of a set or container type."""
    if isinstance(value, str):
        return " ".join(value.lower().replace("`", "").split())
    if isinstance(value, set | frozenset):
        return frozenset(_normal(v) for v in value)
    if isinstance(value, Sequence):
        return tuple(_normal(v) for v in value)
    return value


def number(
    problem: str,
    expected: float | Callable[..., float],
    *,
    hint: str,
    rel: float = 1e-9,
    near: Mapping[float, str] | None = None,
    unit: str = "",
) -> Check:
    """A check of a number, right within relative tolerance `rel` (say why in the chapter);
    `expected` may be a function of what the reader's cell gives (a "try it" problem)."""
    if not callable(expected) and not math.isfinite(expected):
        raise ValueError(f"problem {problem}: the expected answer {expected} is not finite")

    def judge(answer: Any, *given: Any) -> str | None:
        want = expected(*given) if callable(expected) else expected
        try:
            if _numbers_close(want, answer, rel):
                return None
        except (TypeError, ValueError):
            return f"{answer!r} is not a number"
        side = "too large" if float(answer) > want else "too small"
        return f"{answer:,}{unit} is {side}"

    return Check(problem, judge, hint, dict(near or {}))


def choice(
    problem: str,
    expected: Any,
    *,
    options: Iterable[Any],
    hint: str,
    near: Mapping[Any, str] | None = None,
) -> Check:
    """A check of one of `options` (names compare without case), or of a set of them;
    `expected` may be a function of what the reader's cell gives (a "try it" problem)."""
    allowed = {_normal(o) for o in options}

    def judge(answer: Any, *given: Any) -> str | None:
        want = _normal(expected(*given) if callable(expected) else expected)
        said = _normal(answer)
        members = said if isinstance(said, frozenset) else {said}
        unknown = [m for m in members if m not in allowed]
        if unknown:
            return f"{unknown[0]!r} is not one of {sorted(map(str, allowed))}"
        return None if said == want else f"{answer!r} is not it"

    return Check(problem, judge, hint, dict(near or {}))


def exact(
    problem: str, expected: Any, *, hint: str, near: Mapping[Any, str] | None = None
) -> Check:
    """A check of an answer that must equal `expected`: a list of numbers or of names, say
    (a list and a tuple compare alike, names without case); `expected` may be a function of
    what the reader's cell gives (a "try it" problem)."""

    def judge(answer: Any, *given: Any) -> str | None:
        want = expected(*given) if callable(expected) else expected
        return None if _normal(answer) == _normal(want) else f"{answer!r} is not it"

    return Check(problem, judge, hint, dict(near or {}))


def function(
    problem: str,
    reference: Callable[..., Any],
    cases: Sequence[tuple],
    *,
    hint: str,
    rel: float = 1e-9,
) -> Check:
    """A check of a function the reader writes: it must agree with `reference` on `cases`."""
    if not cases:
        raise ValueError(f"problem {problem}: give at least one case to try the function on")

    def judge(answer: Any, *given: Any) -> str | None:
        if not callable(answer):
            return f"{answer!r} is not a function"
        for args in cases:
            want, got = reference(*args), answer(*args)
            try:
                same = _numbers_close(want, got, rel)
            except (TypeError, ValueError):
                same = _normal(want) == _normal(got)
            if not same:
                return f"on {args} it gives {got!r}, not {want!r}"
        return None

    return Check(problem, judge, hint)
