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
import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscale.placement.constraints import activation_axis
from nnxscale.placement.mesh import make_mesh

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

    def permutation(self) -> list[tuple[int, int]]:
        """The (source, destination) pairs of one hop around the ring: each device sends the
        K/V shard it holds to the next one. The kernel's `ppermute` sends exactly these."""
        return [(i, (i + 1) % self.devices) for i in range(self.devices)]

    def holding(self, step: int) -> list[int]:
        """Whose K/V shard each device holds at ring step `step` (device i holds i - step's):
        the permutation applied `step` times to the devices' own shards."""
        held = list(range(self.devices))
        for _ in range(step):
            moved = held[:]
            for source, destination in self.permutation():
                moved[destination] = held[source]
            held = moved
        return held

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


BLOCK = 512
"""The most query and key tokens the kernel scores at once: with `block` tokens a block
pair's scores are b x H x block^2 float32 values whatever the sequence's length."""


def default_block(chunk: int) -> int:
    """The largest divisor of `chunk` (the tokens of one chunk of the layout) up to `BLOCK`."""
    return max(d for d in range(1, min(chunk, BLOCK) + 1) if chunk % d == 0)


def _check_block(ring: Ring, length: int, block: int) -> None:
    """Raise a clear error unless `block` tokens cut every chunk of the layout evenly."""
    chunk = length // len(ring.chunks())
    if block < 1 or chunk % block:
        raise ContextError(
            f"blocks of {block} tokens do not cut the chunks of {chunk} tokens that a "
            f"sequence of {length} has in the {ring.layout} layout over {ring.devices} devices: "
            f"use a block that divides {chunk}, such as {default_block(chunk)} (the default)."
        )


@functools.cache
def schedule(ring: Ring, length: int, block: int, causal: bool) -> tuple[np.ndarray, ...]:
    """The block pairs each device scores at each ring step: for step t an int array of shape
    (devices, pairs, 2) holding (query block, key block) indices into the device's own queries
    and the keys it holds at t (those of device me - t).

    Every device runs one program, so at each step every device scores as many pairs as the
    busiest one, and every step after the first as many as the busiest of them (one loop runs
    them; in the zig-zag and contiguous layouts those steps all need as many). A device's
    pairs that it does not need (wholly above the diagonal: every key after every query, so
    masked to nothing) fill its list up to that count."""
    ring.check(length)
    _check_block(ring, length, block)
    n = ring.devices
    starts = ring.positions(length)[:, ::block]  # (devices, blocks): each block's first token
    blocks = starts.shape[1]
    needed = [
        (np.bool_(not causal) | (starts[:, :, None] + block - 1 >= held[:, None, :])).reshape(n, -1)
        for held in (starts[ring.holding(t)] for t in range(n))  # me holds me - t's keys
    ]
    counts = [int(need.sum(axis=1).max()) for need in needed]  # the busiest device's pairs
    widths = [counts[0]] + [max(counts[1:], default=0)] * (n - 1)
    return tuple(
        np.stack(np.divmod(np.argsort(~need, axis=1, kind="stable")[:, :w], blocks), -1).astype(
            np.int32
        )  # needed pairs first
        for need, w in zip(needed, widths, strict=True)
    )


def scored_pairs(ring: Ring, length: int, block: int, causal: bool) -> int:
    """Query-key pairs each device scores in one pass of the kernel (the same on every
    device): block^2 per scheduled block pair, masked or not."""
    return sum(s.shape[1] for s in schedule(ring, length, block, causal)) * block * block


