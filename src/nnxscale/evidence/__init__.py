"""Evidence: what others measured on real clusters, and the cost model against it.

`runs` holds the protocol published runs are held to (one calibrator per kind of device, the
rest tests), `tpu`, `foundry` and `gpu` the runs themselves and `table` all of them; `grid` the
Ultra-Scale Playbook's 1,265 measured nanotron runs, fitted on small clusters and tested on
large ones; `memory` the field's formulas for activation memory beside the ledgers'. Nothing
here runs on a device: each run is a row of data, priced by `nnxscale.costs`.
"""

from nnxscale.evidence import foundry, gpu, grid, memory, runs, table, tpu

__all__ = ["foundry", "gpu", "grid", "memory", "runs", "table", "tpu"]
