"""``run(cfg)``: check the job, start its ranks the way its tier declares, collect a RunResult.

This is the one place that reaches the launchers. A tier says how its ranks
start (``TierSpec.launcher``): ``local`` ranks from dtlab's launcher, torchrun
agents (``TierSpec.agents``: nodes, restarts, simulated hosts), named RPC
workers, or replica groups around torchft's lighthouse (``TierSpec.replicas``,
``dtlab.train.ft``). Everything that probes the machine runs here, before
any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from dtlab.core import registry
from dtlab.core.config import RunConfig, check_world_cap
from dtlab.core.env import resolve_backend
from dtlab.core.registry import AgentPlan, ReplicaPlan, TierSpec
from dtlab.core.results import RunResult
from dtlab.launch import lifeline, netns
from dtlab.launch.contract import Progress
from dtlab.launch.local import launch
from dtlab.launch.rpc import launch_rpc
from dtlab.launch.torchrun import Node, launch_torchrun
from dtlab.train.ft import run_replicas
from dtlab.train.loop import train


def preflight(cfg: RunConfig) -> None:
    """Every check that looks at the machine (files, namespaces), before any process starts."""
    resolve_backend(cfg.backend, cfg.device)  # --device cuda / --backend nccl on a machine without CUDA
    check_world_cap(cfg.world_size, "RunConfig.world_size")  # an instructor's cap on a shared server
    spec = registry.get(cfg.tier)
    spec.preflight(cfg)
    if spec.agents is not None:
        resolve_network(spec.agents(cfg))
    if spec.replicas is not None:
        resolve_network(spec.replicas(cfg))


def run(cfg: RunConfig, *, progress: Progress = True, start_method: str = "forkserver", record: bool = True,
        stop: threading.Event | None = None) -> RunResult:
    """Run a job on its tier and collect every rank's result.

    ``record=False`` switches the CommRecorder off (to measure its overhead);
    setting ``stop`` from another thread ends the run (``LaunchStopped``).
    """
    resolve_backend(cfg.backend, cfg.device)  # a device this machine lacks fails here, not in every rank
    check_world_cap(cfg.world_size, "RunConfig.world_size")  # an instructor's cap on a shared server
    spec = registry.get(cfg.tier)
    spec.preflight(cfg)  # the network is resolved (and checked) once, by _run_torchrun, before any agent starts
    if spec.launcher == "torchrun":
        return _run_torchrun(cfg, spec, progress=progress, record=record, stop=stop)
    if spec.launcher == "rpc":
        return _run_rpc(cfg, spec, progress=progress, record=record, stop=stop)
    if spec.launcher == "ft":
        plan = spec.replicas(cfg)
        return run_replicas(cfg, plan, resolve_network(plan), progress=progress, record=record, stop=stop,
                            start_method=start_method)
    start = time.perf_counter()
    out = launch(train, spec.processes(cfg), args=(cfg,), backend=cfg.backend, device=cfg.device,
                 timeout_s=cfg.timeout_s, progress=progress, start_method=start_method, record=record, stop=stop,
                 flight_recorder=cfg.flight_recorder)
    return RunResult(cfg, out.values, time.perf_counter() - start, out.logs, out.events, out.flight)


def resolve_network(plan: AgentPlan | ReplicaPlan) -> tuple[str, str]:
    """("netns" | "loopback", why loopback where namespaces were asked for but cannot be made here).

    ``network="netns"`` that cannot run here is an error (ValueError), before any process starts.
    """
    if plan.network == "loopback":
        return "loopback", ""
    ok, reason = netns.available()
    if ok:
        return "netns", ""
    if plan.network == "netns":
        raise ValueError(f"tier_options.network='netns' cannot run here: {reason.split(':')[0]}")
    return "loopback", reason


def run_on_hosts(cfg: RunConfig, nnodes: int, link_mbit: float, *, progress: Progress = False,
                 record: bool = True) -> RunResult:
    """Run a job of a ``local`` tier (fsdp, ddp, ...) as ``nnodes`` torchrun agents on simulated hosts whose links
    are capped at ``link_mbit``: what its collectives cost on a slow network. Needs root (ValueError otherwise,
    before any process starts)."""
    spec = registry.get(cfg.tier)
    if spec.launcher != "local":
        raise ValueError(f"run_on_hosts: the {cfg.tier} tier starts its own processes ({spec.launcher}); "
                         "use a tier of dtlab's local launcher")
    if nnodes < 1 or cfg.world_size % nnodes:
        raise ValueError(f"run_on_hosts: nnodes={nnodes} must divide world_size={cfg.world_size}")
    if not link_mbit > 0:
        raise ValueError(f"run_on_hosts: link_mbit={link_mbit!r} must be > 0 Mbit/s")
    resolve_backend(cfg.backend, cfg.device)
    check_world_cap(cfg.world_size, "RunConfig.world_size")
    spec.preflight(cfg)
    plan = AgentPlan(nproc_per_node=cfg.world_size // nnodes, nodes=nnodes, network="netns", link_mbit=link_mbit)
    return _run_torchrun(cfg, spec, progress=progress, record=record, stop=None, plan=plan)


def _run_torchrun(cfg: RunConfig, spec: TierSpec, *, progress: Progress, record: bool,
                  stop: threading.Event | None, plan: AgentPlan | None = None) -> RunResult:
    """Start the tier's torchrun agents (in namespaces or on loopback) and collect every rank's result."""
    plan = plan or spec.agents(cfg)
    network, reason = resolve_network(plan)
    if reason:
        print(reason)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if plan.scratch_option and not getattr(cfg.tier_options, plan.scratch_option):
            scratch = str(stack.enter_context(lifeline.folder(f"dtlab-{cfg.tier}-")))
            cfg_run = cfg.replace(tier_options=dataclasses.replace(cfg.tier_options,
                                                                   **{plan.scratch_option: scratch}))
        else:
            cfg_run = cfg
        total = max(plan.nodes, plan.max_nodes)
        if network == "netns":
            hosts = stack.enter_context(netns.SimulatedHosts(total, plan.link_mbit or None, plan.link_delay_ms))
            nodes = [Node(h.addr, h.ifname, h.netns) for h in hosts]
        else:
            nodes = [Node() for _ in range(total)]
        nodes = [n if i < plan.nodes else dataclasses.replace(n, join_at_step=plan.join_at_step)
                 for i, n in enumerate(nodes)]
        # Agents that wait for more nodes would hold the first rendezvous open for 30 s by default.
        rdzv_conf = {"last_call_timeout": 1} if plan.max_nodes > plan.nodes else None
        out = launch_torchrun(train, plan.nproc_per_node, args=(cfg_run,), nodes=nodes, nnodes=plan.nnodes,
                              backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout_s,
                              max_restarts=plan.max_restarts, rdzv_conf=rdzv_conf, progress=progress,
                              record=record, stop=stop, flight_recorder=cfg.flight_recorder)
    result = RunResult(cfg, out.values, time.perf_counter() - start, out.logs, out.events, out.flight)
    for rank in result.ranks:
        rank.strategy["network"] = network
        rank.strategy["link_mbit"] = plan.link_mbit if network == "netns" else 0.0
        rank.strategy["link_delay_ms"] = plan.link_delay_ms if network == "netns" else 0.0
    return result


def _run_rpc(cfg: RunConfig, spec: TierSpec, *, progress: Progress, record: bool,
             stop: threading.Event | None) -> RunResult:
    """The tier's named RPC workers, each running ``spec.rpc_main(worker, cfg)``."""
    o = cfg.tier_options
    start = time.perf_counter()
    out = launch_rpc(spec.rpc_main, spec.rpc_names(cfg), args=(cfg,), rpc_timeout_s=o.rpc_timeout_s,
                     bind_address=o.bind_address, timeout_s=cfg.timeout_s, progress=progress, record=record,
                     threads=cfg.threads_per_rank, stop=stop)
    # Not out.events: an RPC launch's events are its calls, which each rank's RankResult holds already.
    return RunResult(cfg, out.values, time.perf_counter() - start, out.logs)