def _scores(q, k, q_pos, k_pos, causal: bool, scale: float) -> jax.Array:
    """Float32 scores (b, KV, G, queries, keys) of one block pair of grouped queries
    (b, queries, KV, G, D) and keys (b, keys, KV, D), -inf where the mask hides a key."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        s = jnp.where((q_pos[:, None] >= k_pos[None, :])[None, None, None], s, -jnp.inf)
    return s


def grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """Queries (b, s, H, D) as (b, s, KV, G, D): the G = H / KV query heads that share each
    key/value head side by side (head h reads key/value head h // G)."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def _rows(x: jax.Array, start: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, block, axis)


def _put(x: jax.Array, rows: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, rows, start, axis)


def _filled(shape: tuple[int, ...], value: float, like: jax.Array) -> jax.Array:
    """A float32 array of `value` that varies over the same mesh axes as `like` (a loop's
    carry inside `jax.shard_map` must keep its type)."""
    return jnp.full_like(like, value, dtype=jnp.float32, shape=shape)


def _loop(width: int, body, state):
    """`body(i, state)` for i in range(width): a loop, or one call where there is one block
    pair (a short sequence), which leaves no loop in the program."""
    return body(0, state) if width == 1 else jax.lax.fori_loop(0, width, body, state)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One device's blockwise attention over the ring: the ring, the whole length, the mask
    and the tokens scored at once."""

    ring: Ring
    length: int
    causal: bool
    block: int

    def hop(self, x):
        """`x` from each device to the next one around the ring."""
        return jax.lax.ppermute(x, self.ring.axis, self.ring.permutation())

    def around(self, state, held, fold):
        """`fold(state, held, pair_at, width, q_pos, k_pos)` at every ring step: `width`
        block pairs, the i-th read by `pair_at(i)` from the schedule, `held` (the K/V shard
        and what travels with it) passed one hop on after each step but the last. The steps
        between the first and the last run as one loop, so the compiler keeps at most the
        held shard and the one arriving, whatever the ring's size; the schedule stays a
        constant of the program, read two indices at a time."""
        n = self.ring.devices
        me = jax.lax.axis_index(self.ring.axis) if n > 1 else 0
        table = jnp.asarray(self.ring.positions(self.length))
        steps = schedule(self.ring, self.length, self.block, self.causal)

        def visit(carry, t, pair_at, width, last=False):
            state, held = carry
            state, held = fold(state, held, pair_at, width, table[me], table[(me - t) % n])
            return (state, held if last else self.hop(held)), None

        first = jnp.asarray(steps[0])
        carry, _ = visit((state, held), 0, lambda i: first[me, i], first.shape[1], n == 1)
        if n > 2:
            middle = jnp.asarray(np.stack(steps[1:-1]))  # (steps, devices, pairs, 2)

            def step(carry, t):
                return visit(carry, t, lambda i: middle[t - 1, me, i], middle.shape[2])

            carry, _ = jax.lax.scan(step, carry, jnp.arange(1, n - 1))
        if n > 1:
            final = jnp.asarray(steps[-1])
            carry, _ = visit(carry, n - 1, lambda i: final[me, i], final.shape[1], True)
        return carry

    def forward(self, q, k, v):
        """Queries against every key/value block as the blocks travel the ring, one block pair
        at a time into a running softmax; the output and each query's log-sum-exp. Queries
        come grouped by the key/value head they read (`grouped`)."""
        bl, b, sq, kv, g, d = self.block, *q.shape
        scale = 1 / math.sqrt(d)

        def fold(state, held, pair_at, width, q_pos, k_pos):
            k, v = held

            def pair(i, state):
                ij = pair_at(i)
                m, total, o = state
                qs, ks = ij[0] * bl, ij[1] * bl
                s = _scores(_rows(q, qs, bl, 1), _rows(k, ks, bl, 1), _rows(q_pos, qs, bl, 0),
                            _rows(k_pos, ks, bl, 0), self.causal, scale)  # fmt: skip
                m_old, total_old = _rows(m, qs, bl, 3), _rows(total, qs, bl, 3)
                m_new = jnp.maximum(m_old, s.max(axis=-1))
                safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - safe[..., None])
                correction = jnp.exp(m_old - safe)
                pv = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), _rows(v, ks, bl, 1),
                                preferred_element_type=jnp.float32)  # fmt: skip
                rows = _rows(o, qs, bl, 1) * correction.transpose(0, 3, 1, 2)[..., None] + pv
                return (
                    _put(m, m_new, qs, 3),
                    _put(total, total_old * correction + p.sum(axis=-1), qs, 3),
                    _put(o, rows, qs, 1),
                )

            return _loop(width, pair, state), held

        start = (
            _filled((b, kv, g, sq), -jnp.inf, q),
            _filled((b, kv, g, sq), 0.0, q),
            _filled(q.shape, 0.0, q),
        )
        (m, total, o), _ = self.around(start, (k, v), fold)
        out = (o / total.transpose(0, 3, 1, 2)[..., None]).astype(q.dtype)
        return out, m + jnp.log(total)

    def backward(self, q, k, v, out, lse, d_out):
        """The gradients, each block pair's probabilities recomputed from the saved
        log-sum-exp: the key/value blocks travel the ring again, their gradients with them,
        and one last hop takes each block's gradient home."""
        bl = self.block
        scale = 1 / math.sqrt(q.shape[-1])
        # the scores are computed again here, not read from the forward pass: a barrier on
        # the queries keeps the compiler from merging the two (which would keep the scores
        # between the passes); the keys' first hop may still be shared with the forward's
        q = jax.lax.optimization_barrier(q)
        delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

        def fold(dq, held, pair_at, width, q_pos, k_pos):
            k, v, dk_arrived, dv_arrived = held

            def pair(i, carry):
                dq, dk, dv = carry
                ij = pair_at(i)
                qs, ks = ij[0] * bl, ij[1] * bl
                q_b, k_b, v_b = _rows(q, qs, bl, 1), _rows(k, ks, bl, 1), _rows(v, ks, bl, 1)
                do_b = _rows(d_out, qs, bl, 1)
                s = _scores(q_b, k_b, _rows(q_pos, qs, bl, 0), _rows(k_pos, ks, bl, 0),
                            self.causal, scale)  # fmt: skip
                p = jnp.exp(s - _rows(lse, qs, bl, 3)[..., None])
                dv_b = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do_b.dtype), do_b,
                                  preferred_element_type=jnp.float32)  # fmt: skip
                dp = jnp.einsum("bqkgd,bskd->bkgqs", do_b, v_b, preferred_element_type=jnp.float32)
                ds = (p * (dp - _rows(delta, qs, bl, 3)[..., None]) * scale).astype(q.dtype)
                dq_b = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_b, preferred_element_type=jnp.float32)
                dk_b = jnp.einsum("bkgqs,bqkgd->bskd", ds, q_b, preferred_element_type=jnp.float32)
                dq = _put(dq, _rows(dq, qs, bl, 1) + dq_b, qs, 1)
                dk = _put(dk, _rows(dk, ks, bl, 1) + dk_b, ks, 1)
                dv = _put(dv, _rows(dv, ks, bl, 1) + dv_b, ks, 1)
                return dq, dk, dv

            # this step's gradients start from zero, and the sums that arrived are added only
            # at the end: the hop of the previous step's sums overlaps this step's compute
            fresh = (_filled(k.shape, 0.0, k), _filled(v.shape, 0.0, v))
            dq, dk, dv = _loop(width, pair, (dq, *fresh))
            return dq, (k, v, dk_arrived + dk, dv_arrived + dv)

        zeros = [_filled(x.shape, 0.0, x) for x in (q, k, v)]
        dq, (_, _, dk, dv) = self.around(zeros[0], (k, v, *zeros[1:]), fold)
        if self.ring.devices > 1:
            dk, dv = self.hop((dk, dv))  # each block's gradient one more hop, to its owner
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.cache
def _attend(kernel: _Kernel, autodiff: bool):
    """The kernel as one device's differentiable function: with a custom VJP that keeps only
    q, k, v, the output and the log-sum-exp, or (`autodiff`) differentiated by JAX through the
    forward's loops, which keeps every block pair's probabilities."""

    def run(q, k, v):
        return kernel.forward(grouped(q, k.shape[2]), k, v)[0].reshape(q.shape)

    if autodiff:
        return run

    @jax.custom_vjp
    def attend(q, k, v):
        return run(q, k, v)

    def forward(q, k, v):
        q = grouped(q, k.shape[2])
        out, lse = kernel.forward(q, k, v)
        return out.reshape(*q.shape[:2], -1, q.shape[-1]), (q, k, v, out, lse)

    def backward(saved, d_out):
        q, out = saved[0], saved[3]
        dq, dk, dv = kernel.backward(*saved, d_out.reshape(out.shape))
        return dq.reshape(*q.shape[:2], -1, q.shape[-1]), dk, dv

    attend.defvjp(forward, backward)
    return attend


