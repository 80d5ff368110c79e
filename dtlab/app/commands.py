"""What each command line does, once it has parsed (``dtlab.app.cli`` parses it).

Apart from the parser because these need torch, the tiers and pandas: ``--help`` and
a line that does not parse are answered before any of them is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from dtlab.app import flags
from dtlab.app.bench import BENCH_DOC, run_all, update_doc
from dtlab.app.saving import check_writable, fallback, save_result
from dtlab.core.config import RunConfig
from dtlab.core.env import resolve_backend
from dtlab.core.failures import RankError
from dtlab.core.results import FLIGHT_DIR, RunResult
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.experiments.compare import compare, format_table, save_comparison
from dtlab.launch import cluster, lifeline, netns, trace
from dtlab.read import flight
from dtlab.train import preflight, run


def config_from_args(args: argparse.Namespace, tier: str, world_size: int) -> RunConfig:
    return RunConfig(**flags.job_fields(args, tier, world_size), tier_options=flags.tier_options(tier, args.opt))


def _preflight(cfg: RunConfig) -> None:
    # Each rank resolves backend and device itself, in its own process: a CUDA device this machine lacks would
    # end there, in a rank's traceback. RunConfig cannot check it (a cluster job is planned on another machine).
    resolve_backend(cfg.backend, cfg.device)
    try:
        preflight(cfg)
    except OSError as exc:  # a probe that could not even look: one line, as for a failed check
        raise ValueError(f"{cfg.tier}: preflight failed: {exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, args.tier, args.world_size)
    _preflight(cfg)
    check_writable(args.out, "--out")
    try:
        result = run(cfg, progress=not args.quiet)
    except RankError as err:
        if not getattr(err, "flight", None):
            raise
        print(f"error: {err}\n{flight.saved_report(err, args.out)}", file=sys.stderr)
        return 1
    out, saved = save_result(result, args.out)
    summary = result.summary()
    print(f"{cfg.tier} x{cfg.world_size}: median step {summary['median_step_s'] * 1e3:.2f} ms, "
          f"{summary['samples_per_s']:.0f} samples/s, final loss {summary['final_loss']:.4f}, "
          f"test accuracy {summary.get('test_accuracy', float('nan')):.3f}")
    print(f"wrote {out}/result.json, events.csv, steps.csv, trace.json, params.pt"
          + (f", {FLIGHT_DIR}/rank_*" if result.flight else ""))
    return 0 if saved else 1


def cmd_compare(args: argparse.Namespace) -> int:
    if args.opt:
        raise ValueError("--opt: compare runs every tier with its default options; use 'run --tier T --opt ...'")
    names = flags.tier_names(args.tiers)
    sizes = flags.world_sizes(args.world_sizes)
    base = config_from_args(args, "single", 1)
    # The jobs compare() will run, each validated and preflighted before the first starts.
    for cfg in [base] + [base.replace(tier=n, world_size=w) for n in names if n != "single" for w in sizes]:
        _preflight(cfg)
    if args.out:
        check_writable(args.out, "--out")
    done: list[RunResult] = []
    table = compare(base, names, sizes, progress=not args.quiet, results=done)
    print(format_table(table))
    if args.out:
        try:
            save_comparison(Path(args.out), table, done)
        except OSError as exc:
            folder = fallback(args.out, exc, lambda f: save_comparison(f, table, done))
            print(f"wrote {folder}/compare.csv and one folder per run")
            return 1
        print(f"wrote {args.out}/compare.csv and one folder per run")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    if args.docs and (args.quick or only):
        print("error: --docs needs the full run of every benchmark (no --quick, no --only)", file=sys.stderr)
        return 2
    try:
        run_all(Path(args.out), quick=args.quick, only=only)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/summary.md and summary.csv")
    if args.docs:
        update_doc(BENCH_DOC, (Path(args.out) / "summary.md").read_text())
        print(f"regenerated the benchmark table in {BENCH_DOC}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.collect:
        try:
            result = cluster.collect(args.collect)
        except FileNotFoundError as exc:  # not finished, failed, or not a cluster directory: one line
            print(f"error: {exc}", file=sys.stderr)
            return 1
        out = result.save(args.collect)
        summary = result.summary()
        print(f"{result.config.tier} x{result.config.world_size}: median step {summary['median_step_s'] * 1e3:.2f} ms, "
              f"final loss {summary['final_loss']:.4f}, test accuracy {summary.get('test_accuracy', float('nan')):.3f}")
        print(f"wrote {out}/result.json, events.csv, steps.csv, trace.json, params.pt")
        return 0
    if args.master_addr is None:
        raise ValueError("--master-addr is required: the address or host name of node 0 (it hosts the rendezvous)")
    launch = dict(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, master_addr=args.master_addr,
                  port=args.port, max_restarts=args.max_restarts, rdzv_id=args.rdzv_id, ifname=args.ifname)
    # First: a bad launch (e.g. --nnodes 0) is named as such, not as the world size it would give.
    cluster.check(args.tier, **launch)
    cfg = config_from_args(args, args.tier, args.nnodes * args.nproc_per_node)
    plan = cluster.plan(cfg, workdir=args.workdir, **launch)
    paths = cluster.write(plan)
    for i, command in enumerate(plan.commands):
        print(f"node {i}:" + (f" (on {plan.master_addr}: it hosts the rendezvous)" if i == 0 else ""))
        print(f"  {command}")
    print("wrote " + ", ".join(str(p) for p in paths))
    print(f"next: sbatch {plan.sbatch_path} (or run the command above on every node); once it has finished: "
          f"python -m dtlab cluster --collect {plan.workdir}")
    return 0


def parse_link(text: str) -> Any:
    """``--link MBIT[:ALPHA_US]`` as a LinkModel (alpha 50 us if not given); ValueError naming the flag."""
    mbit, _, alpha = text.partition(":")
    try:
        return LinkModel.from_bandwidth(float(mbit), float(alpha or 50) * 1e-6)
    except ValueError as exc:
        raise ValueError(f"--link={text!r} is invalid: give MBIT[:ALPHA_US], e.g. 10000:50 ({exc})") from None


def cmd_estimate(args: argparse.Namespace) -> int:
    """``estimate``: the job's predicted memory per rank, nothing launched; with ``--link``, its step time too."""
    link = parse_link(args.link) if args.link else None
    if args.compute != "timed" and link is None:
        raise ValueError(f"--compute {args.compute}: the compute is priced only with --link (a step time)")
    estimate = importlib.import_module("dtlab.cost.estimate")  # pandas and fake tensors: for this command only
    est = estimate.estimate(config_from_args(args, args.tier, args.world_size), link, compute=args.compute)
    if args.json:
        print(est.to_json())
        return 0
    print(f"{args.tier} x{args.world_size}, the rank that needs the most:")
    for kind, nbytes in est.memory.items():
        print(f"  {kind:16} {nbytes / 2**20:10.3f} MiB")
    print(f"  {'peak (sum)':16} {est.peak_bytes / 2**20:10.3f} MiB")
    if est.step_ms is not None:
        print(f"  {'step time':16} {est.step_ms:10.3f} ms")
    print("assumptions:\n" + "\n".join(f"  - {a}" for a in est.assumptions))
    return 0


