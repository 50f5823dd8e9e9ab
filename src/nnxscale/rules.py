"""Rule sets that map logical axis names onto mesh axes, with ordered fallbacks.

A rule set is data: for each logical axis, the mesh axes to try in order. Resolving it against
a model and a mesh (`nnxscale.layout.resolve`) picks, for every dimension of every array, the
first candidate that exists, is not already used by another dimension of the same array, and
divides the dimension; otherwise the dimension is replicated and the reason recorded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TypeAlias

from nnxscale.display import Markdown, table

MeshAxes: TypeAlias = str | tuple[str, ...]
"""One candidate: a mesh axis, or several mesh axes used together for one dimension."""


class RuleError(ValueError):
    """A rule set that cannot be applied as written; the message names the array and the fix."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """A named rule set.

    `logical` maps each logical axis name to its candidates, tried in order; an empty tuple
    replicates that axis. `paths` are (regular expression, logical names) pairs: the first
    pattern that matches an array's path (searched, `/`-separated) gives its logical names,
    overriding its annotations, which is how arrays without annotations get names.
    `auto_axis` shards arrays that have no logical names along their largest dimension the
    axis divides (automatic FSDP). `strict` turns an indivisible dimension into an error.
    """

    name: str
    logical: Mapping[str, tuple[MeshAxes, ...]]
    paths: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    auto_axis: str | None = None
    strict: bool = False

    def replace(self, **changes: object) -> Rules:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def candidates(self, logical_name: str, path: str) -> tuple[tuple[str, ...], ...]:
        """The candidates for `logical_name`, each as a tuple of mesh axes."""
        if logical_name not in self.logical:
            known = ", ".join(sorted(self.logical))
            raise RuleError(
                f"{path}: logical axis {logical_name!r} has no rule in rule set {self.name!r} "
                f"(it has rules for {known}). Add one, e.g. {logical_name!r}: ('data',) to "
                f"shard it or {logical_name!r}: () to replicate it."
            )
        return tuple((c,) if isinstance(c, str) else tuple(c) for c in self.logical[logical_name])

    def names_for_path(self, path: str) -> tuple[str | None, ...] | None:
        """Logical names that a path rule gives the array at `path`, if any rule matches."""
        for pattern, names in self.paths:
            if re.search(pattern, path):
                return names
        return None

    def mesh_axes(self) -> set[str]:
        """Every mesh axis the rule set refers to."""
        axes = {a for cands in self.logical.values() for c in cands for a in _as_tuple(c)}
        return axes | ({self.auto_axis} if self.auto_axis else set())


def _as_tuple(candidate: MeshAxes) -> tuple[str, ...]:
    return (candidate,) if isinstance(candidate, str) else tuple(candidate)


_REPLICATED = {"vocab": (), "embed": (), "heads": (), "head_dim": (), "mlp": (), "length": ()}
_ACTIVATIONS = {"batch": ("data",), "layers": ()}

DP = Rules("DP", {**_REPLICATED, **_ACTIVATIONS})
"""Data parallelism: parameters replicated, the batch split over `data`."""

FSDP = Rules(
    "FSDP",
    {**_REPLICATED, **_ACTIVATIONS, "embed": ("data",), "mlp": ("data",), "vocab": ("data",)},
)
"""Fully sharded data parallelism: each parameter split over `data` along its `embed`
dimension, or else its `mlp` or `vocab` dimension; the batch split over `data` too."""

TP = Rules(
    "TP",
    {**_REPLICATED, **_ACTIVATIONS, "heads": ("model",), "mlp": ("model",), "vocab": ("model",)},
)
"""Tensor parallelism (Megatron-LM): attention split by heads, the MLP by its hidden units
(column- then row-parallel), embeddings and head by vocabulary, over `model`."""

FSDP_TP = Rules(
    "FSDP+TP",
    {
        **_REPLICATED,
        **_ACTIVATIONS,
        "embed": ("data",),
        "heads": ("model",),
        "mlp": ("model", "data"),
        "vocab": ("model", "data"),
    },
)
"""TP over `model` and FSDP over `data`; `mlp` and `vocab` fall back to `data` when `model`
does not divide them."""

RULE_SETS = {rules.name: rules for rules in (DP, FSDP, TP, FSDP_TP)}


def compare(*rule_sets: Rules) -> Markdown:
    """Markdown table: for each logical axis, the candidates of each rule set, in order."""
    names = sorted({name for rules in rule_sets for name in rules.logical})

    def cell(rules: Rules, name: str) -> str:
        if name not in rules.logical:
            return "(no rule)"
        options = ["+".join(_as_tuple(c)) for c in rules.logical[name]]
        return " then ".join(options) if options else "replicated"

    rows = [[name, *(cell(rules, name) for rules in rule_sets)] for name in names]
    return table(["logical axis", *(rules.name for rules in rule_sets)], rows)


def auto_fsdp(axis: str = "data") -> Rules:
    """Automatic FSDP for any pytree: each array split on its largest dimension `axis` divides."""
    return Rules(f"auto-FSDP({axis})", {}, auto_axis=axis)
