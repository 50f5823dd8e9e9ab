"""What `nnxscale.diagnose` reads off JAX: compilations and why the cache missed, the first
operation that made a NaN, and the devices a call kept busy; and the `show` helpers that
print an error or a warning as a reader sees it."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale import diagnose
from nnxscale.core.show import raised, warned
from nnxscale.figures import BREAKS, plot_failures
from nnxscale.placement.mesh import make_mesh


def test_a_new_shape_compiles_again_and_the_miss_says_which_argument(capsys) -> None:
    @jax.jit
    def doubled(x: jax.Array) -> jax.Array:
        return 2 * x

    propagate = logging.getLogger("jax").propagate
    with diagnose.compiles() as seen:
        doubled(jnp.ones(3))
        doubled(jnp.ones(3))  # cached: no compilation, no miss
        doubled(jnp.ones(5))
    assert [c.types for c in seen.of("doubled")] == [
        "(ShapedArray(float32[3]),)",
        "(ShapedArray(float32[5]),)",
    ]
    assert "never seen function" in seen.misses[0]
    assert "different input types" in seen.misses[1] and "f32[5]" in seen.misses[1]
    assert capsys.readouterr().err == ""  # recorded, not printed
    assert logging.getLogger("jax").propagate is propagate
    with diagnose.compiles() as again:
        doubled(jnp.ones(5))
    assert again.of("doubled") == [] and again.misses == []


def test_the_first_nan_names_its_operation_and_the_callers_line() -> None:
    def loss(x: jax.Array) -> jax.Array:
        shifted = x - 2.0
        return jnp.sum(jnp.sqrt(shifted))  # NaN below 2

    first = diagnose.first_nan(jax.jit(loss), jnp.array([3.0, 1.0]))
    assert first is not None
    assert "sqrt" in first.message and "jnp.sqrt(shifted)" in first.code
    assert diagnose.first_nan(jax.jit(loss), jnp.array([3.0, 4.0])) is None
    assert not jax.config.jax_debug_nans  # turned off again


def test_busy_devices_sees_one_device_for_unplaced_inputs_and_all_for_split_ones() -> None:
    mesh = make_mesh((jax.device_count(),), ("data",))
    a = jnp.ones((16 * jax.device_count(), 64))
    square = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a)
    placed = jax.device_put(a, NamedSharding(mesh, P("data")))
    assert set(diagnose.busy_devices(lambda: square(a))) == {a.devices().pop().id}
    assert set(diagnose.busy_devices(lambda: square(placed))) == {d.id for d in jax.devices()}


def test_raised_prints_the_error_returns_it_and_fails_when_nothing_is_raised(capsys) -> None:
    error = raised(lambda: int("x"), ValueError, width=200)
    assert isinstance(error, ValueError)
    assert capsys.readouterr().out == f"ValueError: {error}\n"
    by_name = raised(lambda: np.zeros(2)[5], "IndexError")
    assert isinstance(by_name, IndexError)
    with pytest.raises(AssertionError, match="expected ValueError, and nothing was raised"):
        raised(lambda: None, ValueError)
    with pytest.raises(KeyError):  # another kind goes through
        raised(lambda: {}["k"], ValueError)
    with pytest.raises(KeyError):
        raised(lambda: {}["k"], "ValueError")


def test_warned_returns_the_result_and_the_warning_and_fails_without_one(capsys) -> None:
    def warns() -> int:
        warnings.warn("careful", RuntimeWarning, stacklevel=1)
        return 7

    result, warning = warned(warns, RuntimeWarning)
    assert result == 7 and str(warning) == "careful"
    assert capsys.readouterr().out == "RuntimeWarning: careful\n"
    with pytest.raises(AssertionError, match="expected a UserWarning"):
        warned(warns, UserWarning)


def test_the_failure_map_draws_a_box_per_error_and_refuses_an_unknown_raiser() -> None:
    matplotlib.use("Agg")
    fig = plot_failures({"a": [("E1", "JAX"), ("E2", "nnxscale")], "b": [("E3", "none")]})
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"a", "b", "E1", "E2", "E3"} <= labels
    assert len(fig.axes[0].patches) == 3
    with pytest.raises(ValueError, match=r"raisers \['someone'\] unknown"):
        plot_failures({"a": [("E", "someone")]})


def test_the_appendix_map_draws_every_stage_it_lists() -> None:
    import matplotlib.pyplot as plt

    fig = plot_failures(BREAKS)
    drawn = {text.get_text() for text in fig.axes[0].texts}
    assert set(BREAKS) <= drawn and {name for e in BREAKS.values() for name, _ in e} <= drawn
    plt.close(fig)
