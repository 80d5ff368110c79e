"""Tier: a parameter server over ``torch.distributed.rpc`` -- one server holds the model, T trainers.

Processes: rank 0 is the parameter server ``ps``; ranks 1..T are ``trainer1`` ..
``trainerT``. ``RunConfig.world_size`` is T, the number of trainers (so the global
batch divides among them as among any data-parallel tier's ranks); T + 1 processes run.

Every step each trainer
  1. runs forward through an RRef to the server: ``rpc_sync("ps", _forward, (server, ...))``
     computes the logits on the server, from a snapshot of its parameters;
  2. computes the loss on its share of the global batch (``data.ShardedBatches``) and calls
     ``dist_autograd.backward``: the gradient flows back over RPC into the server's
     parameters, where it is kept in this trainer's distributed-autograd context;
  3. calls ``DistributedOptimizer.step(context)``, which hands that context's gradients to
     the server's ``ServerOptimizer``.

The modes differ only in what the server does with them:

- ``async`` (Hogwild-style): applies them at once. Other trainers' updates may have landed
  since this trainer's forward read the parameters: its staleness is the version it is
  applied to minus the version it was computed on (a version counts updates).
- ``sync``: keeps them until every trainer has sent its share of the step, averages them
  in trainer order (a deterministic sum) and steps once; a forward of step s waits until
  the server reaches version s. That is the single-device step on the same global batch,
  so the parameters match tier ``single`` (<= 1e-5) with SGD and Adam.

Why ``ServerOptimizer`` behind DistributedOptimizer rather than ``torch.optim.Adam``:
torch's DistributedOptimizer builds one optimizer per trainer on the server, so with
Adam each trainer would keep its own moments and every trainer would step on its own.
ServerOptimizer hands the gradients to the server's *one* optimizer instead: the same
state as single-device training, and in sync mode one step per global batch, which is
what parity needs. It cannot wait for the other trainers inside ``step`` (torch steps
under a global lock, which would keep them out), so the sync barrier sits in the next
forward. The forward runs on clones of the parameters, taken under the server's lock: an
update landing before a pending backward then cannot trip autograd's in-place check.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import rpc

from dtlab.core import data as datasets
from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, load_data, optimizer_factory
from dtlab.core.memory import optimizer_state_bytes, parameter_bytes, peak_process_bytes
from dtlab.core.net import LOOPBACK, interface_for, listening_sockets
from dtlab.core.progress import report
from dtlab.core.registry import TierSpec
from dtlab.core.results import RankResult, params_to_bytes, provenance
from dtlab.instrument.rpc import RpcWorker

__all__ = ["MODES", "SPEC", "Options", "ParameterServer", "ServerOptimizer", "preflight", "validate"]

MODES = ("sync", "async")
MAX_TRAINERS = 8  # a waiting trainer holds one of the server's 16 RPC threads
_REPORT_EVERY_S = 0.25


@dataclass(frozen=True)
class Options:
    mode: str = "sync"  # "sync": average every step's gradients, step once; "async": apply each on arrival
    rpc_timeout_s: float = 30.0  # longest any RPC may take, the sync barrier's wait included
    bind_address: str = LOOPBACK  # where TensorPipe listens; anything else is reachable from outside (warned)


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if not rpc.is_available():
        raise ValueError("tier 'rpc' needs torch.distributed.rpc, which this torch build lacks")
    if o.mode not in MODES:
        raise ValueError(f"{name}.mode={o.mode!r} is invalid: choose one of {', '.join(MODES)}")
    if isinstance(o.rpc_timeout_s, bool) or not isinstance(o.rpc_timeout_s, (int, float)) or not o.rpc_timeout_s > 0:
        raise ValueError(f"{name}.rpc_timeout_s={o.rpc_timeout_s!r} is invalid: must be > 0 seconds")
    if cfg.world_size > MAX_TRAINERS:
        raise ValueError(f"RunConfig.world_size={cfg.world_size} is invalid for tier 'rpc': it is the number of "
                         f"trainers, at most {MAX_TRAINERS}")
    if cfg.slow_rank:
        raise ValueError(f"RunConfig.slow_rank={cfg.slow_rank!r} is invalid for tier 'rpc': its trainers run their own "
                         f"loop; straggle a data-parallel tier instead")
    if cfg.device == "cuda" or cfg.backend == "nccl":
        raise ValueError("tier 'rpc' keeps the model on the parameter server's CPU: use device='cpu' or 'auto' "
                         "and backend 'gloo' or 'auto'")


def preflight(cfg: RunConfig) -> None:
    """TensorPipe binds by interface: ``bind_address`` must belong to one of this machine's."""
    o: Options = cfg.tier_options
    try:
        interface_for(o.bind_address)
    except ValueError as exc:
        raise ValueError(f"{cfg.tier} tier_options.bind_address={o.bind_address!r} is invalid: {exc}") from None


