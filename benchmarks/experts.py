"""Dropless experts three ways, on whatever JAX finds: grouped products by blocks, by
`jax.lax.ragged_dot`, and GShard's one-hot dispatch at a capacity factor of 1.25.

Run from the repository root: python benchmarks/experts.py [--steps 7]
For one mixture layer's expert MLPs (SwiGLU), forward and backward, it prints per way the
matrix-product FLOPs of the compiled program (`nnxscale.hlo.dot_flops`, loops included) over
those of the tokens' k copies, and the median time with the TFLOP/s of the tokens' products.
On a CPU the layer is small and float32; on an accelerator it is a Mixtral 8x7B layer (8
experts of 4,096 x 14,336, k = 2) in bfloat16, at 4,096 and 16,384 tokens. The tokens are
spread evenly over the experts. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from nnxscale.analysis.hlo import dot_flops
from nnxscale.core.show import table
from nnxscale.model.dropless import blocks, grouped_swiglu

SMALL = (8, 2, 64, 256, (1024, 4096), "float32", 8)
MIXTRAL = (8, 2, 4096, 14336, (4096, 16384), "bfloat16", 512)
"""The layers timed on a CPU and on an accelerator: experts, k, width, hidden units, token
counts, dtype and block rows."""
CAPACITY = 1.25


def ways(experts: int, top_k: int, tokens: int, block: int) -> dict[str, object]:
    """The three ways, each a function of (its input, its routing, gate, up, down), its
    routing (passed in, not closed over, so that XLA folds none of it) and its input's
    shape."""
    copies = tokens * top_k
    sizes = jnp.full((experts,), copies // experts, jnp.int32)
    n = blocks(copies, experts, block)
    owner = jnp.minimum(jnp.arange(n) * block // (copies // experts), experts - 1)
    group = 4096 if tokens % 4096 == 0 else tokens
    slots = int(CAPACITY * top_k * group / experts)
    dispatch = (
        jax.nn.one_hot(
            jnp.arange(group * top_k).reshape(group, top_k) % (experts * slots), experts * slots
        )
        .sum(1)
        .reshape(group, experts, slots)
    )

    def ragged(x, sizes, g, u, d):
        hidden = jax.nn.silu(jax.lax.ragged_dot(x, g, sizes)) * jax.lax.ragged_dot(x, u, sizes)
        return jax.lax.ragged_dot(hidden, d, sizes)

    def gshard(x, dispatch, g, u, d):
        into = jnp.einsum("tec,gtd->gecd", dispatch.astype(x.dtype), x)
        hidden = jax.nn.silu(jnp.einsum("gecd,edf->gecf", into, g))
        hidden = hidden * jnp.einsum("gecd,edf->gecf", into, u)
        out = jnp.einsum("gecf,efd->gecd", hidden, d)
        return jnp.einsum("tec,gecd->gtd", dispatch.astype(x.dtype), out)

    return {
        "blocks (the book's)": (grouped_swiglu, owner, (n, block)),
        "jax.lax.ragged_dot": (ragged, sizes, (copies,)),
        f"GShard, capacity {CAPACITY}": (gshard, dispatch, (tokens // group, group)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    device = jax.devices()[0]
    cpu = device.platform == "cpu"
    experts, top_k, d, f, counts, dtype, block = SMALL if cpu else MIXTRAL
    print(f"# {device.device_kind}, jax {jax.__version__}: {experts} experts of {d} x {f}, "
          f"k = {top_k}, {dtype}, forward and backward\n")  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(experts, d, f), (experts, d, f), (experts, f, d)]
    w = [jax.random.normal(k, s, dtype) / s[1] ** 0.5 for k, s in zip(keys, shapes, strict=False)]
    rows = []
    for tokens in counts:
        ideal = 3 * 3 * 2 * tokens * top_k * d * f  # three products, forward and backward
        for name, (fn, routing, shape) in ways(experts, top_k, tokens, block).items():
            x = jax.random.normal(keys[3], (*shape, d), dtype)
            probe = jax.random.normal(keys[0], (*shape, d), dtype)  # a cotangent, not all ones

            def loss(x, r, g, u, d, probe, fn=fn):
                return jnp.vdot(fn(x, r, g, u, d), probe).astype(jnp.float32)

            step = jax.jit(jax.value_and_grad(loss, (0, 2, 3, 4)))
            compiled = step.lower(x, routing, *w, probe).compile()
            counted = "ragged-dot" not in compiled.as_text()  # a kernel dot_flops cannot read
            share = f"{dot_flops(compiled) / ideal:.2f}" if counted else "(a ragged-dot kernel)"
            jax.block_until_ready(step(x, routing, *w, probe))
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(step(x, routing, *w, probe))
                times.append(time.perf_counter() - start)
            seconds = sorted(times)[args.steps // 2]
            rows.append([f"{tokens:,}", name, share, f"{1e3 * seconds:,.2f}",
                         f"{ideal / seconds / 1e12:,.3f}"])  # fmt: skip
    columns = ["tokens", "way", "compiled products / the copies'", "ms", "TFLOP/s of the copies"]
    print(table(columns, rows))


if __name__ == "__main__":
    main()
