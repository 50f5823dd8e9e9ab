"""What the cost model prices, and why it refuses the rest: each refusal names the problem
and the rule sets or schedules that it does price."""

from __future__ import annotations

from nnxscale.costs.activations import DROPLESS
from nnxscale.costs.arrays import context_axis, placed
from nnxscale.placement.rules import Rules


def unpriced(rules: Rules, moe: int, schedule: str = "lockstep") -> str:
    """Why the cost model has no formulas for `rules` on this model and pipeline `schedule`,
    or "": for a mixture of experts, context axes (its layer routes whole sequences) and
    the lockstep executor, whose stages return no auxiliary loss; for a context ring inside
    pipeline stages, the lockstep executor too (`nnxscale.pipeline` runs no ring)."""
    staged = bool(rules.axes_of("layers"))
    lockstep = staged and schedule == "lockstep"
    if moe and context_axis(rules) is not None:
        return (
            f"rule set {rules.name!r} splits the sequence, which the cost model does not price "
            "for a mixture of experts (the book's layer routes whole sequences, so every "
            "device of the ring would fill and compute the same experts' slots): use data, "
            "FSDP, expert, tensor and pipeline parallelism"
        )
    if moe > DROPLESS and _splits_experts_or_tensors(rules):
        return (
            f"rule set {rules.name!r} splits the experts or their products, which the cost "
            "model does not price for a dropless mixture (its exchange of token copies and "
            "the blocks' partial sums are not traced): use data, FSDP and pipeline "
            "parallelism, or capacity routing"
        )
    if lockstep and (moe or context_axis(rules) is not None):
        what = "a mixture of experts" if moe else "a context ring inside pipeline stages"
        return (
            f"rule set {rules.name!r} runs {what}, which the book's lockstep executor does "
            "not: price it with schedule='1F1B'"
        )
    return ""


def _splits_experts_or_tensors(rules: Rules) -> bool:
    """Whether `rules` split a mixture's experts (EP) or a product's weights (TP)."""
    placement = placed(rules, True)
    experts = any(
        axes
        for a in placement.arrays
        for name, axes in zip(a.names, a.axes["params"], strict=True)
        if name == "experts"
    )
    return experts or any(placement.tensor(n) for n in ("heads", "mlp", "vocab"))
