"""The model's sizes as the cost model counts them: parameters, products and FLOPs per step,
activation bytes per token, the reference 8B and 70B models, and a strategy's `Setup`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from nnxscale.costs.formula import Formula
from nnxscale.model.config import Config, remat_policy
from nnxscale.model.context import BLOCK
from nnxscale.model.dropless import blocks
from nnxscale.model.moe import capacity
from nnxscale.placement.rules import RuleError, Rules

STATE_BYTES = 4
"""Bytes per element of parameters, gradients and optimizer state: float32, as the Trainer
keeps them whatever the compute dtype."""


OPTIMIZER_COPIES = 3
"""Optimizer state per parameter, in parameter-sized copies: AdamW's two moments and the EMA."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter of what a training state holds: the parameters, a float32 master
    copy (mixed precision), the optimizer's moments, an exponential moving average of the
    weights, and the gradients. The default is the book's Trainer: float32 parameters and
    gradients, AdamW's two float32 moments and an EMA, 16 bytes of state per parameter."""

    parameters: float = STATE_BYTES
    master: float = 0
    moments: float = 2 * STATE_BYTES
    ema: float = STATE_BYTES
    gradients: float = STATE_BYTES

    def __post_init__(self) -> None:
        """Refuse a negative or infinite byte count, or parameters or gradients of none."""
        values = dataclasses.asdict(self)
        bad = {k: v for k, v in values.items() if not 0 <= v < math.inf}
        if bad or not self.parameters or not self.gradients:
            raise ValueError(
                f"a Precision's bytes per parameter must be finite and not negative, the "
                f"parameters' and gradients' positive, got {values}"
            )

    @property
    def optimizer(self) -> float:
        """Bytes per parameter beside the parameters: master copy, moments and EMA."""
        return self.master + self.moments + self.ema


PRECISIONS = {
    "the book: float32, AdamW, EMA": Precision(),
    "bfloat16 + float32 master, AdamW": Precision(2, 4, 8, 0, 4),
    "bfloat16 + float32 master, AdamW, bfloat16 gradients": Precision(2, 4, 8, 0, 2),
    "bfloat16, AdamW in bfloat16": Precision(2, 0, 4, 0, 2),
    "bfloat16 + float32 master, 8-bit Adam": Precision(2, 4, 2, 0, 4),
    "float32, Adafactor (factored, no momentum)": Precision(4, 0, 0, 0, 4),
}
"""Common choices, by name: the book's, Megatron-style mixed precision (18 bytes with the
float32 gradients it accumulates in, Korthikanti et al.'s and ZeRO's 16 with bfloat16 ones),
moments in bfloat16, 8-bit Adam's one byte per moment, and Adafactor, whose factored second
moment holds a row and a column per matrix (next to nothing per parameter)."""


PLANNING = PRECISIONS["bfloat16 + float32 master, AdamW, bfloat16 gradients"]
"""What the planner holds per parameter unless told otherwise: bfloat16 parameters and
gradients, a float32 master copy and AdamW's two moments, 16 bytes (ZeRO's count; what
Megatron-LM holds by default). The book's own Trainer, `PRECISIONS["the book: float32,
AdamW, EMA"]`, holds 20 during a step."""


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of each compute dtype a `Config` may name."""


LOGIT_BYTES = 4
"""Bytes per logit: the model computes its logits, and the loss, in float32."""


SIZES = {
    "vocab": "vocab",
    "embed": "embed",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "mlp": "mlp",
    "layers": "layers",
    "experts": "experts",
}
"""The size each logical axis of a parameter has: the `Config` field of that name."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameter counts of the book's Transformer."""

    total: int
    matmul: int
    """In matrix products: everything but the token embeddings (looked up, unless the head
    reads them) and the norms."""


def counts(cfg: Config) -> Counts:
    """Parameter counts of the Transformer `cfg` describes, by formula: grouped-query
    attention (queries and output over `heads`, keys and values over `kv_heads`), a SwiGLU
    MLP of three matrices (a mixture of experts: a router and `experts` of them, and the
    shared experts' MLP, `shared_experts` times as wide), two norms per layer (and two of
    `head_dim` with QK-norm), the final norm, the embeddings and, unless tied, the head."""
    e, v, d = cfg.embed, cfg.vocab, cfg.head_dim
    attention = 2 * e * d * (cfg.heads + cfg.kv_heads)
    mlp = 3 * e * cfg.mlp
    if cfg.experts:
        mlp = (cfg.experts + cfg.shared_experts) * mlp + e * cfg.experts
    norms = 2 * e + (2 * d if cfg.qk_norm else 0)
    layers = cfg.layers * (attention + mlp + norms)
    head = 0 if cfg.tie_embeddings else e * v
    return Counts(total=v * e + layers + e + head, matmul=cfg.layers * (attention + mlp) + e * v)


