"""Training data that needs no network, batched per step and placed on the data axes.

The corpus is generated: lines of integer arithmetic such as `37+5=42;`, character by
character. The format is learnt in a few steps and the sums more slowly, so the loss falls
visibly within the few dozen steps a chapter can afford. Batch `step` is a pure function of
(seed, step) and each of its rows of (seed, step, row), so a run resumed at step k sees
exactly the batches the uninterrupted run saw, and a process can build just its own rows.
"""

from __future__ import annotations

import hashlib
import math

import jax
import numpy as np
from jax.sharding import NamedSharding

VOCAB = 128  # ASCII


def arithmetic_text(lines: int, seed: int = 0) -> str:
    """`lines` lines of two-operand integer arithmetic and their results, from a seeded RNG."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 100, (2, lines))
    plus = rng.random(lines) < 0.5
    return "".join(
        f"{x}+{y}={x + y};" if p else f"{x}-{y}={x - y};"
        for x, y, p in zip(a.tolist(), b.tolist(), plus.tolist(), strict=True)
    )


def encode(text: str) -> np.ndarray:
    """Token ids of ASCII text (the character codes)."""
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int32)


def decode(tokens: np.ndarray) -> str:
    """ASCII text of token ids."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("ascii")


class Batches:
    """Windows of `length + 1` tokens (inputs and next-token targets), chosen per step and row."""

    def __init__(self, tokens: np.ndarray, batch_size: int, length: int, seed: int = 0) -> None:
        for name, value in (("batch_size", batch_size), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name}={value!r}: it must be a whole number, 1 or more.")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens of shape {tokens.shape} and dtype {tokens.dtype}: pass the corpus as "
                "one flat array of integer token ids (encode() gives one from text)."
            )
        if len(tokens) < length + 2:
            raise ValueError(f"a corpus of {len(tokens)} tokens is too short for length {length}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.length = length
        self.seed = seed

    def describe(self) -> dict[str, int | str]:
        """What fixes every batch: corpus fingerprint, seed and shapes (recorded in checkpoints)."""
        return {
            "corpus_tokens": len(self.tokens),
            "corpus_sha256": hashlib.sha256(
                np.ascontiguousarray(self.tokens).tobytes()
            ).hexdigest(),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "length": self.length,
        }

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows `start:stop` of batch `step`, built without building the others."""
        stop = self.batch_size if stop is None else stop
        windows = []
        for row in range(start, stop):
            rng = np.random.default_rng((self.seed, step, row))
            first = int(rng.integers(0, len(self.tokens) - self.length - 1))
            windows.append(self.tokens[first : first + self.length + 1])
        return np.stack(windows)

    def __call__(self, step: int, sharding: NamedSharding) -> jax.Array:
        """Batch `step` on the mesh; this process builds only the rows its devices hold."""
        shape = (self.batch_size, self.length + 1)
        check_batch_splits(self.batch_size, sharding)
        start, stop = self.local_rows(sharding)
        local = self.rows(step, start, stop)
        return jax.make_array_from_process_local_data(sharding, local, shape)

    def local_rows(self, sharding: NamedSharding) -> tuple[int, int]:
        """The rows start:stop of every batch that this process's devices hold."""
        shape = (self.batch_size, self.length + 1)
        check_batch_splits(self.batch_size, sharding)
        indices = sharding.addressable_devices_indices_map(shape).values()
        bounds = [index[0].indices(self.batch_size)[:2] for index in indices]
        return min(s for s, _ in bounds), max(e for _, e in bounds)


def book_batches(batch_size: int, length: int = 32) -> Batches:
    """The chapters' training data: windows of 4,000 generated lines of arithmetic."""
    return Batches(encode(arithmetic_text(4000)), batch_size=batch_size, length=length)


def check_batch_splits(batch_size: int, sharding: NamedSharding, what: str = "a batch") -> None:
    """Raise a clear error when the data axes cannot split the batch evenly."""
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    split = math.prod(sharding.mesh.shape[a] for a in axes)
    if batch_size % split:
        raise ValueError(
            f"{what} of {batch_size} rows cannot be split over the {split} devices of mesh "
            f"axes {axes}: use a batch size that is a multiple of {split} (for example "
            f"{split * max(1, round(batch_size / split))})."
        )
