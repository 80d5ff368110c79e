"""Tier: elastic (fault-tolerant) DDP -- ddp under torchrun's agent, with snapshots and restarts.

A diff of ``multinode``: the same DDP under torchrun, plus what makes it
survive failures. ``--max-restarts`` lets the agent restart every worker
when one fails; the restarted workers re-rendezvous, load the last snapshot
(written every ``snapshot_every`` steps) and go on, so the run ends with the
parameters it would have had without the failure.

A snapshot holds the model, the optimizer, the step, the RNG states and the
sampler position (here a function of the step). It is written by rank 0 to a
temporary name and renamed into place, so a failure during a save leaves the
previous snapshot whole, and it loads with ``torch.load(weights_only=True)``.
``snapshot_format="dcp"`` saves a sharded Distributed Checkpoint instead,
which reshards when the world size changes.

Reliable restarts: torchrun's agents by default share their rendezvous
TCPStore with the workers; after a SIGKILL, stale keys of the dead worker
there let the new gloo group try to connect to the old worker's port
(pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (dtlab's torchrun
launches always set it) gives each attempt a fresh store.

Faults for teaching, selectable per run: ``faults=("sigkill:7:1",)`` kills
rank 1 at step 7; ``exception:K:R`` raises there; ``oom:K:R`` raises
``torch.OutOfMemoryError``, which the run answers by halving the per-rank
micro-batch and doubling gradient accumulation (the global batch, and so the
training, stays the same). Fault i fires once, after fault i-1 has fired.

Membership change: ``nnodes="1:2"`` with ``join_at_step=K`` starts one node
alone and a second torchrun agent on the same rendezvous once K steps are
done; the first agent sees it waiting, stops its workers and re-rendezvous
with it, and the grown world resumes from the snapshot.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo
from dtlab.core.events import emit
from dtlab.core.job import OptimizerFactory, optimizer_params
from dtlab.core.progress import report
from dtlab.core.registry import AgentPlan, TierSpec
from dtlab.core.results import atomic_write
from dtlab.tiers import ddp
from dtlab.tiers.parts import checkpoint

__all__ = ["FAULT_KINDS", "SPEC", "Fault", "Options", "SnapshotError", "Strategy", "agents", "load_snapshot",
           "parse_faults", "parse_nnodes", "preflight", "validate"]

FAULT_KINDS = ("exception", "sigkill", "oom")
SNAPSHOT = "snapshot.pt"
BATCHING = "batching.json"  # the accumulation the run chose after an out-of-memory error
FORMATS = ("file", "dcp")
JOIN_WAIT_S = 60.0  # how long the small world waits at join_at_step for the other nodes before going on alone


class SnapshotError(ValueError):
    """A snapshot that exists but cannot be used: resuming from step 0 instead would lose work silently."""


@dataclass(frozen=True)
class Options(ddp.BucketOptions):
    nnodes: str = "1"  # torchrun's --nnodes: "N" or "MIN:MAX"
    max_restarts: int = 3
    snapshot_every: int = 5
    snapshot_dir: str = ""  # "": a fresh directory for this run, removed after it; given: kept, resumed from
    snapshot_format: str = "file"
    faults: tuple[str, ...] = ()  # "KIND:STEP[:RANK]", e.g. "sigkill:7:1"
    join_at_step: int = 0  # with MIN < MAX nodes: start the other nodes once this many steps are done


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.step}:{self.rank}"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:2"`` -> (1, 2)."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < 1:
        raise ValueError(f"elastic tier_options.nnodes={text!r} is invalid: give N or MIN:MAX with integers >= 1")
    if low > high:
        raise ValueError(f"elastic tier_options.nnodes={text!r} is invalid: min {low} > max {high}")
    return low, high


def parse_faults(faults: tuple[str, ...], steps: int, min_world: int) -> list[Fault]:
    out = []
    for text in faults:
        parts = str(text).split(":")
        name = f"elastic tier_options.faults entry {text!r}"
        if len(parts) not in (2, 3) or parts[0] not in FAULT_KINDS:
            raise ValueError(f"{name} is invalid: write KIND:STEP[:RANK] with KIND one of {', '.join(FAULT_KINDS)}")
        try:
            step, rank = int(parts[1]), int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            raise ValueError(f"{name} is invalid: STEP and RANK must be integers") from None
        if not 0 <= step < steps:
            raise ValueError(f"{name} is invalid: step {step} is beyond the run (steps 0..{steps - 1})")
        if not 0 <= rank < min_world:
            raise ValueError(f"{name} is invalid: rank {rank} does not exist (the run has ranks 0..{min_world - 1} "
                             f"at its smallest)")
        out.append(Fault(parts[0], step, rank))
    return out


def _snapshot_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / SNAPSHOT


def load_snapshot(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The snapshot in ``directory`` (None if there is none); SnapshotError naming the file if it is unusable."""
    path = _snapshot_path(directory)
    if not path.exists():
        return None
    try:
        snap = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SnapshotError(f"snapshot {path} is corrupt or unreadable ({type(exc).__name__}: {exc}); delete it "
                            f"to start from step 0, or point snapshot_dir elsewhere") from None
    missing = [k for k in ("model", "optimizer", "step", "rng", "sampler") if k not in snap]
    if missing:
        raise SnapshotError(f"snapshot {path} is not a dtlab snapshot: it lacks {', '.join(missing)}")
    return snap


