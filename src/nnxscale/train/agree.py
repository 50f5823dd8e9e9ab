"""Whether a strategy trains a model as one device does: losses in ulps, weights under SGD.

Float32 sums of a batch's rows run in another order on many devices than on one, so a correct
strategy matches one device to a few units in the last place (ulps), not exactly. The weights
are compared after plain SGD, where each step moves a weight by the learning rate times its
gradient: a gap there is a gap in the gradients. (AdamW divides each gradient by its running
magnitude, so a weight whose gradient is rounding noise, 1e-8 next to 1e-1 elsewhere, can
take most of a step in a direction that noise decides: on a correct run such weights can end
the better part of a learning rate apart, so a bound on AdamW's weights that every correct run
meets is as loose as the steps themselves.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from nnxscale.core.trees import flat
from nnxscale.placement.mesh import axis_kind, make_mesh
from nnxscale.placement.rules import Rules
from nnxscale.train.trainer import Trainer

LOSS_ULPS = 16
"""Loss gap allowed, in ulps of the first loss: a few per step for sums in another order."""


def order_ulps(terms: int) -> float:
    """How many ulps two float32 sums (or means) of the same `terms` values may lie apart when
    they add them in different orders: each addition rounds by up to half an ulp, in either
    direction, so the errors add up like a random walk, to about the square root of `terms`.
    A sum that leaves out or double-counts a part of its terms is off by far more."""
    return float(np.sqrt(terms))


WEIGHT_GAP = 1e-3
"""Weight gap allowed after SGD, relative to how far each array moved (`Agreement`): a correct
strategy stays near 1e-6 (float32 rounding), a missing reduction is off by the share of the
batch each device did not see, of order 1."""

FLOOR = 1e-2
"""An array that moved less than this share of the furthest-moving array's RMS movement is
measured against that share instead: its gradient is rounding noise, and so is its gap."""


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How far a run on `mesh` is from the same run on one device."""

    strategy: str
    mesh: dict[str, int]
    losses: tuple[float, ...]
    reference: tuple[float, ...]
    loss_ulps: float
    """Largest loss gap, in ulps of the first loss of one device."""
    weight_gap: float
    """Largest, over arrays, RMS weight gap after SGD / the RMS distance the array moved (or
    `FLOOR` times the largest array's, if that is more)."""
    worst: str
    """The array with that gap."""
    share: float
    """The share of the train state each device holds on `mesh` (1.0: nothing split)."""

    @property
    def ok(self) -> bool:
        """Both gaps within their bounds (`LOSS_ULPS`, `WEIGHT_GAP`)."""
        return self.loss_ulps <= LOSS_ULPS and self.weight_gap <= WEIGHT_GAP

    def check(self) -> Agreement:
        """This agreement, or an AssertionError that says which bound failed and where."""
        if not self.ok:
            raise AssertionError(
                f"{self.strategy} on {self.mesh} does not train as one device does: losses "
                f"{self.loss_ulps:.1f} ulps apart (bound {LOSS_ULPS}), weights after SGD "
                f"{self.weight_gap:.2e} of their movement apart at {self.worst} (bound "
                f"{WEIGHT_GAP:.0e}). Losses {self.losses} against {self.reference}."
            )
        return self

    def __str__(self) -> str:
        return (
            f"{self.strategy} on {self.mesh}, {self.share:.0%} of the state per device: losses "
            f"within {self.loss_ulps:.1f} ulps, weights within {self.weight_gap:.1e} of their "
            f"movement ({self.worst})"
        )


def one_device_mesh(mesh: Mesh) -> Mesh:
    """A mesh with `mesh`'s axis names and types on its first device alone."""
    first = [mesh.devices.flat[0]]
    explicit = axis_kind(mesh) == "explicit"
    return make_mesh((1,) * len(mesh.axis_names), mesh.axis_names, explicit=explicit, devices=first)


