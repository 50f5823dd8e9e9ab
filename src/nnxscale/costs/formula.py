"""Formulas in named sizes: what the cost model derives once and evaluates for any size.

A `Formula` is a sum of terms, each a coefficient times a product of named sizes raised to
integer powers: `4 * vocab * embed / data` is the bytes of a float32 table split over `data`.
The cost model derives its formulas from a rule set and the model's structure, then
evaluates them for a 7B model on 256 chips as easily as for the book's small one; the page's
calculator receives the same formulas as JSON and only evaluates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

Powers = tuple[tuple[str, int], ...]
"""A product of sizes: each name with its (nonzero) power, sorted by name."""

Number = int | float


def _powers(names: Mapping[str, int]) -> Powers:
    return tuple(sorted((n, p) for n, p in names.items() if p))


class Formula:
    """A polynomial in named sizes (negative powers allowed, for sizes that divide)."""

    __slots__ = ("_evaluate", "terms")

    def __init__(self, terms: Mapping[Powers, float] | None = None) -> None:
        self.terms: dict[Powers, float] = {k: v for k, v in (terms or {}).items() if v}
        self._evaluate: Callable[[Mapping[str, Number]], float] | None = None

    @classmethod
    def of(cls, value: Number | str | Formula) -> Formula:
        """A formula for a number, a single named size, or the formula itself."""
        if isinstance(value, Formula):
            return value
        if isinstance(value, str):
            return cls({((value, 1),): 1.0})
        return cls({(): float(value)})

    @classmethod
    def product(cls, names: Iterable[str], coefficient: float = 1.0) -> Formula:
        """`coefficient` times the product of `names` (a name may repeat)."""
        counts: dict[str, int] = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        return cls({_powers(counts): float(coefficient)})

    def __add__(self, other: Number | str | Formula) -> Formula:
        out = dict(self.terms)
        for powers, c in Formula.of(other).terms.items():
            out[powers] = out.get(powers, 0.0) + c
        return Formula(out)

    __radd__ = __add__

    def __neg__(self) -> Formula:
        return self * -1

    def __sub__(self, other: Number | str | Formula) -> Formula:
        return self + (-Formula.of(other))

    def __rsub__(self, other: Number | str | Formula) -> Formula:
        return Formula.of(other) - self

    def __mul__(self, other: Number | str | Formula) -> Formula:
        out: dict[Powers, float] = {}
        for p1, c1 in self.terms.items():
            for p2, c2 in Formula.of(other).terms.items():
                merged = dict(p1)
                for name, power in p2:
                    merged[name] = merged.get(name, 0) + power
                key = _powers(merged)
                out[key] = out.get(key, 0.0) + c1 * c2
        return Formula(out)

    __rmul__ = __mul__

    def __truediv__(self, other: Number | str) -> Formula:
        """Division by a number or by one named size (a formula of one term)."""
        if isinstance(other, str):
            return self * Formula({((other, -1),): 1.0})
        return self * (1.0 / other)

    def per(self, names: Iterable[str]) -> Formula:
        """Divided by the product of `names`: what one device holds of a split quantity."""
        out = self
        for name in names:
            out = out / name
        return out

    def replace(self, name: str, powers: Mapping[str, int]) -> Formula:
        """The formula with size `name` written as a product of other sizes' `powers`
        (`chunk` as `seq / context`: `{"seq": 1, "context": -1}`)."""
        out = Formula()
        for term, c in self.terms.items():
            merged: dict[str, int] = {}
            for n, p in term:
                for m, q in powers.items() if n == name else [(n, 1)]:
                    merged[m] = merged.get(m, 0) + p * q
            out += Formula({_powers(merged): c})
        return out

    def __call__(self, sizes: Mapping[str, Number]) -> float:
        """The value for the given sizes; an error names any size the formula needs and lacks."""
        if self._evaluate is None:
            self._evaluate = evaluator(self.terms)
        try:
            return self._evaluate(sizes)
        except KeyError:
            missing = sorted(self.names() - set(sizes))
            raise KeyError(f"the formula needs sizes {missing}: pass them too") from None

    def __reduce__(self) -> tuple[type[Formula], tuple[dict[Powers, float]]]:
        """Pickled and copied as its terms (its generated evaluation is made again)."""
        return Formula, (self.terms,)

    def names(self) -> set[str]:
        """Every size the formula depends on."""
        return {n for powers in self.terms for n, _ in powers}

    def json(self) -> list[list[object]]:
        """The terms as JSON: `[coefficient, {name: power}]` each (what the calculator reads)."""
        return [[c, dict(powers)] for powers, c in sorted(self.terms.items())]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Formula | int | float | str):
            return NotImplemented
        diff = self - Formula.of(other)
        return all(abs(c) < 1e-9 for c in diff.terms.values())

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.terms.items())))

    def __repr__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for powers, c in sorted(self.terms.items(), key=lambda kv: (-len(kv[0]), kv[0])):
            top = [n if p == 1 else f"{n}^{p}" for n, p in powers if p > 0]
            bottom = [n if p == -1 else f"{n}^{-p}" for n, p in powers if p < 0]
            number = f"{c:g}"
            head = "·".join(([number] if number != "1" or not top else []) + top)
            parts.append(head + "".join(f"/{b}" for b in bottom))
        return " + ".join(parts).replace("+ -", "- ")


def evaluator(terms: Mapping[Powers, float]) -> Callable[[Mapping[str, Number]], float]:
    """`terms` as one generated Python function of the sizes, the exact sum (`math.fsum`) of
    each coefficient times its product of sizes, in the order `math.prod` multiplies them. The
    planner evaluates formulas some 440,000 times for chapter 12's plans; generated, each
    evaluation takes a fifth of the time a walk over the terms took, and those plans 2.2 s
    instead of 3.7 s. The names come from the cost model's own formulas, written in as `repr`
    literals."""
    products = [
        f"_c[{i}] * (" + " * ".join([f"_f(s[{n!r}]) ** {p}" for n, p in powers] or ["1"]) + ")"
        for i, powers in enumerate(terms)
    ]
    source = f"lambda s: _fsum(({''.join(f'{t}, ' for t in products)}))"
    scope = {"_fsum": math.fsum, "_f": float, "_c": tuple(terms.values())}
    return eval(source, scope)  # the source is built above from names and integers only