def _check_writable(directory: str, name: str) -> None:
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"{name}.snapshot_dir={directory!r} is not writable: {exc.strerror or exc}") from None


def validate(cfg: RunConfig) -> None:
    o: Options = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    low, high = parse_nnodes(o.nnodes)
    if cfg.world_size % high:
        raise ValueError(f"{name}.nnodes={o.nnodes!r} does not fit world_size={cfg.world_size}: the world size "
                         f"(at most nodes) must be a multiple of {high} so every node runs the same number of ranks")
    per_node = cfg.world_size // high
    for n in range(low, high + 1):
        if cfg.global_batch_size % (n * per_node):
            raise ValueError(f"RunConfig.global_batch_size={cfg.global_batch_size} must be divisible by every world "
                             f"size the run can have ({n} nodes x {per_node} = {n * per_node} ranks)")
    if not isinstance(o.max_restarts, int) or o.max_restarts < 0:
        raise ValueError(f"{name}.max_restarts={o.max_restarts!r} is invalid: must be an integer >= 0")
    if not isinstance(o.snapshot_every, int) or o.snapshot_every < 1:
        raise ValueError(f"{name}.snapshot_every={o.snapshot_every!r} is invalid: must be an integer >= 1 (steps)")
    if o.snapshot_format not in FORMATS:
        raise ValueError(f"{name}.snapshot_format={o.snapshot_format!r} is invalid: choose one of {', '.join(FORMATS)}")
    faults = parse_faults(o.faults, cfg.steps, low * per_node)
    if any(f.kind == "oom" for f in faults):
        per_rank = cfg.global_batch_size // (high * per_node)
        needed = o.accumulation_steps * 2 ** sum(f.kind == "oom" for f in faults)
        if per_rank % needed:
            raise ValueError(f"{name}.faults: each oom fault halves the micro-batch; the per-rank batch {per_rank} "
                             f"cannot be split into {needed} micro-batches")
    if low < high and not 0 < o.join_at_step < cfg.steps:
        raise ValueError(f"{name}.join_at_step={o.join_at_step!r} is invalid: with nnodes={o.nnodes!r} the other "
                         f"nodes join once that many steps are done, so it must be in 1..{cfg.steps - 1}")
    if low == high and o.join_at_step:
        raise ValueError(f"{name}.join_at_step={o.join_at_step} needs nnodes='MIN:MAX' with MIN < MAX")
    ddp.validate(cfg)


def preflight(cfg: RunConfig) -> None:
    """A given snapshot_dir must be writable and hold nothing unusable (resuming from step 0 would lose work)."""
    o: Options = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if o.snapshot_dir:
        _check_writable(o.snapshot_dir, name)
        try:
            if o.snapshot_format == "file":
                load_snapshot(o.snapshot_dir)
            elif checkpoint.latest(o.snapshot_dir) is not None:
                checkpoint.verify(checkpoint.latest(o.snapshot_dir))
        except (SnapshotError, checkpoint.CheckpointError) as exc:
            raise ValueError(f"{name}.snapshot_dir={o.snapshot_dir!r}: {exc}") from None


def agents(cfg: RunConfig) -> AgentPlan:
    o: Options = cfg.tier_options
    low, high = parse_nnodes(o.nnodes)
    return AgentPlan(nproc_per_node=cfg.world_size // high, nodes=low, max_nodes=high, join_at_step=o.join_at_step,
                     max_restarts=o.max_restarts, scratch_option="snapshot_dir")


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple | list) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