# -- the server ------------------------------------------------------------------
_server: ParameterServer | None = None
_server_ready = threading.Event()


class ParameterServer:
    """The model, its one optimizer and the parameter version, in process ``ps``."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, worker: RpcWorker) -> None:

        self.cfg, self.model, self.recorder = cfg, model, worker.recorder
        self.trainers, self.sync = cfg.world_size, cfg.tier_options.mode == "sync"
        self.names, self.params = zip(*model.named_parameters())
        self.optimizer = optimizer_factory(cfg)(self.params)
        self.version = 0
        self.lock = threading.Condition()  # forwards, updates and the version change under it
        self.read = {r: (0, 0) for r in range(1, self.trainers + 1)}  # trainer -> (step, version) of its forward
        self.pending: dict[int, list[torch.Tensor | None]] = {}
        self.staleness: list[dict[str, int]] = []
        self.done: set[int] = set()
        self.finished = threading.Event()
        self._reported = 0.0

    def forward(self, trainer: int, step: int, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            if self.sync and self.version < step:
                t0 = time.perf_counter()
                if not self.lock.wait_for(lambda: self.version >= step, timeout=rpc.get_rpc_timeout()):
                    raise TimeoutError(f"the parameter server waited {rpc.get_rpc_timeout():g} s (rpc_timeout_s) "
                                       f"for step {step - 1}'s gradients; it has them from trainers "
                                       f"{sorted(self.pending)} of 1..{self.trainers}")
                self.recorder.phases.append(("wait", t0, time.perf_counter(), step))
            a = time.perf_counter()
            self.read[trainer] = (step, self.version)
            snapshot = {n: p.clone() for n, p in zip(self.names, self.params)}  # differentiable: grads reach p
            out = torch.func.functional_call(self.model, snapshot, (x,))
            self.recorder.phases.append(("forward", a, time.perf_counter(), step))
        return out

    def apply(self, trainer: int, grads: list[torch.Tensor | None]) -> None:
        with self.lock:
            if not self.sync:
                self._step([trainer], [grads])
                return
            self.pending[trainer] = grads
            if len(self.pending) == self.trainers:
                order = sorted(self.pending)
                self._step(order, [self.pending[t] for t in order])
                self.pending.clear()
                self.lock.notify_all()

    def _step(self, trainers: list[int], grads: list[list[torch.Tensor | None]]) -> None:
        a = time.perf_counter()
        for i, p in enumerate(self.params):
            present = [g[i] for g in grads if g[i] is not None]
            if not present:
                p.grad = None
                continue
            total = present[0].clone()
            for g in present[1:]:
                total += g
            p.grad = total / len(grads)  # the mean over trainers, as DDP's all-reduce gives
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step = self.read[trainers[0]][0]
        for t in trainers:
            read_step, read_version = self.read[t]
            self.staleness.append({"trainer": t, "step": read_step, "read_version": read_version,
                                   "applied_version": self.version, "staleness": self.version - read_version})
        self.version += 1
        self.recorder.phases.append(("optimizer", a, time.perf_counter(), step))
        self._report()

    def _report(self) -> None:

        now = time.perf_counter()
        total = self.cfg.steps * (1 if self.sync else self.trainers)
        if now - self._reported > _REPORT_EVERY_S or self.version == total:
            report(step=self.version, total=total, desc=f"rpc {self.cfg.tier_options.mode} ps updates")
            self._reported = now

    def trainer_done(self, trainer: int) -> None:
        with self.lock:
            self.done.add(trainer)
            if len(self.done) == self.trainers:
                self.finished.set()


class ServerOptimizer:
    """Built on the server by each trainer's DistributedOptimizer: passes the gradients to the server.

    torch's ``_LocalOptimizer`` has set ``p.grad`` from the trainer's autograd context.
    """

    def __init__(self, params: list[torch.Tensor], trainer: int) -> None:
        self.params, self.trainer, self.server = list(params), trainer, _get_server()
        if any(a is not b for a, b in zip(self.params, self.server.params)):
            raise RuntimeError("ServerOptimizer must get the server's parameters, in order")

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # another trainer's context fills them next
        self.server.apply(self.trainer, grads)


# Module-level functions: RPC sends functions by reference.
def _get_server() -> ParameterServer:
    if not _server_ready.wait(rpc.get_rpc_timeout()) or _server is None:
        raise RuntimeError("the parameter server did not finish building its model in time")
    return _server


def _forward(server: Any, trainer: int, step: int, x: torch.Tensor) -> torch.Tensor:
    return server.local_value().forward(trainer, step, x)


def _parameter_rrefs(server: Any) -> list[Any]:
    return [rpc.RRef(p) for p in server.local_value().params]


def _trainer_done(server: Any, trainer: int) -> None:
    server.local_value().trainer_done(trainer)


# -- the processes -----------------------------------------------------------------
def _serve(worker: RpcWorker, cfg: RunConfig) -> RankResult:
    global _server

    model, data = build_job(cfg, torch.device("cpu"))
    _server = ParameterServer(cfg, model, worker)
    _server_ready.set()
    _server.finished.wait()  # a trainer that dies is caught by the launcher, which ends this process
    server, state = _server, model.state_dict()
    memory = {"parameters": parameter_bytes(model), "optimizer_state": optimizer_state_bytes(server.optimizer),
              **peak_process_bytes(torch.device("cpu"))}
    return RankResult(
        rank=0, steps=[], memory=memory, events=worker.recorder.rows(), phases=worker.recorder.phase_rows(),
        params_checksum=float(sum(t.double().sum() for t in state.values() if t.is_floating_point())),
        params=params_to_bytes(state), evaluation=models.evaluate(model, data, torch.device("cpu")),
        strategy={"mode": cfg.tier_options.mode, "trainers": cfg.world_size, "updates": server.version,
                  "staleness": server.staleness, "listening": listening_sockets(), "workers": list(worker.names)},
        provenance=provenance("tensorpipe", torch.get_num_threads()),
    )


def _train(worker: RpcWorker, cfg: RunConfig) -> RankResult:
    from torch.distributed import autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer

    rec, rank, clock = worker.recorder, worker.rank, time.perf_counter
    data = load_data(cfg)  # inputs in the job's dtype, as the server's model
    batches = datasets.ShardedBatches(len(data), cfg.global_batch_size, rank - 1, cfg.world_size, cfg.seed)
    server = rpc.remote("ps", _get_server)  # an RRef to the server object, which stays in "ps"
    optimizer = DistributedOptimizer(ServerOptimizer, rpc.rpc_sync("ps", _parameter_rrefs, args=(server,)), rank)
    steps = []
    for step in range(cfg.steps):
        rec.step = step
        t0 = clock()
        idx = batches.indices(step)
        x, y = data.train_x[idx], data.train_y[idx]
        a = clock()
        with dist_autograd.context() as context:
            logits = rpc.rpc_sync("ps", _forward, args=(server, rank, step, x))
            loss = models.loss(logits, y)
            b = clock()
            dist_autograd.backward(context, [loss])
            c = clock()
            optimizer.step(context)
            d = clock()
        # The gradient distributed autograd sends the server travels in C++, unseen by the wrappers:
        # recorded here, around backward, as one call carrying the logits' gradient.
        if rec.recording:
            nbytes = logits.numel() * logits.element_size()
            rec.add("dist_backward", "ps", "dist_autograd.backward", nbytes, b, False)["end"] = c
        rec.phases += [("data", t0, a, step), ("forward", a, b, step), ("backward", b, c, step),
                       ("optimizer", c, d, step)]
        steps.append({"step": step, "loss": float(loss), "samples": len(idx), "data": a - t0, "forward": b - a,
                      "backward": c - b, "comm": 0.0, "optimizer": d - c, "total": d - t0})
    rec.step = cfg.steps
    rpc.rpc_sync("ps", _trainer_done, args=(server, rank))
    return RankResult(
        rank=rank, steps=steps, memory=peak_process_bytes(torch.device("cpu")), events=rec.rows(),
        phases=rec.phase_rows(), params_checksum=float("nan"),  # trainers hold no parameters
        strategy={"listening": listening_sockets()}, provenance=provenance("tensorpipe", torch.get_num_threads()),
    )


def _process(worker: RpcWorker, cfg: RunConfig) -> RankResult:
    return _serve(worker, cfg) if worker.rank == 0 else _train(worker, cfg)


def _names(cfg: RunConfig) -> list[str]:
    return ["ps"] + [f"trainer{r}" for r in range(1, cfg.world_size + 1)]


SPEC = TierSpec(
    name="rpc", summary="a parameter server and trainers over torch.distributed.rpc (TensorPipe)",
    options=Options, validate=validate, processes=lambda cfg: cfg.world_size + 1,  # the server and T trainers
    launcher="rpc", preflight=preflight, rpc_main=_process, rpc_names=_names, choices={"mode": MODES},
    autocast=False, activation_checkpointing=False,
)
