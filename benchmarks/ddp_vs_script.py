"""dtlab's ddp tier against a plain torchrun DDP script: steady-state throughput. Target: dtlab/script >= 0.98.

Per round, interleaved: ``dtlab.train.run`` with tier ddp at world size 2
(recording on, as a user runs it), then ``plain_ddp_script.py`` under torchrun
with 2 processes, first at the small size (MLP 256, global batch 128: steps of
a few ms, where dtlab's per-step overhead shows most), then at the large one
(MLP 1024, global batch 1024: compute-bound steps of tens of ms). Same model
(MLP), data (synthetic 8x8), global batch, steps, SGD and one torch thread per
rank on both sides. Both throughputs are the global batch over the median step
time after the same warm-up steps, a step lasting as long as its slowest rank:
process start-up is not in either number.

Reported: dtlab/script samples/s, the median over rounds with the range of the
per-round ratios, for each size; the headline is the lower of the two.

    .venv/bin/python benchmarks/ddp_vs_script.py [--quick] [--out results/bench] [--repeats 8]
        [--model-size 256 --batch 128 --steps 100] [--large-model-size 1024 --large-batch 1024 --large-steps 30]
"""

from __future__ import annotations

from pathlib import Path

import _common as common

NAME = "ddp_vs_script"
TARGET = 0.98
SCRIPT = Path(__file__).resolve().parent / "plain_ddp_script.py"


def main() -> None:
    common.vs_script(NAME, "ddp", SCRIPT, __doc__, target=TARGET)


if __name__ == "__main__":
    main()
