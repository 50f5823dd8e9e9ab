"""The software and devices a run used, for the status page and the chapters."""

from __future__ import annotations

import os
import platform
from importlib import metadata

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "matplotlib",
    "jupyter-book",
    "myst-nb",
    "sphinx",
    "jupytext",
    "nnxscale",
)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed version of each package (`not installed` when absent), Python first."""
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def devices() -> dict[str, str]:
    """What JAX runs on: platform, device count and kind, processes, host CPU cores."""
    import jax

    devs = jax.devices()
    return {
        "platform": devs[0].platform,
        "devices": str(len(devs)),
        "device kind": devs[0].device_kind,
        "processes": str(jax.process_count()),
        "host CPU cores": str(os.cpu_count()),
    }
