"""Rule sets resolved against the book's model and plain pytrees: specs, fallbacks, errors."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from nnxscale import TINY, Config, create
from nnxscale.placement.catalogue import CP, DP, FSDP, FSDP_TP, HSDP, PP, RULE_SETS, TP, ZERO2
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import largest_divisible_dim, resolve
from nnxscale.placement.mesh import make_mesh
from nnxscale.placement.rules import RuleError, Rules, auto_fsdp, compare

GOLDEN = Path(__file__).parent / "golden"
MESHES = {"DP": (8, 1), "FSDP": (8, 1), "TP": (4, 2), "FSDP+TP": (4, 2)}


def params(cfg: Config = TINY) -> nnx.State:
    return nnx.state(abstract(lambda: create(cfg)), nnx.Param)


def mesh_for(shape: tuple[int, int]):
    return make_mesh(shape, ("data", "model"), explicit=False)


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
@pytest.mark.parametrize("name", list(RULE_SETS))
def test_golden_layouts(name: str, scan: bool) -> None:
    """The resolved spec of every parameter, against a reviewed snapshot in tests/golden/."""
    layout = resolve(
        params(TINY.replace(scan_layers=scan)), RULE_SETS[name], mesh_for(MESHES[name])
    )
    text = (
        "".join(f"{p.path} {tuple(p.spec)} {p.shard_shape}\n" for p in layout.placements)
        + f"bytes per device {layout.bytes_per_device()} of {layout.total_bytes()}\n"
    )
    golden = GOLDEN / f"{name.replace('+', '_')}_{'scan' if scan else 'list'}.txt"
    if os.environ.get("NNXSCALE_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"the {name} layout changed; if that is intended, review the diff and rerun with "
        "NNXSCALE_UPDATE_GOLDEN=1"
    )


def test_bytes_per_device_against_the_ideal() -> None:
    state = params()
    dp = resolve(state, DP, mesh_for((8, 1)))
    fsdp = resolve(state, FSDP, mesh_for((8, 1)))
    assert dp.bytes_per_device() == dp.total_bytes() == 4 * 139_584
    assert fsdp.bytes_per_device() * 8 == fsdp.total_bytes()  # every TINY dimension divides
    tp = resolve(state, TP, mesh_for((4, 2)))
    assert tp.bytes_per_device() == (tp.total_bytes() + tp.replicated_bytes()) // 2


def test_fallbacks_are_tried_in_order_and_explained() -> None:
    odd = TINY.replace(mlp=6)
    layout = resolve(params(odd), FSDP_TP, mesh_for((2, 4)))
    down = layout["blocks/0/mlp/down"]  # (mlp, embed): mlp model(4) fails, data(2) fits
    assert tuple(down.spec) == ("data", None)
    assert "mlp=6: model (4) does not divide it, so data" in down.reason
    assert "embed=64: data already splits another dimension, so replicated" in down.reason
    up = layout["blocks/0/mlp/up"]  # (embed, mlp): embed takes data first, mlp has nothing left
    assert tuple(up.spec) == ("data", None)


def test_strict_rules_refuse_an_indivisible_dimension() -> None:
    with pytest.raises(RuleError, match=r"blocks/0/attention/key: dimension kv_heads=1 .*strict"):
        resolve(params(TINY.replace(kv_heads=1)), TP.replace(strict=True), mesh_for((4, 2)))


def test_unknown_logical_axis_names_the_array_and_the_fix() -> None:
    rules = Rules("partial", {"embed": ("data",)})
    first = r"'kv_heads' \(first at blocks/0/attention/key\)"
    with pytest.raises(RuleError, match=rf"no rule for the logical axes {first}.*'kv_heads': \(\)"):
        resolve(params(), rules, mesh_for((8, 1)))


def test_mesh_axis_missing_from_the_mesh() -> None:
    with pytest.raises(RuleError, match=r"uses mesh axes \['model'\] .*size 1 is fine"):
        resolve(params(), TP, make_mesh((8,), ("data",)))


def test_wrong_number_of_names_from_a_path_rule() -> None:
    rules = FSDP.replace(paths=((r"^head$", ("embed",)),))
    with pytest.raises(
        RuleError, match=r"head: 1 logical names \('embed',\) for an array of shape"
    ):
        resolve(params(), rules, mesh_for((8, 1)))


def test_path_rules_override_annotations() -> None:
    rules = FSDP.replace(paths=((r"^(embed|head)$", (None, None)),))
    layout = resolve(params(), rules, mesh_for((8, 1)))
    assert tuple(layout["head"].spec) == (None, None)
    assert tuple(layout["blocks/0/mlp/up"].spec) == ("data", None)


def test_path_rules_name_a_plain_pytree() -> None:
    tree = {"dense": {"kernel": jnp.zeros((16, 32)), "bias": jnp.zeros((32,))}}
    rules = Rules(
        "plain", {"in": (), "out": ("model",)},
        paths=((r"kernel$", ("in", "out")), (r"bias$", ("out",))),
    )  # fmt: skip
    layout = resolve(tree, rules, mesh_for((4, 2)))
    assert tuple(layout["dense/kernel"].spec) == (None, "model")
    assert layout["dense/bias"].shard_shape == (16,)


def test_automatic_fsdp_on_a_tree_without_annotations() -> None:
    tree = {"w": jnp.zeros((12, 64)), "b": jnp.zeros((3,)), "sq": jnp.zeros((16, 16))}
    layout = resolve(tree, auto_fsdp("data"), make_mesh((8,), ("data",)))
    assert tuple(layout["w"].spec) == (None, "data")
    assert tuple(layout["sq"].spec) == ("data", None)  # equal sizes: the first
    assert tuple(layout["b"].spec) == (None,) and "replicated" in layout["b"].reason
    assert (layout["w"].pieces, layout["sq"].pieces, layout["b"].pieces) == (8, 8, 1)
    specs = layout.specs
    assert specs["w"] == layout["w"].spec


def test_largest_divisible_dim() -> None:
    assert largest_divisible_dim((12, 64), 8) == 1
    assert largest_divisible_dim((64, 64), 8) == 0
    assert largest_divisible_dim((3, 5), 2) is None
    assert largest_divisible_dim((4,), 8) is None
    assert largest_divisible_dim((), 8) is None


def test_unknown_path_lookup() -> None:
    with pytest.raises(KeyError, match="no array at 'nope'"):
        resolve(params(), DP, mesh_for((8, 1)))["nope"]


def test_markdown_table_lists_every_array() -> None:
    layout = resolve(params(), FSDP, mesh_for((8, 1)))
    table = layout._repr_markdown_()
    assert table.count("\n| ") == len(layout.placements) + 1
    assert "12.5%" in table.splitlines()[0]


def test_compare_lists_candidates_in_order() -> None:
    text = compare(DP, FSDP_TP)
    assert "| mlp | replicated | model then data |" in text
    assert "| batch | data | data |" in text
    assert "(no rule)" in compare(DP, Rules("x", {"foo": ()}))


def test_random_key_state_is_placed_like_any_scalar() -> None:
    layout = resolve(nnx.state(nnx.Rngs(dropout=0)), FSDP, mesh_for((8, 1)))
    assert layout["dropout/key"].dtype == "key<fry>"
    assert layout["dropout/key"].bytes_per_device == 8 and tuple(layout["dropout/key"].spec) == ()


def test_zero_stages_keep_their_roles_whole():
    import optax

    from nnxscale.placement.catalogue import HSDP, ZERO1, ZERO2
    from nnxscale.placement.rules import role_of
    from nnxscale.train import TrainState

    assert role_of("optimizer/opt_state/0/mu/embed") == "optimizer"
    assert role_of("ema/embed") == "optimizer" and role_of("model/embed") == "params"
    state = nnx.state(abstract(lambda: TrainState(create(TINY), optax.adamw(1e-3))))
    for rules in (ZERO1, ZERO2):
        layout = resolve(state, rules, mesh_for((8, 1)))
        for p in layout.placements:
            if p.path.startswith("model/"):
                assert p.pieces == 1 and "keeps params whole" in p.reason
            elif p.path.startswith(("ema/", "optimizer/")) and len(p.shape) > 1:
                assert p.pieces == 8, p.path
    grads = resolve(params(), ZERO2, mesh_for((8, 1)), role="grads")
    assert all(p.pieces == 8 for p in grads.placements if len(p.shape) > 1)
    grads = resolve(params(), ZERO1, mesh_for((8, 1)), role="grads")
    assert all(p.pieces == 1 for p in grads.placements)
    assert HSDP.logical["batch"] == (("replica", "data"),)


def test_unknown_roles_are_named():
    with pytest.raises(RuleError, match="names roles \\['weights'\\]"):
        FSDP.replace(whole=("weights",))


def test_token_axes_are_those_of_the_batch_and_the_sequence() -> None:
    assert FSDP.token_axes(("data", "model")) == ("data",)
    assert TP.token_axes(("data", "model")) == ("data",)
    assert HSDP.token_axes(("replica", "data")) == ("replica", "data")
    assert CP.token_axes(("data", "context")) == ("data", "context")
    assert PP.token_axes(("stage",)) == ()


def test_a_weight_is_read_gathered_over_the_token_axes_only() -> None:
    from jax.sharding import AbstractMesh, AxisType

    from nnxscale.placement.constraints import weight_axes

    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    names = ("embed", "heads", "head_dim")
    stored, read = weight_axes((64, 4, 16), names, FSDP_TP, mesh)
    assert stored == [("data",), ("model",), None] and read == [None, ("model",), None]
    stored, read = weight_axes((64, 4, 16), names, ZERO2, mesh)
    assert stored == read == [None, None, None]  # ZeRO keeps parameters whole


def test_axes_of_flattens_a_logical_axis_candidates() -> None:
    from nnxscale.placement.catalogue import FSDP_TP, HSDP, PP_FSDP_TP

    assert FSDP_TP.axes_of("mlp") == ("model", "data")
    assert HSDP.axes_of("batch") == ("replica", "data")
    assert PP_FSDP_TP.axes_of("residual_length") == ("model",)
    assert PP_FSDP_TP.axes_of("no such axis") == ()
