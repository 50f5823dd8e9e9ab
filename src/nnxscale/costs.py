"""The cost model: memory per device, FLOPs, bytes sent and step time of every strategy.

Pure arithmetic on the sizes of the book's Transformer (`nnxscale.Config`), a strategy, a mesh
and a hardware description, so it answers for models and clusters far larger than this
machine. Chapter 11 checks each formula against compiled programs of the book's Transformer,
and the in-page calculator (`nnxscale.calculator`) runs the same formulas in the browser.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from nnxscale.comm import ring_bytes
from nnxscale.model import Config
from nnxscale.rules import STRATEGIES

STATE_BYTES = 4
"""Bytes per element of parameters, gradients and optimizer state: float32, as the Trainer
keeps them whatever the compute dtype."""

OPTIMIZER_COPIES = 3
"""Optimizer state per parameter, in parameter-sized copies: AdamW's two moments and the EMA."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per activation value for each compute dtype a `Config` may name."""

LOGIT_BYTES = 4
"""Bytes per logit: the model computes its logits, and the loss, in float32."""

LATENCY = 1e-5
"""Seconds each collective costs before any byte moves (an assumed order of magnitude for
launch and synchronisation, not a datasheet number: the chapter shows it barely matters)."""

EFFICIENCY = 0.5
"""The fraction of peak FLOP/s a step's compute reaches (model FLOPs utilisation)."""

SPLITS = {
    "DP": ("whole", "whole", "whole"),
    "ZeRO-1": ("whole", "whole", "data"),
    "ZeRO-2": ("whole", "data", "data"),
    "FSDP": ("data", "data", "data"),
    "TP": ("model", "model", "model"),
    "FSDP+TP": ("data+model", "data+model", "data+model"),
    "HSDP": ("data", "data", "data"),
    "PP": ("stage", "stage", "stage"),
}
"""How each strategy splits parameters, gradients and optimizer state: `whole` on every
device, over `data`, over `model` (the arrays tensor parallelism cuts), over both, or over
pipeline `stage`s (the layers)."""

