"""The activation ledger is what JAX's autodiff keeps: traced formulas checked at other sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from nnxscale import Config, activations, create, moe
from nnxscale.core.memory import residual_arrays
from nnxscale.costs.formula import Formula
from nnxscale.model.losses import next_token_loss
from nnxscale.placement.catalogue import CP
from nnxscale.placement.constraints import activation_rules

OTHER = dict(vocab=96, embed=48, heads=6, kv_heads=3, head_dim=8, mlp=80, layers=3)
"""Sizes the calibration never saw: none is one of its primes."""


def kept_bytes(cfg: Config, batch: int, seq: int, ring: int = 0) -> int:
    """Bytes autodiff keeps for the loss of `cfg` on `batch` x `seq` tokens, traced."""
    model = nnx.eval_shape(lambda: create(cfg))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def loss(p, t):
        return next_token_loss(nnx.merge(graphdef, p, rest), t, None)

    if not ring:
        arrays = residual_arrays(loss, params, tokens)
    else:
        mesh = AbstractMesh((1, ring), CP.axes, axis_types=(AxisType.Auto,) * 2)
        with activation_rules(CP, mesh):
            arrays = residual_arrays(loss, params, tokens)
    return sum(a.size * a.dtype.itemsize for a in arrays)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", [False, "full", "dots"])
def test_the_formulas_give_autodiffs_bytes_at_sizes_never_traced(dtype: str, remat) -> None:
    batch, seq = 4, 10
    cfg = Config(**OTHER, max_len=seq, scan_layers=True, remat=remat, compute_dtype=dtype)
    k = activations.kept(dtype, remat)
    sizes = {**OTHER, "batch": batch, "seq": seq}
    copies = k.weights * "layers" + k.head_weights if dtype != "float32" else 0
    predicted = (k.layer * "layers" + k.model + copies)(sizes)
    assert predicted == kept_bytes(cfg, batch, seq)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", [False, "full", "dots"])
@pytest.mark.parametrize("top_k, factor", [(1, 1.0), (2, 1.5), (3, 2.0)])
def test_a_mixtures_formulas_give_autodiffs_bytes_at_sizes_never_traced(
    dtype: str, remat, top_k: int, factor: float
) -> None:
    batch, seq, experts = 4, 10, 6
    cfg = Config(
        **OTHER, max_len=seq, scan_layers=True, remat=remat, compute_dtype=dtype,
        experts=experts, top_k=top_k, capacity_factor=factor,
    )  # fmt: skip
    k = activations.kept(dtype, remat, moe=activations.mixture(cfg))
    slots = moe.capacity(seq, experts, top_k, factor)
    sizes = {**OTHER, "batch": batch, "seq": seq, "experts": experts, "capacity": slots}
    sizes["top_k"] = top_k
    copies = k.weights * "layers" + k.head_weights if dtype != "float32" else 0
    predicted = (k.layer * "layers" + k.model + copies)(sizes)
    assert predicted == kept_bytes(cfg, batch, seq)


def test_a_mixture_keeps_two_arrays_of_slots_whatever_its_choices() -> None:
    """The dispatch and its gated copy, the combine: batch x seq x experts x capacity float32
    values each, which grow like attention's scores (capacity grows with seq); what each
    choice adds is only tokens x experts."""
    one, two = (activations.kept(moe=m) for m in (1, 2))
    slots = Formula.product(["batch", "seq", "experts", "capacity"], 8)
    for k in (one, two):
        (term,) = [t for t in k.layer.terms if {"capacity", "seq"} <= dict(t).keys()]
        assert Formula({term: k.layer.terms[term]}) == slots
    per_choice = [t for t in two.layer.terms if "top_k" in dict(t)]
    assert per_choice and all("capacity" not in dict(t) for t in per_choice)
    with pytest.raises(ValueError, match="mixture of experts under context parallelism"):
        activations.kept(ring=True, moe=1)


@pytest.mark.parametrize("ring", [2, 4])
def test_the_rings_formulas_give_autodiffs_bytes_at_other_ring_sizes(ring: int) -> None:
    batch, seq = 4, 4 * ring * 3
    cfg = Config(**OTHER, max_len=seq, scan_layers=True)
    k = activations.kept("float32", False, ring=True)
    sizes = {**OTHER, "batch": batch, "seq": seq, "context": ring, "chunk": seq // ring}
    whole = (k.layer * "layers" + k.model)(sizes)
    per_device_blocks = k.local(sizes)  # the ring's blocks, one set per device of the ring
    assert whole + ring * per_device_blocks == kept_bytes(cfg, batch, seq, ring)


def test_remat_keeps_layer_inputs_and_rebuilds_the_rest() -> None:
    whole, full = activations.kept(), activations.kept("float32", "full")
    assert full.layer == Formula.product(["batch", "seq", "embed"], 4)
    assert full.layer + full.rebuilt == whole.layer
    dots = activations.kept("float32", "dots")  # the products' outputs
    assert dots.layer + dots.rebuilt == whole.layer
    # the blockwise attention keeps no score: nothing a layer keeps grows with seq^2
    assert all(dict(term).get("seq", 0) < 2 for term in whole.layer.terms)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", [False, "full", "dots"])
def test_the_residual_stream_is_what_sequence_parallelism_splits(dtype: str, remat) -> None:
    """Traced under TP+SP on Explicit axes, the arrays whose sequence is split are the
    stream's: in `batch x seq` and `embed` only, part of what each layer keeps, at least the
    textbook's 4E values a token (two norms' inputs and outputs) without remat, and with full
    remat all of it (a layer's input)."""
    k = activations.kept(dtype, remat)
    for part in ("layer", "model"):
        stream, whole = k.on_stream(part), getattr(k, part)
        assert stream.terms and all(
            set(dict(term)) <= {"batch", "seq", "embed"} and "seq" in dict(term)
            for term in stream.terms
        )
        assert all(0 < c <= whole.terms[term] for term, c in stream.terms.items())
    width = jnp.dtype(dtype).itemsize
    values = k.on_stream("layer").terms[(("batch", 1), ("embed", 1), ("seq", 1))] / width
    assert values >= (4 if remat is False else 1)
    if remat == "full":
        assert k.on_stream("layer") == k.layer
    assert activations.kept(ring=True).stream == activations.kept().stream
    assert activations.kept(moe=1).stream is None  # a mixture under SP is not traced


def test_a_size_the_calibration_cannot_name_is_an_error() -> None:
    assert activations.factor(2 * 3 * 3) == {"batch": 1, "seq": 2}
    with pytest.raises(ValueError, match="not a product of the traced sizes"):
        activations.factor(4 * 23)


def test_each_trace_is_made_once_whatever_the_dtypes_that_read_it() -> None:
    policy, dropout = "dots", True  # with dropout: no other test of this module traces it
    before = activations._trace.cache_info().misses
    streams = activations._stream.cache_info().misses
    float32 = activations.kept("float32", policy, dropout)
    bfloat16 = activations.kept("bfloat16", policy, dropout)
    # float32 and bfloat16, with the policy and without it (for `rebuilt`): 4, not 8
    assert activations._trace.cache_info().misses - before == 4
    assert activations._stream.cache_info().misses - streams == 4  # the same, on the stream
    assert float32.layer != bfloat16.layer
