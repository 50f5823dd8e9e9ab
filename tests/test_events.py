"""The programs report typed events, one JSON line each, and `events.read` reads them back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from nnxscale import cli, events
from nnxscale.runtime.events import Checksums, Hello, Resumed, Saving, Step

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


def test_reads_every_event_in_order_as_its_class_and_skips_other_lines() -> None:
    assert events.read(LAUNCHED) == [
        Step(process=1, step=0, loss=5.5),
        Step(process=0, step=0, loss=9.0),
        Step(process=1, step=1, loss=4.25),
        Saving(process=0, step=2, blocked_seconds=0.003),
    ]


def test_filters_by_class_and_process() -> None:
    assert [e.loss for e in events.read(LAUNCHED, Step, 1)] == [5.5, 4.25]
    assert [e.loss for e in events.read(LAUNCHED, Step, process=0)] == [9.0]
    assert events.read(LAUNCHED, Saving, 1) == []
    assert events.read(LAUNCHED, Checksums) == []
    assert events.read(LAUNCHED, process=2) == []


def test_the_prefix_gives_the_process_of_an_event_without_one() -> None:
    fields = '"processes": 1, "local_devices": 1, "devices": 1, "sum": 1'
    lines = [f'[process 3] {{"event": "hello", {fields}}}']
    assert events.read(lines) == [Hello(3, 1, 1, 1, 1)]
    # An event's own process wins over its line's prefix.
    own = f'[process 1] {{"event": "hello", "process": 0, {fields}}}'
    assert events.read([own], process=0) == [Hello(0, 1, 1, 1, 1)]


def test_reads_a_string_and_lines_with_their_newlines() -> None:
    text = 'warning\n{"event": "resumed", "process": 0, "step": 2}\n\n'
    assert events.read(text) == events.read(text.splitlines(keepends=True))
    assert events.read(text, Resumed) == [Resumed(process=0, step=2)]


def test_an_unknown_event_or_field_is_named_not_skipped() -> None:
    with pytest.raises(ValueError, match=r"unknown event 'stpe'.*the kinds are"):
        events.read(['{"event": "stpe", "process": 0}'])
    with pytest.raises(ValueError, match=r"a 'step' event missing \['loss'\], with unknown \[\]"):
        events.read(['{"event": "step", "process": 0, "step": 1}'])
    with pytest.raises(ValueError, match=r"missing \[\], with unknown \['lost'\]"):
        events.read(['{"event": "step", "process": 0, "step": 1, "loss": 2.0, "lost": 1}'])
    with pytest.raises(ValueError, match="unknown event"):
        events.read(['{"event": ["step"], "process": 0}'])


def test_losses_and_checksums_round_trip_exactly(capsys) -> None:
    losses = [2.4100000858306885, 1 / 3, 5.960464477539063e-08, math.pi, 1e300]
    for step, loss in enumerate(losses):
        cli.tell(Step, step=step, loss=loss)
    cli.tell(Checksums, step=4, sums={"model/embed": "00ff"})
    out = capsys.readouterr().out
    assert all(json.loads(line)["process"] == 0 for line in out.splitlines())
    assert [e.loss for e in events.read(out, Step)] == losses  # every bit
    (sums,) = events.read(out, Checksums)
    assert sums == Checksums(process=0, step=4, sums={"model/embed": "00ff"})
    assert repr(sums) == "Checksums(process=0, step=4, sums=<1 arrays>)"


def test_no_event_is_lost_to_a_thread_logging_on_the_same_pipe() -> None:
    """Under PYTHONUNBUFFERED (the launcher's), `print` wrote an event and its newline apart;
    a log line another thread wrote between them joined the event's line, which then read as
    no event (a killed run's last losses were missing)."""
    code = """
import sys, threading
from nnxscale.runtime import events
done = threading.Event()
def log():
    while not done.is_set():
        sys.stderr.write("W orbax: saving in the background\\n")
threading.Thread(target=log, daemon=True).start()
for step in range(3000):
    events.emit(events.Step(process=0, step=step, loss=1.0))
done.set()
"""
    ran = subprocess.run(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=120,
        check=True,
    )
    assert [e.step for e in events.read(ran.stdout, Step)] == list(range(3000))
