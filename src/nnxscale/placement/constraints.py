"""Sharding constraints inside a step: the activation rules in force while a step is traced,
`constrain` and the placed einsum and lookup that follow them, and the axes weights and
activations take (a layout places stored arrays; this places what flows between them)."""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscale.placement.layout import place_array, place_logical, spec_entry
from nnxscale.placement.mesh import axis_kind, constrain_to
from nnxscale.placement.rules import Rules

_ACTIVE: contextvars.ContextVar[tuple[Rules, Mesh] | None] = contextvars.ContextVar(
    "nnxscale_activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(rules: Rules | None, mesh: Mesh | None = None):
    """While active, `constrain` places activations by `rules` on `mesh` (the Trainer enters
    it while it traces a step, so one rule set places parameters and activations alike);
    `activation_rules(None)` turns the constraints off."""
    token = _ACTIVE.set(None if rules is None else (rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _active() -> tuple[Rules, Mesh] | None:
    """The active rules and mesh; none inside `jax.shard_map`, where each device places nothing."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None
    return _ACTIVE.get()


def activation_spec(
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    beside: tuple[tuple[int, str], ...] = (),
) -> tuple[PartitionSpec, Mesh] | None:
    """The partition spec the active rules give an activation of `shape` with logical `names`
    (names the rules do not know stay whole), and the mesh; None when no rules are active.
    `beside` holds (size, name) dimensions placed first and then dropped: an array read
    alongside them, such as the table a batch's lookup indexes, stays off their mesh axes."""
    active = _active()
    if active is None:
        return None
    rules, mesh = active
    lead = tuple(size for size, _ in beside)
    every = tuple(name for _, name in beside) + tuple(names)
    chosen = activation_axes(lead + tuple(shape), every, rules, mesh)
    return _spec(chosen[len(lead) :]), mesh


ROUTED = ("experts",)
"""Logical weight dimensions that stay split where the tokens are split too: the tokens travel
to their experts (an all-to-all) instead of the weights to the tokens."""

Axes = list[tuple[str, ...] | None]
"""The mesh axes splitting each dimension of an array (None: whole)."""


def weight_axes(
    shape: tuple[int, ...], names: tuple[str | None, ...], rules: Rules, mesh: Mesh
) -> tuple[Axes, Axes]:
    """Where `rules` store a parameter of `shape` with logical `names` on `mesh` (as `resolve`
    places it, ZeRO's whole parameters included), and where a computation reads it: the
    stored axes less those that split the tokens (`Rules.token_axes`), whose dimensions are
    gathered first (FSDP), except routed ones (`ROUTED`)."""
    stored, _, _ = place_array("weight", tuple(shape), tuple(names), rules, mesh, "params")
    tokens = set(rules.token_axes(mesh.axis_names))
    read = [
        axes if not axes or name in ROUTED else (tuple(a for a in axes if a not in tokens) or None)
        for axes, name in zip(stored, names, strict=True)
    ]
    return stored, read


def activation_axes(
    shape: tuple[int, ...], names: tuple[str | None, ...], rules: Rules, mesh: Mesh
) -> Axes:
    """The mesh axes `rules` give each dimension of an activation with logical `names` on
    `mesh` (names the rules do not know stay whole)."""
    known = tuple(n if n is not None and n in rules.logical else None for n in names)
    chosen, _, _ = place_logical("activation", tuple(shape), known, rules, mesh)
    return chosen


def weight_layout(
    shape: tuple[int, ...], names: tuple[str | None, ...] | None
) -> tuple[PartitionSpec, PartitionSpec, Mesh] | None:
    """The stored and read partition specs (`weight_axes`) the active rules give a parameter,
    and the mesh; None when no rules are active."""
    active = _active()
    if active is None or names is None:
        return None
    rules, mesh = active
    stored, read = weight_axes(shape, names, rules, mesh)
    return _spec(stored), _spec(read), mesh


def _spec(axes: Axes) -> PartitionSpec:
    return PartitionSpec(*(spec_entry(a) for a in axes))


def activation_axis(name: str) -> tuple[str, int] | None:
    """The mesh axis (and its size, above 1) that the active rules split logical axis `name`
    of activations over, if any: how the model finds its context-parallel axis."""
    active = _active()
    if active is None or not active[0].logical.get(name):
        return None
    rules, mesh = active
    first = rules.candidates(name, "activation")[0]
    if len(first) != 1 or first[0] not in mesh.shape or mesh.shape[first[0]] == 1:
        return None
    return first[0], mesh.shape[first[0]]


def constrain(
    x: jax.Array, names: tuple[str | None, ...], beside: tuple[tuple[int, str], ...] = ()
) -> jax.Array:
    """`x` constrained to the layout its logical names get under the active rules (next to
    the `beside` dimensions, as in `activation_spec`); `x` itself when no rules are active."""
    placed = activation_spec(x.shape, names, beside)
    if placed is None:
        return x
    spec, mesh = placed
    return constrain_to(x, NamedSharding(mesh, spec))


def _explicit() -> bool:
    """Whether rules are active on a mesh whose axes are Explicit."""
    active = _active()
    return active is not None and axis_kind(active[1]) == "explicit"


def placed_einsum(
    subscripts: str, a: jax.Array, b: jax.Array, names: tuple[str | None, ...]
) -> jax.Array:
    """`jnp.einsum(subscripts, a, b)`, its output placed where its logical `names` go under the
    active rules when the mesh's axes are Explicit: there the layout is part of the product's
    type (`out_sharding=`), which JAX requires where the inputs leave it open, as a contraction
    split on both sides (tensor parallelism's second product) does. On Auto axes, or with no
    rules active, the plain product: the compiler places it."""
    if not _explicit():
        return jax.numpy.einsum(subscripts, a, b)
    inputs, output = subscripts.split("->")
    sizes = dict(zip(inputs.split(",")[0], a.shape, strict=True))
    sizes.update(zip(inputs.split(",")[1], b.shape, strict=True))
    spec, mesh = activation_spec(tuple(sizes[letter] for letter in output), names)
    return jax.numpy.einsum(subscripts, a, b, out_sharding=NamedSharding(mesh, spec))


def placed_lookup(
    table: jax.Array,
    rows: jax.Array,
    names: tuple[str | None, ...],
    beside: tuple[tuple[int, str], ...] = (),
) -> jax.Array:
    """`table[rows]`, the lookup of an embedding, its output placed by its logical `names`
    (next to the `beside` dimensions, as in `activation_spec`) on Explicit axes: a gather
    whose layout JAX does not choose when the table is split (`.at[rows].get(out_sharding=)`).
    The plain lookup on Auto axes or with no rules active."""
    if not _explicit():
        return table[rows]
    spec, mesh = activation_spec((*rows.shape, *table.shape[1:]), names, beside)
    return table.at[rows].get(out_sharding=NamedSharding(mesh, spec))


def alongside(w: jax.Array, x: jax.Array) -> jax.Array:
    """Weight `w` ready to meet activation `x` in an elementwise operation (a norm's scale, a
    position embedding). On Explicit axes a weight read as `reduced` (`train.unreduced_grads`)
    may not meet an array split over the axes it is reduced on; broadcast to `x`'s shape and
    split as `x` is, it may, and its gradient stays unreduced. Any other `w` as it is."""
    kind = jax.typeof(w).sharding
    if not getattr(kind.spec, "reduced", None):
        return w
    return jax.sharding.reshard(jax.numpy.broadcast_to(w, x.shape), jax.typeof(x).sharding)


def per_row(index: jax.Array, rows: jax.Array) -> jax.Array:
    """`index` (one entry per column of `rows`, such as each token's position) broadcast to
    `rows`'s shape and split as `rows` is, on Explicit axes: each device then looks up its own
    rows' entries, and a table read as `reduced` (`train.unreduced_grads`) gets its gradient
    unreduced, where a lookup shared by every row would be summed over the rows' axis at once.
    `index` as it is on Auto axes or with no rules active."""
    if not _explicit():
        return index
    return jax.numpy.broadcast_to(index, rows.shape, out_sharding=jax.typeof(rows).sharding)
