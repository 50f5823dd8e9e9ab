"""Point the book at another GitHub repository, such as a fork.

Run from a clone: python book/set_repository.py OWNER/NAME

The repository is written in `_config.yml` (`repository.url`, and `html.baseurl`, the GitHub
Pages address its publishing workflow deploys to), in every chapter's setup cell (which installs
`nnxscale` from it on Colab), in the Colab links and badges of the README. This replaces the
current repository's OWNER/NAME, and its Pages address, in every file git tracks, so that
they all agree again; the tests check that they do. Run it from a clone, then commit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+$")


def current(root: Path = ROOT) -> str:
    """OWNER/NAME of the repository `_config.yml` names."""
    url = yaml.safe_load((root / "_config.yml").read_text())["repository"]["url"]
    return url.removeprefix("https://github.com/").rstrip("/")


def pages(slug: str) -> str:
    """The GitHub Pages address of repository OWNER/NAME (the owner's site, lower case)."""
    owner, name = slug.split("/")
    return f"https://{owner.lower()}.github.io/{name}/"


def set_repository(slug: str, root: Path = ROOT) -> list[Path]:
    """Replace the current repository by `slug` in every tracked file; the files changed."""
    if not SLUG.match(slug):
        raise SystemExit(f"{slug!r} is not OWNER/NAME, such as reader/scaling-flax-nnx")
    old = current(root)
    listed = subprocess.run(
        ["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split()
    changed = []
    for name in listed:
        path = root / name
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # images, and files deleted but not yet committed
        new = text.replace(pages(old), pages(slug)).replace(old, slug)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in set_repository(sys.argv[1]):
        print(path.relative_to(ROOT))
