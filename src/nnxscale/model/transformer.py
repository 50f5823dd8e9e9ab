"""The book's decoder-only Transformer in Flax NNX, every parameter named with logical axes.

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `head_dim`, `mlp`, `length`,
`layers`) in Flax's `out_sharding` metadata, never mesh axis names: a rule set
(`nnxscale.rules`) maps them onto a mesh, so one model serves every parallel strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from nnxscale.model.context import context_split, from_layout, ring_attention, to_layout
from nnxscale.model.losses import cross_entropy
from nnxscale.model.moe import MoE, Routing
from nnxscale.placement.layout import (
    activation_spec,
    alongside,
    constrain,
    per_row,
    placed_einsum,
    placed_lookup,
    weight_layout,
)
from nnxscale.placement.mesh import axis_kind, constrain_to
from nnxscale.placement.rounds import group_layers, layer_rounds, names_of

LOGICAL_AXES = ("vocab", "embed", "heads", "head_dim", "mlp", "length", "layers", "experts")

HEADS = ("batch", "length", "heads", "head_dim")
"""Logical names of queries, keys and values (and the attention's output before projection)."""

TOKENS = ("batch", "length", "embed")
"""Logical names of the input of attention and of the MLP: under sequence parallelism,
where the residual stream's sequence is gathered whole again."""

HIDDEN = ("batch", "length", "mlp")
"""Logical names of the MLP's hidden activations."""

SCORES = ("batch", "heads", None, None)
"""Logical names of dense attention's scores (batch, heads, queries, keys)."""

LOGITS = ("batch", "length", "vocab")
"""Logical names of the logits: split over the vocabulary as the output head is."""

RESIDUAL = ("batch", "residual_length", "embed")
"""Logical names of the residual stream: the embeddings, each block's output, and the norms
and dropout between them (Megatron's sequence parallelism splits `residual_length`)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and switches of the Transformer."""

    vocab: int = 128
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    max_len: int = 32
    dropout: float = 0.1
    scan_layers: bool = False
    remat: bool | str = False
    """Rematerialise each layer in the backward pass: False, True (`"full"`) or the name of a
    policy in `REMAT_POLICIES` (what the layer keeps)."""
    compute_dtype: str = "float32"
    experts: int = 0
    """Experts per MoE layer in place of each MLP (`nnxscale.moe`); 0 keeps the dense MLP."""
    top_k: int = 1
    capacity_factor: float = 2.0
    aux_weight: float = 0.01
    """Weight of the load-balancing loss in the training loss (MoE only)."""

    def __post_init__(self) -> None:
        remat_policy(self.remat)

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


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
"""The chapters' model: about 0.12 M parameters, a forward pass in milliseconds on a CPU."""

BENCH = Config(vocab=8192, embed=512, heads=8, head_dim=64, mlp=2048, layers=8, max_len=256)
"""A realistic size for the benchmarks: about 33 M parameters."""


def _param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int | None
) -> nnx.Param:
    """A parameter with logical axis names: normal(0, 1/fan_in) values, or ones if no fan_in."""
    if fan_in is None:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value, out_sharding=axes)


CAST_WEIGHTS = ("query", "key", "value", "out", "up", "down", "head")
"""The parameters the model reads through `compute_copy`: its matrix products' weights."""


def compute_copy(param: nnx.Param, dtype: Any) -> jax.Array:
    """The weight in the compute dtype, cast where it is stored: each device casts its own
    shard, so a strategy that gathers weights (FSDP) gathers the compute-dtype copy, half the
    bytes of float32 for bfloat16. The gradient flows back in the parameter's dtype, so it is
    reduced in float32. On Explicit axes the weight is read in its read layout (gathered over
    the axes that split the tokens, as FSDP's are): a product of rows split over `data` with a
    weight split over `data` has no layout JAX could choose."""
    value = param[...]
    names = names_of(param) or None
    if names is not None:  # inside a scan over stacked layers, a slice: drop the stacked names
        names = names[len(names) - value.ndim :]
    placed = weight_layout(value.shape, names)
    if value.dtype != jnp.dtype(dtype):
        return _cast_where_stored(value, jnp.dtype(dtype), placed, value.dtype)
    if placed is None or axis_kind(placed[2]) != "explicit":
        return value
    _, read, mesh = placed
    return constrain_to(value, NamedSharding(mesh, read))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_where_stored(value: jax.Array, dtype: Any, placed: Any, stored: Any) -> jax.Array:
    """`value` cast to `dtype` on its stored layout, then gathered to its read layout. The
    gather moves the cast value's bits as unsigned integers of its width: the same bytes, and
    a CPU compiler, which widens low-precision floating-point collectives to float32, keeps
    them."""
    copy = value.astype(dtype)
    if placed is None:
        return copy
    stored, read, mesh = placed
    bits = jax.lax.bitcast_convert_type(copy, jnp.dtype(f"uint{8 * copy.dtype.itemsize}"))
    bits = constrain_to(bits, NamedSharding(mesh, stored))
    bits = constrain_to(bits, NamedSharding(mesh, read))
    return jax.lax.bitcast_convert_type(bits, dtype)


