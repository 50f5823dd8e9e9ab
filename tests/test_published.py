"""The ledger set beside Korthikanti et al.'s per-layer activation count, part by part."""

from __future__ import annotations

import pytest

import nnxscale as nx
from nnxscale.evidence import memory as published


def test_korthikanti_is_34_sbh_plus_5_as2b() -> None:
    cfg = nx.configs.LLAMA3_8B
    parts = published.korthikanti(cfg, 4096)
    s, h, a = 4096, cfg.embed, cfg.heads
    assert sum(parts.values()) == s * h * (34 + 5 * a * s / h)


def test_the_ledgers_parts_add_up_and_keep_no_score() -> None:
    cfg = nx.configs.LLAMA3_8B
    rows = {row[0]: row for row in published.compare_layer(cfg, 4096)}
    ours = published.ledger_by_part(cfg, 4096)
    assert rows["layer"][2] == pytest.approx(sum(ours.values()))
    assert rows["attention scores (s^2)"][2] == 0
    assert all(row[4] for name, row in rows.items() if name != "layer")  # each names why
    # keys and values of 8 heads: the linear attention part below GPT's 11 s b h
    assert rows["attention, linear in s"][3] < 1