def activation_bytes(
    cfg: Config,
    sequences: float,
    seq: int,
    *,
    model: int = 1,
    remat: bool = False,
    context: int = 1,
    sequence_parallel: bool = False,
    flash: bool = True,
) -> float:
    """The least a backward pass needs, by the textbook count: per layer and token the inputs
    of its products and nonlinearities, 4E + 2HD + 2KD + 3F values (two norms' inputs and
    outputs; queries and output, keys and values; the SwiGLU's gate, up and hidden; tensor-
    parallel parts split over `model`, and under sequence parallelism the residual stream's
    4E too), plus H s scores for an attention that keeps them (`flash=False`: the book's
    blockwise attention keeps none), plus the head's; with remat each layer's input and one
    layer rebuilt. What a compiled program keeps lies above it: the ledger uses
    `Costs.activations`, calibrated on autodiff, and chapter 12 compares the two."""
    tokens = sequences * seq / context
    width = DTYPE_BYTES[cfg.compute_dtype]
    residual = 4 * cfg.embed / (model if sequence_parallel else 1)
    scores = 0 if flash else cfg.heads * seq
    heads = 2 * (cfg.heads + cfg.kv_heads) * cfg.head_dim
    values = residual + (heads + 3 * cfg.mlp + scores) / model
    layer = tokens * values * width
    head = tokens * (2 * cfg.embed * width + cfg.vocab / model * LOGIT_BYTES)
    if remat:
        stream = cfg.embed / (model if sequence_parallel else 1)
        return cfg.layers * tokens * stream * width + layer + head
    return cfg.layers * layer + head


def step_flops(cfg: Config, sequences: float, seq: int, *, remat: bool | str = False) -> float:
    """FLOPs of one training step's matrix products over all devices (`products`): for a dense
    model 6 x parameters x tokens plus the blockwise attention's 7 L b H D (s^2 + s block)
    (the block pairs under the causal mask, 2.5 times again backward)."""
    sizes = {**model_sizes(cfg, seq), "batch": sequences, "seq": seq}
    dropless = bool(cfg.experts) and cfg.routing == "dropless"
    return product_flops(remat_policy(remat), bool(cfg.experts), dropless=dropless)(sizes)


def model_flops(cfg: Config, sequences: float, seq: int) -> float:
    """The model FLOPs of one training step as the field counts them for MFU: 6 per matmul
    parameter (the head's included, the looked-up embedding not) and token, plus causal
    attention's two products once, forward and backward: 6 L b H D s^2 (half of the s^2
    pairs). A mixture of experts counts the experts its tokens visit (`top_k`), not their
    slots. What a kernel computes again (flash attention's backward, the block pairs on the
    diagonal, remat) is hardware FLOPs (`step_flops`), not model FLOPs."""
    c = counts(cfg)
    matmul = c.matmul
    if cfg.experts:
        per_expert = 3 * cfg.embed * cfg.mlp
        matmul -= cfg.layers * (cfg.experts - cfg.top_k) * per_expert
    attention = 6 * cfg.layers * sequences * cfg.heads * cfg.head_dim * seq * seq
    return 6 * matmul * sequences * seq + attention


def model_sizes(cfg: Config, seq: int) -> dict[str, float]:
    """The model's sizes the formulas use, with the slots of each expert per group of `seq`
    tokens (`capacity`) for a mixture of experts."""
    sizes: dict[str, float] = {
        name: getattr(cfg, name)
        for name in (
            "vocab",
            "embed",
            "heads",
            "kv_heads",
            "head_dim",
            "mlp",
            "layers",
            "max_len",
            "experts",
        )
    }
    sizes["top_k"] = cfg.top_k
    sizes["summed"] = cfg.top_k if cfg.top_k > 1 else 0  # one copy is weighed, not summed
    sizes["rows"] = (
        blocks(cfg.top_k * seq, cfg.experts, cfg.expert_block) * cfg.expert_block
        if cfg.experts
        else 0
    )
    sizes["shared"] = cfg.shared_experts * cfg.mlp
    sizes["block"] = min(seq, BLOCK)
    sizes["capacity"] = (
        capacity(seq, cfg.experts, cfg.top_k, cfg.capacity_factor) if cfg.experts else 0
    )
    return sizes


