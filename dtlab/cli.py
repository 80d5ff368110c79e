"""Command line: ``python -m dtlab run | compare | bench | cluster``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from dtlab import cluster, tiers
from dtlab.config import RunConfig


def _add_job_args(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--model", default=d.model, help="mlp, cnn, cnn-bn, charformer or package.module:factory")
    p.add_argument("--model-size", type=int, default=d.model_size, help="width of the built-in model")
    p.add_argument("--model-depth", type=int, default=d.model_depth, help="mlp hidden layers / charformer blocks")
    p.add_argument("--dataset", default=d.dataset, help="digits, synthetic or text")
    p.add_argument("--dataset-size", type=int, default=d.dataset_size, help="samples (synthetic only)")
    p.add_argument("--batch-size", type=int, default=d.global_batch_size, help="global batch size")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", default=d.optimizer, help="sgd or adam")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", default=d.backend, help="auto, gloo or nccl")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=d.threads_per_rank, help="threads per rank (0: cores / ranks)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds a collective may wait")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a tier option, e.g. --opt bucket_cap_mb=1 (repeatable)")


def tier_options(tier: str, pairs: list[str]) -> Any:
    """Build the tier's Options from KEY=VALUE strings, converting to each field's type."""
    options_cls = tiers.get(tier).Options
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in fields:
            allowed = ", ".join(fields) or "none"
            raise ValueError(f"--opt {pair!r}: tier {tier!r} takes options: {allowed}")
        default = fields[key].default
        values[key] = _convert(raw, default)
    return options_cls(**values)


def _convert(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"expected a boolean, got {raw!r}")
        return raw.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if default is None and raw.lower() == "none":
        return None
    return raw


def config_from_args(args: argparse.Namespace, tier: str, world_size: int) -> RunConfig:
    return RunConfig(
        tier=tier, world_size=world_size, model=args.model, model_size=args.model_size, model_depth=args.model_depth,
        dataset=args.dataset,
        dataset_size=args.dataset_size, global_batch_size=args.batch_size, steps=args.steps, lr=args.lr,
        optimizer=args.optimizer, seed=args.seed, backend=args.backend, device=args.device,
        threads_per_rank=args.threads, timeout_s=args.timeout, tier_options=tier_options(tier, args.opt),
    )


def cmd_run(args: argparse.Namespace) -> int:
    from dtlab.train import run

    cfg = config_from_args(args, args.tier, args.world_size)
    result = run(cfg, progress=not args.quiet)
    out = result.save(args.out)
    summary = result.summary()
    print(f"{cfg.tier} x{cfg.world_size}: median step {summary['median_step_s'] * 1e3:.2f} ms, "
          f"{summary['samples_per_s']:.0f} samples/s, final loss {summary['final_loss']:.4f}, "
          f"test accuracy {summary.get('test_accuracy', float('nan')):.3f}")
    print(f"wrote {out}/result.json, events.csv, steps.csv, trace.json, params.pt")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dtlab.compare import compare, format_table

    names = [t.strip() for t in args.tiers.split(",") if t.strip()]
    sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    base = config_from_args(args, "single", 1)
    table = compare(base, names, sizes, out_dir=Path(args.out) if args.out else None, progress=not args.quiet)
    print(format_table(table))
    if args.out:
        print(f"wrote {args.out}/compare.csv and one folder per run")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dtlab.bench import run_all

    only = [n.strip() for n in args.only.split(",")] if args.only else None
    if args.readme and (args.quick or only):
        print("error: --readme needs the full run of every benchmark (no --quick, no --only)", file=sys.stderr)
        return 2
    try:
        run_all(Path(args.out), quick=args.quick, only=only)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/summary.md and summary.csv")
    if args.readme:
        from dtlab.bench import update_readme

        readme = Path(__file__).resolve().parents[1] / "README.md"
        update_readme(readme, (Path(args.out) / "summary.md").read_text())
        print(f"regenerated the benchmark table in {readme}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one tier and write result.json, events.csv, trace.json, params.pt")
    p_run.add_argument("--tier", default="single", help=f"one of {', '.join(tiers.TIERS)}")
    p_run.add_argument("--world-size", type=int, default=1)
    p_run.add_argument("--out", default="results/run", help="output folder")
    p_run.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_job_args(p_run)
    p_run.set_defaults(func=cmd_run)
    p_cmp = sub.add_parser("compare", help="run several tiers on the same job and compare them with 'single'")
    p_cmp.add_argument("--tiers", default="single", help="comma-separated tiers")
    p_cmp.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    p_cmp.add_argument("--out", default=None, help="output folder")
    p_cmp.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_job_args(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)
    p_bench = sub.add_parser("bench", help="run every benchmark in benchmarks/ and summarise their ratios")
    p_bench.add_argument("--quick", action="store_true", help="smoke mode: checks each benchmark runs")
    p_bench.add_argument("--only", default="", help="comma-separated benchmark names")
    p_bench.add_argument("--out", default="results/bench", help="output folder")
    p_bench.add_argument("--readme", action="store_true", help="regenerate README.md's benchmark table")
    p_bench.set_defaults(func=cmd_bench)
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
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one clear line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

