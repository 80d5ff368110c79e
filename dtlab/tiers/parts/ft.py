"""What the ft and diloco tiers share: replica groups, their faults, and torchft's Manager on dtlab's terms.

Both tiers run under the ``ft`` launcher (``dtlab.launch.ft``): ``replicas``
groups of ``ranks_per_replica`` ranks, each group a world of its own, joined by
torchft's lighthouse. Each group's ranks build one torchft ``Manager``, which
asks the lighthouse which groups take part and averages across them over a gloo
process group that it rebuilds whenever that answer changes.

torchft is imported lazily, inside the functions that need it, so that
``import dtlab`` and every other tier work without it installed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo
from dtlab.core.events import emit
from dtlab.core.ft import HEARTBEAT_INTERVAL_MS, ReplicaIdentity
from dtlab.core.registry import ReplicaPlan
from dtlab.instrument.recorder import tag_methods

__all__ = ["FAULT_KINDS", "INSTALL", "NETWORKS", "Fault", "Faults", "QuorumLog", "ReplicaOptions", "make_manager",
           "parse_faults", "plan", "preflight", "require_torchft", "validate", "wait_for_all"]

TORCHFT_VERSION = "0.2.0"
INSTALL = f"pip install torchft=={TORCHFT_VERSION}"
FAULT_KINDS = ("kill", "sigkill", "exception")  # kill and sigkill are the same: SIGKILL, no Python error
NETWORKS = ("loopback", "netns", "auto")
# Consecutive uncommitted steps before a group gives up. A dead peer costs one (its all-reduce fails), a quorum
# change at most one more: many in a row mean something is broken, and an endless loop would hide it.
MAX_COMMIT_RETRIES = 20


@dataclass(frozen=True)
class ReplicaOptions:
    """The knobs of a tier made of replica groups (see ``dtlab.core.registry.ReplicaPlan``)."""

    replicas: int = 2
    ranks_per_replica: int = 1  # world_size = replicas x ranks_per_replica
    min_replicas: int = 1
    max_restarts: int = 3  # per replica group
    faults: tuple[str, ...] = ()  # "KIND:STEP:REPLICA", KIND kill or exception, e.g. "kill:10:1"
    network: str = "loopback"  # "netns": one simulated host per replica group (root)
    link_mbit: float = 0.0  # cap of each host's link (netns only); 0: uncapped
    lighthouse_port: int = 0  # 0: a free port


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    replica: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.step}:{self.replica}"


def parse_faults(faults: tuple[str, ...], steps: int, replicas: int, name: str) -> list[Fault]:
    """``("kill:10:1",)`` -> [Fault("kill", 10, 1)]; ValueError naming the entry otherwise."""
    out = []
    for text in faults:
        parts, where = str(text).split(":"), f"{name}.faults entry {text!r}"
        if len(parts) != 3 or parts[0] not in FAULT_KINDS:
            raise ValueError(f"{where} is invalid: write KIND:STEP:REPLICA with KIND one of {', '.join(FAULT_KINDS)}")
        try:
            step, replica = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"{where} is invalid: STEP and REPLICA must be integers") from None
        if not 0 <= step < steps:
            raise ValueError(f"{where} is invalid: step {step} is beyond the run (steps 0..{steps - 1})")
        if not 0 <= replica < replicas:
            raise ValueError(f"{where} is invalid: replica group {replica} does not exist (0..{replicas - 1})")
        out.append(Fault(parts[0], step, replica))
    return out


def _count(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")


def validate(cfg: RunConfig) -> None:
    """The replica-group knobs; pure (no torchft, no sockets)."""
    o: ReplicaOptions = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    _count(f"{name}.replicas", o.replicas, 1)
    _count(f"{name}.ranks_per_replica", o.ranks_per_replica, 1)
    if cfg.world_size % o.ranks_per_replica:
        raise ValueError(f"{name}.ranks_per_replica={o.ranks_per_replica} does not divide world_size="
                         f"{cfg.world_size}: every replica group runs the same number of ranks")
    if o.replicas * o.ranks_per_replica != cfg.world_size:
        raise ValueError(f"{name}.replicas={o.replicas} x ranks_per_replica={o.ranks_per_replica} must equal "
                         f"world_size={cfg.world_size} (give replicas={cfg.world_size // o.ranks_per_replica})")
    _count(f"{name}.min_replicas", o.min_replicas, 1)
    if o.min_replicas > o.replicas:
        raise ValueError(f"{name}.min_replicas={o.min_replicas} is invalid: the run has {o.replicas} replica groups")
    _count(f"{name}.max_restarts", o.max_restarts, 0)
    if o.network not in NETWORKS:
        raise ValueError(f"{name}.network={o.network!r} is invalid: choose one of {', '.join(NETWORKS)}")
    if not o.link_mbit >= 0:
        raise ValueError(f"{name}.link_mbit={o.link_mbit!r} is invalid: must be >= 0 Mbit/s (0: uncapped)")
    if o.link_mbit and o.network == "loopback":
        raise ValueError(f"{name}.link_mbit={o.link_mbit:g} needs network='netns' (or 'auto' as root): "
                         f"loopback replica groups share one uncapped interface")
    if not isinstance(o.lighthouse_port, int) or not 0 <= o.lighthouse_port <= 65535:
        raise ValueError(f"{name}.lighthouse_port={o.lighthouse_port!r} is invalid: a port 1..65535, or 0 for a "
                         f"free one")
    faults = parse_faults(o.faults, cfg.steps, o.replicas, name)
    if faults and o.replicas < 2:
        raise ValueError(f"{name}.faults need replicas >= 2: a failed replica group recovers from a live peer")
    # More faults on a group than max_restarts is allowed: the group is then lost and the others finish without it.


def require_torchft(tier: str) -> Any:
    """The torchft module, or a one-line ValueError saying how to install it."""
    try:
        import torchft  # lazy: only these tiers need it
    except ImportError:
        raise ValueError(f"the {tier} tier needs torchft, which is not installed: {INSTALL}") from None
    return torchft


def preflight(cfg: RunConfig) -> None:
    """torchft importable; a given lighthouse port free (before anything starts)."""
    require_torchft(cfg.tier)
    port = cfg.tier_options.lighthouse_port
    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ValueError(f"{cfg.tier} tier_options.lighthouse_port={port}: 127.0.0.1:{port} is already "
                                 f"in use; choose another port, or 0 for a free one") from None


def plan(cfg: RunConfig) -> ReplicaPlan:
    o: ReplicaOptions = cfg.tier_options
    return ReplicaPlan(o.replicas, o.ranks_per_replica, o.min_replicas, o.max_restarts, o.network, o.link_mbit,
                       o.lighthouse_port)


class Faults:
    """The faults meant for this process: those of its replica group, fired on the group's rank 0.

    A group's k-th fault fires in its k-th attempt (the restarts before it are the earlier faults'),
    at its step; a fault whose step the group never runs (it rejoined later) does not fire.
    """

    def __init__(self, faults: list[Fault], ident: ReplicaIdentity, group_rank: int) -> None:
        mine = sorted((f for f in faults if f.replica == ident.replica), key=lambda f: f.step)
        self.pending = mine[ident.attempt:] if group_rank == 0 else []
        self.ident = ident

    def fire(self, step: int) -> None:
        due = next((f for f in self.pending if f.step == step), None)
        if due is None:
            return
        self.pending.remove(due)
        emit("fault", fault=due.kind, step=step, replica=self.ident.replica, replica_attempt=self.ident.attempt)
        if due.kind in ("kill", "sigkill"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault: exception in replica group {due.replica} at step {step}")


def wait_for_all(manager: Any, ident: ReplicaIdentity, timeout_s: float) -> None:
    """At the first start, ask for quorums until every replica group is in one.

    The lighthouse forms a quorum as soon as ``min_replicas`` groups ask, so the group that starts
    first would otherwise train its first steps alone. (A restarted group does not wait: it joins
    whatever quorum the live groups form next.)
    """
    deadline = time.monotonic() + timeout_s
    manager.start_quorum()
    while manager.num_participants() < ident.replicas:  # blocks until the quorum asked for has formed
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {manager.num_participants()} of {ident.replicas} replica groups joined the "
                               f"first quorum within timeout_s={timeout_s:g} s")
        time.sleep(0.05)  # the lighthouse answers a lone group at once: do not flood it
        manager.start_quorum()


class QuorumLog(logging.Handler):
    """The quorum ids torchft's Manager logs (``torchft_quorums``) when the quorum changes: ``latest``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.latest = -1
        self.changes: list[tuple[int, int]] = []  # (quorum id, step)

    def emit(self, record: logging.LogRecord) -> None:
        self.latest = int(getattr(record, "quorum_id", self.latest))
        self.changes.append((self.latest, int(getattr(record, "step", -1))))