LEDGERS = {
    "program": "this library's program: what JAX's autodiff keeps for the book's Transformer, "
    "gradients split as XLA splits them",
    "fused": "fused kernels: flash attention, fused norms and SwiGLU intermediates in the "
    "compute dtype, as Megatron-LM, torchtitan and MaxText keep them; one gradient buffer, "
    "updated in place; a pipeline of one program per stage",
}
"""The memory ledgers by name, each in words (`nnxscale.costs.ledgers`)."""


LOSSES = {
    "fused": "a fused cross-entropy (flash-attention's, Liger's, Megatron-LM's "
    "--cross-entropy-loss-fusion): the logits kept in the compute dtype, their gradient "
    "written in their place",
    "float32": "the logits cast to float32 for the loss (nanotron's, PyTorch's "
    "cross_entropy on upcast logits): the compute-dtype logits, their float32 copy and "
    "softmax kept, the float32 gradient beside them when the backward pass starts",
}
"""How the fused ledger's loss holds the logits (`Setup.loss`); the program ledger traces
the book's own."""


def check_ledger(name: str) -> str:
    """`name` if it names a ledger; an error naming the choices otherwise."""
    return _one_of("ledger", name, LEDGERS)


def _one_of(field: str, name: str, choices: Mapping[str, str]) -> str:
    """`name` if it is one of `choices`; an error naming `field` and each choice in words."""
    if name not in choices:
        words = "; ".join(f"{k}: {v}" for k, v in choices.items())
        raise ValueError(f"{field}={name!r}: use one of {', '.join(map(repr, choices))} ({words})")
    return name


OVERLAPPED = {
    "collective matmul": "tensor parallelism's collectives split into ring steps, each behind "
    "a piece of its product (Megatron-LM's --tp-comm-overlap, XLA's collective matmul)",
    "parameter prefetch": "ZeRO's gather of updated parameters behind the next step's forward "
    "pass (Megatron-LM's --overlap-param-gather)",
}
"""What a framework may overlap beyond what one compiled step can (`Setup.overlaps`)."""

