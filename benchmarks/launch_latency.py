"""Relaunch latency: time from the call until every rank has finished one all_reduce, world size 2.

Interleaved rounds of: dtlab's warm relaunch (``dtlab.launch``: a forkserver
with torch preloaded), the ``torchrun`` command line, and Hugging Face
Accelerate's fork-based ``notebook_launcher`` (a benchmark-only dependency:
``pip install accelerate``; skipped with a note when it is missing). Each is
timed until the launching call returns. Targets: dtlab/torchrun <= 0.05 and
dtlab/accelerate <= 0.6.

    .venv/bin/python benchmarks/launch_latency.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import _common as common

import dtlab

NAME = "launch_latency"
SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
""")


def one_all_reduce(info) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def accelerate_body() -> None:
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState()  # accelerate's own process-group set-up, as its users write it
    dist.all_reduce(torch.ones(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn) -> dict:
    t0 = time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - t0}


def main() -> None:
    args = common.parse(common.parser(__doc__))
    script = args.out / "launch_latency_script.py"
    script.write_text(SCRIPT)
    dtlab.launch(one_all_reduce, 2, progress=False)  # start the forkserver: what "warm" means

    def torchrun() -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)]
        subprocess.run(cmd, check=True, capture_output=True)

    variants = {"dtlab": lambda _r: timed(lambda: dtlab.launch(one_all_reduce, 2, progress=False)),
                "torchrun": lambda _r: timed(torchrun)}
    try:
        from accelerate import notebook_launcher

        variants["accelerate"] = lambda _r: timed(
            lambda: notebook_launcher(accelerate_body, (), num_processes=2, use_port=str(_free_port())))
    except ImportError:
        common.note("accelerate is not installed: its column is skipped (pip install accelerate)")
    rows = common.interleave(variants, common.repeats(args, full=10, quick=1), warmup_rounds=0 if args.quick else 1)
    common.write_csv(args.out / f"{NAME}.csv", rows)
    med = {name: common.median(r["seconds"] for r in rows if r["variant"] == name and r["round"] >= 0)
           for name in variants}
    vs_torchrun = common.median(common.ratios(rows, "dtlab", "torchrun", "seconds"))
    detail = ", ".join(f"{name} {sec * 1e3:.0f} ms" for name, sec in med.items())
    common.result_line(NAME, vs_torchrun, "<= 0.05", quick=args.quick, passed=vs_torchrun <= 0.05,
                       detail=f"dtlab / torchrun; medians: {detail}")
    if "accelerate" in variants:
        vs_acc = common.median(common.ratios(rows, "dtlab", "accelerate", "seconds"))
        common.result_line(f"{NAME}.vs_accelerate", vs_acc, "<= 0.6", quick=args.quick, passed=vs_acc <= 0.6,
                           detail="dtlab / accelerate notebook_launcher (fork)")
    dtlab.shutdown()


if __name__ == "__main__":
    main()
