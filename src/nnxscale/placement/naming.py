"""Logical names for a model the library was not written for, proposed from paths and shapes.

Tensor parallelism needs every weight to say which of its dimensions are heads, MLP units or
vocabulary (`VOCABULARY`). `propose(model)` reads each parameter's path and
shape, recognises the usual roles (embeddings, attention's query, key, value and output
projections, the MLP's up and down projections, the output head, norms and biases), and
returns a table for the reader to check. `Proposal.edit` corrects a row; `Proposal.rules`
turns the table into path rules (one per array, matching its whole path) beside any rule
set's own.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from flax import nnx

from nnxscale.core.show import Markdown, table
from nnxscale.core.trees import flat
from nnxscale.placement.init import abstract
from nnxscale.placement.rules import RuleError, Rules

Names = tuple[str | None, ...]

VOCABULARY = {
    "batch": "examples of a batch (activations' first dimension)",
    "length": "positions of a sequence inside attention (keys, values, scores)",
    "residual_length": "positions of a sequence in the residual stream (norms, adds, dropout)",
    "vocab": "token ids: rows of the embedding table, columns of the output head",
    "embed": "the model width: the residual stream's features, in and out of every block",
    "heads": "attention heads of the queries (and of the output projection's input)",
    "kv_heads": "attention heads of keys and values (fewer than `heads` under grouped-query "
    "attention: split them only as far as they divide)",
    "head_dim": "features inside one attention head",
    "mlp": "the MLP's hidden units (up projection's output, down projection's input)",
    "layers": "stacked layers of a scanned or pipelined model",
    "experts": "experts of a mixture-of-experts layer",
    "groups": "token groups routed to experts together",
    "rounds": "virtual-stage rounds of an interleaved pipeline",
}
"""The logical axis names the book's rule sets give rules for, and what each names. Annotate
a model with these (or let `propose` suggest them) and every rule set of the
book places it; names outside this list need a rule of their own."""

_ROLES: tuple[tuple[str, str], ...] = (
    ("norm", r"norm|(^|/)ln|scale$"),
    ("query", r"(^|[/_])(q|query|wq|q_proj|q_einsum)($|/)"),
    ("key", r"(^|[/_])(k|key|wk|k_proj)($|/)"),
    ("value", r"(^|[/_])(v|value|wv|v_proj)($|/)"),
    ("key-value", r"(^|[/_])(kv|wkv|kv_proj|kv_einsum)($|/)"),
    ("attention out", r"(^|[/_])(o|wo|o_proj|out_proj|attn_out|attn_vec_einsum)($|/)"),
    ("mlp up", r"(^|[/_])(up|gate|wi|wi_0|wi_1|fc1|w1|w3|c_fc|up_proj|gate_proj)($|/)"),
    ("mlp down", r"(^|[/_])(down|fc2|w2|c_proj|down_proj)($|/)"),
    ("embedding", r"(^|[/_])(embed|embedding|wte|tok_embed|token_embed|tok_embeddings)($|/)"),
    ("output head", r"(^|[/_])(head|lm_head|unembed)($|/)"),
)
"""Roles recognised from a parameter's path, tried in this order (a norm inside an attention
block is a norm, not the attention's query)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One parameter: where it is, its shape, the role read from its path, its names."""

    path: str
    shape: tuple[int, ...]
    role: str
    names: Names


def _role(path: str) -> str:
    lowered = path.lower()
    leaf = lowered.rsplit("/", 1)[-1]
    if leaf in ("bias", "b"):
        return "bias"
    for role, pattern in _ROLES:
        if re.search(pattern, lowered):
            return role
    return "unknown"


_HEADS = {"query": "heads", "key": "kv_heads", "value": "kv_heads", "key-value": "kv_heads"}


def _names_for(role: str, shape: tuple[int, ...], width: int, vocab: int | None) -> Names:
    """Logical names for a parameter of `role` and `shape`: the dimension of the model's
    width is `embed`; the others follow from the role, in order (for attention, the last two
    are heads and head_dim, any before them stay unnamed); None where nothing fits."""
    names: list[str | None] = [None] * len(shape)
    rest = list(range(len(shape)))
    if width in shape:
        at = shape.index(width)
        names[at] = "embed"
        rest.remove(at)
    if role in ("norm", "bias") or len(shape) == 1 or "embed" not in names:
        return tuple(names)
    if role in _HEADS and len(rest) == 1:  # fused heads: (width, heads * head_dim)
        names[rest[0]] = _HEADS[role]
    elif role in _HEADS or role == "attention out":
        if len(rest) >= 2:
            names[rest[-2]] = _HEADS.get(role, "heads")
            names[rest[-1]] = "head_dim"
        elif rest:
            names[rest[0]] = "heads"
    elif role in ("mlp up", "mlp down") and len(rest) == 1:
        names[rest[0]] = "mlp"
    elif role in ("embedding", "output head") and len(rest) == 1:
        names[rest[0]] = "vocab" if shape[rest[0]] == vocab else None
    return tuple(names)


