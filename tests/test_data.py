"""The generated corpus and step-indexed batches placed on the data axes."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.placement.mesh import make_mesh
from nnxscale.train.data import Batches, arithmetic_text, check_batch_splits, decode, encode


def test_corpus_is_deterministic_and_correct() -> None:
    text = arithmetic_text(50, seed=3)
    assert text == arithmetic_text(50, seed=3) != arithmetic_text(50, seed=4)
    for line in text.rstrip(";").split(";"):
        lhs, result = line.split("=")
        assert eval(lhs) == int(result)


def test_encode_decode_round_trip() -> None:
    assert decode(encode("12+3=15;")) == "12+3=15;"
    assert encode("=").dtype == np.int32


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches(encode(arithmetic_text(500)), batch_size=16, length=12, seed=1)


def test_batches_are_a_function_of_step_and_row(batches: Batches) -> None:
    whole = batches.rows(5)
    assert whole.shape == (16, 13)
    np.testing.assert_array_equal(batches.rows(5, 4, 8), whole[4:8])
    np.testing.assert_array_equal(batches.rows(5), whole)
    assert not np.array_equal(batches.rows(6), whole)


def test_placed_batches_are_split_over_data(batches: Batches) -> None:
    mesh = make_mesh((4, 2), ("data", "model"))
    array = batches(2, NamedSharding(mesh, P("data", None)))
    np.testing.assert_array_equal(np.asarray(array), batches.rows(2))
    assert {s.data.shape for s in array.addressable_shards} == {(4, 13)}


def test_a_batch_the_data_axis_cannot_split(batches: Batches) -> None:
    mesh = make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"batch of 12 rows .* 8 devices .*multiple of 8"):
        check_batch_splits(12, NamedSharding(mesh, P("data", None)))
    odd = Batches(batches.tokens, batch_size=12, length=12)
    with pytest.raises(ValueError, match="cannot be split"):
        odd(0, NamedSharding(mesh, P("data", None)))
    with pytest.raises(ValueError, match="cannot be split"):  # was JAX's IndivisibleError
        odd.local_rows(NamedSharding(mesh, P("data", None)))


def test_too_short_a_corpus() -> None:
    with pytest.raises(ValueError, match="too short"):
        Batches(encode("1+1=2;"), 2, 10)


def test_one_process_loads_every_row() -> None:
    mesh = make_mesh((8,), ("data",), explicit=False)
    sharding = NamedSharding(mesh, P("data", None))
    batches = Batches(encode(arithmetic_text(200)), batch_size=16, length=8)
    assert batches.local_rows(sharding) == (0, 16)
