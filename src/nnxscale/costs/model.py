"""The cost model: what one training step holds, computes and sends on each device, and how
long it takes.

A strategy is a rule set and the size of each of its mesh axes (`Setup`). Everything the cost
model says about it is derived from that rule set: the rule set is resolved against the
abstract model on a mesh of size-1 axes (`jax.sharding.AbstractMesh`, no devices), which
says which mesh axes split each dimension of each array; bytes per device, the weights a
step gathers, the gradients it reduces and the activations it splits follow as `Formula`s in
the model's sizes and the axes' sizes (`derive`). The activations are those JAX's autodiff
keeps for the book's Transformer (`nnxscale.activations`), dense or with a mixture of experts
in place of each MLP. The formulas are evaluated for any model, cluster and batch
(`step_cost`), searched by the planner (`nnxscale.planner`), and written into the page for the
calculator (`nnxscale.calculator`), which only evaluates them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping

from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from nnxscale.analysis.comm import ring_bytes
from nnxscale.costs.activations import EXPERTS, LOGICAL, PRIMES, factor, kept, mixture
from nnxscale.costs.formula import Formula
from nnxscale.model.moe import capacity
from nnxscale.model.transformer import CAST_WEIGHTS, Config, create, remat_policy
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import ROUTED, activation_axes, resolve, weight_axes
from nnxscale.placement.rules import RuleError, Rules

STATE_BYTES = 4
"""Bytes per element of parameters, gradients and optimizer state: float32, as the Trainer
keeps them whatever the compute dtype."""

OPTIMIZER_COPIES = 3
"""Optimizer state per parameter, in parameter-sized copies: AdamW's two moments and the EMA."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of each compute dtype a `Config` may name."""

LOGIT_BYTES = 4
"""Bytes per logit: the model computes its logits, and the loss, in float32."""

EFFICIENCY = 0.5
"""The fraction of peak matmul FLOP/s a step's products reach: an assumed model FLOPs
utilisation (MFU) for accelerators; `benchmarks/time_model.py` measures this machine's."""

MARGIN = 0.1
"""The share of a device's memory the planner leaves free: the runtime, the allocator's
fragmentation and buffers the compiler adds beyond the ledger."""

SIZES = {
    "vocab": "vocab",
    "embed": "embed",
    "heads": "heads",
    "head_dim": "head_dim",
    "mlp": "mlp",
    "length": "max_len",
    "layers": "layers",
    "experts": "experts",
}
"""The size each logical axis of a parameter has: the `Config` field of that name."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, its memory and its links, as the time model sees them.

    `flops` is peak dense bfloat16 FLOP/s, `hbm` the bytes per second its memory delivers.
    `fast` is the bytes per second one device sends around a ring inside its fast domain of
    `domain` devices (TPU ICI along one axis, GPU NVLink within a host), `slow` to devices in
    other domains (data-centre network, InfiniBand); `ring` says whether the fast links form
    a ring or torus (TPU ICI, where an all-to-all travels part-way around it) rather than a
    switch (NVLink). `hop` and `far_hop` are the seconds each step of a collective costs
    before any byte moves, on each kind of link. `source` is a key of the bibliography.
    """

    name: str
    flops: float
    memory: float
    hbm: float
    fast: float
    slow: float
    domain: int
    ring: bool
    hop: float
    far_hop: float
    source: str


