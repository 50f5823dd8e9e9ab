"""Every published run the book confronts the cost model with, on TPUs and GPUs."""

from __future__ import annotations

from nnxscale.evidence import foundry, gpu, tpu
from nnxscale.evidence.runs import Run


def runs() -> list[Run]:
    """Every run: MaxText's TPU tables and PaLM (`nnxscale.evidence.tpu`), llm-foundry's MPT
    tables (`nnxscale.evidence.foundry`), the other GPU sources and this book's own
    (`nnxscale.evidence.gpu`)."""
    return tpu.runs() + foundry.runs() + gpu.runs()
