"""The field's own formulas, set beside the ledger's: what a reader checks the book against.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1) count the activations one GPT layer keeps for its backward pass, in bytes with
16-bit activations: 34 s b h + 5 a s^2 b, of which attention 11 s b h + 5 a s^2 b, the MLP
19 s b h and the two layer norms 4 s b h (s tokens, b sequences, width h, a heads).
"""

from __future__ import annotations

from nnxscale.costs.activations import kept
from nnxscale.costs.counts import Setup, sizes_of
from nnxscale.costs.formula import Formula
from nnxscale.model.config import Config
from nnxscale.placement.catalogue import DP

KORTHIKANTI = {
    "attention, linear in s": (11, 0),
    "attention scores (s^2)": (0, 5),
    "MLP": (19, 0),
    "norms": (4, 0),
}
"""Each part of a GPT layer's activations as (coefficient of s b h, of a s^2 b), in bytes."""

WHY = {
    "attention, linear in s": (
        "grouped-query keys and values ({kv} of {heads} heads), a float32 log-sum-exp per "
        "query and head; no dropout mask"
    ),
    "attention scores (s^2)": "the blockwise attention keeps no score (GPT: softmax output, "
    "dropout mask and its output, 5 a s^2 b)",
    "MLP": "SwiGLU keeps its input, gate, up and hidden ({mlp:,} wide); GPT's GELU MLP keeps "
    "19 h per token (4h wide, and a dropout mask)",
    "norms": "RMSNorm computes in float32: each norm's input and output, the residual's",
}
"""Why the ledger's part differs from Korthikanti's, for the model's sizes."""


def korthikanti(cfg: Config, seq: int, sequences: int = 1) -> dict[str, float]:
    """Korthikanti et al.'s bytes per layer, by part, for a GPT layer of `cfg`'s width and
    heads (16-bit activations, with dropout)."""
    sbh = seq * sequences * cfg.embed
    as2b = cfg.heads * seq * seq * sequences
    return {part: a * sbh + b * as2b for part, (a, b) in KORTHIKANTI.items()}


def _part(powers: dict[str, int]) -> str:
    """Which of Korthikanti's parts a term of the ledger's layer belongs to."""
    if powers.get("seq", 0) > 1:
        return "attention scores (s^2)"
    if "mlp" in powers:
        return "MLP"
    if {"heads", "kv_heads", "head_dim"} & set(powers):
        return "attention, linear in s"
    return "norms"


def ledger_by_part(cfg: Config, seq: int, sequences: int = 1) -> dict[str, float]:
    """The bytes the ledger's layer keeps (`activations.kept`, traced from the model, in its
    compute dtype, no remat), by Korthikanti's parts. A term without a batch dimension (a
    norm's scale, a rotary table) counts where its names put it."""
    layer = kept(cfg.compute_dtype).layer
    sizes = sizes_of(cfg, Setup.of(DP, {"data": 1}), sequences, seq)
    found = dict.fromkeys(KORTHIKANTI, 0.0)
    for powers, coefficient in layer.terms.items():
        found[_part(dict(powers))] += Formula({powers: coefficient})(sizes)
    return found


def compare_layer(cfg: Config, seq: int) -> list[list[object]]:
    """Rows (part, Korthikanti's bytes, the ledger's, ratio, why they differ) for one layer
    of `cfg` and one sequence of `seq` tokens, and a total row."""
    theirs, ours = korthikanti(cfg, seq), ledger_by_part(cfg, seq)
    why = {k: v.format(kv=cfg.kv_heads, heads=cfg.heads, mlp=cfg.mlp) for k, v in WHY.items()}
    rows: list[list[object]] = [
        [part, theirs[part], ours[part], ours[part] / theirs[part] if theirs[part] else 0.0,
         why[part]]
        for part in KORTHIKANTI
    ]  # fmt: skip
    total_theirs, total_ours = sum(theirs.values()), sum(ours.values())
    rows.append(["layer", total_theirs, total_ours, total_ours / total_theirs, ""])
    return rows