_DATASHEETS = (
    # name, bf16 FLOP/s, memory, HBM B/s, fast B/s, slow B/s, fast domain, ring, hop s, far hop s
    ("TPU v5e", 1.97e14, 16e9, 8.1e11, 9.0e10, 3.125e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v5p", 4.59e14, 96e9, 2.8e12, 1.8e11, 6.25e9, 8960, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v6e", 9.2e14, 32e9, 1.6e12, 1.8e11, 12.5e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
    ("H100", 9.89e14, 80e9, 3.35e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2023h100"),
    ("H200", 9.89e14, 141e9, 4.8e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024h200"),
    ("B200", 2.25e15, 180e9, 8.0e12, 9.0e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024dgxb200"),
)
HARDWARE = {row[0]: Hardware(*row) for row in _DATASHEETS}
"""Datasheet numbers per device (links: TPU ICI bidirectional bandwidth of one axis and DCN
per chip; GPU NVLink one way per GPU and one 400 Gb/s network adapter per GPU). The hop
latencies are assumed orders of magnitude: about 1 µs per ICI hop (the scaling book), a few
µs per NVLink step, ten per step across the network."""


def hardware(name: str | Hardware) -> Hardware:
    """The hardware of that name (`HARDWARE`), or the description itself."""
    if isinstance(name, Hardware):
        return name
    if name not in HARDWARE:
        raise ValueError(
            f"no hardware named {name!r}: use one of {', '.join(HARDWARE)}, or describe yours "
            "with nnxscale.costs.Hardware(...)"
        )
    return HARDWARE[name]


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameter counts of the book's Transformer."""

    total: int
    matmul: int
    """In matrix products: everything but the embedding tables (looked up) and the norms."""


def counts(cfg: Config) -> Counts:
    """Parameter counts of the Transformer `cfg` describes, by formula (a mixture of experts:
    a router and `experts` MLPs in place of each MLP)."""
    e, v = cfg.embed, cfg.vocab
    attention = 4 * e * cfg.heads * cfg.head_dim
    mlp = 2 * e * cfg.mlp
    if cfg.experts:
        mlp = cfg.experts * mlp + e * cfg.experts
    layers = cfg.layers * (attention + mlp + 2 * e)
    return Counts(
        total=v * e + cfg.max_len * e + layers + e + e * v,
        matmul=cfg.layers * (attention + mlp) + e * v,
    )


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
    """The least a backward pass needs, by the textbook count: per layer and token the inputs
    of its products and nonlinearities, 4E + 4HD + 2F + H s values (tensor-parallel parts
    split over `model`; sequence parallelism splits the residual stream's 4E too; a `flash`
    attention keeps no scores), plus the head's; with remat each layer's input and one layer
    rebuilt. What a compiled program keeps lies above it: the ledger uses `Costs.activations`,
    calibrated on autodiff, and chapter 12 compares the two."""
    tokens = sequences * seq / context
    width = DTYPE_BYTES[cfg.compute_dtype]
    residual = 4 * cfg.embed / (model if sequence_parallel else 1)
    scores = 0 if flash else cfg.heads * seq
    values = residual + (4 * cfg.heads * cfg.head_dim + 2 * cfg.mlp + scores) / model
    layer = tokens * values * width
    head = tokens * (2 * cfg.embed * width + cfg.vocab / model * LOGIT_BYTES)
    if remat:
        stream = cfg.embed / (model if sequence_parallel else 1)
        return cfg.layers * tokens * stream * width + layer + head
    return cfg.layers * layer + head


def step_flops(cfg: Config, sequences: float, seq: int, *, remat: bool | str = False) -> float:
    """FLOPs of one training step's matrix products over all devices (`products`): for a dense
    model 3 x the forward pass's, 6 x parameters x tokens plus attention's 12 L b s^2 H D."""
    sizes = {**model_sizes(cfg, seq), "batch": sequences, "seq": seq}
    return _flops(remat_policy(remat), bool(cfg.experts))(sizes)


def model_sizes(cfg: Config, seq: int) -> dict[str, float]:
    """The model's sizes the formulas use, with the slots of each expert per group of `seq`
    tokens (`capacity`) for a mixture of experts."""
    sizes: dict[str, float] = {
        name: getattr(cfg, name)
        for name in ("vocab", "embed", "heads", "head_dim", "mlp", "layers", "max_len", "experts")
    }
    sizes["top_k"] = cfg.top_k
    sizes["capacity"] = (
        capacity(seq, cfg.experts, cfg.top_k, cfg.capacity_factor) if cfg.experts else 0
    )
    return sizes


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to run a training step: a rule set, the size of each of its mesh axes, the
    micro-batches a step's batch is cut into (gradient accumulation, or a pipeline's), and
    the remat policy (`nnxscale.model.REMAT_POLICIES`)."""

    rules: Rules
    mesh: tuple[tuple[str, int], ...]
    micro_batches: int = 1
    remat: bool | str = False

    @classmethod
    def of(
        cls,
        rules: Rules,
        mesh: Mapping[str, int],
        micro_batches: int = 1,
        remat: bool | str = False,
    ) -> Setup:
        """A setup from a mesh given as {axis: size}, in the rule set's axis order."""
        unknown = sorted(set(mesh) - set(rules.axes))
        if unknown:
            raise RuleError(
                f"mesh axes {unknown} are not axes of rule set {rules.name!r} {rules.axes}"
            )
        if any(int(s) != s or s < 1 for s in mesh.values()):
            raise ValueError(f"mesh axis sizes must be positive integers, got {dict(mesh)}")
        if int(micro_batches) != micro_batches or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches}")
        remat_policy(remat)
        shape = tuple((a, int(mesh.get(a, 1))) for a in rules.axes)
        return cls(rules, shape, int(micro_batches), remat)

    @property
    def sizes(self) -> dict[str, int]:
        """{axis: size}."""
        return dict(self.mesh)

    @property
    def devices(self) -> int:
        """Devices the mesh spans."""
        return math.prod(self.sizes.values())

    def label(self) -> str:
        """The rule set's name and the axes of more than one device, e.g. `FSDP+TP data 4 x
        model 2`."""
        axes = " x ".join(f"{a} {s}" for a, s in self.mesh if s > 1) or "one device"
        return f"{self.rules.name} {axes}"

    def describe(self) -> str:
        """In words, e.g. `FSDP on data 8, 4 micro-batches, the dots policy`."""
        axes = " x ".join(f"{a} {s}" for a, s in self.mesh if s > 1) or "one device"
        micro = f"{self.micro_batches} micro-batch" + ("es" if self.micro_batches > 1 else "")
        policy = remat_policy(self.remat)
        remat = {None: "no remat", "full": "full remat"}.get(policy, f"the {policy} policy")
        return f"{self.rules.name} on {axes}, {micro}, {remat}"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One group of collectives of a step, as formulas: of `kind` over mesh `axes`, the bytes
    of the arrays one pass moves (the P of the ring formulas, summed), how many passes a step
    makes, how many collectives a pass launches, and what compute it may hide behind
    (`OVERLAPS`). `what` says what it moves."""

    kind: str
    axes: tuple[str, ...]
    array: Formula
    passes: Formula
    launches: Formula
    overlap: str
    what: str

    def json(self) -> dict[str, object]:
        """As JSON, for the calculator."""
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "array": self.array.json(),
            "passes": self.passes.json(),
            "launches": self.launches.json(),
            "overlap": self.overlap,
            "what": self.what,
        }


OVERLAPS = {
    "gather": "FSDP's weight gathers: prefetched, each behind the previous layer's compute",
    "reduce": "gradient reductions: each layer's behind the backward pass of the layers below",
    "update": "ZeRO's gather of updated parameters: behind the next forward pass",
    "ring": "ring attention's key/value hops: each behind the attention of the block in hand",
    "blocking": "on the critical path: the next product needs the result (TP, pipeline hops)",
}
"""What each class of collective can hide behind, given the step's dependencies."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """The formulas of one rule set on the book's Transformer (`derive`): bytes per device of
    each part of the state and of the step's working memory, matmul FLOPs per device, the
    collectives, and the divisibility each split needs."""

    rules: Rules
    state: dict[str, Formula]
    activations: Formula
    weights: Formula
    rebuilt: Formula
    gradients: Formula
    layer_gradients: Formula
    """One layer's gradients as its backward pass makes them, before any reduction."""
    head_gradients: Formula
    """The output head's gradients, the first the backward pass makes."""
    accumulator: Formula
    head: Formula
    transfers: tuple[Transfer, ...]
    flops: Formula
    splits: tuple[tuple[str, tuple[str, ...]], ...]
    """(size, mesh axes) pairs: each size must be a multiple of the product of the axes."""
    stage_axis: str | None
    """The axis that splits the layers into a pipeline's stages, if any."""
    batch_axes: tuple[str, ...] = ()
    """The axes that split the batch's sequences."""
    ring_axis: str | None = None
    """The axis that splits every sequence into a ring attention's chunks, if any."""
    forward_flops: Formula = dataclasses.field(default_factory=Formula)
    """Matmul FLOPs of the forward pass per device (what FSDP's first gathers and ZeRO's
    gather of updated parameters hide behind)."""
    attention_flops: Formula = dataclasses.field(default_factory=Formula)
    """Matmul FLOPs of attention's two products per device (what a ring's hops hide behind)."""

    def json(self) -> dict[str, object]:
        """Every formula and axis as JSON: what the calculator evaluates."""
        out: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("rules", "state", "transfers", "splits")
        }
        out = {k: v.json() if isinstance(v, Formula) else v for k, v in out.items()}
        out["state"] = {k: v.json() for k, v in self.state.items()}
        out["transfers"] = [t.json() for t in self.transfers]
        out["splits"] = [[size, list(axes)] for size, axes in self.splits]
        out["batch_axes"] = list(self.batch_axes)
        return out


def _unit_mesh(rules: Rules) -> AbstractMesh:
    """The rule set's mesh with every axis of size 1: where only the structure of a layout
    shows (which axes split which dimension), not whether sizes divide."""
    return AbstractMesh(
        (1,) * len(rules.axes), rules.axes, axis_types=(AxisType.Auto,) * len(rules.axes)
    )


PARAMETER_PRIMES = {
    **{k: v for k, v in PRIMES.items() if k not in ("batch", "seq")},
    "experts": EXPERTS,
}
"""The sizes of the abstract model the layouts are read off (`max_len` is `PRIMES["seq"]`)."""


@functools.cache
def _parameters(moe: bool) -> nnx.State:
    """The abstract parameters of the book's Transformer with stacked layers (shapes only),
    dense or with a mixture of experts."""
    sizes = {k: v for k, v in PARAMETER_PRIMES.items() if k != "experts"}
    experts = EXPERTS if moe else 0
    cfg = Config(**sizes, max_len=PRIMES["seq"], scan_layers=True, experts=experts)
    return nnx.state(abstract(lambda: create(cfg)), nnx.Param)


def _dimension(name: str | None, size: int) -> str:
    """The size name of a parameter's dimension: its logical name's, or for a dimension
    without one (the router's experts) the traced size it is."""
    if name is not None:
        return name
    (found,) = factor(size, PARAMETER_PRIMES).elements()
    return found


@dataclasses.dataclass(frozen=True)
class _Array:
    """One parameter as the cost model sees it: path, logical names, elements, whether the
    model reads it through a compute-dtype copy, and the axes splitting each dimension by role."""

    path: str
    names: tuple[str, ...]
    elements: Formula
    cast: bool
    axes: dict[str, tuple[tuple[str, ...], ...]]

    def per_device(self, role: str, itemsize: float = STATE_BYTES) -> Formula:
        """Bytes one device holds of it in the layout of `role`."""
        return (self.elements * itemsize).per(a for axes in self.axes[role] for a in axes)


_ARRAYS: dict[tuple[str, bool], list[_Array]] = {}


def _arrays(rules: Rules, moe: bool) -> list[_Array]:
    """Every parameter of the model with its axes under `rules`, for each role (resolved once
    per rule set)."""
    key = (repr(rules), moe)
    if key not in _ARRAYS:
        _ARRAYS[key] = _resolved_arrays(rules, moe)
    return _ARRAYS[key]


def _resolved_arrays(rules: Rules, moe: bool) -> list[_Array]:
    if rules.auto_axis is not None:
        raise RuleError(
            f"rule set {rules.name!r} splits arrays by their sizes (automatic FSDP): the cost "
            "model derives layouts from logical names alone. Resolve it at the real sizes "
            "instead (nnxscale.resolve on an AbstractMesh)."
        )
    params, mesh = _parameters(moe), _unit_mesh(rules)
    layouts = {
        role: resolve(params, rules, mesh, role=role, warn_bytes=math.inf)
        for role in ("params", "grads", "optimizer")
    }
    found = []
    for i, placement in enumerate(layouts["params"].placements):
        names = tuple(
            _dimension(n, size)
            for n, size in zip(
                placement.logical or (None,) * len(placement.shape), placement.shape, strict=True
            )
        )
        axes = {}
        for role, layout in layouts.items():
            spec = layout.placements[i].spec
            entries = tuple(spec) + (None,) * (len(names) - len(spec))
            axes[role] = tuple(
                () if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries
            )
        cast = placement.path.split("/")[-1] in CAST_WEIGHTS
        elements = Formula.product(SIZES[n] for n in names)
        found.append(_Array(placement.path, names, elements, cast, axes))
    return found


def _order(names: list[str]) -> tuple[str, ...]:
    """Logical names in the order an array of them is placed: batch, then sequence, the rest."""
    rank = {"batch": 0, "length": 1}
    return tuple(sorted(names, key=lambda n: rank.get(n, 2)))


def _split(formula: Formula, rules: Rules, *, weights: bool = False) -> Formula:
    """`formula` (bytes of whole arrays, one term per kind of array) as one device holds it:
    each term divided by the sizes of the mesh axes that `rules` split its dimensions over,
    as an activation, or as the read copy of a weight (`weight_axes`). A term names each
    dimension once, so an array that repeats an axis across two of them (a mixture's slots,
    split by group and by expert) is split once, not refused as a strict rule set would."""
    mesh, out = _unit_mesh(rules), Formula()
    rules = dataclasses.replace(rules, strict=False)
    for powers, coefficient in formula.terms.items():
        names = _order([LOGICAL.get(n, n) for n, p in powers for _ in range(p)])
        shape = (1,) * len(names)
        if weights:
            axes = weight_axes(shape, names, rules, mesh)[1]
        else:
            axes = activation_axes(shape, names, rules, mesh)
        out += Formula({powers: coefficient}).per(a for dim in axes if dim for a in dim)
    return out


def _per_micro_batch(formula: Formula) -> Formula:
    """`formula` in `batch` (sequences per step) for one of `micro` micro-batches."""
    out = Formula()
    for powers, coefficient in formula.terms.items():
        term = Formula({powers: coefficient})
        out += term / "micro" if "batch" in dict(powers) else term
    return out


def _ordered(axes: Iterable[str], rules: Rules) -> tuple[str, ...]:
    found = set(axes)
    return tuple(a for a in rules.axes if a in found)


def _tensor_axes(arrays: list[_Array], name: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes, other than the tokens', that split dimension `name` of the weights: the
    axes over which the products that contract it are tensor-parallel."""
    tokens = set(rules.token_axes(rules.axes))
    for array in arrays:
        for dim, axes in zip(array.names, array.axes["params"], strict=True):
            if dim == name and axes and name in ("heads", "mlp", "vocab"):
                return _ordered((a for a in axes if a not in tokens), rules)
    return ()


def _weight_transfers(
    arrays: list[_Array], rules: Rules, passes: Formula, reductions: Formula, width: float
) -> list[Transfer]:
    """Gathers of weights split over the tokens' axes (FSDP), reductions of the gradients
    over those axes, and ZeRO's gather of updated parameters, from the arrays' layouts."""
    tokens = set(rules.token_axes(rules.axes))
    groups: dict[tuple[str, tuple[str, ...], str], Formula] = {}

    def add(kind: str, axes: Iterable[str], overlap: str, value: Formula) -> None:
        key = (kind, _ordered(axes, rules), overlap)
        if key[1]:
            groups[key] = groups.get(key, Formula()) + value

    for a in arrays:
        stored = [set(x) for x in a.axes["params"]]
        routed = [n in ROUTED for n in a.names]
        gathered = {x for dim, r in zip(stored, routed, strict=True) if not r for x in dim & tokens}
        read = [dim if r else dim - tokens for dim, r in zip(stored, routed, strict=True)]
        itemsize = width if a.cast else STATE_BYTES
        local = a.elements.per(x for dim in read for x in dim)
        add("all-gather", gathered, "gather", local * itemsize)
        summed = tokens - {x for dim, r in zip(stored, routed, strict=True) if r for x in dim}
        scattered = summed & {x for dim in a.axes["optimizer"] for x in dim}
        add("reduce-scatter", scattered, "reduce", local * STATE_BYTES)
        add("all-reduce", summed - scattered, "reduce", (local * STATE_BYTES).per(scattered))
        updated = {x for dim in a.axes["optimizer"] for x in dim} - {
            x for dim in stored for x in dim
        }
        held = a.elements.per(x for dim in stored for x in dim)
        add("all-gather", updated & tokens, "update", held * STATE_BYTES)
    return [
        Transfer(
            kind,
            axes,
            array,
            passes if overlap == "gather" else reductions if overlap == "reduce" else Formula.of(1),
            Formula.of("layers"),
            overlap,
            {"gather": "weights", "reduce": "gradients", "update": "updated parameters"}[overlap],
        )
        for (kind, axes, overlap), array in groups.items()
    ]


def _activation_transfers(
    arrays: list[_Array], rules: Rules, width: float, passes: int, moe: bool, rerun: bool
) -> list[Transfer]:
    """What moves activations between devices: tensor parallelism's all-reduces, expert
    parallelism's all-to-alls (in each of `passes`) and ring attention's hops (their forward
    again when remat rebuilds the layer: `rerun`)."""
    found = _tensor_all_reduces(arrays, rules, width, passes)
    if moe:
        found += _expert_all_to_alls(rules, width, passes)
    return found + _ring_hops(rules, width, rerun)


@dataclasses.dataclass(frozen=True)
class Product:
    """One kind of matrix product of the step: its forward FLOPs over all devices, the
    products its backward pass makes of it (2: the input's gradient and the weight's; 1 where
    only one operand is differentiated), and whether full remat and the `dots` policy compute
    it again (`dots` keeps products with no batch dimensions; full remat keeps nothing, but
    a layer's last product, whose output its backward pass does not read)."""

    name: str
    forward: Formula
    backward: int
    full: bool
    dots: bool


def products(moe: bool = False) -> tuple[Product, ...]:
    """The step's matrix products, dense or with a mixture of experts in place of each MLP:
    `experts` x `capacity` slots per group of `seq` tokens, filled by a one-hot dispatch
    (whose backward pass differentiates the tokens alone) and summed back by the combine."""

    def product(
        name: str, sizes: str, flops: int, backward: int, full: bool, dots: bool
    ) -> Product:
        formula = Formula.product(sizes.split(), flops)
        return Product(name, formula, backward, full, dots)

    tokens = "layers batch seq"
    attention = (
        product("attention weights", f"{tokens} embed heads head_dim", 8, 2, True, False),
        product("attention scores", f"{tokens} seq heads head_dim", 4, 2, True, True),
    )
    head = product("head", "batch seq embed vocab", 2, 2, False, False)
    if not moe:
        return (
            *attention,
            product("MLP up", f"{tokens} embed mlp", 2, 2, True, False),
            product("MLP down", f"{tokens} embed mlp", 2, 2, False, False),
            head,
        )
    slots = f"{tokens} experts capacity embed"
    return (
        *attention,
        product("router", f"{tokens} embed experts", 2, 2, True, False),
        product("dispatch", slots, 2, 1, True, True),
        product("experts", "layers batch experts capacity embed mlp", 4, 2, True, True),
        product("combine", slots, 2, 2, False, False),
        head,
    )


def _flops(remat: str | None, moe: bool = False) -> Formula:
    """Matmul FLOPs of one step over all devices (`step_flops`), as a formula."""
    total = Formula()
    for p in products(moe):
        again = (remat == "full" and p.full) or (remat == "dots" and p.dots)
        total += p.forward * (1 + p.backward + again)
    return total


_DERIVED: dict[tuple[str, str, object, int], Costs] = {}


def derive(
    rules: Rules, compute_dtype: str = "float32", remat: bool | str = False, moe: int = 0
) -> Costs:
    """The formulas of one training step of the book's Transformer under `rules`, in the
    model's sizes, `batch` (sequences per step), `seq`, `micro` (micro-batches) and the size
    of each mesh axis: derived from the layout `rules` give the abstract model (once per
    rule set, dtype, remat policy and MLP: dense, or a mixture of experts as
    `nnxscale.activations.mixture` says, whose formulas also use `experts`, `top_k` and
    `capacity`)."""
    why = unpriced(rules, moe)
    if why:
        raise ValueError(why)
    key = (repr(rules), compute_dtype, remat_policy(remat), moe)
    if key not in _DERIVED:
        _DERIVED[key] = _derive(rules, compute_dtype, remat, moe)
    return _DERIVED[key]


def unpriced(rules: Rules, moe: int) -> str:
    """Why the cost model has no formulas for `rules` on this model, or "": for a mixture of
    experts, tensor, context and pipeline axes (what the compiled steps were checked
    against is data, FSDP and expert parallelism)."""
    if not moe:
        return ""
    arrays = _arrays(rules, True)
    tensor = any(_tensor_axes(arrays, name, rules) for name in ("heads", "mlp", "vocab"))
    if tensor or _context_axis(rules) is not None or _tensor_stage(arrays) is not None:
        return (
            f"rule set {rules.name!r} has tensor, context or pipeline axes, which the cost "
            "model does not price for a mixture of experts: use data, FSDP and expert "
            "parallelism (EP, FSDP+EP)"
        )
    return ""


def _held(arrays: list[_Array]) -> tuple[dict[str, Formula], Formula, Formula, tuple]:
    """The train state per device (parameters, optimizer state), the gradients held, the
    head's gradients, and every (size, axes) that splits a dimension of an array."""
    state = {
        "parameters": _total(a.per_device("params") for a in arrays),
        "optimizer state": _total(a.per_device("optimizer") for a in arrays) * OPTIMIZER_COPIES,
    }
    # gradients are held as the optimizer state that reads them is split: XLA's partitioner
    # splits a gradient only a split update reads, whatever the rule set says of `grads`
    gradients = _total(a.per_device("optimizer") for a in arrays)
    head_gradients = _total(a.per_device("optimizer") for a in arrays if a.path == "head")
    splits = {
        (SIZES[n], axes)
        for a in arrays
        for role in a.axes.values()
        for n, axes in zip(a.names, role, strict=True)
        if axes
    }
    return state, gradients, head_gradients, tuple(sorted(splits))


def _kept(
    rules: Rules, arrays: list[_Array], compute_dtype: str, policy: str | None, moe: int
) -> tuple[Formula, Formula, Formula]:
    """Per device: the activations the backward pass reads, the compute copies of the
    weights (when the compute dtype or a token axis needs them), and what remat rebuilds."""
    ring = _context_axis(rules)
    tokens = set(rules.token_axes(rules.axes))
    k = kept(compute_dtype, policy or False, ring=ring is not None, moe=moe)
    activations = _per_micro_batch(
        _split(k.layer * "layers" + k.model, rules) + _local(k.local, rules)
    )
    copies = compute_dtype != "float32" or any(
        tokens & {x for d in a.axes["params"] for x in d} for a in arrays
    )
    weights = Formula()
    if copies:
        weights = _split(k.weights * "layers" + k.head_weights, rules, weights=True)
    rebuilt = _per_micro_batch(
        _split(k.rebuilt, rules) if ring is None else _local(k.rebuilt, rules)
    )
    if policy and copies:
        rebuilt += _split(kept(compute_dtype).weights, rules, weights=True)
    return activations, weights, rebuilt


def _derive(rules: Rules, compute_dtype: str, remat: bool | str, moe: int) -> Costs:
    policy = remat_policy(remat)
    width = DTYPE_BYTES[compute_dtype]
    arrays = _arrays(rules, bool(moe))
    tokens = set(rules.token_axes(rules.axes))
    state, gradients, head_gradients, splits = _held(arrays)
    stage = _tensor_stage(arrays)
    if stage is not None:
        return _pipeline(
            rules, arrays, state, gradients, head_gradients, tuple(splits), stage, width
        )
    layer_gradients = _total(
        (a.elements * STATE_BYTES / "layers").per(
            x for d in a.axes["params"] for x in d if x not in tokens
        )
        for a in arrays
        if "layers" in a.names
    )
    ring = _context_axis(rules)
    activations, weights, rebuilt = _kept(rules, arrays, compute_dtype, policy, moe)
    head = _per_micro_batch(_split(Formula.product(["batch", "seq", "vocab"], LOGIT_BYTES), rules))
    passes = Formula.of("micro") * (2 if policy else 1)
    transfers = _weight_transfers(arrays, rules, passes, Formula.of("micro"), width)
    again = policy == "full" or (policy == "dots" and bool(moe))  # the experts' slots again
    transfers += _activation_transfers(
        arrays, rules, width, 3 if again else 2, bool(moe), policy is not None
    )
    accumulator = gradients
    flops = _flops(policy, bool(moe))
    if ring is not None:
        flops += _ring_flops(policy, ring) - _ring_flops(policy, None)
    flops = flops.per(rules.axes)
    extra = _extra(rules, moe=bool(moe), policy=policy)
    return Costs(
        rules,
        state,
        activations,
        weights,
        rebuilt,
        gradients,
        layer_gradients,
        head_gradients,
        accumulator,
        head,
        tuple(transfers),
        flops,
        tuple(splits),
        None,
        **extra,
    )


def _extra(
    rules: Rules, pipeline: bool = False, moe: bool = False, policy: str | None = None
) -> dict[str, object]:
    """The batch's and the ring's axes, and the forward pass's and attention's FLOPs per
    device (a pipeline's backward runs its stage's forward again)."""
    ring = _context_axis(rules)
    forward = sum((p.forward for p in products(moe)), Formula())
    return {
        "batch_axes": tuple(a for a in rules.token_axes(rules.axes) if a != ring),
        "ring_axis": ring,
        "forward_flops": (forward * (2 if pipeline else 1)).per(rules.axes),
        "attention_flops": _ring_flops(policy, ring).per(rules.axes),
    }


def _ring_flops(policy: str | None, ring: str | None) -> Formula:
    """Attention's FLOPs per step over all devices. Dense: every query-key pair, forward,
    twice backward, again under remat. On a zig-zag ring (`nnxscale.context`): 1/2 + 1/(4N)
    of the pairs under the causal mask (with one block per chunk; smaller blocks score
    fewer), forward, 2.5 times backward (the custom VJP recomputes the scores), again under
    remat."""
    (scores,) = [p.forward for p in products() if p.name == "attention scores"]
    again = 1 if policy else 0
    if ring is None:
        return scores * (3 + again)
    return (scores * 0.5 + scores * 0.25 / ring) * (3.5 + again)


def _context_axis(rules: Rules) -> str | None:
    """The mesh axis, other than the batch's, that `rules` split the sequence over (a ring)."""
    batch = set(rules.token_axes(())) | {
        a for c in rules.logical.get("batch", ()) for a in ((c,) if isinstance(c, str) else c)
    }
    for candidate in rules.logical.get("length", ()):
        for axis in (candidate,) if isinstance(candidate, str) else candidate:
            if axis not in batch:
                return axis
    return None


def _local(formula: Formula, rules: Rules) -> Formula:
    """A ring's kept blocks, already per device along the sequence (in `chunk`), split over
    the other axes as activations are, with `chunk` as `seq / context`."""
    axis = _context_axis(rules)
    return (
        _split(formula, rules).replace("chunk", {"seq": 1, axis: -1}).replace("context", {axis: 1})
    )


def _total(formulas: Iterable[Formula]) -> Formula:
    return sum(formulas, Formula())


def _tensor_all_reduces(
    arrays: list[_Array], rules: Rules, width: float, passes: int
) -> list[Transfer]:
    """Tensor parallelism's all-reduces of the residual stream: two per layer for each of
    attention and MLP if their weights are split (in each of `passes`), two for a
    vocabulary-parallel embedding and head."""
    stream = _per_micro_batch(_split(Formula.product(["batch", "seq", "embed"], width), rules))
    found = []
    for name, per_layer, what in (
        ("heads", True, "attention"),
        ("mlp", True, "MLP"),
        ("vocab", False, "embedding and head"),
    ):
        axes = _tensor_axes(arrays, name, rules)
        if axes:
            count = Formula.of("layers") * passes if per_layer else Formula.of(2)
            found.append(
                Transfer(
                    "all-reduce", axes, stream, count * "micro", count, "blocking",
                    f"{what} outputs",
                )
            )  # fmt: skip
    return found


def _expert_all_to_alls(rules: Rules, width: float, passes: int) -> list[Transfer]:
    """Expert parallelism's all-to-alls of the experts' slots: to the experts and back, in
    each of `passes`, over the first axis that splits the experts."""
    experts = _ordered(
        (a for c in rules.logical.get("experts", ()) for a in ((c,) if isinstance(c, str) else c)),
        rules,
    )
    if not experts:
        return []
    slots = _per_micro_batch(
        _split(Formula.product(["batch", "experts", "capacity", "embed"], width), rules)
    )
    count = Formula.of("layers") * 2 * passes
    return [
        Transfer(
            "all-to-all", experts[:1], slots, count * "micro", count, "blocking",
            "experts' slots",
        )
    ]  # fmt: skip


def _ring_hops(rules: Rules, width: float, rerun: bool) -> list[Transfer]:
    """Ring attention's hops when the sequence is split: keys and values in the compute
    dtype, their gradients in float32."""
    axis = _context_axis(rules)
    if axis is None:
        return []
    values = Formula.product(["batch", "seq", "heads", "head_dim"], 2)  # a K and a V block
    hops = Formula.of(axis) - 1
    # forward: N-1 hops, again when remat rebuilds the layer; backward: N-1 more, the
    # first shared with the forward's (the compiler sends it once)
    keys = Formula.of("layers") * (hops * (2 if rerun else 1) + hops - 1)
    grads = Formula.of("layers") * Formula.of(axis)  # with K and V, and one hop home
    return [
        Transfer(
            "collective-permute", (axis,), _per_micro_batch(_split(values * size, rules)),
            count * "micro", count, "ring", what,
        )
        for size, count, what in (
            (width, keys, "keys and values"),
            (STATE_BYTES, grads, "their gradients, in float32"),
        )
    ]  # fmt: skip


def _pipeline(
    rules: Rules,
    arrays: list[_Array],
    state: dict[str, Formula],
    gradients: Formula,
    head_gradients: Formula,
    splits: tuple[tuple[str, tuple[str, ...]], ...],
    stage: str,
    width: float,
) -> Costs:
    """The formulas of a step on `nnxscale.pipeline`'s executor with a 1F1B schedule of
    `micro` micro-batches over `stage`: each device keeps min(stage, micro) stage inputs and
    one output gradient in its buffers, rebuilds one micro-batch's stage in each backward
    task (the executor recomputes instead of keeping activations), sums its stage's
    gradients whole (gathered once per step over an inner FSDP axis, in float32, and
    reduce-scattered once), and hands an activation forward and a gradient back every tick.
    The last stage also computes the logits of a micro-batch."""
    tokens = set(rules.token_axes(rules.axes))
    whole = _total(
        a.elements.per(x for d in a.axes["params"] for x in d if x not in tokens) * STATE_BYTES
        for a in arrays
    )
    k = kept("float32" if width == 4 else "bfloat16")
    micro = _per_micro_batch(_split(Formula.product(["batch", "seq", "embed"], width), rules))
    slots = Formula.of(stage) + 1  # min(stage, micro) inputs and one gradient, at micro >= stage
    one_stage = (_split(k.layer, rules) * "layers").per([stage])
    rebuilt = _per_micro_batch(one_stage) + (_split(k.weights, rules, weights=True) * "layers").per(
        [stage]
    )
    head = _per_micro_batch(
        _split(Formula.product(["batch", "seq", "vocab"], 2 * LOGIT_BYTES) + k.model, rules)
    )
    once = Formula.of(1)
    transfers = _weight_transfers(arrays, rules, once, once, STATE_BYTES)
    ticks = (Formula.of("micro") + stage - 1) * 2
    hand_overs = "stage inputs and their gradients"
    transfers.append(
        Transfer(
            "collective-permute", (stage,), micro, ticks * 2, ticks * 2, "blocking", hand_overs
        )
    )
    flops = (_flops(None) * Formula.of(4) / 3).per(rules.axes)  # the backward runs it again
    weights = whole if tokens else Formula()  # the stage's weights, gathered once per step
    return Costs(
        rules,
        state,
        micro * slots,
        weights,
        rebuilt,
        whole,
        Formula(),
        head_gradients,
        whole,
        head,
        tuple(transfers),
        flops,
        splits,
        stage,
        **_extra(rules, pipeline=True),
    )


def _tensor_stage(arrays: list[_Array]) -> str | None:
    """The mesh axis that splits the stacked layers (a pipeline's stages), if any."""
    for a in arrays:
        for name, axes in zip(a.names, a.axes["params"], strict=True):
            if name == "layers" and axes:
                return axes[0]
    return None


def sizes_of(cfg: Config, setup: Setup, batch: int, seq: int) -> dict[str, float]:
    """The value of every size the formulas use: the model's, the step's and the mesh's."""
    model = model_sizes(cfg, seq)
    return {**model, "batch": batch, "seq": seq, "micro": setup.micro_batches, **setup.sizes}


def mixture_problem(cfg: Config) -> str:
    """What is wrong with `cfg`'s mixture of experts, or "" (a dense model has none)."""
    if cfg.experts < 0:
        return f"experts={cfg.experts}: use 0 for a dense MLP or a positive number of experts"
    if cfg.experts and not 1 <= cfg.top_k <= cfg.experts:
        return f"top_k={cfg.top_k} with {cfg.experts} experts: use 1 <= top_k <= {cfg.experts}"
    if cfg.experts and not cfg.capacity_factor > 0:
        return "the capacity factor must be positive"
    return ""


def unsuitable(cfg: Config, setup: Setup, batch: int, seq: int) -> str:
    """Why `setup` cannot run this model and batch as the cost model prices it, or ""."""
    why = mixture_problem(cfg) or unpriced(setup.rules, mixture(cfg))
    if why:
        return why
    costs = derive(setup.rules, cfg.compute_dtype, setup.remat, mixture(cfg))
    sizes = sizes_of(cfg, setup, batch, seq)
    for size, axes in costs.splits:
        n = math.prod(setup.sizes[a] for a in axes)
        if sizes[size] % n:
            name = "x".join(axes)
            return f"the {name} axis ({n}) does not divide {size} ({sizes[size]})"
    split = math.prod(setup.sizes[a] for a in costs.batch_axes)
    if batch % (split * setup.micro_batches):
        parts = f"{setup.micro_batches} micro-batches x {split} devices"
        return f"the batch of {batch} sequences does not split into {parts}"
    ring = setup.sizes.get(costs.ring_axis, 1) if costs.ring_axis else 1
    if costs.ring_axis and ring < 2:
        return f"a context ring needs 2 or more devices on {costs.ring_axis!r}, not {ring}"
    if seq % (2 * ring):
        return f"{seq} tokens do not cut into 2 x {ring} chunks for the zig-zag ring"
    if seq > cfg.max_len:
        return f"sequences of {seq} tokens exceed the model's max_len ({cfg.max_len})"
    stages = setup.sizes.get(costs.stage_axis, 1) if costs.stage_axis else 1
    if setup.micro_batches < stages:
        return f"{stages} stages need at least {stages} micro-batches (1F1B)"
    return ""


@dataclasses.dataclass(frozen=True)
class Collective:
    """A group of collectives of one step, evaluated: bytes sent per device, seconds it takes
    on the link its axes cross, and the seconds left exposed after overlap."""

    transfer: Transfer
    group: int
    array_bytes: float
    sent: float
    seconds: float
    exposed: float


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the cost model predicts for one training step on one device."""

    setup: Setup
    memory: dict[str, float]
    """Bytes per device at the step's peak, by part: parameters and optimizer state (the
    state, at rest between steps), and the working memory of the step's busiest moment."""
    phases: dict[str, float]
    """Working memory at each candidate for the peak (the peak is the largest)."""
    flops: float
    collectives: tuple[Collective, ...]
    compute_time: float
    bubble: float
    step_time: float

    @property
    def peak(self) -> float:
        """Bytes per device at the step's peak: the state plus the working memory."""
        return sum(self.memory.values())

    @property
    def state(self) -> float:
        """Bytes per device of parameters and optimizer state (what is held between steps)."""
        return self.memory["parameters"] + self.memory["optimizer state"]

    @property
    def sent(self) -> float:
        """Bytes each device sends per step."""
        return sum(c.sent for c in self.collectives)

    @property
    def comm_time(self) -> float:
        """Seconds of the step's collectives, hidden or not."""
        return sum(c.seconds for c in self.collectives)

    @property
    def exposed(self) -> float:
        """Seconds of collectives that compute does not hide."""
        return sum(c.exposed for c in self.collectives)

    @property
    def bound(self) -> str:
        """What sets the step time: compute, or communication that compute cannot hide."""
        return "compute" if self.exposed <= 0.5 * self.step_time else "communication"


def memory_phases(costs: Costs, sizes: Mapping[str, float], micro: int) -> dict[str, float]:
    """Working memory (beyond the state) at the moments that can be a step's peak: the start
    of the backward pass (every layer's activations and weight copies, the logits' gradient
    and the head's gradients), a layer's backward pass (its gradients made, and with remat
    its activations rebuilt), and the optimizer's update (every gradient, and the update
    beside it). With micro-batches, the running sum of gradients is held throughout. On a
    pipeline, a backward task: the buffers, a stage rebuilt, the stage's gradients."""
    if costs.stage_axis is not None:
        parts = (costs.activations, costs.rebuilt, costs.gradients, costs.weights, costs.head)
        return {"a backward task": sum(f(sizes) for f in parts)}
    accumulate = costs.accumulator(sizes) if micro > 1 else 0.0
    kept = costs.activations(sizes) + costs.weights(sizes) + costs.head_gradients(sizes)
    return {
        "backward starts": kept + costs.head(sizes) + accumulate,
        "a layer's backward": kept
        + costs.rebuilt(sizes)
        + costs.layer_gradients(sizes)
        + accumulate,
        "update": 2 * costs.gradients(sizes) + accumulate,
    }


def link(axes: Iterable[str], mesh: Mapping[str, int], hw: Hardware) -> tuple[float, float]:
    """Bytes per second and seconds per step of a collective over mesh `axes`: the fast
    links if the devices along them lie in one fast domain, else the slow ones. Devices fill
    the mesh with the last axis fastest, so the devices along the axes span the sizes from
    the first of them to the last axis of the mesh."""
    names = list(mesh)
    first = min(names.index(a) for a in axes)
    span = math.prod(mesh[a] for a in names[first:])
    return (hw.fast, hw.hop) if span <= hw.domain else (hw.slow, hw.far_hop)


def collective_seconds(
    kind: str, array: float, n: int, mesh: Mapping[str, int], axes: Iterable[str], hw: Hardware
) -> tuple[float, float]:
    """Bytes one device sends for a collective of `kind` on an array of `array` bytes over `n`
    devices, and its seconds: a latency per ring step plus the bytes over the link. An
    all-to-all's `array` is one device's buffer; on a ring it travels part-way around (the
    scaling book: a quarter of an all-gather of the whole array), through a switch only
    the pieces for others leave."""
    bandwidth, hop = link(axes, mesh, hw)
    ring = bandwidth == hw.fast and hw.ring
    steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)
    if kind == "all-to-all":
        sent = (n - 1) / n * array
        moved = n * array * (n - 1) / n / 4 if ring else sent
    else:
        sent = ring_bytes(kind, array, n)
        moved = sent
    return sent, steps * hop + moved / bandwidth


def _exposed(
    transfer: Transfer, seconds: float, pieces: float, window: Mapping[str, float]
) -> float:
    """Seconds of a group of collectives that compute does not hide: all of it on the
    critical path (`blocking`); otherwise what exceeds the compute it can overlap, plus the
    first piece, which nothing precedes (`OVERLAPS`)."""
    if transfer.overlap == "blocking":
        return seconds
    return max(0.0, seconds - window[transfer.overlap]) + seconds / max(1.0, pieces)


def _collectives(
    costs: Costs,
    sizes: dict[str, int],
    mesh: dict[str, int],
    hw: Hardware,
    window: dict[str, float],
) -> list[Collective]:
    """Each transfer of the step that crosses devices, timed on `hw` and with the part of its
    time that compute in its `window` (the seconds it can overlap) leaves exposed."""
    found = []
    for t in costs.transfers:
        n = math.prod(mesh[a] for a in t.axes)
        if n == 1:
            continue
        array, passes = t.array(sizes), t.passes(sizes)
        sent, seconds = collective_seconds(t.kind, array, n, mesh, t.axes, hw)
        total = passes * seconds
        exposed = _exposed(t, total, t.launches(sizes), window)
        found.append(Collective(t, n, array, passes * sent, total, exposed))
    return found


def step_cost(
    cfg: Config,
    setup: Setup,
    hw: Hardware | str,
    batch: int,
    seq: int | None = None,
    *,
    efficiency: float = EFFICIENCY,
) -> StepCost:
    """Memory per device at the step's peak, FLOPs, collectives and time of one step of
    `batch` sequences of `seq` tokens (default `cfg.max_len`) under `setup` on `hw`.

    Compute runs at `efficiency` of peak matmul FLOP/s, plus the bytes elementwise work and
    the optimizer move through memory at the device's bandwidth. Each collective costs a
    latency per ring step and its bytes over the link its axes cross (`link`); what compute
    can hide it behind depends on the step's dependencies (`OVERLAPS`). A pipeline runs the
    executor's lockstep ticks: each as long as a backward task (a stage rebuilt and
    differentiated, three forward passes' worth), two hand-overs per tick.
    """
    hw = hardware(hw)
    seq = seq or cfg.max_len
    costs = derive(setup.rules, cfg.compute_dtype, setup.remat, mixture(cfg))
    sizes = sizes_of(cfg, setup, batch, seq)
    mesh = setup.sizes
    phases = memory_phases(costs, sizes, setup.micro_batches)
    memory = {name: f(sizes) for name, f in costs.state.items()}
    memory["working memory"] = max(phases.values())
    flops = costs.flops(sizes)
    traffic = (
        2 * costs.activations(sizes)
        + 3 * costs.weights(sizes)
        + 3 * sum(memory[k] for k in costs.state)
    )
    compute = flops / (hw.flops * efficiency) + traffic / hw.hbm
    forward = compute * costs.forward_flops(sizes) / flops
    window = {
        "gather": compute,
        "reduce": compute - forward,
        "update": forward,
        "ring": compute * costs.attention_flops(sizes) / flops,
    }
    found = _collectives(costs, sizes, mesh, hw, window)
    bubble = 0.0
    if costs.stage_axis is not None:
        p, m = mesh[costs.stage_axis], setup.micro_batches
        lockstep = 2 * (m + p - 1) * 0.75 * compute / m
        bubble, compute = 1 - compute / lockstep, lockstep
    step = compute + sum(c.exposed for c in found)
    return StepCost(setup, memory, phases, flops, tuple(found), compute, bubble, step)


LEDGER_PARTS = ("parameters", "gradients", "optimizer state", "activations")
"""The four parts of a device's memory ledger, in the order they are usually drawn."""


def ledger(cfg: Config, setup: Setup, batch: int, seq: int | None = None) -> dict[str, float]:
    """Bytes per device of the four things a training step holds under `setup` (its
    `LEDGER_PARTS`): parameters, gradients, optimizer state, and activations (those the
    backward pass keeps, and those remat rebuilds). Each is held at its own moment of the
    step, so the step's peak (`step_cost(...).peak`) is not their sum."""
    seq = seq or cfg.max_len
    costs = derive(setup.rules, cfg.compute_dtype, setup.remat, mixture(cfg))
    sizes = sizes_of(cfg, setup, batch, seq)
    return {
        "parameters": costs.state["parameters"](sizes),
        "gradients": costs.gradients(sizes),
        "optimizer state": costs.state["optimizer state"](sizes),
        "activations": costs.activations(sizes) + costs.rebuilt(sizes),
    }


SEVEN_B = Config(
    vocab=32000,
    embed=4096,
    heads=32,
    head_dim=128,
    mlp=16384,
    layers=32,
    max_len=4096,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)
"""A 6.7 B-parameter model of the book's architecture (GPT-3 6.7B's shape)."""

SEVENTY_B = SEVEN_B.replace(embed=8192, heads=64, mlp=36864, layers=80)
"""A 70 B-parameter model of the book's architecture."""


def ring_hop_tokens(
    hw: Hardware | str,
    mesh: Mapping[str, int],
    axis: str = "context",
    dtype: str = "bfloat16",
    efficiency: float = EFFICIENCY,
    causal: bool = True,
) -> float:
    """Tokens of a sequence per device above which each ring-attention hop computes longer
    than it takes to send the next block over the link the ring's axis crosses (`link`),
    whatever the model's shape. A chunk of c tokens scores a share p of its c^2 pairs with the
    block in hand (a half under a causal mask, on the zig-zag ring): forward, 4 p c^2 H D
    FLOPs against a K and a V block of c H D values in `dtype`; backward, 10 p c^2 H D FLOPs
    (five products) against K and V again and their float32 gradients. The larger of the
    two thresholds."""
    hw = hardware(hw)
    bandwidth, _ = link([axis], mesh, hw)
    share = 0.5 if causal else 1.0
    width, reach = DTYPE_BYTES[dtype], hw.flops * efficiency / bandwidth
    forward = 2 * width / (4 * share)
    backward = 2 * (width + STATE_BYTES) / (10 * share)
    return max(forward, backward) * reach


def crossover(cfg: Config, setup: Setup, hw: Hardware | str, seq: int | None = None) -> float:
    """Tokens per device below which `setup`'s weight gathers and gradient reductions take
    longer than its compute, so that they cannot hide: they do not grow with the batch,
    compute does. From the same collectives and compute time as `step_cost`, at one sequence
    per data-parallel device."""
    seq = seq or cfg.max_len
    tokens = setup.rules.token_axes(setup.rules.axes)
    rows = math.prod(setup.sizes[a] for a in tokens if a != "context") * setup.micro_batches
    cost = step_cost(cfg, setup, hw, rows, seq)
    weights = sum(
        c.seconds for c in cost.collectives if c.transfer.overlap in ("gather", "reduce", "update")
    )
    per_device = (
        seq / math.prod(setup.sizes[a] for a in tokens if a == "context")
        if "context" in tokens
        else seq
    )
    return per_device * weights / cost.compute_time


TIME_BAND = (0.5, 2.0)
"""How far the time model's prediction of a one-device step may lie from the measured time
(predicted / measured) on this book's CPU, where `benchmarks/time_model.py` checks it."""
