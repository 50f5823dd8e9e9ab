"""Rule sets for models annotated elsewhere: with mesh axis names (as Flax's examples
annotate them), or with Flax's logical axis rules layered over a rule set of the book."""

from __future__ import annotations

from collections.abc import Iterable

from jax.sharding import Mesh

from nnxscale.placement.rules import BATCH_AXES, MeshAxes, RuleError, Rules, as_tuple


def mesh_axis_rules(
    axes: tuple[str, ...] | Mesh = ("data", "model"),
    sizes: tuple[int, ...] | None = None,
    *,
    batch: MeshAxes | str | None = "infer",
) -> Rules:
    """Rules for a model annotated with mesh axis names (as Flax's examples do): each name maps
    to the mesh axis of that name. `axes` is the axis names, or a mesh (its names and sizes);
    `sizes` default to the mesh's, else (-1, 1, ...). The batch is split over `batch`: by
    default the first of `BATCH_AXES` the mesh has; None keeps it whole on every device."""
    if isinstance(axes, Mesh):
        sizes = sizes or tuple(axes.shape[name] for name in axes.axis_names)
        axes = tuple(axes.axis_names)
    axes = tuple(axes)
    if not axes:
        raise RuleError("no mesh axes given: pass their names, or a mesh")
    sizes = sizes or (-1, *([1] * (len(axes) - 1)))
    if batch == "infer":
        batch = next((name for name in BATCH_AXES if name in axes), None)
        if batch is None:
            raise RuleError(
                f"mesh axes {axes}: none is named like a batch axis ({', '.join(BATCH_AXES)}), "
                f"so say which splits the batch: mesh_axis_rules(..., batch={axes[0]!r}), or "
                "batch=None to keep every example on every device."
            )
    missing = [a for a in (as_tuple(batch) if batch else ()) if a not in axes]
    if missing:
        raise RuleError(
            f"batch={batch!r} names {missing}, which is not among the mesh axes {axes}: pass "
            f"batch= one of them (e.g. batch={axes[0]!r}), or batch=None to keep it whole."
        )
    logical = {axis: (axis,) for axis in axes}
    return Rules(
        f"mesh axes {'/'.join(axes)}",
        {**logical, "batch": (batch,) if batch else ()},
        axes=axes,
        sizes=tuple(sizes),
    )


def flax_rules(
    logical_rules: Iterable[tuple[str, MeshAxes | None]],
    base: Rules | None = None,
    *,
    axes: tuple[str, ...] | Mesh | None = None,
    batch: MeshAxes | str | None = "infer",
) -> Rules:
    """A rule set from Flax's logical axis rules (the pairs `nnx.logical_axis_rules` and a
    variable's `sharding_rules` take): each logical name tries Flax's mesh axes first, then
    `base`'s candidates for it as fallbacks; `base` (auto-FSDP, strict, ZeRO's roles) keeps
    the rest. Without `base`, the mesh is `axes` (names or a mesh, whose sizes it then keeps;
    default the axes the Flax rules name, in order, sized as `mesh_axis_rules` sizes them)
    and the batch as in `mesh_axis_rules`."""
    pairs = [(str(name), target) for name, target in logical_rules]
    if base is None:
        named = [a for _, t in pairs if t for a in as_tuple(t)]  # type: ignore[arg-type]
        base = mesh_axis_rules(axes or tuple(dict.fromkeys(named)), batch=batch)
        base = base.replace(logical={"batch": base.logical["batch"]})
    targets: dict[str, list[tuple[str, ...] | None]] = {}
    for name, target in pairs:  # Flax tries a name's rules in the order given
        targets.setdefault(name, []).append(None if target is None else as_tuple(target))
    logical = dict(base.logical)
    for name, tried in targets.items():
        if None in tried:  # replicate: the rules before it are still tried first
            tried = tried[: tried.index(None)]
            logical[name] = tuple(tried)
            continue
        rest = [c for c in logical.get(name, ()) if as_tuple(c) not in tried]
        logical[name] = (*tried, *rest)
    over = f" over {base.name}" if base.name and not base.name.startswith("mesh axes") else ""
    return base.replace(name=f"Flax rules{over}", logical=logical)
