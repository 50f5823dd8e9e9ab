"""Ring-algorithm costs of the collectives: bytes each device sends, the book's convention."""

from __future__ import annotations

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def ring_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends for a collective over `group_size` devices on a ring.

    `nbytes` is the size of the full (unsharded) array: the all-gather's output, the
    reduce-scatter's input, the all-reduce's array, the all-to-all's buffer; for
    collective-permute it is the buffer each device sends to its neighbour.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    n = group_size
    if kind == "collective-permute":
        return float(nbytes)
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return factor * nbytes
