"""The book's catalogue of strategies: named rule sets (`nnxscale.rules.Rules`), each with
the mesh axes and sizes it is meant for, from data parallelism to DeepSeek-V3's pipeline of
expert-parallel stages. `STRATEGIES` holds them all; the chapters, the cost model and the
planner read them from here, and a reader's own rule set is written the same way.
"""

from __future__ import annotations

from nnxscale.placement.rules import Rules

_REPLICATED = {
    "vocab": (),
    "embed": (),
    "heads": (),
    "kv_heads": (),
    "head_dim": (),
    "mlp": (),
    "length": (),
    "experts": (),
}
_ACTIVATIONS = {"batch": ("data",), "layers": ()}
STAGE, FSDP_AXIS = "stage", "fsdp"
"""The pipeline's mesh axes: stages, and FSDP inside each stage."""

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
    {
        **_REPLICATED,
        **_ACTIVATIONS,
        "heads": ("model",),
        "kv_heads": ("model",),
        "mlp": ("model",),
        "vocab": ("model",),
    },
    sizes=(-1, 2),
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
        "kv_heads": ("model",),
        "mlp": ("model", "data"),
        "vocab": ("model", "data"),
    },
    sizes=(-1, 2),
)
"""TP over `model` and FSDP over `data`; `mlp` and `vocab` fall back to `data` when `model`
does not divide them."""

PP = Rules(
    "PP",
    {**_REPLICATED, "layers": (STAGE,), "rounds": (), "batch": ()},
    axes=(STAGE,),
    sizes=(-1,),
)
"""Pipeline parallelism: each block's layers split over `stage` (with virtual stages, the
layers of each round: `nnxscale.pipeline.placed`), everything else replicated."""

PP_FSDP = Rules(
    "PP+FSDP",
    {
        **_REPLICATED,
        "layers": (STAGE,),
        "rounds": (),
        "batch": (FSDP_AXIS,),
        "embed": (FSDP_AXIS,),
        "mlp": (FSDP_AXIS,),
        "vocab": (FSDP_AXIS,),
    },
    axes=(STAGE, FSDP_AXIS),
    sizes=(-1, 2),
)
"""Pipeline stages over `stage`, and FSDP over `fsdp` inside each stage."""

PP_FSDP_TP = Rules(
    "PP+FSDP+TP",
    {
        **PP_FSDP.logical,
        "residual_length": ("model",),
        "heads": ("model",),
        "kv_heads": ("model",),
        "mlp": ("model", FSDP_AXIS),
        "vocab": ("model", FSDP_AXIS),
    },
    axes=(STAGE, FSDP_AXIS, "model"),
    sizes=(-1, 2, 2),
)
"""TP x PP x DP, as Llama 3 405B trained: stages over `stage`,
FSDP over `fsdp` and TP with sequence parallelism over `model` inside each stage (with
`fsdp` of one device, TP x PP)."""

PP_TP = Rules(
    "PP+TP",
    {
        **PP_FSDP_TP.logical,
        "batch": ("data",),
        "embed": (),
        "mlp": ("model",),
        "vocab": ("model",),
    },
    axes=(STAGE, "data", "model"),
    sizes=(-1, 1, 2),
)
"""TP x PP x DP with the state replicated over `data`, as Megatron-LM's 2021 runs train."""

ZERO1 = FSDP.replace(name="ZeRO-1", whole=("params", "grads"))
"""ZeRO stage 1: the optimizer state (AdamW's moments, the EMA) split as FSDP splits it;
parameters and gradients whole on every device, as in DP."""

ZERO2 = FSDP.replace(name="ZeRO-2", whole=("params",))
"""ZeRO stage 2: the optimizer state and the gradients split; parameters whole. (Stage 3,
everything split, is FSDP.)"""

FSDP_TP_SP = FSDP_TP.replace(
    name="FSDP+TP+SP", logical={**FSDP_TP.logical, "residual_length": ("model",)}
)
"""FSDP+TP with sequence parallelism, the residual stream split over `model` (torchtitan's 2D)."""

ZERO1_TP = FSDP_TP.replace(
    name="ZeRO-1+TP",
    logical={**FSDP_TP.logical, "residual_length": ("model",)},
    whole=("params", "grads"),
)
"""ZeRO-1 inside tensor and sequence parallelism (Megatron-LM's distributed optimizer,
nanotron): parameters split over `model`, their optimizer state over `model` and `data`."""

PP_ZERO1_TP = PP_FSDP_TP.replace(name="PP+ZeRO-1+TP", whole=("params", "grads"))
"""`ZERO1_TP` inside pipeline stages: the optimizer state also split over `fsdp`."""

REPLICA = "replica"
"""The mesh axis across groups of devices (hosts) in hybrid sharding."""

HSDP = Rules(
    "HSDP",
    {**FSDP.logical, "batch": ((REPLICA, "data"),)},
    axes=(REPLICA, "data"),
    sizes=(2, -1),
)
"""Hybrid sharding: FSDP over `data` inside each group of devices (a host), DP over
`replica` across groups. The batch is split over both; every group holds a whole copy of
the state, so the slow links between groups carry only a gradient all-reduce."""

