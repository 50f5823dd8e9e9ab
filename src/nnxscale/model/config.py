"""What the book's Transformer is, before any array exists: its sizes and switches
(`Config`), the checks that name what is wrong with them and the fix (`config_problem`),
the remat policies a layer may run under, and the chapters' and the benchmarks' sizes
(`TINY`, `BENCH`). The cost model, the planner and the checkpoint records read a model
through this module alone; `nnxscale.model.transformer` builds the modules from it.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and switches of the Transformer."""

    vocab: int = 128
    embed: int = 64
    heads: int = 4
    kv_heads: int = 2
    """Key/value heads, each shared by `heads / kv_heads` query heads (grouped-query
    attention; `kv_heads = heads` is multi-head attention, 1 multi-query)."""
    head_dim: int = 16
    mlp: int = 256
    """Hidden units of the SwiGLU MLP (its gate, up and down matrices)."""
    layers: int = 2
    max_len: int = 32
    """The longest sequence the model takes (rotary positions need no table)."""
    rope_theta: float = 10_000.0
    """The base of the rotary position embeddings' frequencies."""
    tie_embeddings: bool = False
    """Read the output head from the token embeddings (one matrix) instead of its own."""
    qk_norm: bool = False
    """RMSNorm each query and key head before the rotary embedding (Qwen3, Gemma 3)."""
    norm_eps: float = 1e-6
    dropout: float = 0.0
    scan_layers: bool = False
    remat: bool | str = False
    """Rematerialise each layer in the backward pass: False, True (`"full"`) or the name of a
    policy in `REMAT_POLICIES` (what the layer keeps)."""
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    """The dtype parameters are stored in: float32, or bfloat16 (`nnxscale.train.Trainer`
    can keep a float32 master copy in the optimizer state)."""
    experts: int = 0
    """Experts per MoE layer in place of each MLP (`nnxscale.moe`); 0 keeps the dense MLP."""
    top_k: int = 1
    capacity_factor: float = 2.0
    aux_weight: float = 0.01
    """Weight of the load-balancing loss in the training loss (MoE only)."""
    routing: str = "capacity"
    """How a mixture routes its tokens (`ROUTINGS`): "capacity", GShard's (`nnxscale.moe`:
    each expert takes at most `capacity_factor` times its even share, and drops the rest), or
    "dropless" (`nnxscale.dropless`: every token reaches its k experts, on grouped products
    in blocks of `expert_block` rows)."""
    shared_experts: int = 0
    z_weight: float = 0.0
    expert_block: int = 8
    bias_rate: float = 0.0
    """Dropless only: the width of the shared experts every token passes through, in units of
    `mlp` (0: none); the weight of the router's z-loss (ST-MoE uses 0.001); the rows of a
    block (the padding is less than one block per expert); the step of a router bias that
    balances the experts (`dropless.RouterBias`; 0: none; it adds to `aux_weight`'s loss)."""

    def __post_init__(self) -> None:
        problem = config_problem(self)
        if problem:
            raise ValueError(f"Config: {problem}")
        remat_policy(self.remat)

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads


DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a `Config` may compute in or store its parameters in."""


def config_problem(cfg: Config) -> str:
    """What is wrong with `cfg`'s sizes, naming the fix, or "" when nothing is."""
    for name in ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "max_len"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r}: every size must be a positive integer"
    if cfg.heads % cfg.kv_heads:
        divisors = [d for d in range(1, cfg.heads + 1) if cfg.heads % d == 0]
        return (
            f"kv_heads={cfg.kv_heads} does not divide heads={cfg.heads}: each key/value head "
            f"serves a whole group of query heads; use one of {divisors}"
        )
    if cfg.head_dim % 2:
        return (
            f"head_dim={cfg.head_dim} is odd: rotary embeddings turn pairs of dimensions; "
            "use an even head_dim"
        )
    if not cfg.rope_theta > 1:
        return f"rope_theta={cfg.rope_theta}: the rotary base must be above 1 (10,000 is usual)"
    if not 0 <= cfg.dropout < 1:
        return f"dropout={cfg.dropout}: use a rate in [0, 1)"
    for name in ("compute_dtype", "param_dtype"):
        if getattr(cfg, name) not in DTYPES:
            return f"{name}={getattr(cfg, name)!r}: use one of {', '.join(DTYPES)}"
    return _mixture_problem(cfg)


ROUTINGS = ("capacity", "dropless")
"""How a mixture of experts can route its tokens (`Config.routing`)."""


def _mixture_problem(cfg: Config) -> str:
    """What is wrong with `cfg`'s mixture settings, naming the fix, or ""."""
    if cfg.routing not in ROUTINGS:
        return f"routing={cfg.routing!r}: use one of {', '.join(ROUTINGS)}"
    if cfg.experts < 0:
        return f"experts={cfg.experts}: use 0 for a dense MLP or a positive number of experts"
    if cfg.experts and not 1 <= cfg.top_k <= cfg.experts:
        return f"top_k={cfg.top_k} with {cfg.experts} experts: use 1 <= top_k <= {cfg.experts}"
    if cfg.experts and cfg.routing == "capacity" and not cfg.capacity_factor > 0:
        return "the capacity factor must be positive"
    finite = all(0 <= w < float("inf") for w in (cfg.z_weight, cfg.bias_rate))
    if not finite or cfg.shared_experts < 0 or cfg.expert_block < 1:
        return (
            f"z_weight={cfg.z_weight}, bias_rate={cfg.bias_rate}, shared_experts="
            f"{cfg.shared_experts}, expert_block={cfg.expert_block}: use a finite z_weight "
            ">= 0 and bias_rate >= 0, shared_experts >= 0 and expert_block >= 1"
        )
    dropless_only = cfg.shared_experts or cfg.z_weight or cfg.bias_rate
    if not cfg.experts and (cfg.routing != "capacity" or dropless_only):
        return (
            f"routing={cfg.routing!r}, shared_experts={cfg.shared_experts}, z_weight="
            f"{cfg.z_weight}, bias_rate={cfg.bias_rate} configure a mixture of experts: set "
            "experts > 0"
        )
    if cfg.routing == "capacity" and dropless_only:
        return (
            "shared_experts, z_weight and bias_rate belong to dropless routing: set "
            "routing='dropless' or leave them at 0"
        )
    return ""


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""What a rematerialised layer keeps for its backward pass. `full`: only its input; the
backward pass runs the layer's forward again. `dots`: also the outputs of its weight products
(queries, keys, values, projections, the MLP's products); the attention scores, softmax and
elementwise work are recomputed, close to the selective recomputation of Korthikanti et al."""


def remat_policy(remat: bool | str) -> str | None:
    """The name of the remat policy a `Config.remat` value means (None: no remat)."""
    if remat is False:
        return None
    if remat is True:
        return "full"
    if remat not in REMAT_POLICIES:
        raise ValueError(
            f"remat={remat!r} is not a remat policy: use False, True (full) or one of "
            f"{', '.join(map(repr, REMAT_POLICIES))}."
        )
    return remat


TINY = Config()
"""The chapters' model: 0.14 M parameters, a forward pass in milliseconds on a CPU."""

BENCH = Config(
    vocab=8192, embed=512, heads=8, kv_heads=2, head_dim=64, mlp=1536, layers=8, max_len=256
)
"""A realistic size for the benchmarks: about 31 M parameters."""