def ring_attention_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    ring: Ring,
    length: int,
    causal: bool = True,
    block: int | None = None,
    autodiff: bool = False,
) -> jax.Array:
    """The program one device runs inside `jax.shard_map`: its queries against every key/value
    block, the blocks passed one hop around the ring N-1 times, `block` tokens at a time."""
    chunk = length // len(ring.chunks())
    kernel = _Kernel(ring, length, causal, block or default_block(chunk))
    return _attend(kernel, autodiff)(q, k, v)


def _check_inputs(q, k, v, mesh: Mesh, ring: Ring, spec: PartitionSpec) -> None:
    """Raise a clear error, naming the fix, for arrays or a split the kernel cannot take."""
    _check_heads(q, k, v)
    if mesh.shape.get(ring.axis) != ring.devices:
        raise ContextError(
            f"the ring has {ring.devices} devices but the mesh's axis {ring.axis!r} has "
            f"{mesh.shape.get(ring.axis, 'no')} devices: build the Ring from the mesh, "
            f"Ring({ring.axis!r}, mesh.shape[{ring.axis!r}])."
        )
    if len(spec) < 2 or spec[1] != ring.axis:
        raise ContextError(
            f"ring attention needs the sequence (dimension 1) split over {ring.axis!r}; the "
            f"spec {spec} splits it over {spec[1] if len(spec) > 1 else None!r}."
        )
    names = ("batch", "length", "heads", "head_dim")
    for dim, (name, size) in enumerate(zip(names, q.shape[:2] + k.shape[2:], strict=True)):
        axes = spec[dim] if dim < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        split = math.prod(mesh.shape[a] for a in axes)
        if size % split:
            name = "key/value heads" if name == "heads" else name
            raise ContextError(
                f"the {name} ({size}) does not divide over mesh axes {axes} ({split} "
                f"devices): use a {name} that is a multiple of {split}, or leave it whole."
            )


