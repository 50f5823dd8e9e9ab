"""Record what crosses processes on a hybrid mesh, for chapter 8: two processes of four
devices compile a train step of each rule set in `nnxscale.costs.crossing.SHOWN`, and the
reports are written to `src/nnxscale/costs/crossing.json`, after a table of each held
against the cost model. Run it again when the compiler changes what it emits (the test
`test_multi.py` says so when a fresh run differs from the recording)."""

from __future__ import annotations

import json
from pathlib import Path

from nnxscale import cli
from nnxscale.costs import crossing

if __name__ == "__main__":
    lines = {}
    for rules in crossing.SHOWN:
        report = cli.crossing(rules)
        compared = crossing.compare(rules, report)
        print(f"{rules}, mesh {compared.mesh}:\n{compared.show()}\n")
        print(f"gradient bytes crossing: {compared.crossed}, priced: {compared.priced:g}\n")
        compared.check()
        lines[rules] = report.line()
    path = Path(crossing.__file__).with_name(crossing.RECORDED)
    path.write_text(json.dumps(lines, indent=1) + "\n")
    print(f"wrote {path}")