def _cast_forward(value: jax.Array, dtype: Any, placed: Any, stored: Any) -> tuple[jax.Array, None]:
    return _cast_where_stored(value, dtype, placed, stored), None


def _cast_backward(dtype: Any, placed: Any, stored: Any, _: None, grad: jax.Array) -> tuple:
    grad = grad.astype(stored)
    if placed is not None and axis_kind(placed[2]) == "explicit":  # the type of the weight
        grad = jax.sharding.reshard(grad, NamedSharding(placed[2], placed[0]))
    return (grad,)


_cast_where_stored.defvjp(_cast_forward, _cast_backward)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a learned scale."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.scale = _param(rngs, (cfg.embed,), ("embed",), None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6)
        return (normed * alongside(compute_copy(self.scale, jnp.float32), normed)).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads split the projections (column/row parallel)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        qkv = (cfg.embed, cfg.heads, cfg.head_dim)
        names = ("embed", "heads", "head_dim")
        self.query = _param(rngs, qkv, names, cfg.embed)
        self.key = _param(rngs, qkv, names, cfg.embed)
        self.value = _param(rngs, qkv, names, cfg.embed)
        self.out = _param(
            rngs,
            (cfg.heads, cfg.head_dim, cfg.embed),
            ("heads", "head_dim", "embed"),
            cfg.heads * cfg.head_dim,
        )
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = constrain(x, TOKENS)
        q = constrain(
            placed_einsum("ble,ehd->blhd", x, compute_copy(self.query, dtype), HEADS), HEADS
        )
        k = constrain(
            placed_einsum("ble,ehd->blhd", x, compute_copy(self.key, dtype), HEADS), HEADS
        )
        v = constrain(
            placed_einsum("ble,ehd->blhd", x, compute_copy(self.value, dtype), HEADS), HEADS
        )
        ring = context_split(x.shape[1])
        if ring is None:
            context = self.dense(q, k, v)
        else:
            spec, mesh = activation_spec(q.shape, HEADS)
            context = ring_attention(q, k, v, mesh, ring, spec=spec)
        return placed_einsum("blhd,hde->ble", context, compute_copy(self.out, dtype), RESIDUAL)

    def dense(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Causal attention with the whole score matrix (batch, heads, length, length)."""
        dtype = q.dtype
        scores = placed_einsum("bqhd,bkhd->bhqk", q, k, SCORES) / math.sqrt(self.head_dim)
        length = q.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e30)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        return placed_einsum("bhqk,bkhd->bqhd", weights, v, HEADS)


class MLP(nnx.Module):
    """Two-layer GELU feed-forward block; `mlp` splits it column- then row-parallel."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.up = _param(rngs, (cfg.embed, cfg.mlp), ("embed", "mlp"), cfg.embed)
        self.down = _param(rngs, (cfg.mlp, cfg.embed), ("mlp", "embed"), cfg.mlp)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, TOKENS)
        up = placed_einsum("ble,em->blm", x, compute_copy(self.up, x.dtype), HIDDEN)
        hidden = constrain(jax.nn.gelu(up), HIDDEN)
        return placed_einsum("blm,me->ble", hidden, compute_copy(self.down, x.dtype), RESIDUAL)


