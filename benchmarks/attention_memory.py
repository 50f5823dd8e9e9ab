"""How the book's model's compiled step grows with the sequence: no score matrix is held.

Run from the repository root: python benchmarks/attention_memory.py [--sequences 2]
Prints, for 1,024, 2,048 and 4,096 tokens, the compiled temporaries of the forward and
backward pass of the book's model (TINY) on one device, and of attention alone: the book's
blockwise kernel (`nnxscale.context.flash_attention`, grouped-query heads read in place)
beside `jax.nn.dot_product_attention` on the same heads repeated, which XLA's CPU backend
computes densely and whose backward keeps every score. Each row's growth is over the row
above; a doubling of the sequence should at most double what grows linearly. Compiled only:
the numbers are XLA's buffer assignment, not a run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from nnxscale import TINY, growth
from nnxscale.core.show import table
from nnxscale.model.context import flash_attention
from nnxscale.runtime.devices import FAST_COMPILE

LENGTHS = (1024, 2048, 4096)


def attention_temporaries(length: int, sequences: int, dense: bool) -> int:
    """Temporaries of attention's forward and backward pass at TINY's heads."""
    q = jax.ShapeDtypeStruct((sequences, length, TINY.heads, TINY.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((sequences, length, TINY.kv_heads, TINY.head_dim), jnp.float32)

    def attend(q, k, v):
        if not dense:
            return flash_attention(q, k, v)
        k, v = (jnp.repeat(x, TINY.groups, axis=2) for x in (k, v))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    grad = jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2))
    compiled = jax.jit(grad).lower(q, kv, kv).compile(FAST_COMPILE)
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=2)
    args = parser.parse_args()
    model = growth.step_temporaries(TINY, list(LENGTHS), args.sequences)
    columns = {
        "model step": model,
        "blockwise attention": {
            n: attention_temporaries(n, args.sequences, False) for n in LENGTHS
        },
        "dense attention": {n: attention_temporaries(n, args.sequences, True) for n in LENGTHS},
    }
    rows = []
    for i, n in enumerate(LENGTHS):
        row: list[object] = [f"{n:,}"]
        for found in columns.values():
            grown = "" if i == 0 else f"{found[n] / found[LENGTHS[i - 1]]:.2f}x"
            row += [f"{found[n] / 1e6:,.1f}", grown]
        rows.append(row)
    headers = ["tokens"] + [f"{name} {part}" for name in columns for part in ("(MB)", "growth")]
    print(f"{args.sequences} sequences, one device ({jax.devices()[0].platform})")
    print(table(headers, rows))


if __name__ == "__main__":
    main()
