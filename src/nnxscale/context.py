"""Context parallelism: attention over a sequence split across devices, by ring attention.

Each device holds a contiguous piece of every sequence's queries, keys and values (with the
zig-zag layout, two pieces: chunk i and chunk 2N-1-i, so that under a causal mask every device
does the same work). Queries stay put; the key/value blocks travel around the ring with
`ppermute`, one hop per step, and each device folds every block it sees into a running
softmax (its running maximum, sum and weighted values), so no device ever holds the whole
attention matrix: at most one (its queries x one block) at a time.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from nnxscale.layout import activation_axis

LAYOUTS = ("contiguous", "zigzag")


class ContextError(ValueError):
    """A sequence the context axis cannot split as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Ring:
    """A context-parallel ring: the mesh axis the sequence is split over, its size, and how
    the sequence's chunks are dealt to its devices (`LAYOUTS`)."""

    axis: str
    devices: int
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ContextError(f"unknown layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")

    def chunks(self) -> list[int]:
        """Which chunks of the sequence, in order, device 0, 1, ... holds: one chunk each
        (contiguous), or chunks i and 2N-1-i (zig-zag: an early, cheap chunk with a late one)."""
        n = self.devices
        if self.layout == "contiguous":
            return list(range(n))
        return [c for i in range(n) for c in (i, 2 * n - 1 - i)]

    def check(self, length: int) -> None:
        """Raise a clear error unless `length` tokens cut into the layout's equal chunks."""
        chunks = len(self.chunks())
        if length % chunks:
            raise ContextError(
                f"a sequence of {length} tokens cannot be cut into {chunks} equal chunks for "
                f"the {self.devices} devices of context axis {self.axis!r} ({self.layout} "
                f"layout): use a length that is a multiple of {chunks}, or a context axis "
                "whose size (times 2 for zig-zag) divides the length."
            )

    def positions(self, length: int) -> np.ndarray:
        """The token positions each device holds, shape (devices, length // devices)."""
        return self.order(length).reshape(self.devices, -1)

    def causal_work(self, length: int) -> list[int]:
        """Query-key pairs each device computes under a causal mask: equal across devices
        for the zig-zag layout, growing with the device for the contiguous one."""
        table = self.positions(length)
        keys = np.arange(length)[None, :]
        return [int((table[i][:, None] >= keys).sum()) for i in range(self.devices)]

    def order(self, length: int) -> np.ndarray:
        """The natural position of each place of the layout: the permutation `to_layout` applies."""
        self.check(length)
        chunks = np.arange(length).reshape(len(self.chunks()), -1)
        return chunks[self.chunks()].reshape(-1)


def to_layout(x: jax.Array, ring: Ring, axis: int = 1) -> jax.Array:
    """`x` with its sequence axis reordered so that splitting it evenly over the ring's devices
    gives each device its chunks (identity for the contiguous layout). One gather by a constant
    permutation: from a whole array each device takes its own chunks without communication."""
    return jnp.take(x, ring.order(x.shape[axis]), axis=axis)


def from_layout(x: jax.Array, ring: Ring, axis: int = 1) -> jax.Array:
    """The inverse of `to_layout`: the sequence back in its natural order."""
    return jnp.take(x, np.argsort(ring.order(x.shape[axis])), axis=axis)


def context_split(length: int, layout: str = "zigzag") -> Ring | None:
    """The ring the active rules split a sequence of `length` over (the mesh axis of the
    activations' `length`), checked to divide it; None when nothing splits it."""
    found = activation_axis("length")
    if found is None:
        return None
    ring = Ring(*found, layout=layout)
    ring.check(length)
    return ring


def _fold(carry, q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """One key/value block folded into the running softmax (max, sum, weighted values)."""
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
    q: jax.Array, k: jax.Array, v: jax.Array, *, ring: Ring, length: int, causal: bool = True
) -> jax.Array:
    """The program one device runs inside `jax.shard_map`: its queries against every key/value
    block, the blocks passed one hop around the ring N-1 times."""
    n = ring.devices
    me = jax.lax.axis_index(ring.axis)
    table = jnp.asarray(ring.positions(length))
    b, sq, h, d = q.shape
    carry = (
        jnp.full((b, h, sq), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, sq), jnp.float32),
        jnp.zeros((b, sq, h, d), jnp.float32),
    )
    hop = [(i, (i + 1) % n) for i in range(n)]
    scale = 1 / math.sqrt(d)
    for step in range(n):
        source = (me - step) % n  # whose block this device holds now
        carry = _fold(carry, q, k, v, table[me], table[source], causal, scale)
        if step < n - 1:
            k, v = jax.lax.ppermute((k, v), ring.axis, hop)
    _, total, o = carry
    return (o / total.transpose(0, 2, 1)[..., None]).astype(q.dtype)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    ring: Ring,
    *,
    spec: PartitionSpec | None = None,
    causal: bool = True,
) -> jax.Array:
    """Attention of (batch, length, heads, head_dim) arrays whose sequence is already in the
    ring's layout (`to_layout`) and split over its axis: how a model keeps them from layer to
    layer. `spec` may split batch and heads too (the sequence must be split over the ring's
    axis). The result is in the same layout and split."""
    ring.check(q.shape[1])
    spec = PartitionSpec(None, ring.axis) if spec is None else spec
    if len(spec) < 2 or spec[1] != ring.axis:
        raise ContextError(
            f"ring attention needs the sequence (dimension 1) split over {ring.axis!r}; the "
            f"spec {spec} splits it over {spec[1] if len(spec) > 1 else None!r}."
        )
    body = partial(ring_attention_local, ring=ring, length=q.shape[1], causal=causal)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)


def attention_in_order(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    ring: Ring,
    *,
    causal: bool = True,
) -> jax.Array:
    """`ring_attention` for arrays in their natural order: reordered into the layout and back
    (the reordering moves data between devices; a model does it once, at its input)."""
    moved = [to_layout(x, ring) for x in (q, k, v)]
    return from_layout(ring_attention(*moved, mesh, ring, causal=causal), ring)
