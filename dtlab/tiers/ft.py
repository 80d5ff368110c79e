"""Tier: fault tolerance per step (torchft) -- DDP whose replica groups fail and rejoin without a restart.

A diff of ``elastic``'s answer to a failure. torchelastic stops every worker
and restarts the world from the last snapshot; here a failure stays inside its
replica group. ``replicas`` groups of ``ranks_per_replica`` ranks each train
data parallel, and torchft's Manager averages their gradients across the groups
every step (``torchft.ddp.DistributedDataParallel``: a comm hook that all-reduces
each bucket through the Manager; ``torchft.optim.OptimizerWrapper``: the
optimizer steps only if the Manager says the step may be committed).

Every step starts with a quorum: the lighthouse says which groups take part.
When a group dies, the others' all-reduce fails, that step is not committed,
the next quorum leaves the dead group out (once its heartbeats stop), and they
run the step again at the reduced count: the loop repeats a step the Manager
did not commit (``next_step``). The ft launcher starts the dead group again; it
joins at the next quorum, receives the live state -- model, optimizer, step --
from a peer over the Manager's process group (never from a file), and the
groups go on together, ending with equal parameters.

Within a group of several ranks the gradients are also averaged over the group
(one all-reduce of the flattened gradients), so without faults the run trains
the parameters ddp trains at the same world size and global batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.env import DistInfo
from dtlab.core.events import emit
from dtlab.core.failures import NoPeerToRecover
from dtlab.core.ft import identity
from dtlab.core.ft import timeouts as replica_timeouts
from dtlab.core.job import OptimizerFactory, optimizer_params
from dtlab.core.registry import ReplicaPlan, TierSpec
from dtlab.instrument.recorder import tagged
from dtlab.tiers.parts import base, ft  # the replica groups ft and diloco share

__all__ = ["Options", "SPEC", "Strategy", "plan", "validate"]


@dataclass(frozen=True)
class Options(ft.ReplicaOptions):
    """Replica groups (see ``dtlab.tiers.parts.ft.ReplicaOptions``) that average gradients every step.

    ``timeouts``: how fast a dead group is noticed -- ``"tuned"`` (dtlab's: 300 ms without heartbeats,
    beats every 50 ms) or ``"torchft"`` (torchft 0.2.0's defaults: 5000 ms, every 100 ms); both in full in
    ``dtlab.core.ft.TIMEOUTS``.
    """

    timeouts: str = "tuned"


def validate(cfg: RunConfig) -> None:
    ft.validate(cfg)
    replica_timeouts(cfg.tier_options.timeouts, f"{cfg.tier} tier_options.timeouts")


def plan(cfg: RunConfig) -> ReplicaPlan:
    return dataclasses.replace(ft.plan(cfg), timeouts=cfg.tier_options.timeouts)


class Strategy(base.Strategy):
    """torchft's DDP and optimizer wrapper around the unchanged model; a step is repeated until committed."""

    params_on_every_rank = True  # the groups' agreement is checked on every rank of each

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        super().__init__(cfg, info)
        self.ident = identity()
        o: Options = cfg.tier_options
        # The group's share of the global batch: ddp's split over all replicas x ranks.
        self.data_rank, self.data_world = self.ident.replica * info.world_size + info.rank, cfg.world_size
        self.faults = ft.Faults(ft.parse_faults(o.faults, cfg.steps, o.replicas, cfg.tier), self.ident,
                                      info.rank)
        beat = replica_timeouts(o.timeouts).heartbeat_interval_ms
        self.manager, self.quorums = ft.make_manager(cfg, info, self.ident, sync_quorum=False,
                                                           heartbeat_interval_ms=beat)
        if info.rank == 0:  # the process is up and beats: what a restarted group's process start cost
            emit("ft_manager_ready", replica=self.ident.replica, replica_attempt=self.ident.attempt)
        self.model: nn.Module | None = None
        self.inner: torch.optim.Optimizer | None = None
        self.records: list[dict[str, Any]] = []  # one per step run: committed or not, and with how many groups
        self.healed_at: int | None = None
        self.step_started = 0.0
        self.quorum = (0, False)  # this step's (participating groups, healing)

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        return _ddp_class()(self.manager, model)

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        import torchft.optim  # lazy: see wrap

        self.inner = build(optimizer_params(self.unwrap(model), build))
        self.manager.register_state_dict_fn("default", self._load, self._state)
        wrapped = torchft.optim.OptimizerWrapper(self.manager, self.inner)
        if self.ident.attempt == 0:
            ft.wait_for_all(self.manager, self.ident, self.cfg.timeout_s)  # step 0 with every group
        else:
            wrapped.zero_grad()  # the first quorum: the restarted group learns from it where the others are
        self.manager.wait_quorum()
        self.start_step = self.manager.current_step()
        if self.ident.attempt and self.start_step:
            self.healed_at = self.start_step  # its state arrives before its first commit (should_commit)
        elif self.ident.attempt and self.ident.replicas > 1 and self.manager.num_participants() <= 1:
            raise NoPeerToRecover(f"replica group {self.ident.replica} restarted after every other group had "
                                  f"finished: there is no live state to recover")
        emit("ft_begin", replica=self.ident.replica, replica_attempt=self.ident.attempt, step=self.start_step,
             healing=self.healed_at is not None, participants=self.manager.num_participants())
        return wrapped

    def _state(self) -> dict[str, Any]:
        return {"model": self.unwrap(self.model).state_dict(), "optimizer": self.inner.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.unwrap(self.model).load_state_dict(state["model"])
        self.inner.load_state_dict(state["optimizer"])
        if self.info.rank == 0:  # the live state has arrived from a peer: the end of the transfer
            emit("ft_state_loaded", replica=self.ident.replica, replica_attempt=self.ident.attempt)

    def on_step_start(self, step: int) -> None:
        self.step_started = time.time()
        self.faults.fire(step)

    def sync_gradients(self, model: nn.Module) -> None:
        """Within a group of several ranks: average the (already cross-group averaged) gradients over it.

        Also notes this step's quorum (its all-reduces waited for it): how many groups averaged, and
        whether this group only received (it is healing: its own gradient counted as zero).
        """
        self.quorum = (self.manager.num_participants(), not self.manager.is_participating())
        if self.info.world_size == 1:
            return
        grads = [p.grad for p in self.unwrap(model).parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        with tagged("ft_intra_replica"):
            dist.all_reduce(flat)
        flat /= self.info.world_size
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def on_step_end(self, step: int) -> None:
        participants, healing = self.quorum
        record = {"step": step, "committed": self.manager.current_step() > step, "participants": participants,
                  "healing": healing, "quorum_id": self.quorums.latest, "start": self.step_started,
                  "end": time.time()}
        self.records.append(record)
        if self.info.rank == 0:
            emit("ft_step", replica=self.ident.replica, replica_attempt=self.ident.attempt,
                 **{k: v for k, v in record.items() if k != "start"})

    def next_step(self, step: int) -> int:
        """The Manager's count of committed steps: the same step again if this one was not committed."""
        return self.manager.current_step()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        out = super().finish(model, data)
        self.manager.shutdown(wait=False)  # its server and heartbeats end here, not at interpreter exit
        return out

    def describe(self) -> dict[str, Any]:
        return {"replica": self.ident.replica, "attempt": self.ident.attempt, "group_rank": self.info.rank,
                "start_step": self.start_step, "healed_at": self.healed_at, "ft_steps": self.records,
                "quorum_changes": self.quorums.changes, "torchft": ft.TORCHFT_VERSION}


def _ddp_class() -> type:
    """torchft's DDP, with its comm hook made safe for the failure it exists for.

    In torchft 0.2.0 the hook asserts on the Manager's future chain, which is only built when the
    all-reduce succeeds: the first failed all-reduce (a peer group died) ends the very rank that
    should go on. The same hook that returns the bucket once the wait is over, successful or not,
    keeps it alive; after a failure the Manager has recorded the error and does not commit the step.
    """
    import torchft.ddp  # lazy: torchft is an optional extra (dtlab.tiers.parts.ft)

    class DistributedDataParallel(torchft.ddp.DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # noqa: ANN001, ANN205 - DDP rejects string annotations here
            state.allreduce(bucket.buffer()).wait()  # averaged in place; False (error recorded) on a failure
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return DistributedDataParallel


SPEC = TierSpec(name="ft", summary="torchft: replica groups average every step; a failed group rejoins from a peer",
                options=Options, validate=validate, strategy=Strategy, launcher="ft", preflight=ft.preflight,
                replicas=plan, choices={"network": ft.NETWORKS, "timeouts": ("tuned", "torchft")})