class Proposal:
    """Proposed logical names for every parameter of a model: check them, `edit` what is
    wrong, and turn them into path rules with `rules`."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def names(self) -> dict[str, Names]:
        """Path -> logical names."""
        return {row.path: row.names for row in self.rows}

    def edit(self, path: str, names: Names) -> Proposal:
        """A copy with the names of the parameter at `path` replaced by `names` (any names:
        `rules` checks that the rule set knows them)."""
        if path not in self.names():
            raise KeyError(f"no parameter at {path!r}; the paths are {list(self.names())}")
        rows = [
            dataclasses.replace(row, names=tuple(names), role="edited") if row.path == path else row
            for row in self.rows
        ]
        _check_rank(rows)
        return Proposal(rows)

    def paths(self) -> tuple[tuple[str, Names], ...]:
        """Path rules, one per parameter, each matching its whole path at the end of a path
        (`(^|/)...$`): the parameter itself, and its copies in a train state (`model/...`,
        `ema/...`, the optimizer's moments). Where one parameter's path ends another's
        (`norm/scale`, `blocks/0/norm/scale`), the longer match wins (`Rules`)."""
        return tuple((f"(^|/){re.escape(row.path)}$", row.names) for row in self.rows)

    def rules(self, base: Rules) -> Rules:
        """`base` with these names as path rules beside its own (they override annotations);
        a name `base` has no rule for is refused here, naming the arrays."""
        known = set(base.logical)
        unknown = {row.path: n for row in self.rows for n in row.names if n and n not in known}
        if unknown:
            raise RuleError(
                f"rule set {base.name!r} has no rule for the names {sorted(set(unknown.values()))}"
                f" the proposal gives {sorted(unknown)}: edit them (the rule set knows "
                f"{', '.join(sorted(known))}) or add rules for them to it."
            )
        paths = self.paths() + tuple(base.paths)
        return base.replace(name=f"{base.name} by proposed names", paths=paths)

    def _repr_markdown_(self) -> str:
        return str(self.table())

    def table(self) -> Markdown:
        """The proposal as a table: path, shape, role, logical names."""
        rows = [[r.path, r.shape, r.role, r.names] for r in self.rows]
        return table(["path", "shape", "role", "logical names"], rows)

    def __str__(self) -> str:
        return "\n".join(f"{r.path} {r.shape} {r.role}: {r.names}" for r in self.rows)


def _check_rank(rows: list[Row]) -> None:
    for row in rows:
        if len(row.names) != len(row.shape):
            raise RuleError(
                f"{row.path}: {len(row.names)} names {row.names} for shape {row.shape}; give "
                "one name (or None) per dimension."
            )


def propose(model: nnx.Module | Callable[[], nnx.Module]) -> Proposal:
    """Logical names (`VOCABULARY`) for every `nnx.Param` of `model` (a
    module, or a function that creates one, traced abstractly), from its path and shape. The
    model's width is its most common parameter dimension; the vocabulary is the largest other
    dimension of an embedding or output head (a position table is shorter than it)."""
    module = abstract(model) if callable(model) and not isinstance(model, nnx.Module) else model
    params: list[tuple[str, Any]] = flat(nnx.state(module, nnx.Param))
    shapes = {path: tuple(int(d) for d in x.shape) for path, x in params}
    counts = collections.Counter(d for shape in shapes.values() for d in shape if len(shape) > 1)
    if not counts:
        raise ValueError("the model has no parameter of two or more dimensions to name")
    width = counts.most_common(1)[0][0]
    tables = [s for p, s in shapes.items() if _role(p) in ("embedding", "output head")]
    vocab = max((d for s in tables if len(s) == 2 for d in s if d != width), default=None)
    rows = [Row(p, s, _role(p), _names_for(_role(p), s, width, vocab)) for p, s in shapes.items()]
    _check_rank(rows)
    return Proposal(rows)