SCHEDULES = ("lockstep", "1F1B", "ZB-H1", "ZB-V")
"""How a pipeline runs its micro-batches: `lockstep`, the book's executor (one SPMD program
whose ticks all stages run together, each stage rebuilt in its backward task, as MaxText and
Praxis run pipelines); `1F1B`, one program per stage (MPMD, as Megatron-LM and JaxPP run
them), each stage keeping its micro-batches' activations until their backward pass, and with
virtual stages the interleaved schedule (Narayanan et al. 2021); `ZB-H1` and `ZB-V`, 1F1B
with each backward split into the input's gradient and the weights' (Qi et al. 2024), ZB-V
on two stages per device in a V. The book's executor runs the lockstep one; the others it
prices with 1F1B's memory (p stages in flight on the busiest device, as Qi et al. give for
both) and each schedule's own bubble (`nnxscale.costs.pipeline_bubble`)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to run a training step: a rule set, the size of each of its mesh axes, the
    micro-batches a step's batch is cut into (gradient accumulation, or a pipeline's), the
    remat policy (`nnxscale.model.REMAT_POLICIES`), the bytes per parameter its state
    holds (`Precision`), and for a pipeline its schedule (`SCHEDULES`) and the virtual
    stages each device runs (interleaved 1F1B when more than one)."""

    rules: Rules
    mesh: tuple[tuple[str, int], ...]
    micro_batches: int = 1
    remat: bool | str = False
    precision: Precision = Precision()
    schedule: str = "lockstep"
    virtual: int = 1
    reduce_once: bool = False
    """Whether gradient accumulation reduces once per step (`train.unreduced_grads`: the
    weights read whole for the step, the micro-batches' partial sums added unreduced)
    instead of once per micro-batch."""
    ledger: str = "program"
    """The memory ledger (`LEDGERS`): this library's compiled program, or a trainer with
    fused kernels (`nnxscale.costs.ledgers`)."""
    overlaps: tuple[str, ...] = ()
    """What the framework overlaps beyond one compiled step (`OVERLAPPED`)."""
    loss: str = "fused"
    """How the fused ledger's loss holds the logits (`LOSSES`)."""
    regather: bool = True
    """Under sequence parallelism, whether the fused ledger's products gather their inputs
    again in the backward pass (Megatron-LM) or keep them gathered, whole over the tensor
    axis (PyTorch's autograd unless told otherwise; nanotron's runs in the grid)."""
    flat: bool = False
    """Whether the framework shards its state as flat, padded buffers over the batch's axes
    (PyTorch's FSDP, Megatron-LM's distributed optimizer, nanotron's ZeRO), so no dimension
    need divide them; JAX shards each array along its dimensions, which must."""

    @classmethod
    def of(
        cls,
        rules: Rules,
        mesh: Mapping[str, int],
        micro_batches: int = 1,
        remat: bool | str = False,
        precision: Precision | None = None,
        schedule: str = "lockstep",
        virtual: int = 1,
        reduce_once: bool = False,
        ledger: str = "program",
        overlaps: tuple[str, ...] = (),
        loss: str = "fused",
        regather: bool = True,
        flat: bool = False,
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
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
        if schedule == "ZB-V" and virtual in (1, 2):
            virtual = 2  # its V: two stages on each device
        elif int(virtual) != virtual or virtual < 1 or (virtual > 1 and schedule != "1F1B"):
            raise ValueError(
                f"virtual={virtual!r}: virtual stages are a positive integer, more than one "
                "only for the 1F1B schedule (interleaved 1F1B; ZB-V always runs two)"
            )
        shape = tuple((a, int(mesh.get(a, 1))) for a in rules.axes)
        return cls(
            rules,
            shape,
            int(micro_batches),
            remat,
            precision or Precision(),
            schedule,
            int(virtual),
            bool(reduce_once),
            check_ledger(ledger),
            _overlaps(overlaps),
            _one_of("loss", loss, LOSSES),
            bool(regather),
            bool(flat),
        )

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
        return f"{self.rules.name} on {axes}, {micro}, {remat}{self.pipelined()}"

    def pipelined(self) -> str:
        """The pipeline schedule in words (", 1F1B, 2 virtual stages"), or "" for lockstep;
        and ", gradients reduced once a step" where they are."""
        if self.reduce_once:
            return ", gradients reduced once a step"
        if self.schedule == "lockstep":
            return ""
        interleaved = self.virtual > 1 and self.schedule == "1F1B"
        virtual = f", {self.virtual} virtual stages" if interleaved else ""
        mpmd = " (needs a runtime of one program per stage)" if self.schedule[:2] == "ZB" else ""
        return f", {self.schedule}{virtual}{mpmd}"


def _overlaps(names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` sorted, each a key of `OVERLAPPED`; an error naming the choices otherwise."""
    unknown = sorted(set(names) - set(OVERLAPPED))
    if unknown:
        raise ValueError(f"overlaps {unknown}: use some of {', '.join(map(repr, OVERLAPPED))}")
    return tuple(sorted(set(names)))


@dataclasses.dataclass(frozen=True)
class Product:
    """One kind of matrix product of the step: its forward FLOPs over all devices, the
    products its backward pass makes of it (2: the input's gradient and the weight's; 1 where
    only one operand is differentiated; 2.5 for attention's, whose custom VJP scores each
    block pair again), and whether full remat and the `dots` policy compute
    it again (`dots` keeps products with no batch dimensions; full remat keeps nothing, but
    a layer's last product, whose output its backward pass does not read)."""

    name: str
    forward: Formula
    backward: float
    full: bool
    dots: bool


def products(moe: bool = False, dropless: bool = False) -> tuple[Product, ...]:
    """The step's matrix products, dense or with a mixture of experts in place of each MLP:
    `experts` x `capacity` slots per group of `seq` tokens, filled by a one-hot dispatch
    (whose backward pass differentiates the tokens alone) and summed back by the combine;
    or, `dropless`, each sequence's k copies of its tokens in `rows` rows of blocks
    (`nnxscale.dropless`), weighed and `summed` back per token, and the shared experts' MLP
    of width `shared`."""

    def product(
        name: str, sizes: str, flops: int, backward: float, full: bool, dots: bool
    ) -> Product:
        formula = Formula.product(sizes.split(), flops)
        return Product(name, formula, backward, full, dots)

    tokens = "layers batch seq"
    weights = product("", f"{tokens} embed heads head_dim", 4, 2, True, False).forward
    weights += product("", f"{tokens} embed kv_heads head_dim", 4, 2, True, False).forward
    # the blockwise kernel scores the block pairs on and under the diagonal: (s^2 + s x block)/2
    scores = product("", f"{tokens} seq heads head_dim", 2, 2, True, True).forward
    scores += product("", f"{tokens} block heads head_dim", 2, 2, True, True).forward
    attention = (
        Product("attention weights", weights, 2, True, False),
        Product("attention scores", scores, 2.5, True, True),
    )
    head = product("head", "batch seq embed vocab", 2, 2, False, False)
    if not moe:
        return (
            *attention,
            product("MLP gate and up", f"{tokens} embed mlp", 4, 2, True, False),
            product("MLP down", f"{tokens} embed mlp", 2, 2, False, False),
            head,
        )
    router = product("router", f"{tokens} embed experts", 2, 2, True, False)
    if dropless:
        return (
            *attention,
            router,
            product("experts", "layers batch rows embed mlp", 6, 2, True, True),
            product("combine", f"{tokens} summed embed", 2, 1, False, False),
            product("shared gate and up", f"{tokens} embed shared", 4, 2, True, False),
            product("shared down", f"{tokens} embed shared", 2, 2, False, False),
            head,
        )
    slots = f"{tokens} experts capacity embed"
    return (
        *attention,
        router,
        product("dispatch", slots, 2, 1, True, True),
        product("experts", "layers batch experts capacity embed mlp", 6, 2, True, True),
        product("combine", slots, 2, 2, False, False),
        head,
    )


ROUTING = ("router", "dispatch", "combine")
"""A mixture's products that route tokens: they contract no tensor-parallel dimension."""


@functools.cache
def product_flops(
    remat: str | None, moe: bool = False, only: tuple[str, ...] = (), *, dropless: bool = False
) -> Formula:
    """Matmul FLOPs of one step over all devices (`step_flops`), as a formula: of every
    product (`products`), or of those named in `only`. Made once per choice (a formula's
    evaluation is compiled on first use, and runs tables price thousands of steps)."""
    total = Formula()
    for p in (p for p in products(moe, dropless) if not only or p.name in only):
        again = (remat == "full" and p.full) or (remat == "dots" and p.dots)
        total += p.forward * (1 + p.backward + again)
    return total


def sizes_of(cfg: Config, setup: Setup, batch: int, seq: int) -> dict[str, float]:
    """The value of every size the formulas use: the model's, the step's and the mesh's."""
    model = model_sizes(cfg, seq)
    return {
        **model,
        "batch": batch,
        "seq": seq,
        "micro": setup.micro_batches,
        "virtual": setup.virtual,
        "interleaved": int(setup.virtual > 1 and setup.schedule == "1F1B"),
        **setup.sizes,
        "layers": _padded(cfg.layers, setup),
        "flight": min(_stages(setup), setup.micro_batches),
    }


def _stages(setup: Setup) -> int:
    """A pipeline's stages: the size of the mesh axes that split the layers (1 without)."""
    return math.prod(setup.sizes.get(a, 1) for a in setup.rules.axes_of("layers"))


def _padded(layers: int, setup: Setup) -> int:
    """The layers a pipeline's busiest stage runs, times the stages and virtual stages: a
    stage count that does not divide the layers gives some stages one layer more, and the
    slowest stage sets the step's pace (Llama 3 405B's 126 layers ran as 16 stages of 8)."""
    chunks = _stages(setup) * setup.virtual
    return -(-layers // chunks) * chunks


def mixture_problem(cfg: Config) -> str:
    """What the cost model cannot price of `cfg`'s mixture of experts, or "" (a `Config`
    refuses a mixture that cannot run: k above the experts, a negative count)."""
    if cfg.experts and cfg.shared_experts:
        return (
            f"shared_experts={cfg.shared_experts}: the cost model prices the FLOPs of shared "
            "experts (`step_flops`), not their state or memory: price the mixture without them"
        )
    return ""
