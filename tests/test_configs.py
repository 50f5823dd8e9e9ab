"""Published configurations count exactly the parameters their releases state."""

from __future__ import annotations

import pytest
from flax import nnx

import nnxscale as nx
from nnxscale.costs import counts


@pytest.mark.parametrize("name", list(nx.configs.PUBLISHED))
def test_each_published_configuration_counts_its_release_exactly(name: str) -> None:
    cfg, published = nx.configs.PUBLISHED[name]
    model = nnx.eval_shape(lambda: nx.create(cfg))  # abstract: nothing is allocated
    assert nx.model.count_params(model) == published
    assert counts(cfg).total == published  # the cost model's formula agrees


def test_llama3_8b_is_the_count_the_issue_names() -> None:
    assert counts(nx.configs.LLAMA3_8B).total == 8_030_261_248


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_heads": 3}, "kv_heads=3 does not divide heads=4"),
        ({"head_dim": 15}, "head_dim=15 is odd"),
        ({"layers": 0}, "layers=0: every size must be a positive integer"),
        ({"embed": -64}, "embed=-64"),
        ({"mlp": 2.5}, "mlp=2.5"),
        ({"rope_theta": 0.5}, "rope_theta=0.5"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"param_dtype": "int8"}, "param_dtype='int8'"),
        ({"experts": -2}, "experts=-2: use 0 for a dense MLP"),
        ({"experts": 4, "top_k": 5}, "top_k=5 with 4 experts: use 1 <= top_k <= 4"),
        ({"experts": 4, "top_k": 0, "routing": "dropless"}, "top_k=0 with 4 experts"),
        ({"experts": 4, "capacity_factor": 0.0}, "the capacity factor must be positive"),
    ],
)
def test_bad_configurations_are_refused_when_made(change: dict, message: str) -> None:
    """Before a parameter is made: a mixture with k above its experts too, which would
    otherwise fail only when the first batch is routed."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        nx.TINY.replace(**change)
