"""Command line: ``python -m dtlab run | compare | estimate | bench | exercises | cluster | trace | clean``.

This module only parses: it imports neither torch nor a tier, so ``--help`` and a
line that does not parse are answered at once. What a command does is in
``dtlab.app.commands``, imported once the line has parsed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import SimpleNamespace
from typing import Any

from dtlab.app import flags
from dtlab.core import registry
from dtlab.core.config import check_fields


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (importing no tier: the tier names come from the registry's list)."""
    parser = _Parser(prog="python -m dtlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one tier and write result.json, events.csv, trace.json, params.pt")
    p_run.add_argument("--tier", default="single", help=f"one of {', '.join(registry.names())}")
    p_run.add_argument("--world-size", type=int, default=1)
    p_run.add_argument("--out", default="results/run", help="output folder")
    p_run.add_argument("--quiet", action="store_true", help="no progress bar")
    p_run.add_argument("--flight-recorder", action="store_true",
                       help="PyTorch's Flight Recorder in every rank: each rank's dump in OUT/flight_recorder; "
                            "a hang's report names the rank, the collective and its sequence number")
    flags.add_job_args(p_run)
    p_run.set_defaults(func="cmd_run")
    p_cmp = sub.add_parser("compare", help="run several tiers on the same job and compare them with 'single'")
    p_cmp.add_argument("--tiers", default="single", help="comma-separated tiers")
    p_cmp.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    p_cmp.add_argument("--out", default=None, help="output folder")
    p_cmp.add_argument("--quiet", action="store_true", help="no progress bars")
    flags.add_job_args(p_cmp)
    p_cmp.set_defaults(func="cmd_compare")
    p_est = sub.add_parser("estimate", help="predict a run's memory per rank without starting it (the same flags "
                           "as run)")
    p_est.add_argument("--tier", default="single", help=f"one of {', '.join(registry.names())}")
    p_est.add_argument("--world-size", type=int, default=1)
    p_est.add_argument("--json", action="store_true", help="JSON: memory, memory_max_over_ranks, peak_bytes, step_ms, "
                       "assumptions, per_rank")
    p_est.add_argument("--link", default="", metavar="MBIT[:ALPHA_US]",
                       help="predict the step time too, on a link of this bandwidth (Mbit/s) and latency (us, "
                            "default 50)")
    p_est.add_argument("--compute", default="timed", choices=("timed", "predicted"),
                       help="with --link: a rank's compute timed here (default), or predicted on this machine's "
                            "roofline (python -m dtlab.cost.roofline saves it)")
    flags.add_job_args(p_est)
    p_est.set_defaults(func="cmd_estimate")
    p_bench = sub.add_parser("bench", help="run every benchmark in benchmarks/ and summarise their ratios")
    p_bench.add_argument("--quick", action="store_true", help="smoke mode: checks each benchmark runs")
    p_bench.add_argument("--only", default="", help="comma-separated benchmark names")
    p_bench.add_argument("--out", default="results/bench", help="output folder")
    p_bench.add_argument("--docs", "--readme", dest="docs", action="store_true",
                         help="regenerate the benchmark table in docs/measurement.md (--readme is the same flag)")
    p_bench.set_defaults(func="cmd_bench")
    p_ex = sub.add_parser("exercises", help="list the exercises (write an algorithm, dtlab checks it), or describe one")
    p_ex.add_argument("name", nargs="?", default=None, help="an exercise to describe")
    p_ex.set_defaults(func="cmd_exercises")
    p_cl = sub.add_parser("cluster", help="write a multi-node torchrun job (node commands and a SLURM script), "
                          "or --collect its results")
    p_cl.add_argument("--tier", default="ddp", help=f"one of {', '.join(registry.CLUSTER)}")
    p_cl.add_argument("--nnodes", type=int, default=2, help="machines (one torchrun agent each)")
    p_cl.add_argument("--nproc-per-node", type=int, default=1, help="ranks per machine (e.g. its GPUs)")
    p_cl.add_argument("--master-addr", default=None, help="address or host name of node 0 (required)")
    p_cl.add_argument("--port", type=int, default=29500, help="rendezvous port on node 0")
    p_cl.add_argument("--workdir", default="results/cluster", help="a directory every node shares")
    p_cl.add_argument("--max-restarts", type=int, default=None,
                      help="torchrun restarts (default 0; the elastic tier's max_restarts for it)")
    p_cl.add_argument("--ifname", default=None, help="network interface between the nodes (default: gloo's choice)")
    p_cl.add_argument("--rdzv-id", default="dtlab", help="rendezvous id (the SLURM script uses the job id)")
    p_cl.add_argument("--collect", default=None, metavar="WORKDIR",
                      help="after the run: gather WORKDIR's results and write result.json etc. there")
    flags.add_job_args(p_cl)
    p_cl.set_defaults(func="cmd_cluster")
    p_tr = sub.add_parser("trace", help="run an unmodified torchrun (or python) script with dtlab's recorder in "
                          "every rank and write a run's folder: dtlab trace -- torchrun --nproc-per-node 2 train.py")
    p_tr.add_argument("--out", default="results/trace", help="output folder")
    p_tr.add_argument("--flight-recorder", action="store_true",
                      help="PyTorch's Flight Recorder in every rank: a hang's report names the rank and the collective")
    p_tr.add_argument("--timeout", type=float, default=0.0,
                      help="seconds a collective may wait, for a process group the script starts without a timeout "
                           "(0: torch's default)")
    p_tr.add_argument("--step", default="optimizer", choices=("optimizer", "marker"),
                      help="where a step ends: each optimizer step() (default), or each call the script makes to "
                           "dtlab.launch.traced.step()")
    p_tr.add_argument("traced", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                      help="torchrun ... SCRIPT ARGS, python -m torch.distributed.run ..., or python SCRIPT ARGS")
    p_tr.set_defaults(func="cmd_trace")
    p_clean = sub.add_parser("clean", help="remove the temporary folders, network namespaces and links of runs whose "
                             "process died (a killed kernel's, if even its reaper was killed)")
    p_clean.set_defaults(func="cmd_clean")
    return parser