def _check_settings(steps: int, learning_rate: float) -> None:
    """Refuse, before anything is compiled, settings under which any strategy would pass."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: the runs are compared after at least 1 step.")
    if not (np.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(
            f"learning_rate={learning_rate!r}: the weights are compared after SGD steps, so "
            "they must move; at a learning rate of 0 (or below, or not finite) a strategy that "
            "never reduces its gradients would pass. Use the default, 0.1."
        )


def _check_comparable(
    losses: tuple[float, ...],
    end: dict[str, np.ndarray],
    start: dict[str, np.ndarray],
    learning_rate: float,
) -> None:
    """Refuse runs that prove nothing: a loss or weight not finite, or no weight moved."""
    if not np.all(np.isfinite(losses)) or not all(np.all(np.isfinite(x)) for x in end.values()):
        raise ValueError(
            f"the runs' losses {losses} or weights are not finite at learning_rate="
            f"{learning_rate!r}: a gap between NaNs says nothing. Lower the learning rate."
        )
    if all(np.array_equal(end[path], start[path]) for path in end):
        raise ValueError(
            f"no weight moved in the one-device run at learning_rate={learning_rate!r}: the "
            "gradients are zero (or the rate too small to change a float32), so a wrong "
            "strategy would pass. Raise the learning rate, or check the loss."
        )


def _params(trainer: Any) -> dict[str, np.ndarray]:
    state = nnx.state(trainer.model(), nnx.Param)
    return {path: np.asarray(x, np.float64) for path, x in flat(state)}


def agreement(
    make: Callable[[], nnx.Module],
    rules: Rules,
    mesh: Mesh,
    batches: Callable[[int, Any], Any],
    *,
    steps: int = 3,
    learning_rate: float = 0.1,
    reference: Mesh | None = None,
    **options: Any,
) -> Agreement:
    """Train `make()`'s model `steps` steps with SGD under `rules` on `mesh` and on one device
    (`reference`: default `mesh`'s axes on its first device), from the same initial weights,
    and measure how far apart the losses and weights end. `options` go to `Trainer.create`
    (`loss_fn=...`, `compiler_options=...`: both runs compile alike). Assert on the result
    with `.check()`.

    The model is made on one device and copied into each layout, so both runs start from the
    same weights whatever the initialisers do. A comparison that cannot tell a wrong strategy
    from a right one is refused (ValueError): no step, a learning rate at which nothing moves,
    or a run whose losses or weights are not finite."""
    _check_settings(steps, learning_rate)
    runs = []
    for where in (reference or one_device_mesh(mesh), mesh):
        with nnx.use_eager_sharding(False):
            model = make()
        trainer = Trainer.create(model, optax.sgd(learning_rate), rules, where, **options)
        start = _params(trainer)
        losses = tuple(trainer.train(batches, steps))
        runs.append((start, _params(trainer), losses))
        share = trainer.layout.bytes_per_device() / trainer.layout.total_bytes()
    (start, one, one_losses), (many_start, many, losses) = runs
    if any(not np.array_equal(start[p], many_start[p]) for p in start):
        raise AssertionError("the two runs did not start from the same weights")
    _check_comparable(losses + one_losses, one, start, learning_rate)
    ulp = float(np.spacing(np.float32(one_losses[0])))
    loss_gap = max(abs(a - b) for a, b in zip(losses, one_losses, strict=True)) / ulp

    def rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0

    moved = {path: rms(one[path] - start[path]) for path in one}
    floor = FLOOR * max(moved.values(), default=0.0)
    gaps = {path: rms(many[path] - one[path]) / max(moved[path], floor, 1e-30) for path in one}
    worst = max(gaps, key=gaps.get) if gaps else ""
    return Agreement(
        rules.name,
        dict(mesh.shape),
        losses,
        one_losses,
        loss_gap,
        gaps.get(worst, 0.0),
        worst,
        share,
    )
