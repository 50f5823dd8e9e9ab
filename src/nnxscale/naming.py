"""Logical names for a model the library was not written for, proposed from paths and shapes.

Tensor parallelism needs every weight to say which of its dimensions are heads, MLP units or
vocabulary (`nnxscale.rules.VOCABULARY`). `propose(model)` reads each parameter's path and
shape, recognises the usual roles (embeddings, attention's query, key, value and output
projections, the MLP's up and down projections, the output head, norms and biases), and
returns a table for the reader to check. `Proposal.edit` corrects a row; `Proposal.rules`
turns the table into path rules (one per array, matching its whole path, so no two rules
match the same array) on top of any rule set.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from flax import nnx

from nnxscale.init import abstract
from nnxscale.rules import VOCABULARY, RuleError, Rules
from nnxscale.show import Markdown, table
from nnxscale.trees import flat

Names = tuple[str | None, ...]

_ROLES: tuple[tuple[str, str], ...] = (
    ("norm", r"norm|ln|layernorm|rmsnorm|scale$"),
    ("query", r"(^|[/_])(q|query|wq|q_proj)($|[/_])"),
    ("key", r"(^|[/_])(k|key|wk|k_proj)($|[/_])"),
    ("value", r"(^|[/_])(v|value|wv|v_proj)($|[/_])"),
    ("key-value", r"(^|[/_])(kv|wkv|kv_proj)($|[/_])"),
    ("attention out", r"(^|[/_])(o|out|wo|o_proj|out_proj)($|[/_])|attn.*(out|proj)"),
    ("mlp up", r"up|gate|wi|fc1|w1|w3|c_fc|dense_in|hidden"),
    ("mlp down", r"down|fc2|w2|c_proj|dense_out"),
    ("embedding", r"embed|wte|tok|token"),
    ("output head", r"head|unembed|lm_head|logits|output"),
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


def _names_for(role: str, shape: tuple[int, ...], width: int, vocab: int | None) -> Names:
    """Logical names for a parameter of `role` and `shape`, given the model's width."""
    rank = len(shape)

    def named(size: int, default: str | None) -> str | None:
        if size == width:
            return "embed"
        if vocab is not None and size == vocab:
            return "vocab"
        return default

    if role in ("norm", "bias") or rank == 1:
        return (named(shape[0], None),) if rank == 1 else (None,) * rank
    if role in ("query", "key", "value", "key-value") and rank in (3, 4):
        head_name = "heads" if role == "query" else "kv_heads"
        return (*((None,) * (rank - 3)), "embed", head_name, "head_dim")
    if role in ("query", "key", "value", "key-value") and rank == 2:
        return ("embed", "heads" if role == "query" else "kv_heads")
    if role == "attention out" and rank == 3:
        return ("heads", "head_dim", "embed")
    if role == "attention out" and rank == 2:
        return ("heads", "embed")
    if role == "mlp up" and rank == 2:
        return ("embed", "mlp")
    if role == "mlp down" and rank == 2:
        return ("mlp", "embed")
    return tuple(named(size, None) for size in shape)


class Proposal:
    """Proposed logical names for every parameter of a model: check them, `edit` what is
    wrong, and turn them into path rules with `rules`."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def names(self) -> dict[str, Names]:
        """Path -> logical names."""
        return {row.path: row.names for row in self.rows}

    def edit(self, path: str, names: Names) -> Proposal:
        """A copy with the names of the parameter at `path` replaced by `names`."""
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
        `ema/...`, the optimizer's moments)."""
        return tuple((f"(^|/){re.escape(row.path)}$", row.names) for row in self.rows)

    def rules(self, base: Rules) -> Rules:
        """`base` with these names as its path rules (they override annotations); a name
        `base` has no rule for is refused here, naming the array."""
        unknown = sorted({n for row in self.rows for n in row.names if n} - set(base.logical))
        if unknown:
            raise RuleError(
                f"rule set {base.name!r} has no rule for {unknown}, which the proposal uses: "
                f"edit those arrays' names (known: {', '.join(sorted(base.logical))}) or add "
                "rules for them."
            )
        return base.replace(name=f"{base.name} by proposed names", paths=self.paths())

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
        unknown = [n for n in row.names if n and n not in VOCABULARY]
        if unknown:
            raise RuleError(
                f"{row.path}: {unknown} are not in the library's vocabulary "
                f"({', '.join(VOCABULARY)}); use those, or add a rule for them to your set."
            )


def propose(model: nnx.Module | Callable[[], nnx.Module]) -> Proposal:
    """Logical names for every `nnx.Param` of `model` (a module, or a function that creates
    one, which is traced abstractly), from its path and shape. The model's width is its most
    common parameter dimension; a vocabulary is the other dimension of an embedding."""
    module = abstract(model) if callable(model) and not isinstance(model, nnx.Module) else model
    params: list[tuple[str, Any]] = flat(nnx.state(module, nnx.Param))
    shapes = {path: tuple(int(d) for d in x.shape) for path, x in params}
    counts = collections.Counter(d for shape in shapes.values() for d in shape if len(shape) > 1)
    if not counts:
        raise ValueError("the model has no parameter of two or more dimensions to name")
    width = counts.most_common(1)[0][0]
    embeddings = [s for p, s in shapes.items() if _role(p) == "embedding" and len(s) == 2]
    vocab = next((d for s in embeddings for d in s if d != width), None)
    rows = [Row(p, s, _role(p), _names_for(_role(p), s, width, vocab)) for p, s in shapes.items()]
    _check_rank(rows)
    return Proposal(rows)
