"""Tier: DiLoCo (torchft) -- replica groups that train alone for H steps, then average what they learned.

A diff of ``ft``: the same replica groups, lighthouse and Manager, but no
gradient crosses between groups during a step. Each group runs ``sync_every``
(H) inner steps with the job's own optimizer; then the groups all-reduce their
*pseudo-gradient* -- the parameters at the last synchronisation minus the
parameters now -- and an outer optimizer (SGD with Nesterov momentum,
``outer_lr``, ``outer_momentum``) applies the average to the synchronised
parameters. The link carries one model's worth of bytes every H steps instead
of every step. ``fragments`` > 1 is streaming DiLoCo: the model is split into
that many pieces and one piece synchronises every H / fragments steps, so the
traffic is spread out (each piece still every H steps).
``outer_comm_dtype`` sends the pseudo-gradients as bf16, int8 or fp8 codes (``dtlab.tiers.parts.diloco_comm``;
int8 and fp8 with one float32 scale per 128 values) instead of fp32. ``evaluate_syncs`` evaluates the model each
group holds right after each synchronisation on the held-out split (the synchronised model, for fragments = 1),
outside the timed step, and records it with the synchronisation.

torchft's ``DiLoCo`` does all of it from hooks on the inner optimizer; the
Manager forms a quorum at each synchronisation only, so a failed group costs
the others nothing between synchronisations. A restarted group trains its first
H steps alone, receives the live state at its first synchronisation (``heal``)
and jumps to the others' step.

Within a group of several ranks the inner steps are plain DDP over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.env import DistInfo
from dtlab.core.events import emit
from dtlab.core.failures import NoPeerToRecover
from dtlab.core.ft import identity
from dtlab.core.job import OptimizerFactory, build_job, load_data, optimizer_params
from dtlab.core.models import evaluate
from dtlab.core.quantise import COMM_DTYPES, check_options
from dtlab.core.registry import TierSpec
from dtlab.tiers.parts import base, ft  # the replica groups ft and diloco share
from dtlab.tiers.parts.diloco_comm import QuantisedManager

__all__ = ["Options", "SPEC", "Strategy", "fragment_modules", "validate"]


@dataclass(frozen=True)
class Options(ft.ReplicaOptions):
    sync_every: int = 20  # H: inner steps between synchronisations
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    fragments: int = 1  # > 1: streaming DiLoCo, one fragment synchronises every sync_every / fragments steps
    outer_comm_dtype: str = "fp32"  # how pseudo-gradients travel: fp32, bf16, int8 or fp8 (dtlab.core.quantise)
    evaluate_syncs: bool = False  # held-out loss of each group's model right after each synchronisation


def validate(cfg: RunConfig) -> None:
    o: Options = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    ft.validate(cfg)
    for field in ("sync_every", "fragments"):
        value = getattr(o, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field}={value!r} is invalid: must be an integer >= 1")
    if o.sync_every % o.fragments:
        raise ValueError(f"{name}.fragments={o.fragments} must divide sync_every={o.sync_every}: one fragment "
                         f"synchronises every sync_every / fragments steps")
    if cfg.steps % o.sync_every:
        raise ValueError(f"{name}.sync_every={o.sync_every} must divide steps={cfg.steps}: the run ends on a "
                         f"synchronisation, where every replica group holds the same model")
    check_options(o, name, ("outer_comm_dtype",), block=None)
    if not isinstance(o.evaluate_syncs, bool):
        raise ValueError(f"{name}.evaluate_syncs={o.evaluate_syncs!r} is invalid: must be True or False")
    if not o.outer_lr > 0:
        raise ValueError(f"{name}.outer_lr={o.outer_lr!r} is invalid: must be > 0")
    if not 0 <= o.outer_momentum < 1:
        raise ValueError(f"{name}.outer_momentum={o.outer_momentum!r} is invalid: must be in [0, 1)")


def fragment_modules(model: nn.Module, fragments: int) -> list[nn.Module]:
    """The model in ``fragments`` contiguous pieces (modules holding parameters, in order), sharing its tensors."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if fragments > len(owners):
        raise ValueError(f"diloco tier_options.fragments={fragments} is invalid: this model has only {len(owners)} "
                         f"layers with parameters to split")
    sizes = [sum(p.numel() for p in m.parameters(recurse=False)) for m in owners]
    total, pieces, current, done = sum(sizes), [], [], 0
    for i, (module, size) in enumerate(zip(owners, sizes)):
        current.append(module)
        done += size
        target = total * (len(pieces) + 1) / fragments  # where this piece should end, in parameters
        must = len(owners) - i - 1 == fragments - len(pieces) - 1  # as many layers left as pieces to fill
        nearer = i + 1 < len(owners) and abs(done - target) <= abs(done + sizes[i + 1] - target)
        if len(pieces) < fragments - 1 and (must or nearer):
            pieces.append(nn.ModuleList(current))
            current = []
    pieces.append(nn.ModuleList(current))
    return pieces


def preflight(cfg: RunConfig) -> None:
    ft.preflight(cfg)
    if cfg.tier_options.fragments > 1:  # the model must have the layers to split (built on the CPU, not trained)
        fragment_modules(build_job(cfg, torch.device("cpu"))[0], cfg.tier_options.fragments)


