"""Published models as `Config`s, exact to the parameter: what the book prices and compares.

Each configuration is the architecture its authors released (sizes from the model's
`config.json` and paper), written in the book's Transformer, so that `nnxscale.costs` prices
the model that was trained and `PUBLISHED` holds the parameter count the release states; a
test counts each on abstract arrays (nothing is allocated) and asserts equality.
"""

from __future__ import annotations

from nnxscale.model.config import Config

_RUN = {"scan_layers": True, "compute_dtype": "bfloat16"}

LLAMA3_8B = Config(
    vocab=128_256,
    embed=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    mlp=14_336,
    layers=32,
    max_len=8192,
    rope_theta=500_000.0,
    norm_eps=1e-5,
    **_RUN,
)
"""Llama 3 8B (Meta, 2024): grouped-query attention with 8 key/value heads, untied head."""

LLAMA3_70B = LLAMA3_8B.replace(embed=8192, heads=64, mlp=28_672, layers=80)
"""Llama 3 70B."""

LLAMA3_405B = LLAMA3_8B.replace(embed=16_384, heads=128, mlp=53_248, layers=126)
"""Llama 3.1 405B."""

QWEN3_8B = LLAMA3_8B.replace(
    vocab=151_936,
    mlp=12_288,
    layers=36,
    max_len=32_768,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    qk_norm=True,
)
"""Qwen3 8B (Alibaba, 2025): QK-norm, untied head."""

QWEN3_0_6B = QWEN3_8B.replace(embed=1024, heads=16, mlp=3072, layers=28, tie_embeddings=True)
"""Qwen3 0.6B: the same family with tied embeddings and head_dim 128 > embed / heads."""

MIXTRAL_8X7B = LLAMA3_8B.replace(
    vocab=32_000, max_len=32_768, rope_theta=1_000_000.0, experts=8, top_k=2
)
"""Mixtral 8x7B (Mistral AI, 2024): eight SwiGLU experts per layer, two chosen per token."""

PUBLISHED = {
    "Llama 3 8B": (LLAMA3_8B, 8_030_261_248),
    "Llama 3 70B": (LLAMA3_70B, 70_553_706_496),
    "Llama 3.1 405B": (LLAMA3_405B, 405_853_388_800),
    "Qwen3 8B": (QWEN3_8B, 8_190_735_360),
    "Qwen3 0.6B": (QWEN3_0_6B, 596_049_920),
    "Mixtral 8x7B": (MIXTRAL_8X7B, 46_702_792_704),
}
"""Each configuration and the parameter count its release states (the safetensors' total)."""
