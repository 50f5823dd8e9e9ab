"""Communication hidden behind compute: a collective matmul, and what the compiled program
says about which transfers may overlap which products.

`collective_matmul` computes `all_gather(x) @ w` without the all-gather: the rows of `x` go
round the ring one block per step with `ppermute`, and each step multiplies the block in
hand while the next one travels (Wang et al., 2023, and the scaling book's chapter on
sharded matrix multiplication). `independent_pairs` reads off the compiled program that no
product waits for the transfer beside it, and `async_pairs` which collectives the backend
split into a start and a done with work scheduled between them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnxscale.analysis.program import Program
from nnxscale.profiling.profiles import COLLECTIVES, Cost, costs

_DEFINED = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


def _ring(n: int) -> list[tuple[int, int]]:
    """Each device sends to the next one round the ring."""
    return [(i, (i + 1) % n) for i in range(n)]


def held_block(device: int | jax.Array, step: int, n: int) -> int | jax.Array:
    """Whose rows `device` holds at `step` of the collective matmul's ring of `n`: each
    step every device passes its block on to device + 1, so it holds device - step's."""
    return (device - step) % n


def collective_matmul_block(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """Inside `shard_map`: this device's columns of `all_gather(x, axis) @ w`, computed in
    N steps. At step s the device holds the rows that device i - s started with: it sends
    them on to device i + 1 and multiplies them, and the two do not depend on each other."""
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    rows = x.shape[0]
    out = jnp.zeros((n * rows, w.shape[1]), jnp.result_type(x, w))
    block = x
    for step in range(n):
        following = jax.lax.ppermute(block, axis, _ring(n)) if step < n - 1 else None
        owner = held_block(i, step, n)
        out = jax.lax.dynamic_update_slice_in_dim(out, block @ w, owner * rows, axis=0)
        block = following
    return out


def gathered_matmul_block(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """Inside `shard_map`: the same columns the plain way, gather every row, then multiply."""
    return jax.lax.all_gather(x, axis, tiled=True) @ w


def _sharded(block: Callable[..., jax.Array], mesh: Mesh, axis: str) -> Callable[..., jax.Array]:
    """`block` as a function of whole arrays: `x` split by rows over `axis`, `w` by columns,
    the result by columns."""
    body = functools.partial(block, axis=axis)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis)
    )
    return jax.jit(mapped)


def collective_matmul(mesh: Mesh, axis: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`x @ w` for `x` split by rows and `w` by columns over `axis` of `mesh`, as a
    collective matmul: N - 1 ring steps of `ppermute`, each beside a product."""
    return _sharded(collective_matmul_block, mesh, axis)


def gathered_matmul(mesh: Mesh, axis: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`x @ w` for the same layout by an all-gather of `x`, then one product."""
    return _sharded(gathered_matmul_block, mesh, axis)


def _reaches(read: Program, computation: str, source: str, target: str) -> bool:
    """Whether `target` uses `source`'s result, directly or through other instructions."""
    graph = read.computations[computation]
    seen, todo = set(), [source]
    while todo:
        name = todo.pop()
        if name == target:
            return True
        if name not in seen:
            seen.add(name)
            todo += [u for u in graph[name].users if u in graph]
    return False


@dataclass(frozen=True)
class Beside:
    """A transfer and a product of the same block that neither waits for the other."""

    transfer: str
    product: str


def independent_pairs(program: object) -> list[Beside]:
    """Every (collective-permute, matrix product) of the compiled program that read the
    same block and do not depend on each other: the product needs not wait for the send,
    nor the send for the product, so a backend may run them at once."""
    read = Program.of(program)
    table: dict[str, Cost] = costs(program)
    found = []
    for name, computation in read.computations.items():
        for ins in computation.values():
            if not ins.opcode.startswith("collective-permute") or ins.opcode.endswith("-done"):
                continue
            block = ins.operands[0]
            for user in computation[block].users:
                cost = table.get(user)
                if cost is None or cost.kind != "matmul":
                    continue
                if not _reaches(read, name, ins.name, user) and not _reaches(
                    read, name, user, ins.name
                ):
                    found.append(Beside(ins.name, user))
    return found


@dataclass(frozen=True)
class Async:
    """A collective split into a start and a done, with the ops scheduled between them."""

    start: str
    done: str
    between: tuple[str, ...]


def async_pairs(program: object) -> list[Async]:
    """The collectives the backend compiled as an asynchronous start/done pair, each with
    the instructions its schedule places between the two (the work that can hide it), in
    the order the program's text lists them, which is its schedule. XLA's latency-hiding
    scheduler makes these on GPU and TPU; the CPU backend runs collectives synchronously."""
    text = program if isinstance(program, str) else program.as_text()
    line = {}
    for k, row in enumerate(text.splitlines()):
        name = _DEFINED.match(row)
        if name:
            line.setdefault(name.group(1), k)
    read = Program.of(program)
    found = []
    for computation in read.computations.values():
        order = sorted((n for n in computation if n in line), key=line.__getitem__)
        for name in order:
            ins = computation[name]
            base = ins.opcode.removesuffix("-start")
            if not ins.opcode.endswith("-start") or base not in COLLECTIVES:
                continue
            done = next((u for u in ins.users if computation[u].opcode == f"{base}-done"), None)
            if done in line:
                between = order[order.index(name) + 1 : order.index(done)]
                found.append(Async(name, done, tuple(between)))
    return found