def _check_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Raise a clear error unless queries (b, s, H, D) and keys and values (b, s, KV, D) fit
    grouped-query attention: KV dividing H."""
    if (
        q.ndim != 4
        or k.shape != v.shape
        or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]
        or q.shape[2] % k.shape[2]
    ):
        raise ContextError(
            "attention takes queries (batch, length, heads, head_dim) and keys and values of "
            "one shape (batch, length, kv_heads, head_dim), kv_heads dividing heads; got "
            f"{q.shape}, {k.shape} and {v.shape}."
        )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    block: int | None = None,
    autodiff: bool = False,
) -> jax.Array:
    """Blockwise (flash-style) attention of queries (b, s, H, D) over keys and values
    (b, s, KV, D), KV dividing H (grouped-query attention), on one device's arrays: the ring
    kernel with a ring of one device. It scores `block` tokens against `block` (at most
    `BLOCK`), skips the block pairs a causal mask hides, and with its custom VJP keeps only
    q, k, v, the output and the log-sum-exp, so no step holds the whole score matrix. A
    causal sequence that `block` does not divide is padded with keys no query sees."""
    _check_heads(q, k, v)
    length = q.shape[1]
    block = block or min(length, BLOCK)
    if not causal and length % block:
        block = default_block(length)
    padded = -(-length // block) * block
    if padded != length:
        q, k, v = (jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0))) for x in (q, k, v))
    kernel = _Kernel(Ring("", 1, "contiguous"), padded, causal, block)
    return _attend(kernel, autodiff)(q, k, v)[:, :length]


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    ring: Ring,
    *,
    spec: PartitionSpec | None = None,
    causal: bool = True,
    block: int | None = None,
    autodiff: bool = False,
) -> jax.Array:
    """Attention of (batch, length, heads, head_dim) arrays whose sequence is already in the
    ring's layout (`to_layout`) and split over its axis: how a model keeps them from layer to
    layer. `spec` may split batch and heads too (the sequence must be split over the ring's
    axis). The result is in the same layout and split. `block` sets the tokens scored at once
    (`default_block`); `autodiff` differentiates the loops instead of the custom VJP, to
    measure what the custom VJP saves."""
    spec = PartitionSpec(None, ring.axis) if spec is None else spec
    _check_inputs(q, k, v, mesh, ring, spec)
    ring.check(q.shape[1])
    if block is not None:
        _check_block(ring, q.shape[1], block)
    body = partial(
        ring_attention_local,
        ring=ring,
        length=q.shape[1],
        causal=causal,
        block=block,
        autodiff=autodiff,
    )
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)


def compiled_attention(
    devices: int,
    length: int,
    *,
    heads: int = 2,
    head_dim: int = 16,
    block: int | None = None,
    causal: bool = True,
    grad: bool = True,
    autodiff: bool = False,
    dense: bool = False,
    compiler_options: dict[str, object] | None = None,
) -> jax.stages.Compiled:
    """The compiled attention of one float32 sequence of `length` tokens split over a zig-zag
    ring of the first `devices` devices, forward and backward (`grad`), compiled only: what
    the chapter reads its memory and FLOPs from. `dense` compiles
    `jax.nn.dot_product_attention` instead, on one device; `compiler_options` go to XLA
    (`nnxscale.devices.FAST_COMPILE` compiles faster)."""
    mesh = make_mesh((devices,), ("context",), devices=jax.devices()[:devices])
    ring = Ring("context", devices)
    split = NamedSharding(mesh, PartitionSpec(None, "context"))
    x = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32, sharding=split)

    def attend(q, k, v):
        if dense:
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        return ring_attention(q, k, v, mesh, ring, causal=causal, block=block, autodiff=autodiff)

    program = jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2)) if grad else attend
    return jax.jit(program).lower(x, x, x).compile(compiler_options)


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
