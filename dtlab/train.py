"""The training loop (it knows no strategy) and ``run(cfg)``.

Each rank builds the same seeded model and data, lets the tier's Strategy wrap
them, and runs the loop, timing each phase. The tier decides *how* gradients
are made consistent; the loop only calls the Strategy's hooks.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtlab import data as datasets
from dtlab import models, tiers
from dtlab.config import RunConfig
from dtlab.env import DistInfo
from dtlab.instrument import CommRecorder, active
from dtlab.memory import SavedActivations, gradient_bytes, optimizer_state_bytes, parameter_bytes, peak_process_bytes
from dtlab.results import RankResult, RunResult, params_to_bytes, provenance

_REPORT_EVERY_S = 0.25


def optimizer_factory(cfg: RunConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``functools.partial(OptimizerClass, lr=...)``: tiers that shard it read ``.func`` and ``.keywords``."""
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[cfg.optimizer]
    return functools.partial(cls, lr=cfg.lr)


def build_job(cfg: RunConfig, device: torch.device) -> tuple[torch.nn.Module, datasets.Dataset]:
    """The seeded model and data every rank (and every tier) starts from."""
    data = datasets.load(cfg.dataset, cfg.dataset_size, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model, data.input_shape, data.num_classes, cfg.model_size, cfg.model_depth).to(device)
    return model, data


def train(info: DistInfo, cfg: RunConfig) -> RankResult:
    """Run ``cfg`` as rank ``info.rank``. Called inside each rank process."""
    from dtlab.launcher import report

    torch.set_num_threads(cfg.resolved_threads)
    # Not started when the launcher records nothing: phases are timed, collectives not.
    recorder = active() or CommRecorder(info.rank)
    model, data = build_job(cfg, info.device)
    strategy = tiers.get(cfg.tier).Strategy(cfg, info)
    model = strategy.wrap(model)
    param_bytes = parameter_bytes(model)  # after wrap: a sharded or split tier holds only its part
    optimizer = strategy.make_optimizer(model, optimizer_factory(cfg))
    start = strategy.start_step  # > 0 when the tier resumed from a checkpoint
    batches = datasets.ShardedBatches(len(data), cfg.global_batch_size, strategy.data_rank, strategy.data_world,
                                      cfg.seed)
    accum = strategy.accumulation_steps
    memory: dict[str, int] = {"parameters": param_bytes}
    steps: list[dict[str, float]] = []
    last_report = 0.0
    phases = recorder.phases
    clock = time.perf_counter
    for step in range(start, cfg.steps):
        recorder.step = step
        t0 = clock()
        idx = batches.indices(step)
        x, y = data.train_x[idx].to(info.device), data.train_y[idx].to(info.device)
        t_data = clock()
        phases.append(("data", t0, t_data, step))
        forward = backward = 0.0
        step_loss = torch.zeros(())
        micro_batches = zip(x.chunk(accum), y.chunk(accum)) if accum > 1 else [(x, y)]
        if strategy.custom_step:  # e.g. a pipeline schedule: forward and backward interleave
            a = clock()
            step_loss = strategy.run_step(model, x, y)
            b = clock()
            phases.append(("forward_backward", a, b, step))
            forward, micro_batches = b - a, []
        for micro, (xm, ym) in enumerate(micro_batches):
            last = micro == accum - 1
            with strategy.no_sync(model) if not last else _nothing():
                a = clock()
                with SavedActivations() if step == start and micro == 0 else _nothing() as acts:
                    loss = models.loss(model(xm), ym)
                    if accum > 1:
                        loss = loss / accum
                if acts is not None:
                    memory["activations"] = acts.bytes(exclude=model.parameters())
                b = clock()
                loss.backward()
                c = clock()
            phases += [("forward", a, b, step), ("backward", b, c, step)]
            forward, backward = forward + b - a, backward + c - b
            step_loss += loss.detach()
        a = clock()
        strategy.sync_gradients(model)
        b = clock()
        if step == start:  # the first step is warm-up, left out of the medians: accounting there costs nothing measured
            memory["gradients"] = gradient_bytes(strategy.unwrap(model))
        o = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        c = clock()
        phases += [("comm", a, b, step), ("optimizer", o, c, step)]
        loss_value = float(step_loss)  # NaN on ranks that compute no loss (early pipeline stages)
        steps.append({"step": step, "loss": loss_value, "samples": len(idx), "data": t_data - t0,
                      "forward": forward, "backward": backward, "comm": b - a, "optimizer": c - o, "total": c - t0})
        if step == start:
            memory["optimizer_state"] = optimizer_state_bytes(optimizer)
        if c - last_report > _REPORT_EVERY_S or step == cfg.steps - 1:
            report(step=step + 1, total=cfg.steps, loss=loss_value, desc=f"{cfg.tier} rank 0",
                   samples_per_s=len(idx) * info.world_size / (c - t0))
            last_report = c
    recorder.step = cfg.steps
    memory.update(peak_process_bytes(info.device))
    # Both are called on every rank: a sharded tier gathers the full state (a collective) here.
    state = strategy.full_state_dict(model)
    evaluation = strategy.evaluate(model, data)
    checksum = float(sum(t.detach().double().sum() for t in state.values() if t.is_floating_point()))
    return RankResult(
        rank=info.rank,
        steps=steps,
        memory=memory,
        events=recorder.rows(),
        phases=recorder.phase_rows(),
        params_checksum=checksum,
        params=params_to_bytes(state) if info.is_main else None,
        evaluation=evaluation,
        strategy=strategy.describe(),
        provenance=provenance(info.backend, cfg.resolved_threads),
    )


class _nothing:  # noqa: N801 - reads like contextlib.nullcontext, but yields None cheaply
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run(cfg: RunConfig, *, progress: bool | Callable[[dict[str, Any]], None] = True,
        start_method: str = "forkserver", record: bool = True, stop: threading.Event | None = None) -> RunResult:
    """Run a job on its tier and collect every rank's result.

    ``record=False`` switches the CommRecorder off (to measure its overhead);
    setting ``stop`` from another thread ends the run (``LaunchStopped``).
    """
    from dtlab.launcher import launch

    tier = tiers.get(cfg.tier)
    if hasattr(tier, "run"):  # a tier with its own processes (RPC servers, torchrun agents)
        return tier.run(cfg, progress=progress, record=record, stop=stop)
    start = time.perf_counter()
    out = launch(train, tier.processes(cfg), args=(cfg,), backend=cfg.backend, device=cfg.device,
                 timeout_s=cfg.timeout_s, progress=progress, start_method=start_method, record=record,
                 stop=stop)
    return RunResult(cfg, list(out), time.perf_counter() - start, out.logs)
