"""The environment report of the status page."""

from __future__ import annotations

import tomllib
from importlib import metadata

import jax
import pytest

from nnxscale.runtime.environment import (
    PYTHON,
    REQUIRED,
    check_versions,
    devices,
    release,
    versions,
)

from book import ROOT


def test_versions_lists_python_and_the_pinned_packages() -> None:
    found = versions()
    assert next(iter(found)) == "python"
    assert found["jax"] == jax.__version__
    assert versions(("no-such-package-xyz",))["no-such-package-xyz"] == "not installed"


def test_devices_reports_what_jax_sees() -> None:
    assert devices()["devices"] == str(jax.device_count())
    assert devices()["platform"] == "cpu"


def test_the_lower_bounds_are_the_ones_pyproject_declares_and_the_pins_meet() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = dict(d.split(">=") for d in project["dependencies"] if d.split(">=")[0] in REQUIRED)
    assert declared == REQUIRED
    assert project["requires-python"] == ">=" + ".".join(map(str, PYTHON))
    check_versions()  # the pinned environment passes


def test_an_older_jax_or_flax_is_named_with_the_versions_needed() -> None:
    old = {"jax": "0.10.2", "flax": "0.12.8"}

    def installed(name: str) -> str:
        return old.get(name) or metadata.version(name)

    with pytest.raises(ImportError) as raised:
        check_versions(installed)
    message = str(raised.value)
    assert "jax 0.10.2 (needs 0.12.0 or later)" in message
    assert "flax 0.12.8 (needs 0.12.12 or later)" in message
    assert "jaxlib" not in message.split("Upgrade")[0]  # only what is too old is named
    assert "pip install -U" in message


def test_a_missing_package_is_named_and_releases_compare_as_numbers() -> None:
    def installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    with pytest.raises(ImportError, match="jax not installed"):
        check_versions(installed)
    assert release("0.12.0.1") == (0, 12, 0, 1) > release("0.12.0") > release("0.9.9")
    assert release("2.0rc1") == (2, 0)
