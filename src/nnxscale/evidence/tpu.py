"""Published training runs on TPUs: MaxText's tables on v5e, v5p and v6e, and PaLM on v4.

MaxText compiles its step with XLA, as this library does, so its runs are priced with the
program ledger. One run per kind of chip calibrates its efficiency (`calibrates`), chosen
for the simplest layout its source states in full: MaxText's smallest model on one v5e slice
and on one v5p slice, and its Llama 3.1 70B recipe on a v6e slice (the only v6e model whose
every setting the recipe states and which fits without offloading more than the model
prices). PaLM's
layout the rule sets cannot express, so the v4 takes PaLM's published hardware FLOPs
utilisation (`nnxscale.costs.HARDWARE`).
"""

from __future__ import annotations

import math

from nnxscale.costs.counts import Precision
from nnxscale.evidence.runs import Run
from nnxscale.model.config import Config
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_70B

MAXTEXT = Precision(parameters=4, master=0, moments=8, ema=0, gradients=4)
"""What MaxText holds per parameter: float32 weights (cast to bfloat16 per layer), AdamW's two
float32 moments and float32 gradients."""


def maxtext(scale: int, seq: int = 2048) -> Config:
    """MaxText's `global_parameter_scale` model (MaxText's base.yml scaled as its
    `get_individual_scales` does: heads and MLP, then width, then layers, each doubled in
    turn), a Llama-2-style decoder with 32,000 tokens."""
    steps, rest = divmod(int(math.log2(scale)), 3)
    heads, width = steps + (rest > 0), steps + (rest > 1)
    return Config(
        vocab=32_000,
        embed=2048 * 2**width,
        heads=16 * 2**heads,
        kv_heads=16 * 2**heads,
        head_dim=128,
        mlp=7168 * 2**heads,
        layers=16 * 2**steps,
        max_len=seq,
        dropout=0.0,
        scan_layers=True,
        compute_dtype="bfloat16",
    )


LLAMA2_70B = LLAMA3_70B.replace(vocab=32_000, max_len=4096)
"""Llama 2 70B: Llama 3 70B's layers with a 32,000-token vocabulary."""

PALM_540B = Config(
    vocab=256_000,
    embed=18_432,
    heads=48,
    kv_heads=1,
    head_dim=256,
    mlp=73_728,
    layers=118,
    max_len=2048,
    tie_embeddings=True,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)
"""PaLM 540B (Chowdhery et al. 2022, table 1): multi-query attention, SwiGLU, shared
input and output embeddings."""

_V5E = {
    16: (6, (120, 117, 117, 115, 111, 108)),
    32: (4, (132, 128, 126, 125, 123, 119)),
    64: (2, (118, 112, 110, 108, 105, 99)),
    128: (1, (110, 110, 108, 104, 100, 91)),
}
"""MaxText's v5e table: per model scale, the batch per chip and the TFLOP/s per chip on 1, 2,
4, 8, 16 and 32 slices of 256 chips. MaxText's README tables (v5e and v5p) predate its
counting attention under the causal mask (its PR #1988 halved attention's FLOPs): they count
12 L b s^2 H D where the field's count has 6 L b H D s^2. At 2,048 tokens that is under 4%
of a step's FLOPs (`tests/test_runs.py`), which the v5e and v5p calibrations absorb."""


def _v5e() -> list[Run]:
    """MaxText's runs on 1 to 32 TPU v5e-256 slices: FSDP inside a slice, DP across (128B:
    FSDP 16 x TP 16 inside), full remat."""
    found = []
    for scale, (per_chip, tflops) in _V5E.items():
        for slices, value in zip((1, 2, 4, 8, 16, 32), tflops, strict=True):
            inside = {"data": 16, "model": 16} if scale == 128 else {"data": 256}
            rules = (
                ("HSDP+TP" if scale == 128 else "HSDP")
                if slices > 1
                else ("FSDP+TP" if scale == 128 else "FSDP")
            )
            mesh = {"replica": slices, **inside} if slices > 1 else inside
            found.append(
                Run(
                    f"MaxText {scale}B, {slices} x v5e-256",
                    maxtext(scale),
                    "TPU v5e",
                    rules,
                    mesh,
                    per_chip * 256 * slices,
                    2048,
                    "full",
                    "TFLOP/s per device",
                    value,
                    "maxtext2025",
                    "configs/tpu/v5e/README.md",
                    slice=256,
                    calibrates=(scale, slices) == (16, 1),
                    precision=MAXTEXT,
                    ledger="program",
                )
            )
    return found


