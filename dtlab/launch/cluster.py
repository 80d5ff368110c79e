"""``python -m dtlab cluster``: the launch the multinode and elastic tiers simulate, on real nodes.

``plan`` turns a RunConfig into the torchrun command every node runs -- built by
``torchrun_command``, the same function behind ``launch_torchrun``, so what the
notebooks teach is what runs on the cluster. ``write`` leaves the job
(``config.json``) and a SLURM batch script in WORKDIR, a directory every node
shares; ``dtlab.launch.worker`` loads the job from there on each rank and leaves its
result next to it. ``collect`` reads those results back as the RunResult that
``dtlab.run`` returns, so the same analysis applies to the cluster run.

Every check runs in ``plan``, before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from dtlab.core import events, registry
from dtlab.core.config import RunConfig
from dtlab.core.flight import dump_files
from dtlab.core.results import FLIGHT_DIR, RunResult, atomic_write
from dtlab.launch import workdir as workdir_files
from dtlab.launch.torchrun import load_results, result_paths, torchrun_command

__all__ = ["SBATCH", "TIERS", "ClusterPlan", "check", "collect", "plan", "write"]

# The tiers whose ranks are plain torchrun workers: dtlab.launch.worker runs train() with the process group up.
TIERS = registry.CLUSTER
_NOT_HERE = {
    "single": "it trains one rank in one process, so there is nothing to spread over nodes",
    "dp": "it is one process driving replicas (threads or local GPUs), not ranks torchrun starts",
    "rpc": "it starts its own parameter server and trainers over torch.distributed.rpc, not torchrun workers",
    "pipeline": "dtlab cluster does not offer it (yet)",
}
SBATCH = "dtlab.sbatch"
SNAPSHOTS = "snapshots"  # the elastic tier's snapshot directory inside WORKDIR, unless its options name one
# What a run leaves in WORKDIR. write() removes a previous run's so that collect() never mixes two runs,
# and a leftover launch_torchrun payload, which the worker would run instead of config.json.
_STALE = (workdir_files.PAYLOAD, events.EVENTS, workdir_files.progress_path(Path()).name, "result-rank*.pkl",
          "error-rank*.json")


@dataclass(frozen=True)
class ClusterPlan:
    """A cluster run, ready to write: the job, its shared directory and what each node runs."""

    config: RunConfig
    workdir: Path  # absolute: every node must find the same directory
    commands: tuple[str, ...]  # node i's shell command (all the same: see plan)
    sbatch: str  # the SLURM batch script write() leaves in WORKDIR
    master_addr: str
    port: int

    @property
    def config_path(self) -> Path:
        return self.workdir / workdir_files.CONFIG

    @property
    def sbatch_path(self) -> Path:
        return self.workdir / SBATCH


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")


def _word(name: str, value: object, what: str) -> None:
    """A non-empty string without whitespace (it becomes one argument, and one #SBATCH value)."""
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{name}={value!r} is invalid: give {what} (non-empty, no spaces)")


def check(tier: str, *, nnodes: int, nproc_per_node: int, master_addr: str, port: int = 29500,
          max_restarts: int | None = None, rdzv_id: str = "dtlab", ifname: str | None = None) -> None:
    """Raise ValueError, naming the setting, for a launch a cluster cannot run; ``plan`` calls it first."""
    if tier not in TIERS:
        why = _NOT_HERE.get(tier, "it is not a dtlab tier")
        raise ValueError(f"tier {tier!r} cannot run on a cluster: {why}; choose one of {', '.join(TIERS)}")
    _at_least("nnodes", nnodes, 1)
    _at_least("nproc_per_node", nproc_per_node, 1)
    _at_least("port", port, 1)
    if port > 65535:
        raise ValueError(f"port={port} is invalid: a TCP port is 1..65535")
    if max_restarts is not None:
        _at_least("max_restarts", max_restarts, 0)
    _word("master_addr", master_addr, "the address or host name of node 0, which hosts the rendezvous")
    if ":" in master_addr and not (master_addr.startswith("[") and master_addr.endswith("]")):
        raise ValueError(f"master_addr={master_addr!r} is invalid: give the port as port=..., and an IPv6 "
                         f"address in brackets ('[::1]')")
    _word("rdzv_id", rdzv_id, "an id the nodes of this run share")
    if ifname is not None:
        _word("ifname", ifname, "the network interface the nodes reach each other on, e.g. 'eth0' (or omit it)")


def _node_env(ifname: str | None) -> dict[str, str]:
    env = {
        # torchrun's agents otherwise share their rendezvous store with the workers, and after a failure
        # a dead worker's stale keys there can derail the restarted group (see dtlab.tiers.elastic).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",  # the ranks' output reaches the node's log as it is printed
    }
    if ifname:  # without one, gloo and NCCL take the interface the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ifname
    return env


def _for_cluster(cfg: RunConfig, world: int, nnodes: int, max_restarts: int, workdir: Path) -> RunConfig:
    """The job at its real world size, with the tier options that describe the launch made consistent with it."""
    o = cfg.tier_options
    if cfg.tier == "multinode":
        if o.link_mbit:
            raise ValueError(f"multinode tier_options.link_mbit={o.link_mbit:g} is invalid on a cluster: it caps "
                             f"simulated links; a cluster's links are what they are (use 0)")
        o = dataclasses.replace(o, nnodes=nnodes)
    elif cfg.tier == "elastic":
        if any(str(f).startswith("oom") for f in o.faults):
            raise ValueError("elastic tier_options.faults: an 'oom' fault needs the re-batching of dtlab.run's "
                             "elastic launch, which a cluster's workers (train from config.json) do not do")
        o = dataclasses.replace(o, nnodes=str(nnodes), max_restarts=max_restarts)
    # Validates the whole job again at its world size (batch divisibility, tier checks).
    cfg = cfg.replace(world_size=world, tier_options=o)
    if cfg.tier == "elastic" and not o.snapshot_dir:
        # Last: this validation creates the directory (it probes that it is writable), so only a job that
        # is valid in every other way gets here. In the shared WORKDIR, every node sees the same snapshots.
        cfg = cfg.replace(tier_options=dataclasses.replace(o, snapshot_dir=str(workdir / SNAPSHOTS)))
    return cfg


def plan(cfg: RunConfig, *, nnodes: int, nproc_per_node: int, master_addr: str, port: int = 29500,
         workdir: str | os.PathLike[str], max_restarts: int | None = None, rdzv_id: str = "dtlab",
         ifname: str | None = None, python: str = sys.executable) -> ClusterPlan:
    """The commands that run ``cfg`` on ``nnodes`` machines with ``nproc_per_node`` ranks each.

    ``cfg.world_size`` must be ``nnodes * nproc_per_node``, or 1 (the default, then set to it).
    ``max_restarts`` (torchrun's) defaults to the elastic tier's own option, else 0. ``ifname`` is
    the interface the nodes reach each other on (gloo's and NCCL's); omitted, gloo takes the one the
    host name resolves to. ``python`` must exist at the same path on every node (a shared venv).
    Raises ValueError before anything is written.
    """
    check(cfg.tier, nnodes=nnodes, nproc_per_node=nproc_per_node, master_addr=master_addr, port=port,
          max_restarts=max_restarts, rdzv_id=rdzv_id, ifname=ifname)
    if callable(cfg.model):
        raise ValueError(f"RunConfig.model={cfg.model!r} cannot be sent to a cluster in config.json: give a "
                         f"built-in name or an import path 'package.module:factory' every node can import")
    if callable(cfg.dataset):
        raise ValueError(f"RunConfig.dataset={cfg.dataset!r} cannot be sent to a cluster in config.json: give a "
                         f"built-in name or an import path 'package.module:factory' every node can import")
    world = nnodes * nproc_per_node
    if cfg.world_size not in (1, world):
        raise ValueError(f"RunConfig.world_size={cfg.world_size} does not match the cluster: nnodes x "
                         f"nproc_per_node = {nnodes} x {nproc_per_node} = {world} ranks")
    # Not resolve(): a symlink may resolve to a path that exists only on this host (an automount).
    work = Path(os.path.abspath(workdir))
    if any(c.isspace() for c in str(work)):
        raise ValueError(f"workdir={str(work)!r} is invalid: an #SBATCH line cannot hold a path with spaces")
    if max_restarts is None:
        max_restarts = cfg.tier_options.max_restarts if cfg.tier == "elastic" else 0
    cfg = _for_cluster(cfg, world, nnodes, max_restarts, work)
    json.dumps(cfg.to_dict())  # a value config.json cannot hold fails here, not on the nodes
    env = _node_env(ifname)
    argv = torchrun_command(work, nproc_per_node, nnodes=str(nnodes), port=port, rdzv_id=rdzv_id,
                            max_restarts=max_restarts, rdzv_host=master_addr, local_addr=None, python=python)
    # On a real cluster every node runs this same command. Node 0 is the one on master_addr: torchrun sees
    # the address is its own and hosts the rendezvous there (another node that thinks so too finds the port
    # taken and joins as a client); which node's ranks come first, torchrun decides at the rendezvous.
    command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
    return ClusterPlan(cfg, work, (command,) * nnodes, _sbatch(cfg, work, nnodes, nproc_per_node, port,
                                                               max_restarts, env, python), master_addr, port)


def _sbatch(cfg: RunConfig, work: Path, nnodes: int, nproc_per_node: int, port: int, max_restarts: int,
            env: dict[str, str], python: str) -> str:
    """A SLURM batch script: one task per node, each a torchrun agent that starts the node's ranks."""
    # The shell fills these in at run time: the allocation's first node, and an id unique to the job.
    master, job_id = f"${{MASTER_ADDR}}:{port}", "${SLURM_JOB_ID}"
    argv = torchrun_command(work, nproc_per_node, nnodes=str(nnodes), port=port, rdzv_id=job_id,
                            max_restarts=max_restarts, rdzv_host="${MASTER_ADDR}", local_addr=None, python=python)

    def quote(arg: str) -> str:
        return f'"{arg}"' if arg in (master, job_id) else shlex.quote(arg)

    launcher, entry = argv[:-3], argv[-3:]  # entry: -m dtlab.launch.worker WORKDIR
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    return f"""#!/bin/bash
#SBATCH --job-name=dtlab-{cfg.tier}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --output={work}/slurm-%j.out
# dtlab cluster: tier {cfg.tier}, {nnodes} node(s) x {nproc_per_node} rank(s). Add what your cluster
# needs above (a partition, a time limit, --gpus-per-node={nproc_per_node} for GPU ranks).
set -euo pipefail

# The allocation's first node hosts the rendezvous; every node runs the same torchrun command.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
{exports}

# One task per node: each is a torchrun agent, which starts its node's ranks. If one
# agent gives up, srun stops the others instead of leaving them waiting for it.
srun --kill-on-bad-exit=1 \\
    {" ".join(quote(a) for a in launcher)} \\
    {" ".join(quote(a) for a in entry)}

# When it has finished: python -m dtlab cluster --collect {shlex.quote(str(work))}
"""


def write(plan: ClusterPlan) -> list[Path]:
    """Write WORKDIR/config.json (the job the workers load) and WORKDIR/dtlab.sbatch; return their paths."""
    work = plan.workdir
    work.mkdir(parents=True, exist_ok=True)
    for pattern in _STALE:
        for path in work.glob(pattern):
            path.unlink()
    atomic_write(plan.config_path, json.dumps(plan.config.to_dict(), indent=2).encode())
    atomic_write(plan.sbatch_path, plan.sbatch.encode())
    plan.sbatch_path.chmod(0o755)
    return [plan.config_path, plan.sbatch_path]


def collect(workdir: str | os.PathLike[str]) -> RunResult:
    """Every rank's result in WORKDIR (once all nodes have finished) as a RunResult, with the run's events.

    Raises FileNotFoundError naming WORKDIR and the ranks whose results are missing.
    """
    work = Path(workdir)
    if not (work / workdir_files.CONFIG).is_file():
        raise FileNotFoundError(f"{work} holds no {workdir_files.CONFIG}: not a dtlab cluster directory "
                                f"(python -m dtlab cluster ... --workdir {work} writes one)")
    cfg = workdir_files.read_config(work)
    paths = result_paths(work)
    missing = [r for r in range(cfg.world_size) if r not in paths]
    if missing:
        raise FileNotFoundError(_missing(work, missing, cfg.world_size))
    run_events = events.read_events(work)
    # No launcher timed the run: it lasted from the first worker's start to the last one's finish.
    times = [e["time"] for e in run_events if e.get("kind") in ("worker_start", "worker_finish")]
    wall_s = max(times) - min(times) if times else 0.0
    flight = {r: p.read_bytes() for r, p in dump_files(work / FLIGHT_DIR).items()}  # with cfg.flight_recorder
    return RunResult(cfg, load_results(paths[r] for r in range(cfg.world_size)), wall_s, {}, run_events, flight)


def _missing(work: Path, missing: list[int], world: int) -> str:
    ranks = ", ".join(map(str, missing))
    message = (f"{work}: no result from rank(s) {ranks} of {world}: the run has not finished, it failed, or "
               f"{work} is not a directory every node shares")
    for path in sorted(work.glob("error-rank*.json")):
        error = json.loads(path.read_text())
        message += f"; rank {error['rank']} failed: {error['error_type']}: "
        message += (error["message"].splitlines() or [""])[0]
    logs = sorted(p.name for p in work.glob("slurm-*.out"))
    if logs:
        message += f" (see {', '.join(logs)})"
    return message