STRATEGY_NAMES = tuple(SPLITS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links, as the time model sees them.

    `fast` is the bytes per second one device sends around a ring inside its fast domain of
    `domain` devices (TPU ICI along one axis, GPU NVLink); `slow` the bytes per second it sends
    to devices in other domains (data-centre network, InfiniBand). `source` is a key of the
    book's bibliography.
    """

    name: str
    flops: float
    memory: float
    fast: float
    slow: float
    domain: int
    source: str


HARDWARE = {
    hw.name: hw
    for hw in (
        Hardware("TPU v5e", 1.97e14, 16e9, 9.0e10, 3.125e9, 256, "austin2025scaling"),
        Hardware("TPU v5p", 4.59e14, 96e9, 1.8e11, 6.25e9, 8960, "austin2025scaling"),
        Hardware("TPU v6e", 9.2e14, 32e9, 1.8e11, 12.5e9, 256, "austin2025scaling"),
        Hardware("H100", 9.89e14, 80e9, 4.5e11, 5.0e10, 8, "nvidia2023h100"),
        Hardware("H200", 9.89e14, 141e9, 4.5e11, 5.0e10, 8, "nvidia2024h200"),
        Hardware("B200", 2.25e15, 180e9, 9.0e11, 5.0e10, 8, "nvidia2024dgxb200"),
    )
}
"""Peak dense bfloat16 FLOP/s, memory and link bandwidths per device. TPU links: ICI
bidirectional bandwidth of one axis (a ring with wraparound) and DCN per chip; GPU links:
NVLink one way per GPU and one 400 Gb/s network adapter per GPU."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameter counts of the book's Transformer, by what the strategies do with them."""

    total: int
    tensor: int
    """In arrays tensor parallelism splits (a `heads`, `mlp` or `vocab` dimension)."""
    blocks: int
    """In the layers (what pipeline stages split)."""
    matmul: int
    """In matrix products: everything but the embedding tables (looked up) and the norms."""
    blocks_matmul: int
    """In the layers' matrix products (what rematerialisation computes twice)."""


def counts(cfg: Config) -> Counts:
    """Parameter counts of the Transformer `cfg` describes, by formula."""
    e, v = cfg.embed, cfg.vocab
    attention = 4 * e * cfg.heads * cfg.head_dim
    mlp = 2 * e * cfg.mlp
    layer = attention + mlp + 2 * e
    blocks = cfg.layers * layer
    return Counts(
        total=v * e + cfg.max_len * e + blocks + e + e * v,
        tensor=2 * v * e + cfg.layers * (attention + mlp),
        blocks=blocks,
        matmul=cfg.layers * (attention + mlp) + e * v,
        blocks_matmul=cfg.layers * (attention + mlp),
    )


def held(cfg: Config, split: str, mesh: Mapping[str, int]) -> float:
    """Parameters per device (elements) when a state is split as `split` says (`SPLITS`)."""
    c = counts(cfg)
    d, t, p = mesh.get("data", 1), mesh.get("model", 1), mesh.get("stage", 1)
    other = c.total - c.tensor
    return {
        "whole": c.total,
        "data": c.total / d,
        "model": c.tensor / t + other,
        "data+model": (c.tensor / t + other) / d,
        "stage": c.blocks / p + c.total - c.blocks,
    }[split]


def layer_values(
    cfg: Config,
    seq: int,
    model: int = 1,
    *,
    sequence_parallel: bool = False,
    flash: bool = False,
) -> float:
    """Activation values one layer keeps per token for its backward pass: the inputs of its
    matrix products and nonlinearities (4E + 4HD + 2F + H s), tensor-parallel parts split.
    Sequence parallelism splits the residual stream's 4E too; `flash` attention keeps no
    scores (its backward recomputes them block by block), dropping the H s term."""
    residual = 4 * cfg.embed / (model if sequence_parallel else 1)
    scores = 0 if flash else cfg.heads * seq
    return residual + (4 * cfg.heads * cfg.head_dim + 2 * cfg.mlp + scores) / model


def activation_bytes(
    cfg: Config,
    sequences: float,
    seq: int,
    *,
    model: int = 1,
    remat: bool = False,
    context: int = 1,
    sequence_parallel: bool = False,
    flash: bool = False,
) -> float:
    """Bytes of activations one device keeps for the backward pass of `sequences` sequences
    of `seq` tokens: every layer's (or, with remat, every layer's input and one layer rebuilt
    at a time), plus the final norm's input and output and the float32 logits. Context
    parallelism gives each device `seq / context` of every sequence's tokens (each query still
    scores all `seq` keys, one block at a time)."""
    tokens = sequences * seq / context
    width = DTYPE_BYTES[cfg.compute_dtype]
    split = dict(sequence_parallel=sequence_parallel, flash=flash)
    layer = tokens * layer_values(cfg, seq, model, **split) * width
    head = tokens * (2 * cfg.embed * width + cfg.vocab / model * LOGIT_BYTES)
    if remat:
        stream = cfg.embed / (model if sequence_parallel else 1)
        return cfg.layers * tokens * stream * width + layer + head
    return cfg.layers * layer + head


def ring_hop_tokens(hardware: Hardware, dtype: str = "bfloat16") -> float:
    """Tokens of a sequence per device above which one ring-attention hop computes longer
    than it takes to send the next key/value block: a chunk of c tokens does 4 c^2 H D FLOPs
    against 2 c H D values sent, so c >= bytes x FLOP/s x EFFICIENCY / (2 x link bytes/s),
    whatever the model's shape."""
    return DTYPE_BYTES[dtype] * hardware.flops * EFFICIENCY / (2 * hardware.fast)


def step_flops(cfg: Config, sequences: float, seq: int, *, remat: bool = False) -> float:
    """FLOPs of one training step's matrix products: 3 x the forward pass's (6 x parameters x
    tokens, plus attention's 12 L b s^2 H D). Remat runs each layer's forward again, all but
    its last product (the MLP's down projection, whose output the backward does not need)."""
    c = counts(cfg)
    tokens = sequences * seq
    attention = 4 * cfg.layers * sequences * seq**2 * cfg.heads * cfg.head_dim
    total = 3 * (2 * c.matmul * tokens + attention)
    if remat:
        last = cfg.layers * cfg.mlp * cfg.embed
        total += 2 * (c.blocks_matmul - last) * tokens + attention
    return total


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective of a step: over which mesh axis, the bytes of its array (the
    P of the ring formulas, summed over its executions) and how many executions."""

    kind: str
    axis: str
    array_bytes: float
    count: int

    def sent(self, mesh: Mapping[str, int]) -> float:
        """Bytes each device sends for these collectives, by the ring formulas."""
        return ring_bytes(self.kind, self.array_bytes, mesh[self.axis])


def mesh_for(strategy: str, devices: int, hardware: Hardware | None = None) -> dict[str, int]:
    """The mesh a strategy runs on: the rule set's own shape (`nnxscale.rules.STRATEGIES`);
    hybrid sharding puts `replica` across the fast domains when `hardware` is given."""
    _check_strategy(strategy)
    rules = STRATEGIES[strategy]
    if strategy == "HSDP" and hardware is not None:
        replica = max(1, math.gcd(devices, max(1, devices // hardware.domain)))
        return {"replica": replica, "data": devices // replica}
    return dict(zip(rules.axes, rules.mesh_shape(devices), strict=True))


def transfers(
    cfg: Config, strategy: str, mesh: Mapping[str, int], sequences: int, seq: int
) -> list[Transfer]:
    """The collectives of one training step under `strategy` on `mesh`, by formula.

    P is the gradient's bytes (float32). DP all-reduces it; ZeRO-1 and ZeRO-2 reduce-scatter
    it and all-gather the updated parameters; FSDP all-gathers the parameters twice (forward
    and backward) and reduce-scatters the gradient; tensor parallelism all-reduces a layer's
    activations four times (two forward, two backward) plus the embedding's and the head's,
    and reduces its 1/t of the gradient over `data`; hybrid sharding runs FSDP inside each
    group and all-reduces the 1/d shard across groups; a pipeline sends every micro-batch's
    activations forward and their gradients back.
    """
    _check_strategy(strategy)
    c = counts(cfg)
    full = c.total * STATE_BYTES
    d = mesh.get("data", 1)
    per_replica = sequences * seq / (d * mesh.get("replica", 1))
    activation = per_replica * cfg.embed * DTYPE_BYTES[cfg.compute_dtype]
    tp = held(cfg, "model", mesh) * STATE_BYTES
    layers = cfg.layers
    if strategy == "DP":
        return [Transfer("all-reduce", "data", full, 1)]
    if strategy in ("ZeRO-1", "ZeRO-2"):
        return [
            Transfer("reduce-scatter", "data", full, 1),
            Transfer("all-gather", "data", full, 1),
        ]
    if strategy in ("FSDP", "HSDP"):
        out = [
            Transfer("all-gather", "data", 2 * full, 2 * layers),
            Transfer("reduce-scatter", "data", full, layers),
        ]
        if strategy == "HSDP":
            out.append(Transfer("all-reduce", "replica", full / d, 1))
        return out
    if strategy in ("TP", "FSDP+TP"):
        activations = Transfer("all-reduce", "model", (4 * layers + 2) * activation, 4 * layers + 2)
        if strategy == "TP":
            return [activations, Transfer("all-reduce", "data", tp, 1)]
        return [
            activations,
            Transfer("all-gather", "data", 2 * tp, 2 * layers),
            Transfer("reduce-scatter", "data", tp, layers),
        ]
    stages = mesh.get("stage", 1)
    boundaries = 2 * sequences * seq * cfg.embed * DTYPE_BYTES[cfg.compute_dtype]
    return [Transfer("collective-permute", "stage", boundaries if stages > 1 else 0, 2)]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the cost model predicts for one training step on one device."""

    strategy: str
    mesh: dict[str, int]
    memory: dict[str, float]
    """Bytes per device: parameters, gradients, optimizer state, activations."""
    flops: float
    """FLOPs per device."""
    transfers: list[Transfer]
    sent: float
    """Bytes each device sends per step."""
    compute_time: float
    comm_time: float
    bubble: float
    """Fraction of a pipeline's ticks its devices idle (0 for the other strategies)."""
    step_time: float

    @property
    def total_memory(self) -> float:
        """Bytes per device of everything in the ledger."""
        return sum(self.memory.values())

    @property
    def bound(self) -> str:
        """Which side sets the step time: compute or communication."""
        return "compute" if self.compute_time >= self.comm_time else "communication"


def step_cost(
    cfg: Config,
    strategy: str,
    devices: int,
    hardware: Hardware,
    sequences: int,
    seq: int | None = None,
    *,
    remat: bool = False,
    mesh: Mapping[str, int] | None = None,
    efficiency: float = EFFICIENCY,
    overlap: bool = True,
    micro_batches: int | None = None,
) -> StepCost:
    """Memory per device, FLOPs, bytes sent and time of one step of `sequences` sequences of
    `seq` tokens (default `cfg.max_len`) under `strategy` on `devices` devices of `hardware`.

    Compute runs at `efficiency` of peak; each collective costs `LATENCY` plus its bytes over
    the link its axis runs on (fast inside a domain, slow across); with `overlap` the step
    takes the longer of compute and communication, else their sum. A pipeline runs 1F1B with
    `micro_batches` (default 4 per stage) and idles (p-1)/(m+p-1) of its ticks.
    """
    seq = seq or cfg.max_len
    mesh = dict(mesh or mesh_for(strategy, devices, hardware))
    if math.prod(mesh.values()) != devices:
        raise ValueError(f"mesh {mesh} has {math.prod(mesh.values())} devices, not {devices}")
    params_split, grads_split, optimizer_split = SPLITS[strategy]
    t, p = mesh.get("model", 1), mesh.get("stage", 1)
    batch_split = mesh.get("data", 1) * mesh.get("replica", 1)
    bubble, in_flight = 0.0, sequences / batch_split
    cfg_held = cfg
    if strategy == "PP":
        m = micro_batches or 4 * p
        bubble = (p - 1) / (m + p - 1)
        in_flight = min(p, m) * sequences / m
        cfg_held = cfg.replace(layers=math.ceil(cfg.layers / p))
    memory = {
        "parameters": held(cfg, params_split, mesh) * STATE_BYTES,
        "gradients": held(cfg, grads_split, mesh) * STATE_BYTES,
        "optimizer state": held(cfg, optimizer_split, mesh) * STATE_BYTES * OPTIMIZER_COPIES,
        "activations": activation_bytes(cfg_held, in_flight, seq, model=t, remat=remat),
    }
    flops = step_flops(cfg, sequences, seq, remat=remat) / devices
    moves = transfers(cfg, strategy, mesh, sequences, seq)
    sent = sum(x.sent(mesh) for x in moves)
    compute = flops / (hardware.flops * efficiency) / (1 - bubble)
    comm = sum(
        LATENCY * x.count + x.sent(mesh) / link_bandwidth(x.axis, mesh, hardware)
        for x in moves
        if mesh[x.axis] > 1
    )
    step = max(compute, comm) if overlap else compute + comm
    return StepCost(strategy, mesh, memory, flops, moves, sent, compute, comm, bubble, step)


@dataclasses.dataclass(frozen=True)
class Option:
    """One strategy for a plan: its predicted cost (with or without remat), or why it fails."""

    strategy: str
    cost: StepCost | None
    remat: bool
    reason: str = ""

    @property
    def fits(self) -> bool:
        """Whether the strategy runs: its mesh suits the model and batch and it fits memory."""
        return not self.reason


class Plan:
    """The strategies for one model, cluster and batch: those that fit ranked by predicted
    step time (then bytes sent, then memory), and why each of the others does not fit."""

    def __init__(self, options: list[Option], hardware: Hardware, memory: float) -> None:
        fit = sorted(
            (o for o in options if o.fits),
            key=lambda o: (round(o.cost.step_time, 9), o.cost.sent, o.cost.total_memory),
        )
        self.ranked = fit
        self.rejected = [o for o in options if not o.fits]
        self.hardware = hardware
        self.memory = memory

    @property
    def best(self) -> Option:
        """The fastest strategy that fits; an error if none does."""
        if not self.ranked:
            reasons = "; ".join(f"{o.strategy}: {o.reason}" for o in self.rejected)
            raise ValueError(f"no strategy fits: {reasons}")
        return self.ranked[0]

    def __getitem__(self, strategy: str) -> Option:
        for option in (*self.ranked, *self.rejected):
            if option.strategy == strategy:
                return option
        raise KeyError(strategy)

    def _repr_markdown_(self) -> str:
        from nnxscale.display import table

        rows = []
        for rank, o in enumerate([*self.ranked, *self.rejected], start=1):
            c = o.cost
            mesh = " x ".join(f"{k} {v}" for k, v in (c.mesh if c else {}).items())
            rows.append(
                [
                    rank if o.fits else "-",
                    o.strategy,
                    mesh or "-",
                    "yes" if o.remat else "no",
                    f"{c.total_memory / 1e9:.1f}" if c else "-",
                    f"{c.sent / 1e9:.2f}" if c else "-",
                    f"{c.step_time:.3f} ({c.bound})" if c and o.fits else "-",
                    o.reason or "fits",
                ]
            )
        headers = [
            "rank",
            "strategy",
            "mesh",
            "remat",
            "GB per device",
            "GB sent per device",
            "step (s)",
            "verdict",
        ]
        return str(table(headers, rows, f"{self.hardware.name}, {self.memory / 1e9:.0f} GB"))


def plan(
    cfg: Config,
    devices: int,
    hardware: Hardware | str,
    memory_per_device: float | None = None,
    global_batch: int = 8,
    seq: int | None = None,
    **options: object,
) -> Plan:
    """Every strategy for training `cfg` on `devices` devices of `hardware` with batches of
    `global_batch` sequences of `seq` tokens: ranked if it fits `memory_per_device` (default:
    the device's memory), first without remat, then with; else the reason it does not.
    `options` go to `step_cost` (efficiency, overlap, micro_batches)."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    budget = memory_per_device or hw.memory
    seq = seq or cfg.max_len
    result = []
    for strategy in STRATEGY_NAMES:
        mesh = mesh_for(strategy, devices, hw)
        reason = unsuitable(cfg, strategy, mesh, global_batch, options.get("micro_batches"))
        if reason:
            result.append(Option(strategy, None, False, reason))
            continue
        costs = [
            step_cost(cfg, strategy, devices, hw, global_batch, seq, remat=r, mesh=mesh, **options)
            for r in (False, True)
        ]
        fitting = [c for c in costs if c.total_memory <= budget]
        if fitting:
            result.append(Option(strategy, fitting[0], fitting[0] is costs[1]))
            continue
        c = costs[1]
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in c.memory.items())
        reason = f"needs {c.total_memory / 1e9:.1f} GB even with remat ({parts})"
        result.append(Option(strategy, c, True, reason))
    return Plan(result, hw, budget)


def unsuitable(
    cfg: Config,
    strategy: str,
    mesh: Mapping[str, int],
    global_batch: int,
    micro_batches: object = None,
) -> str:
    """Why a strategy's mesh cannot run this model and batch as the cost model assumes, or ""."""
    split = mesh.get("data", 1) * mesh.get("replica", 1)
    if global_batch % split:
        return f"the batch of {global_batch} sequences does not split over {split} devices"
    t = mesh.get("model", 1)
    uncut = [n for n in ("heads", "mlp", "vocab") if getattr(cfg, n) % t]
    if uncut:
        return f"the model axis ({t}) does not divide {', '.join(uncut)}"
    d = mesh.get("data", 1)
    if SPLITS[strategy][2].startswith("data") and cfg.embed % d:
        return f"the data axis ({d}) does not divide embed ({cfg.embed})"
    p = mesh.get("stage", 1)
    if cfg.layers % p:
        return f"{p} stages do not divide {cfg.layers} layers"
    m = micro_batches or 4 * p
    if strategy == "PP" and global_batch % m:
        return f"the batch of {global_batch} sequences does not split into {m} micro-batches"
    return ""


def link_bandwidth(axis: str, mesh: Mapping[str, int], hardware: Hardware) -> float:
    """Bytes per second of a ring along `axis`: fast if its devices lie in one domain.

    Devices fill the mesh with the last axis fastest, so the devices along `axis` span its
    size times the sizes of the axes after it.
    """
    names = list(mesh)
    span = math.prod(mesh[a] for a in names[names.index(axis) :])
    return hardware.fast if span <= hardware.domain else hardware.slow


def fsdp_crossover(cfg: Config, hardware: Hardware, efficiency: float = EFFICIENCY) -> float:
    """Tokens per device below which FSDP is communication-bound on the fast links.

    Compute is 6 x matmul parameters x tokens / (peak x efficiency); FSDP sends about
    3 x parameters x 4 bytes over `fast`: they are equal at this many tokens.
    """
    c = counts(cfg)
    return 3 * c.total * STATE_BYTES * hardware.flops * efficiency / (6 * c.matmul * hardware.fast)


def _check_strategy(strategy: str) -> None:
    if strategy not in SPLITS:
        raise ValueError(
            f"no cost model for strategy {strategy!r}; use one of {', '.join(STRATEGY_NAMES)}"
        )


SEVEN_B = Config(
    vocab=32000,
    embed=4096,
    heads=32,
    head_dim=128,
    mlp=16384,
    layers=32,
    max_len=4096,
    dropout=0.0,
    compute_dtype="bfloat16",
)
"""A 6.7 B-parameter model of the book's architecture (GPT-3 6.7B's shape)."""

SEVENTY_B = SEVEN_B.replace(embed=8192, heads=64, mlp=36864, layers=80)
"""A 70 B-parameter model of the book's architecture."""