_V5P = {
    32: (6, 4, "dots", {64: (328, 319)}),
    64: (3, 4, "dots", {64: (323, 309)}),
    128: (1, 8, "dots", {128: (315, 305), 256: (316, 274)}),
    256: (1, 8, "dots", {512: (308, 289)}),
    512: (2, 8, "full", {512: (294, 282)}),
    1024: (2, 16, "full", {1024: (254, 237), 2048: (297, 279)}),
}
"""MaxText's v5p table: per model scale, the batch per chip, the tensor-parallel width, the
remat policy (MaxText's `minimal` saves the products' outputs, as `dots` does), and per
slice size in chips (a v5p-N slice has N / 2 chips) the TFLOP/s per chip on 1 and 2 slices."""


def _v5p() -> list[Run]:
    """MaxText's runs on one and two TPU v5p slices: FSDP x TP inside, DP across."""
    found = []
    for scale, (per_chip, tp, remat, slices) in _V5P.items():
        for chips, values in slices.items():
            for count, value in zip((1, 2), values, strict=True):
                inside = {"data": chips // tp, "model": tp}
                mesh = {"replica": 2, **inside} if count == 2 else inside
                found.append(
                    Run(
                        f"MaxText {scale}B, {count} x v5p-{2 * chips}",
                        maxtext(scale),
                        "TPU v5p",
                        "HSDP+TP" if count == 2 else "FSDP+TP",
                        mesh,
                        per_chip * chips * count,
                        2048,
                        remat,
                        "TFLOP/s per device",
                        value,
                        "maxtext2025",
                        "configs/tpu/v5p/README.md",
                        slice=chips,
                        calibrates=(scale, count) == (32, 1),
                        precision=MAXTEXT,
                        ledger="program",
                    )
                )
    return found


_V6E = "docs/reference/models/tiering.md and its recipes"
_OFFLOADED = (
    "; its remat policy ('custom') offloads the decoder's input and the attention projections "
    "to host memory and recomputes the rest, priced as dots (the v6e calibration absorbs it)"
)
_LLAMA2_70B = (
    "; benchmarks/maxtext_trillium_model_configs.py's llama2_70b_4096 (batch 4 a chip, full "
    "remat), priced; its optimized variant runs batch 2 with qkv_proj_offloaded"
)
_TPU_V6E = {
    "hardware": "TPU v6e",
    "rules": "FSDP",
    "mesh": {"data": 256},
    "source": "maxtext2025",
    "quantity": "tokens/s per device",
    "precision": MAXTEXT,
    "ledger": "program",
}


def _others() -> list[Run]:
    """MaxText's v6e recipes, and PaLM on TPU v4."""
    return [
        Run(
            name="Llama 3.1 8B, v6e-256",
            cfg=LLAMA3_8B,
            batch=4 * 256,
            seq=8192,
            remat="dots",
            published=7207,
            where=_V6E + _OFFLOADED,
            **_TPU_V6E,
        ),
        Run(
            name="Llama 3.1 70B, v6e-256",
            cfg=LLAMA3_70B,
            batch=5 * 256,
            seq=8192,
            remat="dots",
            published=960,
            where=_V6E + _OFFLOADED,
            calibrates=True,
            **_TPU_V6E,
        ),
        Run(
            name="Llama 2 70B, v6e-256",
            cfg=LLAMA2_70B,
            batch=4 * 256,
            seq=4096,
            remat="full",
            published=900,
            where=_V6E + _LLAMA2_70B,
            **_TPU_V6E,
        ),
        Run(
            name="PaLM 540B, 6,144 TPU v4",
            cfg=PALM_540B,
            hardware="TPU v4",
            rules="HSDP+TP",
            mesh={"replica": 2, "data": 256, "model": 12},
            batch=2048,
            seq=2048,
            remat="full",
            quantity="MFU",
            published=0.462,
            source="chowdhery2022palm",
            where="section 4 and table 3 (2 pods: TP 12 x FSDP 256 each)",
            why="multi-query attention under TP 12: its one key/value head is copied to every "
            "device of the model axis, and the rule sets split kv_heads over it",
        ),
    ]


def runs() -> list[Run]:
    """Every TPU run: MaxText's v5e and v5p tables, its v6e recipes, and PaLM."""
    return _v5e() + _v5p() + _others()
