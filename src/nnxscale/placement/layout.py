"""Resolving a rule set against a model and a mesh: a spec, shard shape and byte count per array."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core.spmd import composite_rules, get_logical_axis_rules
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscale.core.show import table
from nnxscale.core.trees import flat
from nnxscale.placement.mesh import axis_kind
from nnxscale.placement.rules import RuleError, Rules, role_of


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one array goes: its logical names, mesh spec, per-device shape and bytes, and why."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None
    spec: PartitionSpec
    shard_shape: tuple[int, ...]
    bytes_per_device: int
    total_bytes: int
    reason: str
    fallback: bool = False
    """Whether the array is split less than the rules intend: a dimension they asked to split
    could not be (no candidate divides it), or it has no names where others are split."""

    @property
    def pieces(self) -> int:
        """Into how many different blocks the array is cut (1: every device holds it whole)."""
        return math.prod(self.shape) // math.prod(self.shard_shape)


def largest_divisible_dim(shape: tuple[int, ...], size: int) -> int | None:
    """The largest dimension that `size` divides (the first of equals), or None."""
    fits = [d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def _axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def spec_entry(axes: tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    """One dimension's entry of a `PartitionSpec`: None, one mesh axis, or a tuple of them."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def place_logical(
    path: str,
    shape: tuple[int, ...],
    logical: tuple[str | None, ...],
    rules: Rules,
    mesh: Mesh,
    flax: dict[str, object] | None = None,
) -> tuple[list[tuple[str, ...] | None], list[str], bool]:
    """Mesh axes for each dimension of an array named `logical`, by Flax's rules (`flax`)
    and then `rules`; the notes on what could not be split, and whether any could not."""
    if len(logical) != len(shape):
        raise RuleError(
            f"{path}: {len(logical)} logical names {logical} for an array of shape {shape}; "
            "give one name (or None) per dimension."
        )
    chosen: list[tuple[str, ...] | None] = []
    notes: list[str] = []
    used, short = set[str](), False  # short: a dimension asked to split, no candidate divides
    for size, name in zip(shape, logical, strict=True):
        if name is None:
            chosen.append(None)
            continue
        pick, skipped, indivisible = None, [], False
        for axes in rules.candidates(name, path, flax):
            if not set(axes) <= set(mesh.axis_names):
                whose = "Flax's logical rules (nnx.logical_axis_rules or the variable's "
                whose += "sharding_rules)" if flax and name in flax else f"rule set {rules.name!r}"
                raise RuleError(
                    f"{path}: {whose} map {name!r} to mesh axes {axes}, and the mesh "
                    f"{dict(mesh.shape)} lacks {sorted(set(axes) - set(mesh.axis_names))}: "
                    "change the rule or add the axis to the mesh."
                )
            if used & set(axes):
                skipped.append(f"{'+'.join(axes)} already splits another dimension")
            elif size % _axes_size(mesh, axes):
                skipped.append(f"{'+'.join(axes)} ({_axes_size(mesh, axes)}) does not divide it")
                indivisible = True
            else:
                pick = axes
                break
        if pick is None and skipped and rules.strict:
            raise RuleError(
                f"{path}: dimension {name}={size} cannot be split ({'; '.join(skipped)}) and "
                f"rule set {rules.name!r} is strict. Make {name} a multiple of the axis size, "
                f"add a fallback for {name!r}, or use strict=False to replicate it."
            )
        short |= indivisible and pick is None
        if skipped:
            outcome = f"{'+'.join(pick)}" if pick else "replicated"
            notes.append(f"{name}={size}: {'; '.join(skipped)}, so {outcome}")
        elif pick and size > 1 and _axes_size(mesh, pick) == 1:
            notes.append(f"{name}={size}: {'+'.join(pick)} has one device, so not split")
        used |= set(pick or ())
        chosen.append(pick)
    return chosen, notes, short