HSDP_TP = Rules(
    "HSDP+TP",
    {**FSDP_TP.logical, "batch": ((REPLICA, "data"),)},
    axes=(REPLICA, "data", "model"),
    sizes=(2, -1, 2),
)
"""FSDP+TP inside each slice or group of hosts, DP over `replica` across them: the layout
MaxText runs across TPU slices (`ici_fsdp_parallelism` and `ici_tensor_parallelism` inside,
`dcn_data_parallelism` across)."""

SP = TP.replace(name="TP+SP", logical={**TP.logical, "residual_length": ("model",)})
"""Tensor parallelism with Megatron's sequence parallelism: the residual stream (norms,
dropout, residual adds) split along its sequence over `model` too, so each layer's
all-reduces become an all-gather before and a reduce-scatter after each split region."""

CONTEXT = "context"
"""The mesh axis context parallelism splits every sequence over."""

_SEQUENCE = {"length": (CONTEXT,), "residual_length": (CONTEXT,)}

CP = Rules(
    "CP",
    {**_REPLICATED, **_ACTIVATIONS, **_SEQUENCE},
    axes=("data", CONTEXT),
    sizes=(1, -1),
)
"""Context parallelism: every activation split along its sequence over `context` (ring
attention passes keys and values around it); parameters replicated, as in DP."""

FSDP_CP = Rules(
    "FSDP+CP",
    {**FSDP.logical, **_SEQUENCE},
    axes=("data", CONTEXT),
    sizes=(-1, 2),
)
"""FSDP over `data` (parameters and batch) and context parallelism over `context`."""

FSDP_CP_TP = Rules(
    "FSDP+CP+TP",
    {**FSDP_TP.logical, **_SEQUENCE},
    axes=("data", CONTEXT, "model"),
    sizes=(-1, 2, 2),
)
"""FSDP over `data`, every sequence split over `context` (ring attention) and tensor
parallelism over `model` inside a host: the layout of long-context training (inside
pipeline stages: `PP_FSDP_CP_TP`). With `data` of one device it is CP x TP."""

PP_FSDP_CP_TP = Rules(
    "PP+FSDP+CP+TP",
    {
        **PP_FSDP_TP.logical,
        "length": (CONTEXT,),
        "residual_length": ((CONTEXT, "model"),),
    },
    axes=(STAGE, FSDP_AXIS, CONTEXT, "model"),
    sizes=(-1, 2, 2, 2),
)
"""Context parallelism inside pipeline stages, as Llama 3 405B trained at 131k tokens:
stages over `stage`, and inside each stage FSDP over `fsdp`, every sequence split over
`context` (the book's ring attention; Llama 3 all-gathers keys and values instead) and TP
over `model`, with sequence parallelism splitting the residual stream's chunk of the
sequence over `model` too."""

EXPERT = "expert"
"""The mesh axis expert parallelism splits a mixture's experts over."""

EP = Rules(
    "EP",
    {
        **_REPLICATED,
        **_ACTIVATIONS,
        "batch": (("data", EXPERT),),
        "experts": (EXPERT,),
        "groups": ("data",),
    },
    axes=("data", EXPERT),
    sizes=(1, -1),
    strict=True,
)
"""Expert parallelism: each device holds its share of every MoE layer's experts and its share
of the batch (over `data` and `expert`); the rest replicated, as in DP. Strict: an expert
count the axis does not divide is an error, not a silent replication."""

FSDP_EP = Rules(
    "FSDP+EP",
    {**FSDP.logical, "batch": (("data", EXPERT),), "experts": (EXPERT,), "groups": ("data",)},
    axes=("data", EXPERT),
    sizes=(-1, 4),
)
"""Expert parallelism over `expert` and FSDP over `data`: the experts split over both."""

PP_FSDP_EP = Rules(
    "PP+FSDP+EP",
    {
        **PP_FSDP.logical,
        "batch": ((FSDP_AXIS, EXPERT),),
        "experts": (EXPERT,),
        "groups": (FSDP_AXIS,),
    },
    axes=(STAGE, FSDP_AXIS, EXPERT),
    sizes=(-1, 2, 2),
)
"""Pipeline stages over `stage`, and FSDP+EP inside each stage (over `fsdp` and `expert`):
DeepSeek-V3's layout (16 stages, experts over 64 devices), with FSDP where it used ZeRO-1."""

STRATEGIES = {
    rules.name: rules
    for rules in (
        DP,
        ZERO1,
        ZERO2,
        FSDP,
        TP,
        FSDP_TP,
        HSDP,
        HSDP_TP,
        PP,
        PP_FSDP,
        PP_FSDP_TP,
        PP_TP,
        FSDP_TP_SP,
        ZERO1_TP,
        PP_ZERO1_TP,
        SP,
        CP,
        FSDP_CP,
        FSDP_CP_TP,
        PP_FSDP_CP_TP,
        EP,
        FSDP_EP,
        PP_FSDP_EP,
    )
}
"""Every rule set of the book, with the mesh axes and sizes each is meant for."""

RULE_SETS = {rules.name: rules for rules in (DP, FSDP, TP, FSDP_TP)}
"""The four strategies chapters 2 to 4 compare on one model, on a `(data, model)` mesh."""
