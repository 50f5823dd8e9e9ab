"""The environment report of the status page."""

from __future__ import annotations

import jax

from nnxscale.environment import devices, versions


def test_versions_lists_python_and_the_pinned_packages() -> None:
    found = versions()
    assert next(iter(found)) == "python"
    assert found["jax"] == jax.__version__
    assert versions(("no-such-package-xyz",))["no-such-package-xyz"] == "not installed"


def test_devices_reports_what_jax_sees() -> None:
    assert devices()["devices"] == str(jax.device_count())
    assert devices()["platform"] == "cpu"