class _NoFlightRecorderNote(logging.Filter):
    """torchft warns at every quorum change that NCCL's flight recorder cannot be reset: true, and moot on gloo."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage().lower()


@contextlib.contextmanager
def _servers_bound_to(host: str) -> Iterator[None]:
    """torchft's manager server binds every interface (``[::]``); dtlab keeps it on the run's own address."""
    import torchft.manager as tm  # lazy: see the module's docstring

    original = tm.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs.get("bind", ":0")).rsplit(":", 1)[-1]
        return original(**{**kwargs, "bind": f"{host}:{port}"})

    tm.ManagerServer = bound
    try:
        yield
    finally:
        tm.ManagerServer = original


def make_manager(cfg: RunConfig, info: DistInfo, ident: ReplicaIdentity, *, sync_quorum: bool,
                 heartbeat_interval_ms: int = HEARTBEAT_INTERVAL_MS) -> tuple[Any, QuorumLog]:
    """This rank's torchft Manager (its replica group's rank ``info.rank``) and the log of its quorum changes.

    Recovery goes over the Manager's own gloo group (torchft's PGTransport), never through a file, and
    that group's all-reduces and transfers are recorded (tags ``ft_cross_replica`` and ``ft_recovery``).
    """
    torchft = require_torchft(cfg.tier)
    from torchft.checkpointing.pg_transport import PGTransport  # lazy: see the module's docstring

    logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderNote())
    quorums = QuorumLog()
    quorum_logger = logging.getLogger("torchft_quorums")
    quorum_logger.setLevel(logging.INFO)
    quorum_logger.propagate = False
    quorum_logger.addHandler(quorums)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    pg = torchft.ProcessGroupGloo(timeout=timeout)
    tag_methods(pg, {"allreduce": "ft_cross_replica", "send": "ft_recovery", "recv": "ft_recovery"})
    with _servers_bound_to(ident.host):
        manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.tier_options.min_replicas,
            use_async_quorum=not sync_quorum, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=info.rank, world_size=info.world_size, replica_id=f"replica{ident.replica}",
            lighthouse_addr=ident.lighthouse, hostname=ident.host, init_sync=False, max_retries=MAX_COMMIT_RETRIES,
            heartbeat_interval=datetime.timedelta(milliseconds=heartbeat_interval_ms),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=info.device))
    return manager, quorums
