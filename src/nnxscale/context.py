"""Context parallelism: attention over a sequence split across devices, by ring attention.

Each device holds a contiguous piece of every sequence's queries, keys and values (with the
zig-zag layout, two pieces: chunk i and chunk 2N-1-i, so that under a causal mask every device
does the same work). Queries stay put; the key/value blocks travel around the ring with
`ppermute`, one hop per step, and each device folds every block it sees into a running
softmax (its running maximum, sum and weighted values), so no device ever holds the whole
attention matrix: at most one (its queries x one block) at a time.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

LAYOUTS = ("contiguous", "zigzag")


class ContextError(ValueError):
    """A sequence the context axis cannot split as asked; the message names the fix."""


def chunk_order(devices: int, layout: str) -> list[int]:
    """Which chunks of the sequence, in order, device 0, 1, ... holds: one chunk each
    (contiguous), or chunks i and 2N-1-i (zig-zag: the early, cheap chunk with a late one)."""
    if layout == "contiguous":
        return list(range(devices))
    if layout == "zigzag":
        return [c for i in range(devices) for c in (i, 2 * devices - 1 - i)]
    raise ContextError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")


def check_length(length: int, devices: int, layout: str) -> None:
    """Raise a clear error unless `length` tokens split into the layout's chunks."""
    chunks = len(chunk_order(devices, layout))
    if length % chunks:
        raise ContextError(
            f"a sequence of {length} tokens cannot be cut into {chunks} equal chunks for "
            f"{devices} devices ({layout} layout): use a length that is a multiple of "
            f"{chunks}, or a context axis whose size divides it."
        )


def to_layout(x: jax.Array, devices: int, layout: str, axis: int = 1) -> jax.Array:
    """`x` with its sequence axis reordered so that splitting it evenly over the devices gives
    each device its chunks (identity for the contiguous layout)."""
    check_length(x.shape[axis], devices, layout)
    order = chunk_order(devices, layout)
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def from_layout(x: jax.Array, devices: int, layout: str, axis: int = 1) -> jax.Array:
    """The inverse of `to_layout`: the sequence back in its natural order."""
    order = chunk_order(devices, layout)
    chunks = jnp.split(x, len(order), axis=axis)
    natural = [None] * len(order)
    for position, chunk in zip(order, chunks, strict=True):
        natural[position] = chunk
    return jnp.concatenate(natural, axis=axis)


def positions(devices: int, length: int, layout: str) -> jax.Array:
    """The token positions each device holds, shape (devices, length // devices)."""
    return to_layout(jnp.arange(length)[None], devices, layout).reshape(devices, -1)


def causal_work(devices: int, length: int, layout: str) -> list[int]:
    """Query-key pairs each device computes under a causal mask (pairs its blocks would
    skip entirely count as skipped): equal across devices for the zig-zag layout."""
    table = positions(devices, length, layout)
    return [int((table[i][:, None] >= jnp.arange(length)[None, :]).sum()) for i in range(devices)]


def _fold(carry, q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """One block folded into the running softmax (max, sum, weighted values)."""
    m, total, o = carry
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if causal:
        visible = q_pos[:, None] >= k_pos[None, :]
        scores = jnp.where(visible[None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - safe[..., None])
    correction = jnp.exp(m - safe)
    total = total * correction + p.sum(axis=-1)
    o = o * correction.transpose(0, 2, 1)[..., None] + jnp.einsum(
        "bhqk,bkhd->bqhd", p.astype(v.dtype), v
    ).astype(jnp.float32)
    return m_new, total, o


def ring_attention_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str,
    devices: int,
    length: int,
    layout: str = "zigzag",
    causal: bool = True,
) -> jax.Array:
    """The program one device runs inside `jax.shard_map`: its queries against every key/value
    block, the blocks passed one hop around the ring N-1 times."""
    me = jax.lax.axis_index(axis)
    table = positions(devices, length, layout)
    q_pos = table[me]
    b, sq, h, d = q.shape
    carry = (
        jnp.full((b, h, sq), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, sq), jnp.float32),
        jnp.zeros((b, sq, h, d), jnp.float32),
    )
    ring = [(i, (i + 1) % devices) for i in range(devices)]
    scale = 1 / math.sqrt(d)
    for step in range(devices):
        source = (me - step) % devices  # whose block this device holds now
        carry = _fold(carry, q, k, v, q_pos, table[source], causal, scale)
        if step < devices - 1:
            k, v = jax.lax.ppermute((k, v), axis, ring)
    _, total, o = carry
    return (o / total.transpose(0, 2, 1)[..., None]).astype(q.dtype)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    *,
    axis: str = "context",
    layout: str = "zigzag",
    causal: bool = True,
) -> jax.Array:
    """Attention of (batch, length, heads, head_dim) arrays whose sequence is already in the
    layout (`to_layout`) and split over `axis` of `mesh`: how a model keeps them from layer to
    layer. The result is in the same layout and split."""
    devices = mesh.shape[axis]
    check_length(q.shape[1], devices, layout)
    body = partial(
        ring_attention_local,
        axis=axis,
        devices=devices,
        length=q.shape[1],
        layout=layout,
        causal=causal,
    )
    spec = P(None, axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)


def attention_in_order(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    *,
    axis: str = "context",
    layout: str = "zigzag",
    causal: bool = True,
) -> jax.Array:
    """`ring_attention` for arrays in their natural order: reordered into the layout and back
    (the reordering moves data between devices; a model does it once, at its input)."""
    devices = mesh.shape[axis]
    moved = [to_layout(x, devices, layout) for x in (q, k, v)]
    out = ring_attention(*moved, mesh, axis=axis, layout=layout, causal=causal)
    return from_layout(out, devices, layout)
