"""`python -m nnxscale COMMAND ...`: the library's programs, each in a process of its own.

`launch` starts N local processes that form one distributed run (`nnxscale.launch`); `train`,
`restore` and `collective` are the programs the chapters and tests run in them, or alone with
another device count (`nnxscale.cli`).
"""

from __future__ import annotations

import sys

from nnxscale import cli, launch


def main(argv: list[str]) -> None:
    """Run `launch ARGS` with the launcher, any other command with `nnxscale.cli`."""
    if argv[:1] == ["launch"]:
        launch.main(argv[1:])
    else:
        cli.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
