"""The book's Transformer; published `configs`, ring attention (`context`), mixtures (`moe`,
GShard's with a capacity, and `dropless`), losses, `Params`."""

from nnxscale.model.casting import CAST_WEIGHTS, compute_copy
from nnxscale.model.config import BENCH, REMAT_POLICIES, config_problem, remat_policy
from nnxscale.model.transformer import (
    HEADS,
    HIDDEN,
    KV_HEADS,
    LOGICAL_AXES,
    LOGITS,
    MLP,
    RESIDUAL,
    TOKENS,
    Attention,
    Block,
    BlockRunner,
    RMSNorm,
    count_params,
    plain_stack,
)

__all__ = [
    "BENCH",
    "CAST_WEIGHTS",
    "HEADS",
    "HIDDEN",
    "KV_HEADS",
    "LOGICAL_AXES",
    "LOGITS",
    "MLP",
    "REMAT_POLICIES",
    "RESIDUAL",
    "TOKENS",
    "Attention",
    "Block",
    "BlockRunner",
    "RMSNorm",
    "compute_copy",
    "config_problem",
    "count_params",
    "plain_stack",
    "remat_policy",
]
