"""Formulas in named sizes: the algebra the cost model derives with and the calculator reads."""

from __future__ import annotations

import copy
import json
import math
import pickle
import random

import pytest

from nnxscale.costs.formula import Formula

SIZES = {"vocab": 32000, "embed": 4096, "data": 8, "seq": 4096, "context": 4}


def test_a_table_split_over_data() -> None:
    table = Formula.product(["vocab", "embed"], 4) / "data"
    assert table(SIZES) == 4 * 32000 * 4096 / 8
    assert table.names() == {"vocab", "embed", "data"}
    assert repr(table) == "4·embed·vocab/data"


def test_sums_products_and_differences_collect_like_terms() -> None:
    a = Formula.of("embed") * 3 + Formula.of("embed") * 2
    assert a == Formula.of("embed") * 5
    assert (a - a).terms == {}
    square = (Formula.of("seq") + 1) * (Formula.of("seq") - 1)
    assert square(SIZES) == 4096**2 - 1
    assert 2 * Formula.of("seq") + 1 == Formula.of("seq") * 2 + 1


def test_replace_writes_a_size_through_others() -> None:
    chunk = Formula.product(["chunk", "chunk", "context"], 8)  # 8 chunk^2 context
    per_device = chunk.replace("chunk", {"seq": 1, "context": -1})
    assert per_device == Formula.product(["seq", "seq"], 8) / "context"
    assert per_device(SIZES) == 8 * 4096**2 / 4


def test_json_round_trips_every_term() -> None:
    f = Formula.product(["embed", "vocab"], 2) / "data" + 7
    terms = json.loads(json.dumps(f.json()))
    rebuilt = sum((Formula({tuple(sorted(p.items())): c}) for c, p in terms), Formula())
    assert rebuilt == f


def test_a_missing_size_is_named() -> None:
    with pytest.raises(KeyError, match=r"needs sizes \['model'\]"):
        (Formula.of("embed") / "model")({"embed": 4})


def test_the_generated_evaluation_is_the_term_walk_bit_for_bit() -> None:
    """Each term's product in `math.prod`'s order, times its coefficient, summed exactly:
    what the cost model's numbers were before evaluation was generated."""
    rng = random.Random(0)
    names = sorted(SIZES)
    for _ in range(200):
        terms = {
            tuple(
                sorted({n: rng.choice([-2, -1, 1, 2, 3]) for n in rng.sample(names, k)}.items())
            ): rng.uniform(-1e3, 1e3)
            for k in (0, 1, 2, 3, 5)
        }
        f = Formula(terms)
        walked = math.fsum(
            c * math.prod(float(SIZES[n]) ** p for n, p in powers) for powers, c in terms.items()
        )
        assert f(SIZES) == walked
    assert Formula()(SIZES) == 0.0
    assert Formula.of(float("inf"))({}) == float("inf")  # a coefficient no literal spells


def test_an_evaluated_formula_pickles_and_copies_as_its_terms() -> None:
    f = Formula.product(["embed", "vocab"], 2) / "data"
    value = f(SIZES)  # its evaluation is generated now
    for again in (pickle.loads(pickle.dumps(f)), copy.deepcopy(f)):
        assert again == f and again(SIZES) == value
