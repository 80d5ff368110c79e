"""Command line: ``python -m dtlab run | compare | bench | cluster | clean``."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from dtlab import exercises, tiers
from dtlab.app.bench import BENCH_DOC, run_all, update_doc
from dtlab.app.saving import check_writable, fallback, save_result
from dtlab.core import options
from dtlab.core.config import RunConfig
from dtlab.core.env import resolve_backend
from dtlab.core.failures import RankError
from dtlab.core.results import FLIGHT_DIR, RunResult
from dtlab.cost import estimate
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.experiments.compare import compare, format_table, save_comparison
from dtlab.launch import cluster, lifeline, netns
from dtlab.read import flight
from dtlab.train import preflight, run


def _add_job_args(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--model", default=d.model, help="mlp, cnn, cnn-bn, charformer, moe or package.module:factory")
    p.add_argument("--model-size", type=int, default=d.model_size, help="width of the built-in model")
    p.add_argument("--model-depth", type=int, default=d.model_depth, help="mlp hidden layers / charformer blocks")
    p.add_argument("--heads", type=int, default=d.model_heads, help="charformer / moe attention heads")
    p.add_argument("--dataset", default=d.dataset, help="digits, synthetic, text or package.module:factory")
    p.add_argument("--dataset-size", type=int, default=d.dataset_size, help="samples (synthetic only)")
    p.add_argument("--batch-size", type=int, default=d.global_batch_size, help="global batch size")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", default=d.optimizer, help="sgd, adam or muon")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", default=d.backend, help="auto, gloo or nccl")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=d.threads_per_rank, help="threads per rank (0: cores / ranks)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds a collective may wait")
    p.add_argument("--slow-rank", default=d.slow_rank, metavar="RANK:DELAY",
                   help="make one rank a straggler, e.g. 1:5ms (it computes that much longer every step)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's forward in backward (less activation memory, more compute)")
    p.add_argument("--precision", default=d.precision, help="fp32 or bf16 (autocast of the forward and loss)")
    p.add_argument("--dtype", default=d.dtype, help="float32 or float64: the parameters' and inputs' dtype")
    p.add_argument("--experts", type=int, default=d.experts, help="--model moe: experts per layer")
    p.add_argument("--top-k", type=int, default=d.top_k, help="--model moe: experts each token is sent to")
    p.add_argument("--capacity-factor", type=float, default=d.capacity_factor,
                   help="--model moe: tokens an expert takes, as a multiple of an even share (0: dropless)")
    p.add_argument("--aux-loss-coef", type=float, default=d.aux_loss_coef,
                   help="--model moe: weight of the load-balancing loss in the loss (0: none)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a tier option, e.g. --opt bucket_cap_mb=1 (repeatable); booleans true/false, "
                   "lists comma-separated: --opt faults=sigkill:7:1,exception:12:0")


def tier_options(tier: str, pairs: list[str]) -> Any:
    """Build the tier's Options from ``--opt KEY=VALUE`` strings (converted by ``dtlab.core.options``).

    A tuple option takes comma-separated values (``--opt faults=sigkill:7:1,exception:12:0``); given
    twice, its values add up. Anything that does not fit is one line naming ``--opt`` and the field.
    """
    spec = tiers.get(tier)
    known = options.fields(spec.options)
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            what = "is not KEY=VALUE" if not sep else f"tier {tier!r} has no option {key!r}"
            raise ValueError(f"--opt {pair}: {what}; it takes: {', '.join(known) or 'no options'}")
        try:
            value = options.parse(known[key], raw, key)
        except options.OptionError as exc:
            raise ValueError(f"--opt {exc}") from None
        values[key] = values.get(key, ()) + value if known[key] == "tuple" else value
    return spec.options(**values)


def config_from_args(args: argparse.Namespace, tier: str, world_size: int) -> RunConfig:
    return RunConfig(
        tier=tier, world_size=world_size, model=args.model, model_size=args.model_size, model_depth=args.model_depth,
        model_heads=args.heads, dataset=args.dataset,
        dataset_size=args.dataset_size, global_batch_size=args.batch_size, steps=args.steps, lr=args.lr,
        optimizer=args.optimizer, seed=args.seed, backend=args.backend, device=args.device,
        threads_per_rank=args.threads, timeout_s=args.timeout, slow_rank=args.slow_rank,
        activation_checkpointing=args.activation_checkpointing, precision=args.precision, dtype=args.dtype,
        experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef, flight_recorder=getattr(args, "flight_recorder", False),
        tier_options=tier_options(tier, args.opt),
    )


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


def _split(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} {text!r}: give one or more comma-separated values")
    return items


def _world_sizes(text: str) -> list[int]:
    sizes = []
    for item in _split(text, "--world-sizes"):
        try:
            sizes.append(int(item))
        except ValueError:
            raise ValueError(f"--world-sizes {text}: {item!r} is not an integer (write e.g. 1,2,4)") from None
    return sizes


def cmd_compare(args: argparse.Namespace) -> int:
    if args.opt:
        raise ValueError("--opt: compare runs every tier with its default options; use 'run --tier T --opt ...'")
    names = _split(args.tiers, "--tiers")
    for name in names:
        if name not in tiers.TIERS:
            raise ValueError(f"--tiers {args.tiers}: unknown tier {name!r}: choose from {', '.join(tiers.TIERS)}")
    sizes = _world_sizes(args.world_sizes)
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


# The flag that sets each RunConfig field, to name it in an error about that field.
FLAGS = {"tier": "--tier", "world_size": "--world-size", "model": "--model", "model_size": "--model-size",
         "model_depth": "--model-depth", "model_heads": "--heads", "dataset": "--dataset",
         "dataset_size": "--dataset-size",
         "global_batch_size": "--batch-size", "steps": "--steps", "lr": "--lr", "optimizer": "--optimizer",
         "seed": "--seed", "backend": "--backend", "device": "--device", "threads_per_rank": "--threads",
         "timeout_s": "--timeout", "slow_rank": "--slow-rank",
         "activation_checkpointing": "--activation-checkpointing", "precision": "--precision", "dtype": "--dtype",
         "experts": "--experts", "top_k": "--top-k", "capacity_factor": "--capacity-factor",
         "aux_loss_coef": "--aux-loss-coef", "flight_recorder": "--flight-recorder"}
COMMAND_FLAGS = {"compare": {"world_size": "--world-sizes", "tier": "--tiers"},
                 "cluster": {"world_size": "--nnodes x --nproc-per-node"}}


def name_flag(message: str, args: argparse.Namespace) -> str:
    """Prefix an error about a RunConfig field or a tier option with the flag that sets it."""
    found = re.search(r"(RunConfig|tier_options)\.(\w+)", message)
    if message.startswith("--") or not found:
        return message
    where, name = found.groups()
    if where == "tier_options":
        given = [p for p in getattr(args, "opt", []) if p.partition("=")[0].strip().replace("-", "_") == name]
        return f"--opt {given[-1] if given else name}: {message}"
    flag = COMMAND_FLAGS.get(args.command, {}).get(name) or FLAGS.get(name)
    return f"{flag}: {message}" if flag else message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


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
    if args.name is not None:
        print(exercises.describe(args.name))  # ValueError lists the names
        return 0
    for name in exercises.names():
        print(f"{name:16} {exercises.describe(name).split('. ')[0]}.")
    print("\nIn a notebook: from dtlab import exercises; exercises.check(NAME, your_function) "
          "(ddp_script: the path of your script)")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """``clean``: what runs of processes that no longer exist left behind (normally their reaper removed it)."""
    removed = [str(p) for p in lifeline.sweep_folders()]
    ok, reason = netns.available()
    removed += netns.remove_stale() if ok else []
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} left-over(s) removed" + ("" if ok else f"; network namespaces not checked: {reason}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m dtlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one tier and write result.json, events.csv, trace.json, params.pt")
    p_run.add_argument("--tier", default="single", help=f"one of {', '.join(tiers.TIERS)}")
    p_run.add_argument("--world-size", type=int, default=1)
    p_run.add_argument("--out", default="results/run", help="output folder")
    p_run.add_argument("--quiet", action="store_true", help="no progress bar")
    p_run.add_argument("--flight-recorder", action="store_true",
                       help="PyTorch's Flight Recorder in every rank: each rank's dump in OUT/flight_recorder; "
                            "a hang's report names the rank, the collective and its sequence number")
    _add_job_args(p_run)
    p_run.set_defaults(func=cmd_run)
    p_cmp = sub.add_parser("compare", help="run several tiers on the same job and compare them with 'single'")
    p_cmp.add_argument("--tiers", default="single", help="comma-separated tiers")
    p_cmp.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    p_cmp.add_argument("--out", default=None, help="output folder")
    p_cmp.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_job_args(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)
    p_est = sub.add_parser("estimate", help="predict a run's memory per rank without starting it (the same flags "
                           "as run)")
    p_est.add_argument("--tier", default="single", help=f"one of {', '.join(tiers.TIERS)}")
    p_est.add_argument("--world-size", type=int, default=1)
    p_est.add_argument("--json", action="store_true", help="JSON: memory, memory_max_over_ranks, peak_bytes, step_ms, "
                       "assumptions, per_rank")
    p_est.add_argument("--link", default="", metavar="MBIT[:ALPHA_US]",
                       help="predict the step time too, on a link of this bandwidth (Mbit/s) and latency (us, "
                            "default 50)")
    p_est.add_argument("--compute", default="timed", choices=("timed", "predicted"),
                       help="with --link: a rank's compute timed here (default), or predicted on this machine's "
                            "roofline (python -m dtlab.cost.roofline saves it)")
    _add_job_args(p_est)
    p_est.set_defaults(func=cmd_estimate)
    p_bench = sub.add_parser("bench", help="run every benchmark in benchmarks/ and summarise their ratios")
    p_bench.add_argument("--quick", action="store_true", help="smoke mode: checks each benchmark runs")
    p_bench.add_argument("--only", default="", help="comma-separated benchmark names")
    p_bench.add_argument("--out", default="results/bench", help="output folder")
    p_bench.add_argument("--docs", "--readme", dest="docs", action="store_true",
                         help="regenerate the benchmark table in docs/measurement.md (--readme is the same flag)")
    p_bench.set_defaults(func=cmd_bench)
    p_ex = sub.add_parser("exercises", help="list the exercises (write an algorithm, dtlab checks it), or describe one")
    p_ex.add_argument("name", nargs="?", default=None, help="an exercise to describe")
    p_ex.set_defaults(func=cmd_exercises)
    p_cl = sub.add_parser("cluster", help="write a multi-node torchrun job (node commands and a SLURM script), "
                          "or --collect its results")
    p_cl.add_argument("--tier", default="ddp", help=f"one of {', '.join(cluster.TIERS)}")
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
    _add_job_args(p_cl)
    p_cl.set_defaults(func=cmd_cluster)
    p_clean = sub.add_parser("clean", help="remove the temporary folders, network namespaces and links of runs whose "
                             "process died (a killed kernel's, if even its reaper was killed)")
    p_clean.set_defaults(func=cmd_clean)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one clear line, not a traceback
        line = " ".join(str(exc).split())  # a message spanning lines still prints as one
        print(f"error: {name_flag(line, args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

