"""The software and devices a run used, for the status page and the chapters."""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Callable
from importlib import metadata

PYTHON = (3, 12)
"""The oldest Python the library runs on: jax 0.11 and later need 3.12."""

REQUIRED = {
    "jax": "0.12.0",
    "jaxlib": "0.12.0",
    "flax": "0.12.12",
    "optax": "0.2.8",
    "orbax-checkpoint": "0.12.8",
}
"""The oldest releases the library is built and tested with (pyproject.toml's lower bounds):
the book relies on jax 0.12's `jax.reshard`, reduced and unreduced shardings and `pcast`, and
on flax 0.12.12's `nnx.Optimizer(..., wrt=)` and eager sharding."""

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


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '0.12.0.1' -> (0, 12, 0, 1), '2.0rc1' -> (2, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("rc")[0].split("+")[0]))


def check_versions(installed: Callable[[str], str] = metadata.version) -> None:
    """Raise an ImportError that names every package older than `REQUIRED` and the command that
    upgrades it, before an old JAX or Flax fails somewhere deep in a chapter."""
    if sys.version_info[:2] < PYTHON:
        raise ImportError(
            f"nnxscale needs Python {'.'.join(map(str, PYTHON))} or later (jax 0.11 and later "
            f"do), this is Python {platform.python_version()}"
        )
    old = []
    for name, needed in REQUIRED.items():
        try:
            found = installed(name)
        except metadata.PackageNotFoundError:
            found = "not installed"
        if found == "not installed" or release(found) < release(needed):
            old.append(f"{name} {found} (needs {needed} or later)")
    if old:
        upgrade = " ".join(f"'{name}>={needed}'" for name, needed in REQUIRED.items())
        raise ImportError(
            f"nnxscale needs newer packages: {'; '.join(old)}. Upgrade them with: "
            f"pip install -U {upgrade}"
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