def place_array(
    path: str,
    shape: tuple[int, ...],
    logical: tuple[str | None, ...] | None,
    rules: Rules,
    mesh: Mesh,
    role: str,
    flax: dict[str, object] | None = None,
) -> tuple[list[tuple[str, ...] | None], str, bool]:
    """Mesh axes for each dimension, the reason, and whether the rules could not be followed."""
    chosen: list[tuple[str, ...] | None] = [None] * len(shape)
    notes: list[str] = []
    short = False
    if role in rules.whole:
        placed = place_array(path, shape, logical, rules.replace(whole=()), mesh, role, flax)[0]
        tokens = set(rules.token_axes(mesh.axis_names))
        kept = [tuple(a for a in axes or () if a not in tokens) or None for axes in placed]
        return kept, f"{rules.name} keeps {role} whole over the batch's axes", False
    if logical is not None and rules.annotations != "ignore":
        chosen, notes, short = place_logical(path, shape, logical, rules, mesh, flax)
        if rules.auto_axis is None or rules.annotations == "use":
            return chosen, "; ".join(notes), short
    elif rules.auto_axis is None:
        if rules.strict and rules.shards_anything() and shape:
            raise RuleError(
                f"{path}: an array of shape {shape} has no logical names, and rule set "
                f"{rules.name!r} is strict and has no automatic axis. Annotate it, add a path "
                "rule for it, or use auto_fsdp(...) to split unnamed arrays."
            )
        return chosen, "no logical names: replicated", rules.shards_anything() and bool(shape)
    axis, size = rules.auto_axis, mesh.shape[rules.auto_axis]
    if any(axis in (axes or ()) for axes in chosen):
        return chosen, "; ".join([*notes, f"{axis} already splits another dimension"]), short
    whole_dims = tuple(0 if axes else n for n, axes in zip(shape, chosen, strict=True))
    dim = largest_divisible_dim(whole_dims, size)
    kind = "fill" if logical is not None and rules.annotations == "fill" else "auto"
    if dim is None:
        if rules.strict and shape:
            raise RuleError(
                f"{path}: no whole dimension of shape {shape} is divisible by {axis} ({size}) "
                f"and rule set {rules.name!r} is strict. Pad a dimension to a multiple of "
                f"{size}, use a mesh whose {axis} divides one, or strict=False to replicate it."
            )
        split = any(chosen)
        whole = f"{kind}: no {'whole ' if split else ''}dimension divisible by {axis} ({size}), "
        whole += "so not split further" if split else "replicated"
        return chosen, "; ".join([*notes, whole]), short or (not split and bool(shape) and size > 1)
    chosen[dim] = (axis,)
    picked = f"{kind}: largest dimension divisible by {axis} ({size})"
    if size == 1:
        picked = f"{kind}: {axis} has one device, so not split"
    return chosen, "; ".join([*notes, picked]), short


ANNOTATION_KEYS = ("out_sharding", "sharding_names", "sharding")
"""Variable metadata holding logical (or mesh axis) names, newest Flax spelling first:
`nnx.with_partitioning` and `nnx.Param(..., out_sharding=...)` write `out_sharding`."""


def _logical_names(leaf: Any, path: str, rules: Rules) -> tuple[str | None, ...] | None:
    from_path = rules.names_for_path(path)
    if from_path is not None:
        return tuple(from_path)
    if isinstance(leaf, nnx.Variable):
        metadata = leaf.get_metadata()
        for key in ANNOTATION_KEYS:
            names = metadata.get(key)
            if isinstance(names, PartitionSpec | tuple | list) and names:
                return tuple(names)
    return None


def flax_rules_of(leaf: Any) -> dict[str, object]:
    """Flax's logical rules for `leaf`: the active `nnx.logical_axis_rules` merged with the
    variable's own `sharding_rules`, by Flax's merge (refusing a name the two map apart)."""
    local = leaf.get_metadata().get("sharding_rules") if isinstance(leaf, nnx.Variable) else None
    return dict(composite_rules(get_logical_axis_rules(), local or ()))


