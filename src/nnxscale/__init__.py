"""nnxscale: the library of the book Scaling Flax NNX.

`import nnxscale as nx` gives the names a reader needs, for the book's Transformer and for any
NNX module or pytree of arrays: meshes, rule sets and their layouts, sharded initialisation,
the trainer, checkpoints. Names load on first use, so `import nnxscale` starts no JAX work
(the setup cell must emulate devices before JAX starts). The modules behind them (`nx.fsdp`,
`nx.pipeline`, `nx.schedules`, `nx.hlo`, ...) hold what the chapters build step by step.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    "devices": ("emulate_devices", "EmulationTooLateError"),
    "mesh": ("make_mesh", "grid_shape"),
    "rules": (
        "Rules",
        "RuleError",
        "DP",
        "FSDP",
        "TP",
        "FSDP_TP",
        "ZERO1",
        "ZERO2",
        "HSDP",
        "PP",
        "PP_FSDP",
        "SP",
        "CP",
        "FSDP_CP",
        "EP",
        "FSDP_EP",
        "STRATEGIES",
        "RULE_SETS",
        "auto_fsdp",
        "mesh_axis_rules",
        "strategy_mesh",
        "compare",
    ),
    "layout": ("Layout", "Placement", "ReplicationWarning", "resolve", "activation_rules"),
    "context": ("Ring", "ContextError", "ring_attention"),
    "init": ("abstract", "init_sharded", "shard"),
    "losses": ("LossFn", "GradsFn", "cross_entropy", "next_token_loss"),
    "train": ("Trainer", "TrainState", "adamw", "loss_and_grads", "LEARNING_RATE"),
    "checkpoint": (
        "Checkpoints",
        "CheckpointError",
        "CheckpointMismatchError",
        "NoCheckpointError",
    ),
    "trees": ("largest_difference", "place"),
    "params": ("Params",),
    "model": ("Config", "Transformer", "TINY", "BENCH", "create", "count_params"),
    "data": ("Batches", "book_batches"),
    "hlo": ("collectives",),
    "memory": ("CompiledMemory", "device_bytes", "saved_bytes"),
    "costs": ("Setup", "step_cost", "HARDWARE", "Hardware"),
    "planner": ("plan",),
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}
_MODULES = (
    "activations",
    "calculator",
    "checkpoint",
    "cli",
    "comm",
    "context",
    "costs",
    "data",
    "devices",
    "display",
    "environment",
    "figures",
    "formula",
    "fsdp",
    "hlo",
    "init",
    "launch",
    "layout",
    "losses",
    "machine",
    "memory",
    "mesh",
    "model",
    "moe",
    "params",
    "pipeline",
    "planner",
    "rules",
    "schedules",
    "train",
    "trees",
)

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"nnxscale.{_WHERE[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"nnxscale.{name}")
    elif name == "show":  # the chapters' name for the display helpers
        value = importlib.import_module("nnxscale.display")
    else:
        raise AttributeError(f"module 'nnxscale' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_MODULES, "show"})