class Block(nnx.Module):
    """One pre-norm Transformer layer: attention and MLP, each with dropout on its output."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.attention_norm = RMSNorm(cfg, rngs=rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = (
            MoE(
                cfg.embed,
                cfg.mlp,
                cfg.experts,
                top_k=cfg.top_k,
                capacity_factor=cfg.capacity_factor,
                rngs=rngs,
            )
            if cfg.experts
            else MLP(cfg, rngs=rngs)
        )
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
        return self.with_aux(x, dropout_key)[0]

    def with_aux(self, x: jax.Array, dropout_key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """The layer's output and its load-balancing loss (zero for a dense MLP)."""
        x, routing = self.with_routing(x, dropout_key)
        return x, jnp.zeros((), jnp.float32) if routing is None else routing.aux_loss

    def with_routing(
        self, x: jax.Array, dropout_key: jax.Array | None
    ) -> tuple[jax.Array, Routing | None]:
        """The layer's output and, for a mixture of experts, how it routed its tokens (each
        sequence is one group)."""
        keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
        x = constrain(x + self._drop(self.attention(self.attention_norm(x)), keys[0]), RESIDUAL)
        h, routing = self.mlp_norm(x), None
        if isinstance(self.mlp, MoE):
            h, routing = self.mlp(h)
        else:
            h = self.mlp(h)
        return constrain(x + self._drop(h, keys[1]), RESIDUAL), routing

    def _drop(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        return self.dropout(x, deterministic=key is None, rngs=key)


def _stacked_blocks(cfg: Config, rngs: nnx.Rngs) -> Block:
    """`cfg.layers` blocks whose parameters are stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return create(rngs)


BlockRunner = Callable[
    ["Transformer", jax.Array, "jax.Array | None"], "tuple[jax.Array, jax.Array | None]"
]
"""`blocks(model, x, keys) -> (output, summed load-balancing loss or None)`: how
`Transformer.loss` runs the blocks (hand-written FSDP and the pipeline bring their own)."""


class Transformer(nnx.Module):
    """Decoder-only language model: token and position embeddings, blocks, norm, output head.

    It runs on meshes of either kind (`nnxscale.mesh.AXIS_TYPES`): its activations are
    placed by their logical names under the active rules, on Explicit axes in the types of
    its products and lookups (`out_sharding=`), on Auto axes by constraints the compiler
    honours."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1)
        self.position = _param(rngs, (cfg.max_len, cfg.embed), ("length", "embed"), 1)
        if cfg.scan_layers:
            self.blocks = _stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        self.head = _param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.embed)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], seed: int = 0) -> Transformer:
        """The Transformer a checkpoint's record describes (its `Config` as a dict)."""
        return create(Config(**config), seed)

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits (batch, length, vocab) for integer tokens (batch, length); dropout if keyed."""
        keys = None if dropout_key is None else self.layer_keys(dropout_key)
        return self.unembed(self.run_blocks(self.embed_tokens(tokens), keys)[0])

    def loss(
        self,
        tokens: jax.Array,
        keys: jax.Array | None = None,
        blocks: BlockRunner | None = None,
    ) -> jax.Array:
        """The book's loss on `tokens` (batch, length + 1), written once: embed, the blocks,
        then the head and the loss (`head_loss`). `blocks(model, x, keys)` runs the blocks
        (default `run_blocks`): hand-written FSDP and the pipeline plug their runners in."""
        x = self.embed_tokens(tokens[:, :-1])
        y, aux = blocks(self, x, keys) if blocks else self.run_blocks(x, keys)
        return self.head_loss(y, tokens[:, 1:], aux)

    def head_loss(self, y: jax.Array, targets: jax.Array, aux: jax.Array | None) -> jax.Array:
        """Mean cross-entropy of `targets` under the head's logits for the blocks' output `y`,
        plus, with experts, `aux_weight` times the layers' mean load-balancing loss `aux`
        (their sum). A runner that returns no `aux` cannot train experts, and is refused."""
        loss = cross_entropy(self.unembed(y), targets)
        if not self.cfg.experts:
            return loss
        if aux is None:
            raise ValueError(
                "these blocks run without the experts' load-balancing loss, which training "
                "would drop: train a mixture of experts with the rule sets (nx.EP, nx.FSDP_EP)"
            )
        return loss + self.cfg.aux_weight * aux / self.cfg.layers

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The blocks' input: token plus position embeddings, in the compute dtype. Under
        context parallelism the sequence is put in the zig-zag layout here, once."""
        cfg = self.cfg
        length = tokens.shape[1]
        if length > cfg.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len {cfg.max_len}")
        where = jnp.arange(length)
        split = context_split(length)
        if split is not None:
            tokens, where = to_layout(tokens, split), jnp.asarray(split.order(length))
        # a lookup follows its table's layout: rows split as the logits' vocabulary, so the
        # lookup runs on this device's sequences, and columns whole, gathered as a weight
        batch = ((tokens.shape[0], "batch"),)
        table = constrain(self.embed[...], ("vocab", None), beside=batch)
        position = placed_lookup(self.position[...], per_row(where, tokens), RESIDUAL)
        x = placed_lookup(table, tokens, RESIDUAL) + position
        return constrain(x.astype(jnp.dtype(cfg.compute_dtype)), RESIDUAL)

    def routings(self, tokens: jax.Array) -> list[Routing]:
        """How each layer's experts routed `tokens` (no dropout): what a chapter plots. One
        compiled program per shape of `tokens` (op by op, every op would compile anew)."""
        if self.cfg.scan_layers or not self.cfg.experts:
            raise ValueError(
                "routings reads a Python loop of MoE layers: use experts > 0 and scan_layers=False"
            )
        return _routings(self, tokens)

    def layer_keys(self, dropout_key: jax.Array) -> jax.Array:
        """One dropout key per layer, from the step's key."""
        return jax.random.split(dropout_key, self.cfg.layers)

    def unembed(self, x: jax.Array) -> jax.Array:
        """Float32 logits from the blocks' output: final norm, then the output head (the
        sequence back in its natural order under context parallelism, and split as the
        residual stream is, so that each device computes the logits of its own tokens)."""
        split = context_split(x.shape[1])
        if split is not None:
            x = constrain(from_layout(x, split), RESIDUAL)
        x = self.final_norm(x)
        head = compute_copy(self.head, x.dtype)
        return placed_einsum("ble,ev->blv", x, head, LOGITS).astype(jnp.float32)

    def run_blocks(self, x: jax.Array, keys: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Every block in turn (a Python loop, or a scan over stacked blocks, held in rounds
        or not: `group_layers`), remat if set; the output and the sum of the layers'
        load-balancing losses."""
        policy = remat_policy(self.cfg.remat)
        apply: Callable[[Block, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array]] = (
            nnx.remat(lambda block, h, key: block.with_aux(h, key), policy=REMAT_POLICIES[policy])
            if policy
            else (lambda block, h, key: block.with_aux(h, key))
        )
        total = jnp.zeros((), jnp.float32)
        if not self.cfg.scan_layers:
            for i, block in enumerate(self.blocks):
                x, aux = apply(block, x, None if keys is None else keys[i])
                total = total + aux
            return x, total

        @nnx.scan(in_axes=(0, nnx.Carry, 0 if keys is not None else None), out_axes=nnx.Carry)
        def run(
            block: Block, carry: tuple[jax.Array, jax.Array], key: jax.Array | None
        ) -> tuple[jax.Array, jax.Array]:
            h, aux = apply(block, carry[0], key)
            return h, carry[1] + aux

        return run(plain_stack(self.blocks), (x, total), keys)


def plain_stack(blocks: nnx.Module) -> nnx.Module:
    """Stacked blocks as one stack of layers, whether or not they are held in rounds."""
    graphdef, state = nnx.split(blocks)
    if layer_rounds(state) == 1:
        return blocks
    return nnx.merge(graphdef, group_layers(state, 1))


def create(cfg: Config, seed: int = 0) -> Transformer:
    """A Transformer with weights drawn from `seed` (unsharded: see nnxscale.init for shards)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    """Number of parameter elements."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@nnx.jit
def _routings(model: Transformer, tokens: jax.Array) -> list[Routing]:
    """Each MoE layer's routing of `tokens` through the model's Python loop of blocks."""
    x, found = model.embed_tokens(tokens), []
    for block in model.blocks:
        x, routing = block.with_routing(x, None)
        found.append(routing)
    return found
