"""The tier registry: what each tier declares about itself, and where to find it by name.

A tier module builds one ``TierSpec``; ``COURSE`` lists the tiers by name, in the
order of the course, and ``get(name)`` imports the tier's module (``dtlab.tiers.<name>``,
dashes as underscores) the first time it is asked for. ``RunConfig`` checks a job
against its tier's spec, the runner launches by it, and the CLI and the panel build
their knobs from its ``options`` dataclass. Only data and plain functions live here,
so every layer can read a spec while the tiers themselves sit above this one; and a
tier's name is known without importing torch or any tier (the command line answers
``--help`` or a bad flag at once, and a rank imports only the tier it runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LAUNCHERS = ("local", "torchrun", "rpc", "ft")


@dataclass(frozen=True)
class AgentPlan:
    """How a torchrun tier's agents ("nodes") are started, derived from the job alone."""

    nproc_per_node: int
    nodes: int  # agents at the start
    max_nodes: int = 0  # > nodes: the others join once ``join_at_step`` steps are done
    join_at_step: int = 0
    max_restarts: int = 0
    network: str = "loopback"  # "loopback", "netns" or "auto" (namespaces where possible)
    link_mbit: float = 0.0  # cap of each simulated host's link (netns only); 0: uncapped
    link_delay_ms: float = 0.0  # one-way delay per packet on each simulated host's link (netns only)
    scratch_option: str = ""  # a tier option naming a directory; "" in the job: the runner makes a temporary one

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes``."""
        return f"{self.nodes}:{self.max_nodes}" if self.max_nodes > self.nodes else str(self.nodes)


@dataclass(frozen=True)
class ReplicaPlan:
    """How an ``ft`` tier's replica groups start: each group its own world, torchft's lighthouse between them.

    A replica group that fails is restarted (up to ``max_restarts`` times) and rejoins through the lighthouse,
    taking its state from a live peer; the others go on meanwhile.
    """

    replicas: int
    ranks_per_replica: int
    min_replicas: int = 1  # the lighthouse forms no quorum with fewer replica groups
    max_restarts: int = 3  # per replica group
    network: str = "loopback"  # "loopback", "netns" or "auto": one simulated host per replica group
    link_mbit: float = 0.0  # cap of each simulated host's link (netns only); 0: uncapped
    lighthouse_port: int = 0  # 0: a free port
    timeouts: str = "tuned"  # the lighthouse's: "tuned" (dtlab's) or "torchft" (its defaults); core.ft.TIMEOUTS


@dataclass(frozen=True)
class TierSpec:
    """One tier: its name, knobs, checks and how it runs.

    ``validate(cfg)`` is pure (no files, sockets or namespaces: ``RunConfig`` calls
    it on every change); ``preflight(cfg)`` probes the environment and runs once,
    before any process starts. ``launcher`` says how ranks start: ``local`` (dtlab's
    launcher, the same function on every rank), ``torchrun`` (agents, see
    ``agents``), ``rpc`` (named RPC workers running ``rpc_main``) or ``ft`` (replica
    groups that fail and rejoin on their own, see ``replicas``).
    """

    name: str
    summary: str
    options: type
    validate: Callable[[Any], None]
    strategy: type | None = None
    processes: Callable[[Any], int] = lambda cfg: cfg.world_size
    launcher: str = "local"
    preflight: Callable[[Any], None] = lambda cfg: None
    agents: Callable[[Any], AgentPlan] | None = None
    rpc_main: Callable[..., Any] | None = None
    rpc_names: Callable[[Any], list[str]] | None = None
    replicas: Callable[[Any], ReplicaPlan] | None = None
    # The loop runs the model's forward (RunConfig.precision may autocast it) and the
    # model's blocks (RunConfig.activation_checkpointing may recompute them).
    autocast: bool = True
    activation_checkpointing: bool = True
    models: tuple[str, ...] = ()  # built-in models the tier can split (empty: any)
    optimizers: tuple[str, ...] = ("sgd", "adam")  # RunConfig.optimizer values the tier can step
    # Options whose values the panel offers as a list (field -> choices).
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"TierSpec {self.name!r}: launcher {self.launcher!r} is not one of {LAUNCHERS}")
        if self.launcher == "local" and self.strategy is None:
            raise ValueError(f"TierSpec {self.name!r}: a local tier needs a Strategy")
        if self.launcher == "torchrun" and (self.agents is None or self.strategy is None):
            raise ValueError(f"TierSpec {self.name!r}: a torchrun tier needs agents() and a Strategy")
        if self.launcher == "rpc" and (self.rpc_main is None or self.rpc_names is None):
            raise ValueError(f"TierSpec {self.name!r}: an rpc tier needs rpc_main and rpc_names")
        if self.launcher == "ft" and (self.replicas is None or self.strategy is None):
            raise ValueError(f"TierSpec {self.name!r}: an ft tier needs replicas() and a Strategy")


# The built-in tiers in the order of the course; each is the module dtlab.tiers.<name with _ for ->.
COURSE: tuple[str, ...] = ("single", "dp", "ddp-naive", "ddp", "zero", "rpc", "pipeline", "fsdp", "multinode",
                           "elastic", "ft", "diloco", "tp", "fsdp-tp", "cp", "ep", "nd")
TIER_PACKAGE = "dtlab.tiers"
# The tiers a job for machines of one's own can run (dtlab.launch.cluster writes their commands).
CLUSTER: tuple[str, ...] = ("ddp-naive", "ddp", "zero", "fsdp", "multinode", "elastic")

_TIERS: dict[str, TierSpec] = {}


def register(spec: TierSpec) -> TierSpec:
    """Add a tier (a built-in one registers on first ``get``; a tier of your own, by calling this)."""
    if spec.name in _TIERS and _TIERS[spec.name] is not spec:
        raise ValueError(f"tier {spec.name!r} is registered twice")
    _TIERS[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Every tier's name: the course's, then any registered besides, without importing a tier."""
    return COURSE + tuple(n for n in _TIERS if n not in COURSE)


def module_name(name: str) -> str:
    """Where a built-in tier lives, e.g. ``dtlab.tiers.ddp_naive`` for ``ddp-naive``."""
    return f"{TIER_PACKAGE}.{name.replace('-', '_')}"


def get(name: str) -> TierSpec:
    """The tier called ``name``: a built-in one is imported now if no one has asked for it yet."""
    if name not in _TIERS and name in COURSE:
        spec = importlib.import_module(module_name(name)).SPEC
        if spec.name != name:
            raise ValueError(f"{module_name(name)}.SPEC is named {spec.name!r}, not {name!r}")
        register(spec)
    if name not in _TIERS:
        raise ValueError(f"unknown tier {name!r}: choose one of {', '.join(names())}")
    return _TIERS[name]
