"""nnxscale: the library of the book Scaling Flax NNX.

`import nnxscale as nx` gives, under one spelling each, the names a reader needs to train
the book's Transformer or any NNX module on many devices: meshes, rule sets, sharded
initialisation, the trainer and its options, checkpoints, and the compiled program's
collectives, memory and plan. Everything else lives in the modules, spelled with theirs
(`nx.fsdp`, `nx.pipeline`, `nx.schedules`, `nx.hlo`, `nx.costs`, `nx.show`, ...), each
`nx.<module>` whatever layer (subpackage) holds it: core, runtime, placement, model, analysis,
train, checkpoint, parallelism, costs, evidence, profiling, figures.

Importing starts no JAX backend, so the setup cell can still emulate devices after it.
"""

from __future__ import annotations

from nnxscale.runtime import environment

environment.check_versions()  # before anything imports jax or flax

from nnxscale import checkpoint, cli, costs, evidence, figures, model, train
from nnxscale.analysis import comm, hlo, program
from nnxscale.analysis.hlo import collectives
from nnxscale.checkpoint import integrity, multi
from nnxscale.checkpoint.store import Checkpoints
from nnxscale.core import memory, problems, show, steered, trees
from nnxscale.core.memory import CompiledMemory
from nnxscale.costs import activations, calculator, formula, planner
from nnxscale.costs.planner import plan
from nnxscale.model import configs, context, dropless, growth, losses, moe, params
from nnxscale.model.config import TINY, Config
from nnxscale.model.transformer import Transformer, create
from nnxscale.parallelism import fsdp, pipeline, schedules
from nnxscale.placement import (
    annotations,
    catalogue,
    compiling,
    constraints,
    init,
    layout,
    mesh,
    naming,
    rounds,
    rules,
)
from nnxscale.placement.annotations import mesh_axis_rules
from nnxscale.placement.catalogue import (
    CP,
    DP,
    EP,
    FSDP,
    FSDP_CP,
    FSDP_EP,
    FSDP_TP,
    HSDP,
    PP,
    PP_FSDP,
    RULE_SETS,
    SP,
    TP,
    ZERO1,
    ZERO2,
)
from nnxscale.placement.init import abstract, init_sharded, shard
from nnxscale.placement.layout import resolve
from nnxscale.placement.mesh import make_mesh
from nnxscale.placement.rules import Rules, auto_fsdp, strategy_mesh
from nnxscale.profiling import diagnose, machine, overlap, profiles
from nnxscale.runtime import cluster, devices, events, launch, preemption
from nnxscale.runtime.devices import emulate_devices
from nnxscale.train import agree, data
from nnxscale.train.agree import agreement
from nnxscale.train.data import Batches, book_batches
from nnxscale.train.state import TrainOptions, adamw
from nnxscale.train.trainer import Trainer, trainer_for

__version__ = "0.1.0"

__all__ = [
    "CP",
    "DP",
    "EP",
    "FSDP",
    "FSDP_CP",
    "FSDP_EP",
    "FSDP_TP",
    "HSDP",
    "PP",
    "PP_FSDP",
    "RULE_SETS",
    "SP",
    "TINY",
    "TP",
    "ZERO1",
    "ZERO2",
    "Batches",
    "Checkpoints",
    "CompiledMemory",
    "Config",
    "Rules",
    "TrainOptions",
    "Trainer",
    "Transformer",
    "abstract",
    "adamw",
    "agreement",
    "auto_fsdp",
    "book_batches",
    "collectives",
    "create",
    "emulate_devices",
    "init_sharded",
    "make_mesh",
    "mesh_axis_rules",
    "plan",
    "resolve",
    "shard",
    "strategy_mesh",
    "trainer_for",
]

MODULES = (
    activations, agree, annotations, calculator, catalogue, checkpoint, cli, cluster, comm,
    compiling, configs, constraints, context, costs, data, devices, diagnose, dropless, environment,
    events, evidence, figures, formula, fsdp, growth, hlo, init, integrity, launch, layout, losses,
    machine, memory, mesh, model, moe, multi, naming, overlap, params, pipeline, planner,
    preemption, problems, profiles, program, rounds, rules, schedules, show, steered, train, trees,
)  # fmt: skip
"""The modules, each reached as `nx.<module>`: the rest of the library, spelled with its home."""
