"""The command-line programs report JSON events, one a line, and `events` reads them back."""

from __future__ import annotations

import json
import math

from nnxscale import cli

# Output as a launcher collects it: prefixed lines of two workers, and a line of the
# collectives library, a warning, a blank line and JSON that is no event between them.
LAUNCHED = [
    '[process 1] {"event": "step", "process": 1, "step": 0, "loss": 5.5}',
    "[process 0] Gloo: connected to 1 peer",
    '[process 0] {"event": "step", "process": 0, "step": 0, "loss": 9.0}',
    "[process 1] UserWarning: something {in braces}",
    '[process 1] {"event": "step", "process": 1, "step": 1, "loss": 4.25}',
    "",
    "[process 0] [1, 2, 3]",
    '[process 0] {"no": "event"}',
    '[process 0] {"event": "saving", "process": 0, "step": 2, "blocked_seconds": 0.003}',
]


def test_reads_every_event_in_order_and_skips_other_lines() -> None:
    assert [(e["event"], e["process"], e["step"]) for e in cli.events(LAUNCHED)] == [
        ("step", 1, 0),
        ("step", 0, 0),
        ("step", 1, 1),
        ("saving", 0, 2),
    ]


def test_filters_by_kind_and_process() -> None:
    assert cli.events(LAUNCHED, "step", 1) == [
        {"event": "step", "process": 1, "step": 0, "loss": 5.5},
        {"event": "step", "process": 1, "step": 1, "loss": 4.25},
    ]
    assert [e["loss"] for e in cli.events(LAUNCHED, "step", process=0)] == [9.0]
    assert cli.events(LAUNCHED, "saving", 1) == []
    assert cli.events(LAUNCHED, "checksums") == []
    assert cli.events(LAUNCHED, process=2) == []


def test_the_prefix_gives_the_process_of_an_event_without_one() -> None:
    lines = ['[process 3] {"event": "hello", "sum": 4}', '{"event": "hello", "sum": 4}']
    assert cli.events(lines) == [
        {"event": "hello", "sum": 4, "process": 3},
        {"event": "hello", "sum": 4},
    ]
    assert cli.events(lines, process=3) == [{"event": "hello", "sum": 4, "process": 3}]
    # An event's own process wins over its line's prefix.
    assert cli.events(['[process 1] {"event": "hello", "process": 0}'], process=0) == [
        {"event": "hello", "process": 0}
    ]


def test_reads_a_string_and_lines_with_their_newlines() -> None:
    text = 'warning\n{"event": "resumed", "process": 0, "step": 2}\n\n'
    assert cli.events(text) == cli.events(text.splitlines(keepends=True))
    assert cli.events(text, "resumed") == [{"event": "resumed", "process": 0, "step": 2}]


def test_losses_round_trip_exactly(capsys) -> None:
    losses = [2.4100000858306885, 1 / 3, 5.960464477539063e-08, math.pi, 1e300]
    for step, loss in enumerate(losses):
        cli.emit("step", step=step, loss=loss)
    cli.emit("checksums", step=4, sums={"model/embed": "00ff"})
    out = capsys.readouterr().out
    assert all(json.loads(line)["process"] == 0 for line in out.splitlines())
    assert [e["loss"] for e in cli.events(out, "step")] == losses  # every bit
    assert cli.events(out, "checksums") == [
        {"event": "checksums", "process": 0, "step": 4, "sums": {"model/embed": "00ff"}}
    ]