class Strategy(base.Strategy):
    """The job's optimizer as DiLoCo's inner optimizer; a Nesterov SGD per fragment as the outer one."""

    comm_channels = ("ddp_buckets",)  # the inner steps' DDP
    params_on_every_rank = True  # the groups' agreement is checked on every rank of each

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        super().__init__(cfg, info)
        self.ident, self.options = identity(), cfg.tier_options
        self.data_rank, self.data_world = self.ident.replica * info.world_size + info.rank, cfg.world_size
        o = self.options
        self.faults = ft.Faults(ft.parse_faults(o.faults, cfg.steps, o.replicas, cfg.tier), self.ident,
                                      info.rank)
        self.manager, self.quorums = ft.make_manager(cfg, info, self.ident, sync_quorum=True)
        self.model: nn.Module | None = None
        self.inner: torch.optim.Optimizer | None = None
        self.diloco: Any = None
        self.step = 0  # the step running now: sent to a healing peer, which continues from it
        self.healed_to: int | None = None  # set when this group received a peer's state during this step
        self.syncs: list[dict[str, Any]] = []
        self.inner_steps = 0  # counted as torchft's DiLoCo counts them: a fragment syncs every H / fragments
        # the held-out split, for evaluate_syncs: loaded once, on the group's rank 0 only
        self.heldout = load_data(cfg) if self.options.evaluate_syncs and info.rank == 0 else None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        if self.info.world_size == 1:
            return model
        return DistributedDataParallel(model)  # inner steps: data parallel within the group

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        from torchft.local_sgd import DiLoCo  # lazy: torchft is an optional extra (dtlab.tiers.parts.ft)

        o, plain = self.options, self.unwrap(model)
        self.inner = build(optimizer_params(plain, build))
        self.manager.register_state_dict_fn("default", self._load, self._state)
        self.manager.register_state_dict_fn("dtlab", self._load_step, lambda: {"step": self.step})
        pieces = fragment_modules(plain, o.fragments)
        outer = [torch.optim.SGD(p.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=True)
                 for p in pieces]
        if self.ident.attempt == 0:
            ft.wait_for_all(self.manager, self.ident, self.cfg.timeout_s)
        manager = self.manager if o.outer_comm_dtype == "fp32" else QuantisedManager(self.manager,
                                                                                     o.outer_comm_dtype)
        self.diloco = DiLoCo(manager, pieces, self.inner, outer, sync_every=o.sync_every,
                             use_bucketization=True)  # one flat all-reduce per fragment, not one per tensor
        self.diloco.__enter__()  # its hooks on the inner optimizer: they synchronise every sync_every steps
        return self.inner

    def _state(self) -> dict[str, Any]:
        return {"model": self.unwrap(self.model).state_dict(), "optimizer": self.inner.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.unwrap(self.model).load_state_dict(state["model"])
        self.inner.load_state_dict(state["optimizer"])

    def _load_step(self, state: dict[str, Any]) -> None:
        self.healed_to = int(state["step"])

    def on_step_start(self, step: int) -> None:
        self.step = step
        self.faults.fire(step)

    def on_step_end(self, step: int) -> None:
        self.inner_steps += 1
        if self.inner_steps % (self.options.sync_every // self.options.fragments):
            return  # no synchronisation in this step
        record = {"step": step, "syncs_committed": self.manager.current_step(),
                  "participants": self.manager.num_participants(), "healed_to": self.healed_to,
                  "quorum_id": self.quorums.latest}
        if self.heldout is not None:  # after the step's timing ends: the evaluation is not training time
            record["heldout_loss"] = evaluate(self.unwrap(self.model), self.heldout, self.info.device)["loss"]
        self.syncs.append(record)
        if self.info.rank == 0:
            emit("diloco_sync", replica=self.ident.replica, replica_attempt=self.ident.attempt, **record)
        first = len(self.syncs) == 1
        if first and self.ident.attempt and self.healed_to is None and record["participants"] <= 1:
            raise NoPeerToRecover(f"replica group {self.ident.replica} restarted after every other group had "
                                  f"finished: there is no live state to recover")

    def next_step(self, step: int) -> int:
        """After receiving a peer's state at a synchronisation: the peer's next step; else the next one."""
        if self.healed_to is None:
            return step + 1
        to, self.healed_to = self.healed_to, None
        return to + 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        out = super().finish(model, data)
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        return out

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {"replica": self.ident.replica, "attempt": self.ident.attempt, "group_rank": self.info.rank,
                "sync_every": o.sync_every, "fragments": o.fragments, "outer_lr": o.outer_lr,
                "outer_momentum": o.outer_momentum, "outer_comm_dtype": o.outer_comm_dtype, "syncs": self.syncs,
                "torchft": ft.TORCHFT_VERSION}


SPEC = TierSpec(name="diloco", summary="torchft DiLoCo: replica groups sync every H steps (outer Nesterov step)",
                options=Options, validate=validate, strategy=Strategy, launcher="ft", preflight=preflight,
                replicas=ft.plan, choices={"network": ft.NETWORKS, "outer_comm_dtype": COMM_DTYPES})