class Strategy(ddp.Strategy):
    """ddp, plus: load the snapshot at start, save one every k steps, inject the faults asked for."""

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        super().__init__(cfg, info)
        o: Options = cfg.tier_options
        if not o.snapshot_dir:  # dtlab.run gives each run its own; a bare train() call must say where
            raise ValueError("the elastic tier needs tier_options.snapshot_dir when train() is called directly")
        self.directory = Path(o.snapshot_dir)
        batching = self.directory / BATCHING
        if batching.exists():  # an earlier attempt ran out of memory: smaller micro-batches, same global batch
            self.accumulation_steps = json.loads(batching.read_text())["accumulation_steps"]
        self.faults = parse_faults(o.faults, cfg.steps, info.world_size)
        self.saved: list[int] = []
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = build(optimizer_params(model, build))
        self.model, self.optimizer = model, optimizer
        self.start_step = self._resume(model, optimizer)
        emit("resume" if self.start_step else "begin", step=self.start_step,
                    accumulation_steps=self.accumulation_steps, per_rank_batch=self.cfg.global_batch_size
                    // self.info.world_size)
        return optimizer

    # -- snapshots --------------------------------------------------------------------------
    def _resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        if self.options.snapshot_format == "dcp":
            if checkpoint.latest(self.directory) is None:
                return 0
            step = checkpoint.load(self.unwrap(model), optimizer, self.directory)
            for group in optimizer.param_groups:
                group["lr"] = self.cfg.lr
            return step
        snap = load_snapshot(self.directory)
        if snap is None:
            return 0
        expected = {"seed": self.cfg.seed, "global_batch_size": self.cfg.global_batch_size}
        if {k: snap["sampler"][k] for k in expected} != expected:
            raise SnapshotError(f"snapshot {_snapshot_path(self.directory)} belongs to another job: its sampler "
                                f"{snap['sampler']} does not match {expected}")
        self.unwrap(model).load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        torch.set_rng_state(snap["rng"]["torch"])
        random.setstate(_to_tuples(snap["rng"]["python"]))
        return int(snap["step"])

    def on_step_end(self, step: int) -> None:
        model, optimizer = self.model, self.optimizer
        step += 1  # steps done
        if self.info.is_main:
            emit("step", step=step)
        joining = step == self.options.join_at_step and self.info.world_size < self.cfg.world_size
        if step % self.options.snapshot_every == 0 or step == self.cfg.steps or joining:
            self._snapshot(model, optimizer, step)
        if joining:
            self._wait_for_join(step)

    def _wait_for_join(self, step: int) -> None:
        """Hold here, snapshot saved, until the agent restarts us into the grown world (or give up)."""
        if self.info.is_main:
            report(step=step, total=self.cfg.steps, desc="elastic: waiting for a node to join")  # starts the node
        emit("waiting_for_join", step=step)
        deadline = time.time() + JOIN_WAIT_S
        while time.time() < deadline:
            time.sleep(0.1)  # the agent stops this process once the new node waits at the rendezvous
        emit("join_timeout", step=step, waited_s=JOIN_WAIT_S)

    def _snapshot(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        t0 = time.time()
        if self.options.snapshot_format == "dcp":
            checkpoint.save(self.unwrap(model), optimizer, step, checkpoint.step_dir(self.directory, step))
        elif self.info.is_main:  # every rank holds the same state after a DDP step: rank 0 writes it
            self._save_file(model, optimizer, step)
        self.saved.append(step)
        if self.info.is_main:
            emit("snapshot", step=step, seconds=time.time() - t0, format=self.options.snapshot_format)

    def _save_file(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        import io

        # The sampler is a pure function of the step (dtlab.core.data.ShardedBatches): its position is the step.
        snap = {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "rng": _rng_state(), "world_size": self.info.world_size,
                "sampler": {"seed": self.cfg.seed, "global_batch_size": self.cfg.global_batch_size,
                            "next_step": step}}
        buffer = io.BytesIO()
        torch.save(snap, buffer)
        atomic_write(_snapshot_path(self.directory), buffer.getvalue())

    # -- faults -----------------------------------------------------------------------------
    def _fault_marker(self, index: int) -> Path:
        return self.directory / f"fault-{index}.fired"

    def on_step_start(self, step: int) -> None:
        """Fire the next fault if it is due at this step on this rank."""
        for index, fault in enumerate(self.faults):
            if self._fault_marker(index).exists():
                continue  # fired in an earlier attempt
            if fault.step != step or fault.rank != self.info.rank:
                return  # the next fault to fire is not this one's
            atomic_write(self._fault_marker(index), str(fault).encode())
            emit("fault", fault=fault.kind, step=fault.step)
            if fault.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "oom":
                raise torch.OutOfMemoryError(f"simulated out-of-memory error on rank {fault.rank} at step "
                                             f"{fault.step} (injected fault {index})")
            raise RuntimeError(f"injected fault {index}: exception on rank {fault.rank} at step {fault.step}")
        return

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "snapshots": self.saved, "start_step": self.start_step,
                "accumulation_steps": self.accumulation_steps, "node": int(os.environ.get("GROUP_RANK", 0)),
                "local_rank": self.info.local_rank, "global_rank": self.info.rank}

    def on_error(self, exc: BaseException) -> None:
        """An out-of-memory error: the next attempt trains half the micro-batch, twice as often."""
        if not isinstance(exc, torch.OutOfMemoryError):
            return
        batching = self.directory / BATCHING
        current = json.loads(batching.read_text())["accumulation_steps"] if batching.exists() else \
            self.options.accumulation_steps
        atomic_write(batching, json.dumps({"accumulation_steps": current * 2}).encode())
        emit("oom_answer", accumulation_steps=current * 2)


SPEC = TierSpec(name="elastic", summary="DDP under torchrun's elastic agent: snapshots, restarts, faults, joins",
                options=Options, validate=validate, strategy=Strategy, launcher="torchrun", preflight=preflight,
                agents=agents, choices={"comm_hook": ddp.COMM_HOOKS, "snapshot_format": FORMATS})