class Layout:
    """A rule set resolved against a tree of arrays and a mesh."""

    def __init__(
        self,
        rules: Rules,
        mesh: Mesh,
        placements: list[Placement],
        specs: Any,
        gradient_specs: dict[str, PartitionSpec] | None = None,
    ):
        self.rules = rules
        self.mesh = mesh
        self.placements = placements
        self.specs = specs
        self.gradient_specs = gradient_specs or {}
        """Path -> spec of each parameter's gradient, where the rule set places gradients
        apart from parameters (ZeRO-2); empty where they go together."""

    def gradient_shardings(self, params: Any, prefix: str = "") -> Any:
        """Where a step puts the gradients of `params`, the parameters at `prefix` of the
        resolved tree, read off this resolution (`gradient_specs`); None when the gradients
        go where the parameters are."""
        if not self.gradient_specs:
            return None
        treedef = jax.tree.structure(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        specs = []
        for path, leaf in flat(params):
            spec = self.gradient_specs[prefix + path]
            specs.append(leaf.replace(spec) if isinstance(leaf, nnx.Variable) else spec)
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            treedef.unflatten(specs),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def shardings(self) -> Any:
        """The tree of `NamedSharding`s, shaped like the resolved tree."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def array_at(self, path: str) -> jax.ShapeDtypeStruct:
        """The array at `path` as a shape, dtype and sharding: drawable before it exists."""
        for p in self.placements:
            if p.path == path:
                return jax.ShapeDtypeStruct(
                    p.shape, p.dtype, sharding=NamedSharding(self.mesh, p.spec)
                )
        raise KeyError(f"no array at {path!r}; the layout has {[p.path for p in self.placements]}")

    def bytes_per_device(self) -> int:
        """Bytes each device holds for the whole tree (the largest share if uneven)."""
        return sum(p.bytes_per_device for p in self.placements)

    def total_bytes(self) -> int:
        """Bytes of the whole tree, unsharded."""
        return sum(p.total_bytes for p in self.placements)

    def replicated_bytes(self) -> int:
        """Bytes of the arrays every device holds whole (`replicated()`'s, summed)."""
        return sum(p.total_bytes for p in self.replicated())

    def replicated(self, min_bytes: int = 0) -> list[Placement]:
        """The arrays of at least `min_bytes` that every device holds whole (cut into one
        piece: no axis splits them, or only axes of one device), largest first."""
        whole = [p for p in self.placements if p.pieces == 1 and p.total_bytes >= min_bytes]
        return sorted(whole, key=lambda p: -p.total_bytes)

    def unsplit(self) -> list[Placement]:
        """The arrays split less than the rule set meant, each with its reason: a dimension
        no candidate divides, no logical names under rules that split others, or (held whole)
        only axes of one device to split over. Largest first."""
        less = [p for p in self.placements if p.fallback or (p.pieces == 1 and any(p.spec))]
        return sorted(less, key=lambda p: -p.total_bytes)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a batch goes: every array of it split on its first dimension over the mesh
        axes of the rule set's `batch` rule (the first candidate the mesh has), the rest whole."""
        for axes in self.rules.candidates("batch", "the batch"):
            if set(axes) <= set(self.mesh.axis_names):
                return NamedSharding(self.mesh, PartitionSpec(spec_entry(axes)))
        return NamedSharding(self.mesh, PartitionSpec())

    def __str__(self) -> str:
        whole = self.replicated()
        lines = [
            f"{self.rules.name} on mesh {dict(self.mesh.shape)}: {len(self.placements)} arrays, "
            f"{self.bytes_per_device():,} of {self.total_bytes():,} bytes per device "
            f"({self.bytes_per_device() / max(1, self.total_bytes()):.1%}), "
            f"{len(whole)} held whole by every device"
        ]
        lines += [
            f"  {p.path} {p.shape} -> {tuple(p.spec)} {p.shard_shape}" for p in self.placements
        ]
        return "\n".join(lines)

    def __getitem__(self, path: str) -> Placement:
        for placement in self.placements:
            if placement.path == path:
                return placement
        raise KeyError(f"no array at {path!r}; paths look like {self.placements[0].path!r}")

    def _repr_markdown_(self) -> str:
        share = self.bytes_per_device() / self.total_bytes()
        title = (
            f"**{self.rules.name}** on mesh {dict(self.mesh.shape)}: {self.bytes_per_device():,}"
            f" of {self.total_bytes():,} bytes per device ({share:.1%})"
        )
        headers = ["path", "shape", "logical axes", "mesh spec", "per device", "bytes/device"]
        rows = [
            [
                p.path,
                p.shape,
                p.logical or "-",
                tuple(p.spec),
                p.shard_shape,
                p.bytes_per_device,
                p.reason,
            ]
            for p in self.placements
        ]
        return str(table([*headers, "note"], rows, title))


WARN_BYTES = 1 << 20
"""Arrays at least this large that the rules meant to split and could not are warned about."""


class ReplicationWarning(UserWarning):
    """Arrays that a rule set meant to split are held whole by every device."""


def resolve(
    tree: Any, rules: Rules, mesh: Mesh, *, warn_bytes: int = WARN_BYTES, role: str | None = None
) -> Layout:
    """Place every array of `tree` (an nnx State, a module's state, or any pytree) on `mesh`.

    Logical names come from a matching path rule, else the variable's `out_sharding`
    annotation; arrays with neither are replicated, or split by the automatic FSDP rule.
    Flax's logical rules (the variable's `sharding_rules`, and `nnx.logical_axis_rules` if
    active while this runs: enter it again around a restore) are tried before `rules`'.
    Arrays whose role (`role`, else `nnxscale.rules.role_of(path)`) is in `rules.whole` stay
    whole.
    A `ReplicationWarning` names every array whose logical names asked for a split the mesh
    cannot make, and unnamed arrays of at least `warn_bytes` held whole (`Layout.unsplit()`
    lists them all, with reasons; an infinite `warn_bytes` warns of nothing).
    """
    axis_kind(mesh)
    missing = sorted(rules.mesh_axes() - set(mesh.axis_names))
    if missing:
        raise RuleError(
            f"rule set {rules.name!r} uses mesh axes {missing} that the mesh "
            f"{dict(mesh.shape)} does not have. Add them to the mesh (size 1 is fine) or use "
            "a rule set written for this mesh."
        )
    treedef = jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placements, specs, gradient_specs = [], [], {}
    apart = role is None and ("params" in rules.whole) != ("grads" in rules.whole)
    leaves = [(p, x, _logical_names(x, p, rules), flax_rules_of(x)) for p, x in flat(tree)]
    rules.check_known({p: [n for n in names or () if n not in f] for p, _, names, f in leaves})
    for path, leaf, logical, flax in leaves:
        shape = tuple(int(d) for d in np.shape(leaf))
        dtype = leaf.dtype  # a NumPy dtype, or a JAX key type (which has an itemsize too)
        where = role or role_of(path)
        chosen, reason, fallback = place_array(path, shape, logical, rules, mesh, where, flax)
        spec = PartitionSpec(*(spec_entry(axes) for axes in chosen))
        if apart and where == "params":  # the gradient's place, in the same pass
            split = place_array(path, shape, logical, rules, mesh, "grads", flax)[0]
            gradient_specs[path] = PartitionSpec(*(spec_entry(axes) for axes in split))
        splits = [_axes_size(mesh, a) if a else 1 for a in chosen]
        shard = tuple(s // k for s, k in zip(shape, splits, strict=True))
        placements.append(
            Placement(
                path,
                shape,
                str(dtype),
                logical,
                spec,
                shard,
                math.prod(shard) * dtype.itemsize,
                math.prod(shape) * dtype.itemsize,
                reason,
                fallback,
            )
        )
        specs.append(leaf.replace(spec) if isinstance(leaf, nnx.Variable) else spec)
    layout = Layout(rules, mesh, placements, treedef.unflatten(specs), gradient_specs)
    _warn_if_whole(sorted(placements, key=lambda p: -p.total_bytes), layout, warn_bytes)
    return layout


def _warn_if_whole(placements: list[Placement], layout: Layout, warn_bytes: int) -> None:
    """Warn of what the rules meant to split and could not: every array whose names asked for
    a split the mesh cannot make, whatever its size, and unnamed arrays held whole from
    `warn_bytes` (all of them when the rules split nothing); nothing when it is infinite."""
    if warn_bytes == math.inf:
        return
    named = [p for p in placements if p.fallback and p.logical is not None]
    whole = [p for p in placements if p.fallback and p.logical is None and p.pieces == 1]
    if named or len(whole) < sum(bool(p.shape) and p.total_bytes > 0 for p in placements):
        whole = [p for p in whole if p.total_bytes >= warn_bytes]
    found = []
    for what, listed in (
        ("cannot split {} arrays as their names ask", named),
        ("leaves {} arrays of {:,} bytes whole on every device", whole),
    ):
        shown = ", ".join(f"{p.path} {p.shape} ({p.reason})" for p in listed[:3])
        more = f" and {len(listed) - 3} more" if len(listed) > 3 else ""
        held = sum(p.total_bytes for p in listed)
        found += [f"{what.format(len(listed), held)}: {shown}{more}"] if listed else []
    if found:
        warnings.warn(
            ReplicationWarning(
                f"rule set {layout.rules.name!r} on mesh {dict(layout.mesh.shape)} "
                f"{'; it '.join(found)}. Use a mesh whose axes divide those dimensions, add "
                "rules or annotations for them, or auto_fsdp(...); Layout.unsplit() lists "
                "each array split less than meant, with its reason."
            ),
            stacklevel=3,
        )
