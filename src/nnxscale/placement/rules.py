"""Rule sets that map logical axis names onto mesh axes, with ordered fallbacks.

A rule set is data: for each logical axis, the mesh axes to try in order. Resolving it against
a model and a mesh (`nnxscale.layout.resolve`) picks, for every dimension of every array, the
first candidate that exists, is not already used by another dimension of the same array, and
divides the dimension; otherwise the dimension is replicated and the reason recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping

import jax
from jax.sharding import Mesh

from nnxscale.core.show import Markdown, table
from nnxscale.placement.mesh import grid_shape, make_mesh

type MeshAxes = str | tuple[str, ...]
"""One candidate: a mesh axis, or several mesh axes used together for one dimension."""

BATCH_AXES = ("data", "fsdp", "batch", "replica", "dp")
"""Mesh axis names that `mesh_axis_rules` takes for the batch's when it is not given, first
found first."""


class RuleError(ValueError):
    """A rule set that cannot be applied as written; the message names the array and the fix."""


ANNOTATIONS = ("use", "ignore", "fill")
"""How `auto_axis` meets arrays that carry logical names: see `Rules`."""

ROLES = ("params", "grads", "optimizer")
"""What an array of the training step is: a parameter, a gradient, or optimizer state (the
optimizer's moments and the EMA). ZeRO stages are rule sets that keep some roles whole."""


def role_of(path: str) -> str:
    """The role of a train state array from its path: optimizer state under `optimizer/` and
    `ema/`, a parameter (or a step counter, RNG key) anywhere else."""
    return "optimizer" if path.startswith(("optimizer/", "ema/")) else "params"


@dataclasses.dataclass(frozen=True)
class Rules:
    """A named rule set, and the mesh it is meant for.

    `logical` maps each logical axis name to its candidates, tried in order; an empty tuple
    replicates that axis. `paths` are (regular expression, logical names) pairs: the first
    pattern that matches an array's path (searched, `/`-separated) gives its logical names,
    overriding its annotations, which is how arrays without annotations get names.
    `auto_axis` shards arrays that have no logical names along their largest dimension the
    axis divides (automatic FSDP); `annotations` says what it does with arrays that have them:
    `"use"` places them by `logical` only, `"ignore"` treats them as unnamed, `"fill"` places
    them by `logical` and then splits their largest still-whole dimension over `auto_axis`.
    `strict` turns a dimension that should be split and cannot be into an error.
    `whole` lists roles (`ROLES`) kept whole over the batch's axes (tensor, pipeline and
    expert axes still split them): ZeRO-1 is FSDP's rules with parameters and gradients
    whole, ZeRO-2 with parameters whole.
    `axes` and `sizes` describe the mesh (`strategy_mesh` builds it): an axis of size -1 takes
    the devices the others leave, one of size k takes the largest count up to k that divides
    what is left; without a -1 the sizes are the mesh's shape, for exactly that many devices.

    Path rules are searched in every array's path; when several match, the longest match wins
    (`_query_norm/scale$` over `norm/scale$`), and two equally long matches that give
    different names are refused: the order they are written in never decides.
    """

    name: str
    logical: Mapping[str, tuple[MeshAxes, ...]]
    paths: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    auto_axis: str | None = None
    annotations: str = "use"
    strict: bool = False
    axes: tuple[str, ...] = ("data", "model")
    sizes: tuple[int, ...] = (-1, 1)
    whole: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown_roles = sorted(set(self.whole) - set(ROLES))
        if unknown_roles:
            raise RuleError(
                f"rule set {self.name!r}: whole={self.whole!r} names roles {unknown_roles}; "
                f"use some of {', '.join(map(repr, ROLES))}."
            )
        if self.annotations not in ANNOTATIONS:
            raise RuleError(
                f"rule set {self.name!r}: annotations={self.annotations!r}; use one of "
                f"{', '.join(map(repr, ANNOTATIONS))}."
            )
        if (
            len(self.axes) != len(self.sizes)
            or list(self.sizes).count(-1) > 1
            or any(s != -1 and (not isinstance(s, int) or s < 1) for s in self.sizes)
        ):
            raise RuleError(
                f"rule set {self.name!r}: mesh axes {self.axes} with sizes {self.sizes}; give "
                "one size per axis, each a whole number of at least 1, and at most one of "
                "them -1 (the devices the others leave)."
            )
        unknown = sorted(self.mesh_axes() - set(self.axes))
        if unknown:
            raise RuleError(
                f"rule set {self.name!r} refers to mesh axes {unknown} that its mesh axes "
                f"{self.axes} lack: add them to `axes` (with a size) or change the rules."
            )

    def replace(self, **changes: object) -> Rules:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def candidates(
        self, logical_name: str, path: str, flax: Mapping[str, object] | None = None
    ) -> tuple[tuple[str, ...], ...]:
        """The candidates for `logical_name`, each a tuple of mesh axes. A name Flax's logical
        rules map (`flax`: the active `nnx.logical_axis_rules` and the variable's own
        `sharding_rules`, `flax_rules_of`) tries Flax's axes first, then these; None replicates."""
        if flax and logical_name in flax:
            target = flax[logical_name]
            if target is None:
                return ()
            first = as_tuple(target)  # type: ignore[arg-type]
            rest = self.logical.get(logical_name, ())
            return (first, *(c for c in map(as_tuple, rest) if c != first))
        if logical_name not in self.logical:
            known = ", ".join(sorted(self.logical)) or "no names"
            raise RuleError(
                f"{path}: logical axis {logical_name!r} has no rule in rule set {self.name!r} "
                f"(it has rules for {known}). Add one, e.g. {logical_name!r}: ('data',) to "
                f"shard it or {logical_name!r}: () to replicate it; for a model annotated "
                "with mesh axis names use mesh_axis_rules(...), or annotations='ignore' to "
                "place it by the automatic axis alone."
            )
        return tuple((c,) if isinstance(c, str) else tuple(c) for c in self.logical[logical_name])

    def names_for_path(self, path: str) -> tuple[str | None, ...] | None:
        """Logical names that a path rule gives the array at `path`, if any rule matches: the
        rule matching the longest stretch of the path (see the class docstring)."""
        found = []
        for pattern, names in self.paths:
            match = re.search(pattern, path)
            if match:
                found.append((match.end() - match.start(), pattern, tuple(names)))
        if not found:
            return None
        longest = max(length for length, _, _ in found)
        best = {names: pattern for length, pattern, names in found if length == longest}
        if len(best) > 1:
            rival = "; ".join(f"{pattern!r} gives {names}" for names, pattern in best.items())
            raise RuleError(
                f"{path}: path rules of rule set {self.name!r} match equally long stretches of "
                f"it and disagree ({rival}). Make one more specific (anchor it, e.g. "
                f"'(^|/){path.rsplit('/', 1)[-1]}$' or the whole path '^{path}$')."
            )
        return next(iter(best))

    def check_known(self, names: Mapping[str, Iterable[str | None]]) -> None:
        """Refuse, before anything is placed, the logical names (path -> names, less those
        Flax's rules map) this rule set has no rule for: all of them at once, with the fix.
        Names of another mesh's axes, under rules for this mesh's (`mesh_axis_rules`), get
        that mesh's rules, or the map from its names to this mesh's axes."""
        unknown: dict[str, str] = {}
        for path, listed in names.items():
            for name in listed:
                if name and name not in self.logical:
                    unknown.setdefault(name, path)
        if not unknown or self.annotations == "ignore":
            return
        own = tuple(sorted(unknown, key=lambda n: n not in BATCH_AXES))  # the batch's first
        found = ", ".join(f"{n!r} (first at {unknown[n]})" for n in own)
        if self.axes and all(self.logical.get(a) in ((a,), ((a,),)) for a in self.axes):
            pairs = list(zip(own, self.axes * len(own), strict=False))
            raise RuleError(
                f"the model's annotations name mesh axes {found} that the mesh of rule set "
                f"{self.name!r} lacks (its axes are {self.axes}): the model was written for "
                f"a mesh whose axes are named {own}. Make that mesh and its rules, "
                f"nx.make_mesh(shape, {own}) and nx.mesh_axis_rules({own}), or map the "
                f"model's names onto this mesh: nx.annotations.flax_rules({pairs}, "
                f"axes={self.axes})."
            )
        known = ", ".join(sorted(self.logical)) or "no names"
        raise RuleError(
            f"rule set {self.name!r} has no rule for the logical axes {found} (it has rules "
            f"for {known}). Add them, e.g. {own[0]!r}: ('data',) to shard or {own[0]!r}: () "
            "to replicate; for a model annotated with mesh axis names use "
            "mesh_axis_rules(...), or annotations='ignore' to place it by the automatic axis "
            "alone."
        )

    def mesh_axes(self) -> set[str]:
        """Every mesh axis the rule set refers to."""
        axes = {a for cands in self.logical.values() for c in cands for a in as_tuple(c)}
        return axes | ({self.auto_axis} if self.auto_axis else set())

    def axes_of(self, name: str) -> tuple[str, ...]:
        """Every mesh axis among the candidates for logical axis `name`, in order."""
        return self._axes.get(name, ())

    @functools.cached_property
    def _axes(self) -> dict[str, tuple[str, ...]]:
        """`axes_of` for every logical axis, made once: the planner asks it thousands of times."""
        return {n: tuple(a for c in cs for a in as_tuple(c)) for n, cs in self.logical.items()}

    @functools.cached_property
    def key(self) -> str:
        """The rule set as text (its repr, made once): what the cost model's caches key on."""
        return repr(self)

    def shards_anything(self) -> bool:
        """Whether the rule set splits any parameter (DP and PP's replicated parts do not)."""
        named = any(c for name, c in self.logical.items() if name != "batch")
        return named or self.auto_axis is not None

    def token_axes(self, mesh_axes: Iterable[str]) -> tuple[str, ...]:
        """The mesh axes (of `mesh_axes`) that split the tokens: the batch's, and the
        sequence's under context parallelism. Each device computes the loss of its own tokens,
        so gradients are summed over these axes, and weights split over them are gathered."""
        present = set(mesh_axes)
        found: list[str] = []
        for name in ("batch", "length"):
            for axes in self.logical.get(name, ()):
                if set(as_tuple(axes)) <= present:
                    found += [a for a in as_tuple(axes) if a not in found]
                    break
        return tuple(found)

    def mesh_shape(self, devices: int) -> tuple[int, ...]:
        """The size of each of `axes` on `devices` devices (see the class docstring)."""
        if -1 not in self.sizes:
            if math.prod(self.sizes) != devices:
                fixed = dict(zip(self.axes, self.sizes, strict=True))
                raise RuleError(
                    f"rule set {self.name!r} fixes its mesh at {fixed}"
                    f" ({math.prod(self.sizes)} devices), and {devices} were asked for: make one "
                    "size -1 to take the devices the others leave, or use that many devices."
                )
            return tuple(self.sizes)
        left, shape = devices, list(self.sizes)
        for i, size in enumerate(self.sizes):
            if size > 0:
                shape[i] = grid_shape(left, size)[1]
                left //= shape[i]
        shape[self.sizes.index(-1)] = left
        return tuple(shape)


def as_tuple(candidate: MeshAxes) -> tuple[str, ...]:
    """A candidate's mesh axes as a tuple (one axis, or several used together)."""
    return (candidate,) if isinstance(candidate, str) else tuple(candidate)


def compare(*rule_sets: Rules) -> Markdown:
    """Markdown table: for each logical axis, the candidates of each rule set, in order."""
    names = sorted({name for rules in rule_sets for name in rules.logical})

    def cell(rules: Rules, name: str) -> str:
        if name not in rules.logical:
            return "(no rule)"
        options = ["+".join(as_tuple(c)) for c in rules.logical[name]]
        return " then ".join(options) if options else "replicated"

    rows = [[name, *(cell(rules, name) for rules in rule_sets)] for name in names]
    return table(["logical axis", *(rules.name for rules in rule_sets)], rows)


def auto_fsdp(
    axis: str = "data",
    *,
    annotations: str = "use",
    logical: Rules | None = None,
    strict: bool = False,
) -> Rules:
    """Automatic FSDP for any pytree: each array split on its largest dimension `axis` divides.

    The batch is split over `axis` too. Arrays with logical names follow `logical`'s rules
    (for a model annotated with mesh axis names, `mesh_axis_rules(...)`), as `annotations`
    says: "use" them, "ignore" them, or "fill" what they leave whole.
    """
    base = logical or Rules("", {}, axes=(axis,), sizes=(-1,))
    axes, sizes = base.axes, base.sizes
    if axis not in axes:  # the automatic axis takes the devices the others leave
        axes, sizes = (*axes, axis), (*(1 if s == -1 else s for s in sizes), -1)
    return base.replace(
        name=f"auto-FSDP({axis})" + (f" over {base.name}" if base.name else ""),
        logical={"batch": (axis,), **base.logical},
        auto_axis=axis,
        annotations=annotations,
        strict=strict,
        axes=axes,
        sizes=sizes,
    )


def strategy_mesh(rules: Rules, devices: int | None = None, *, explicit: bool = False) -> Mesh:
    """The mesh that a rule set is meant for (its `axes` and `sizes`), with Auto axes unless
    `explicit` (`nnxscale.mesh.AXIS_TYPES` says which a model needs).

    It spans the first `devices` devices (all by default). With an odd count and TP's
    `model` of size 2, `model` has one device: tensor parallelism then splits nothing.
    """
    available = jax.device_count()
    if devices is not None and not 1 <= devices <= available:
        raise ValueError(
            f"a mesh of {devices} devices was asked for and JAX has {available}: pass at most "
            f"{available}, or emulate more (NNXSCALE_DEVICES={devices}) and restart."
        )
    pool = jax.devices()[: devices or available]
    return make_mesh(rules.mesh_shape(len(pool)), rules.axes, explicit=explicit, devices=pool)