def _jobs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (tier, world size) pairs a command line will make jobs of; none for a command without a job."""
    if not hasattr(args, "model") or getattr(args, "collect", None):
        return []
    if args.command == "compare":
        sizes = flags.world_sizes(args.world_sizes)
        return [("single", 1)] + [(t, w) for t in flags.tier_names(args.tiers) for w in sizes]
    if args.command == "cluster":  # a bad --nnodes is named by the cluster's own check, not as a world size
        return [(args.tier, args.nnodes * args.nproc_per_node)] if min(args.nnodes, args.nproc_per_node) > 0 else []
    return [(args.tier, args.world_size)]


def check_flags(args: argparse.Namespace) -> None:
    """The checks every tier shares, on the flags as given: a wrong one is named before torch is imported.
    Then each ``--opt`` against its tier's options, which imports that tier alone (and torch)."""
    jobs = _jobs(args)
    for tier, world_size in jobs:
        check_fields(SimpleNamespace(**flags.job_fields(args, tier, world_size)))
    if getattr(args, "opt", None) and args.command != "compare":  # compare refuses --opt itself
        for tier in dict.fromkeys(tier for tier, _ in jobs):
            flags.tier_options(tier, args.opt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_flags(args)
    except ValueError as exc:
        return _refuse(exc, args)
    commands = importlib.import_module("dtlab.app.commands")  # torch and the tiers, now that the line parses
    try:
        return getattr(commands, args.func)(args)
    except ValueError as exc:
        return _refuse(exc, args)


def _refuse(exc: ValueError, args: argparse.Namespace) -> int:
    """Bad input: one clear line naming the flag, not a traceback."""
    line = " ".join(str(exc).split())  # a message spanning lines still prints as one
    print(f"error: {flags.name_flag(line, args)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