def cmd_exercises(args: argparse.Namespace) -> int:
    """``exercises``: each exercise's name and first sentence; with a name, its whole description."""
    exercises = importlib.import_module("dtlab.exercises")  # every checker (the planner's op counts among them)
    if args.name is not None:
        print(exercises.describe(args.name))  # ValueError lists the names
        return 0
    for name in exercises.names():
        print(f"{name:16} {exercises.describe(name).split('. ')[0]}.")
    print("\nIn a notebook: from dtlab import exercises; exercises.check(NAME, your_function) "
          "(ddp_script: the path of your script)")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """``trace``: an unmodified script run with the recorder in every rank; its folder written as a run's."""
    user = args.traced[1:] if args.traced[:1] == ["--"] else args.traced
    trace.command(user)  # a command or script that will not run is one line, before anything starts
    if args.timeout < 0:
        raise ValueError(f"--timeout {args.timeout:g}: give seconds > 0 (or 0 for torch's default)")
    check_writable(args.out, "--out")
    result, code = trace.run(user, flight_recorder=args.flight_recorder, step=args.step, timeout_s=args.timeout)
    if result is None:
        print(f"error: the traced command ended with exit code {code} before any rank left a result "
              "(see its output above)", file=sys.stderr)
        return code or 1
    out, saved = save_result(result, args.out)
    if code != 0:
        why = "was stopped (Ctrl-C)" if code == 130 else f"ended with exit code {code}"
        print(f"error: the traced command {why}; what its ranks recorded is saved", file=sys.stderr)
        if result.flight:
            print(flight.report(result), file=sys.stderr)
    comm = result.comm_summary()
    per_step = ", ".join(f"{op} {c['bytes_per_step']:.0f} B" for op, c in comm.items() if c["calls_per_step"])
    print(f"{result.config.script} x{result.config.world_size}: {result.config.steps} step(s), "
          f"median step {result.median_step_s() * 1e3:.2f} ms; per step on rank 0: {per_step or 'no collective'}")
    print(f"wrote {out}/result.json, events.csv, steps.csv, trace.json" + (f", {FLIGHT_DIR}/rank_*" if result.flight
                                                                            else ""))
    return code or (0 if saved else 1)


def cmd_clean(args: argparse.Namespace) -> int:
    """``clean``: what runs of processes that no longer exist left behind (normally their reaper removed it)."""
    removed = [str(p) for p in lifeline.sweep_folders()]
    ok, reason = netns.available()
    removed += netns.remove_stale() if ok else []
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} left-over(s) removed" + ("" if ok else f"; network namespaces not checked: {reason}"))
    return 0
