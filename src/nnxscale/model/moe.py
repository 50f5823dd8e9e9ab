"""A mixture-of-experts layer: top-k routing with expert capacity, and expert parallelism.

A router scores each token against every expert; each token goes to its top k experts, each
expert takes at most `capacity` tokens per group (tokens past it are dropped: their output
from that expert is zero and the residual stream carries them on), and the outputs are summed
with the router's weights. Routing is decided per group of tokens (GShard's local groups), so
that a device routes its own tokens without asking the others. Expert parallelism puts each
device's experts on it and moves tokens there and back with two all-to-alls.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnxscale.placement.constraints import activation_axis, constrain

GROUPS = ("batch", None, None, None)
"""The same slots placed with their groups of tokens (where the dispatch computes them)."""

SLOTS = ("groups", "experts", None, None)
"""Logical names of the experts' slots (groups, experts, slots, d): under expert parallelism
each device holds its experts' slots of every group, which the compiler reaches by an
all-to-all from the groups' split."""


class MoEError(ValueError):
    """An expert layout that cannot work as asked; the message names the fix."""


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots each expert has for a group of `tokens` tokens: factor x the even share k T / E,
    rounded up (a factor of 1.0 leaves no slack: any imbalance drops tokens)."""
    return max(1, math.ceil(factor * top_k * tokens / experts))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token of a group goes: `dispatch[t, e, c]` is 1 if token t takes slot c of
    expert e, `combine[t, e, c]` its router weight there; per expert, the tokens it was sent
    (`wanted`) and kept (`kept`); the load-balancing loss; and `chosen[t]`, the k experts
    token t asked for, first choice first (kept or not)."""

    dispatch: jax.Array
    combine: jax.Array
    wanted: jax.Array
    kept: jax.Array
    aux_loss: jax.Array
    chosen: jax.Array

    @property
    def dropped(self) -> jax.Array:
        """The fraction of token-expert assignments that found their expert full."""
        return 1 - self.kept.sum() / self.wanted.sum()


def largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest values along the last axis of `x` and their indices, largest first (the
    lower index first among equals), as `jax.lax.top_k` gives them, by k rounds of argmax in
    a scan: elementwise work and reductions along the last axis, which the partitioner keeps
    where the rows are. (XLA's TopK is a custom call it does not partition: under a rule set
    that splits the tokens, every device would gather and route the whole batch.)"""

    def pick(rest: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
        index = jnp.argmax(rest, axis=-1)
        return jnp.where(jax.nn.one_hot(index, x.shape[-1], dtype=bool), -jnp.inf, rest), index

    _, picked = jax.lax.scan(pick, jax.lax.stop_gradient(x), length=k)
    indices = jnp.moveaxis(picked, 0, -1).astype(jnp.int32)
    hot = jax.nn.one_hot(indices, x.shape[-1], dtype=bool)
    return jnp.sum(jnp.where(hot, x[..., None, :], 0), axis=-1), indices


def route(logits: jax.Array, top_k: int, slots: int) -> Routing:
    """Top-k routing of one group's tokens (logits: tokens x experts) into `slots` slots per
    expert. Every token's first choice is placed before any second choice (GShard's order), in
    token order; a choice that finds its expert full is dropped. Gates are the router's
    softmax probabilities, renormalised over the k chosen experts when k > 1. The choices are
    placed by a scan (each choice's slots follow the earlier choices'); a token takes at most
    one slot of an expert, so `combine` is `dispatch` times the token's gate at that expert:
    the backward pass keeps one array of slots for the gates, not one per choice."""
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise MoEError(f"top_k={top_k} with {experts} experts: use 1 <= top_k <= {experts}.")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    gates, chosen = largest(probs, top_k)
    if top_k > 1:
        gates = gates / gates.sum(axis=-1, keepdims=True)
    wants = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # tokens x choices x experts

    def place(carry: tuple[jax.Array, ...], want: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
        dispatch, taken, kept = carry  # taken: slots already filled by earlier choices
        position = jnp.cumsum(want, axis=0) - 1 + taken
        fits = want * (position < slots)
        dispatch = dispatch + fits[..., None] * jax.nn.one_hot(position, slots, dtype=jnp.int32)
        return (dispatch, taken + want.sum(axis=0), kept + fits.sum(axis=0)), None

    empty = jnp.zeros_like(wants[0, 0])  # typed as the tokens are (inside jax.shard_map too)
    start = (jnp.zeros_like(empty, jnp.float32, shape=(tokens, experts, slots)), empty, empty)
    (dispatch, taken, kept), _ = jax.lax.scan(place, start, jnp.moveaxis(wants, 1, 0))
    gate = jnp.sum(jnp.where(wants.astype(bool), gates[..., None], 0), axis=1)
    combine = dispatch * gate[..., None]
    first = jax.nn.one_hot(chosen[:, 0], experts, dtype=jnp.float32)
    aux = experts * jnp.sum(first.mean(axis=0) * probs.mean(axis=0))
    return Routing(dispatch, combine, taken, kept, aux, chosen)


@partial(jax.jit, static_argnames=("top_k", "slots"))
def route_groups(logits: jax.Array, top_k: int, slots: int) -> Routing:
    """`route` for each group of `logits` (groups x tokens x experts), the loss averaged;
    compiled once per shape when called eagerly (its scans would compile on every call)."""
    routing = jax.vmap(partial(route, top_k=top_k, slots=slots))(logits)
    return dataclasses.replace(routing, aux_loss=routing.aux_loss.mean())


def route_tokens(x: jax.Array, router: jax.Array, top_k: int, capacity_factor: float) -> Routing:
    """The routing of `x` (groups x tokens x d) by `router` (d x experts): float32 logits,
    each group on its own, with `capacity` slots per expert and group."""
    slots = capacity(x.shape[1], router.shape[1], top_k, capacity_factor)
    logits = jnp.einsum("gtd,de->gte", x.astype(jnp.float32), router)
    return route_groups(logits, top_k, slots)


def experts_forward(
    inputs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """Each expert's SwiGLU network on its slots: (..., experts, slots, d) -> same."""
    dtype = inputs.dtype
    gated = jnp.einsum("...ecd,edf->...ecf", inputs, gate.astype(dtype))
    hidden = jax.nn.silu(gated) * jnp.einsum("...ecd,edf->...ecf", inputs, up.astype(dtype))
    return jnp.einsum("...ecf,efd->...ecd", hidden, down.astype(dtype))


