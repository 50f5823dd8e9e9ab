"""Test setup: 8 emulated CPU devices in the pytest process, and shared paths and helpers."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest

from nnxscale.runtime.devices import emulate_devices
from nnxscale.runtime.launch import Run, run

from book import ROOT

TEST_DEVICES = 8

emulate_devices(TEST_DEVICES)

CLUSTER_PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "mpirun", "orted", "prted")
"""The daemons and launchers of the cluster engines that tests/test_clusters.py starts."""


def cluster_processes() -> dict[int, str]:
    """The running processes of `CLUSTER_PROGRAMS`, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            name = (entry / "comm").read_text().strip() if entry.name.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if name in CLUSTER_PROGRAMS:
            found[int(entry.name)] = name
    return found


BEFORE = cluster_processes() if sys.platform == "linux" else {}


def run_python(code: str, **env: str) -> Run:
    """Run `code` in a fresh Python process (its own JAX backend) with extra environment; the
    finished run, whatever its exit status."""
    return run([sys.executable, "-c", code], env=env, check=False)


def jupyter_book(*args: str, cwd: Path = ROOT) -> Run:
    """Run the jupyter-book command of this environment; the finished run, whatever its end."""
    command = [str(Path(sys.executable).with_name("jupyter-book")), *args]
    return run(command, cwd=cwd, timeout=3600, check=False)


def clean_arguments() -> tuple[str, ...]:
    """What `jupyter-book clean` is given before the test build: everything, unless
    NNXSCALE_KEEP_EXECUTIONS=1 (the pull-request workflow, which restores the chapters'
    executions from its cache) keeps the jupyter-cache, whose entries are keyed on each
    chapter's code and emptied by the build when `src/`, the pins or the device count change."""
    keep = os.environ.get("NNXSCALE_KEEP_EXECUTIONS") == "1"
    return ("clean", ".") if keep else ("clean", "--all", ".")


@pytest.fixture(scope="session")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole book, built from clean with every chapter executed for real (or read back from
    the executions cache, `clean_arguments`); its HTML folder.

    Built once per test run: with pytest-xdist, the first worker to ask builds it while the
    others wait on a lock in the run's shared temporary folder, then read the same result.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    log_file = ROOT / "_build" / "build.log"
    with open(shared / "built-book.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        status = shared / "built-book.returncode"
        if not status.exists():
            assert jupyter_book(*clean_arguments()).returncodes == [0]
            result = jupyter_book("build", ".")
            log_file.parent.mkdir(exist_ok=True)
            log_file.write_text(result.text)
            status.write_text(str(result.returncodes[0]))
    assert status.read_text() == "0", log_file.read_text()[-5000:]
    return ROOT / "_build" / "html"


EXECUTES_CHAPTERS = {"test_device_counts.py", "test_colab.py"}
"""Test modules that execute chapters outside the book's build: the sweep tier."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the fast tier fast: a test of the built book must be marked `book`, and one that
    executes chapters itself `sweep`, so that `-m "not book and not sweep"` executes none."""
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        if "built_book" in getattr(item, "fixturenames", ()) and "book" not in marks:
            raise pytest.UsageError(f"{item.nodeid} uses the built book: mark it `book`")
        if item.path.name in EXECUTES_CHAPTERS and "sweep" not in marks:
            raise pytest.UsageError(f"{item.nodeid} executes chapters: mark it `sweep`")


FAST_SECONDS = 6.0
"""The longest an unmarked test may run in the fast tier; a longer one is marked `slow`."""
TIERS = {"slow", "book", "sweep"}


def fast_tier(config: pytest.Config) -> bool:
    """Whether this session runs the fast tier alone: its marker expression leaves out every
    other tier (`-m "not slow and not book and not sweep"`), so nothing else loads the cores."""
    expression = config.getoption("markexpr") or ""
    return all(f"not {tier}" in expression for tier in TIERS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In the fast tier, an unmarked test that runs over `FAST_SECONDS` fails, naming its time
    and the fix (mark it `slow`, or make it faster), so the tier stays fast as it grows."""
    report = yield
    marked = {m.name for m in item.iter_markers()} & TIERS
    slow = report.when == "call" and report.passed and call.duration > FAST_SECONDS
    if slow and not marked and fast_tier(item.config):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {call.duration:.1f} s, over the fast tier's {FAST_SECONDS:g} s "
            "for an unmarked test: mark it @pytest.mark.slow, or make it faster."
        )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it leaves a cluster daemon or launcher behind (checked once, in the
    process that ran every test or in pytest-xdist's controller, after its workers ended)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or sys.platform != "linux":
        return
    left = {pid: name for pid, name in cluster_processes().items() if pid not in BEFORE}
    if left:
        listed = ", ".join(f"{name} (pid {pid})" for pid, name in sorted(left.items()))
        session.config.get_terminal_writer().line(f"processes left behind: {listed}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
