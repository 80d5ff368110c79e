"""Tier: DataParallel -- one process, one thread per replica, the master does the rest.

With at least ``world_size`` CUDA devices this is torch's own
``nn.DataParallel``. Without them ``nn.DataParallel`` would just call the
module, so dtlab runs the same steps itself on CPU replicas in threads:

1. replicate: each replica gets its own copy of the parameters, made with an
   autograd op whose backward adds the replica's gradient onto the master
   copy (the "reduce" of the parameter-server pattern);
2. scatter: the batch is cut into one chunk per replica;
3. parallel forward: every replica runs its chunk in its own thread;
4. gather: the outputs are concatenated on the master, where the loss is taken.

Backward then flows back through gather, the replicas and the copies, and the
gradients arrive summed on the master, which steps. One process, one master
and the GIL are why DataParallel scales poorly; the phase timeline shows it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from dtlab.core.compat import replicate_for_data_parallel
from dtlab.core.config import RunConfig
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import active
from dtlab.tiers.parts import base
from dtlab.tiers.parts.base import NoOptions as Options

__all__ = ["EmulatedDataParallel", "Options", "SPEC", "Strategy", "validate"]


def validate(cfg: RunConfig) -> None:
    """world_size is the number of replicas; RunConfig checks it divides the batch."""


def _use_real_dp(replicas: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= replicas >= 2


def _replicate(master: nn.Module, replicas: int) -> list[nn.Module]:
    """Structural copies of ``master`` whose parameters are autograd-linked clones.

    Mirrors ``torch.nn.parallel.replicate``, which refuses CPU devices. Buffers
    of replica 0 are the master's own; the others get copies whose in-place
    updates are lost, exactly as DataParallel documents.
    """
    modules = list(master.modules())
    out = []
    for r in range(replicas):
        copies = {id(m): replicate_for_data_parallel(m) for m in modules}
        for m in modules:
            rep = copies[id(m)]
            for name, child in m._modules.items():
                rep._modules[name] = copies[id(child)] if child is not None else None
            for name, p in m._parameters.items():
                if p is not None:
                    setattr(rep, name, p.clone())  # clone's backward adds into p.grad: the reduce
            for name, b in m._buffers.items():
                if b is not None and r > 0:
                    rep._buffers[name] = b.clone()
        out.append(copies[id(master)])
    return out


class EmulatedDataParallel(nn.Module):
    """DataParallel's four steps on one device, replicas in threads."""

    def __init__(self, module: nn.Module, replicas: int) -> None:
        super().__init__()
        self.module = module
        self.replicas = replicas
        self.pool = ThreadPoolExecutor(max_workers=replicas, thread_name_prefix="dp-replica")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rec = active()
        step = rec.step if rec is not None else -1
        spans: list[tuple[str, float, float, int]] = []
        t0 = time.perf_counter()
        replicas = _replicate(self.module, self.replicas)
        t1 = time.perf_counter()
        chunks = x.chunk(self.replicas)
        t2 = time.perf_counter()

        def forward_one(i: int) -> torch.Tensor:
            a = time.perf_counter()
            out = replicas[i](chunks[i])
            spans.append((f"dp_forward:{i}", a, time.perf_counter(), step))
            return out

        outputs = list(self.pool.map(forward_one, range(len(chunks))))
        t3 = time.perf_counter()
        out = torch.cat(outputs)
        t4 = time.perf_counter()
        spans += [("dp_replicate", t0, t1, step), ("dp_scatter", t1, t2, step), ("dp_gather", t3, t4, step)]
        if rec is not None:
            rec.phases.extend(spans)
        return out


class Strategy(base.Strategy):
    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.real = _use_real_dp(cfg.world_size)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.real:
            return nn.DataParallel(model, device_ids=list(range(self.cfg.world_size)))
        return EmulatedDataParallel(model, self.cfg.world_size)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def describe(self) -> dict[str, Any]:
        kind = "torch.nn.DataParallel" if self.real else "emulated on CPU threads"
        return {"dataparallel": kind, "replicas": self.cfg.world_size}


SPEC = TierSpec(name="dp", summary="nn.DataParallel: one process drives a replica per device",
                options=Options, validate=validate, strategy=Strategy, processes=lambda cfg: 1,
                autocast=False, activation_checkpointing=False)