def dispatched(
    x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """The layer by dispatch and combine (x: groups x tokens x d): tokens gathered into their
    experts' slots, computed there, and summed back with their gates."""
    inputs = jnp.einsum("gtec,gtd->gecd", routing.dispatch.astype(x.dtype), x)
    if activation_axis("experts") is not None:  # expert parallelism by the rules
        # each group's slots where its tokens are, then moved to their experts' devices
        inputs = constrain(constrain(inputs, GROUPS), SLOTS)
    outputs = experts_forward(inputs, gate, up, down)
    if activation_axis("experts") is not None:
        outputs = constrain(constrain(outputs, SLOTS), GROUPS)
    return jnp.einsum("gtec,gecd->gtd", routing.combine.astype(x.dtype), outputs)


def dense_reference(
    x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """The same layer computed the slow, obvious way: every token through every expert,
    weighted by its gate where it was kept and by zero elsewhere."""
    gated = jnp.einsum("gtd,edf->gtef", x, gate.astype(x.dtype))
    hidden = jax.nn.silu(gated) * jnp.einsum("gtd,edf->gtef", x, up.astype(x.dtype))
    everything = jnp.einsum("gtef,efd->gted", hidden, down.astype(x.dtype))
    weights = routing.combine.sum(axis=-1).astype(x.dtype)
    return jnp.einsum("gte,gted->gtd", weights, everything)


class MoE(nnx.Module):
    """A mixture-of-experts feed-forward layer: a router and `experts` stacked SwiGLU MLPs
    (gate, up, down) whose parameters carry the logical axis `experts`."""

    def __init__(
        self,
        embed: int,
        mlp: int,
        experts: int,
        *,
        top_k: int = 1,
        capacity_factor: float = 2.0,
        rngs: nnx.Rngs,
    ) -> None:
        def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
            return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)

        self.router = nnx.Param(normal((embed, experts), embed), out_sharding=("embed", None))
        self.gate = nnx.Param(
            normal((experts, embed, mlp), embed), out_sharding=("experts", "embed", "mlp")
        )
        self.up = nnx.Param(
            normal((experts, embed, mlp), embed), out_sharding=("experts", "embed", "mlp")
        )
        self.down = nnx.Param(
            normal((experts, mlp, embed), mlp), out_sharding=("experts", "mlp", "embed")
        )
        self.top_k, self.capacity_factor = top_k, capacity_factor

    def routing(self, x: jax.Array) -> Routing:
        """The routing of `x` (groups x tokens x d), each group on its own."""
        return route_tokens(x, self.router[...], self.top_k, self.capacity_factor)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Routing]:
        """The layer's output for `x` (groups x tokens x d) and the routing that made it."""
        routing = self.routing(x)
        return dispatched(x, routing, *self.experts()), routing

    def experts(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The experts' gate, up and down matrices."""
        return self.gate[...], self.up[...], self.down[...]


def check_experts(experts: int, devices: int, axis: str) -> None:
    """Raise a clear error unless `devices` devices of `axis` split `experts` evenly."""
    if experts % devices:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise MoEError(
            f"{experts} experts cannot be split evenly over the {devices} devices of mesh axis "
            f"{axis!r}: use a number of experts that {devices} divides, or an axis of "
            f"{', '.join(map(str, divisors))} devices."
        )


def expert_parallel_local(
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    axis: str,
    top_k: int,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """The program one device runs inside `jax.shard_map`: route its own group of tokens,
    send each expert's slots to the device that holds the expert (all-to-all), compute its
    experts on every group's slots, send the results back (all-to-all), and combine."""
    routing = route_tokens(x, router, top_k, capacity_factor)
    (groups, _, experts, slots), d = routing.dispatch.shape, x.shape[-1]
    inputs = jnp.einsum("gtec,gtd->egcd", routing.dispatch.astype(x.dtype), x)
    inputs = inputs.reshape(experts, groups * slots, d)  # each expert's slots, every group
    inputs = jax.lax.all_to_all(inputs, axis, split_axis=0, concat_axis=1, tiled=True)
    outputs = experts_forward(inputs, gate, up, down)  # this device's experts, every device's slots
    outputs = jax.lax.all_to_all(outputs, axis, split_axis=1, concat_axis=0, tiled=True)
    outputs = outputs.reshape(experts, groups, slots, d)
    y = jnp.einsum("gtec,egcd->gtd", routing.combine.astype(x.dtype), outputs)
    return y, jax.lax.pmean(routing.aux_loss, axis)


def expert_parallel(
    moe: MoE, x: jax.Array, mesh: Mesh, axis: str = "expert"
) -> tuple[jax.Array, jax.Array]:
    """The MoE layer by hand with `jax.shard_map`: groups of tokens and experts both split
    over `axis`, one group per device. Returns the output and the load-balancing loss."""
    devices = mesh.shape[axis]
    check_experts(moe.up.shape[0], devices, axis)
    if x.shape[0] % devices:
        raise MoEError(
            f"{x.shape[0]} groups of tokens cannot be split over the {devices} devices of "
            f"{axis!r}: give a number of groups that {devices} divides."
        )
    body = partial(
        expert_parallel_local, axis=axis, top_k=moe.top_k, capacity_factor=moe.capacity_factor
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis), P(), P(axis), P(axis), P(axis)),
        out_specs=(P(axis), P()),
    )(x, moe.router[...], *moe.experts())
