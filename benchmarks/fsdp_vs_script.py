"""dtlab's fsdp tier against a plain torchrun FSDP2 script: steady-state throughput. Target: dtlab/script >= 0.98.

As ``ddp_vs_script.py``, with tier fsdp against ``plain_fsdp_script.py``: per
round, interleaved, ``dtlab.train.run`` with tier fsdp at world size 2
(recording on, as a user runs it) and the plain script under torchrun with 2
processes, at the small size (MLP 256, global batch 128) and the large one
(MLP 1024, global batch 1024). Both sides shard the same units (each Linear of
the MLP, then the root) with FSDP2's defaults, on the same data, global batch,
steps, SGD and one torch thread per rank; both throughputs are the global batch
over the median step time after the same warm-up steps.

On CPU FSDP2 runs every all-gather and reduce-scatter synchronously in the
training thread, so what dtlab adds on top (recording each one, tagged with its
unit and pass) lies on the critical path: this is where it would show.

    .venv/bin/python benchmarks/fsdp_vs_script.py [--quick] [--out results/bench] [--repeats 8]
        [--model-size 256 --batch 128 --steps 100] [--large-model-size 1024 --large-batch 1024 --large-steps 30]
"""

from __future__ import annotations

from pathlib import Path

import _common as common

NAME = "fsdp_vs_script"
TARGET = 0.98
SCRIPT = Path(__file__).resolve().parent / "plain_fsdp_script.py"


def main() -> None:
    common.vs_script(NAME, "fsdp", SCRIPT, __doc__, target=TARGET)


if __name__ == "__main__":
    main()
