"""The training loop: it knows no strategy.

Each rank builds the same seeded model and data, lets the tier's Strategy wrap
them, and runs the loop, timing each phase. The tier decides *how* gradients
are made consistent; the loop only calls the Strategy's hooks.
"""

from __future__ import annotations

import time

import torch

from dtlab.core import data as datasets
from dtlab.core import models, registry
from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo
from dtlab.core.job import build_job, optimizer_factory
from dtlab.core.memory import (
    SavedActivations,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    peak_process_bytes,
)
from dtlab.core.progress import report
from dtlab.core.results import RankResult, params_to_bytes, provenance
from dtlab.instrument.recorder import CommRecorder, active
from dtlab.tiers.base import Strategy

_REPORT_EVERY_S = 0.25


class _Loop:
    """One rank's run of the job: state shared by the step and its phases."""

    def __init__(self, cfg: RunConfig, info: DistInfo, strategy: Strategy, recorder: CommRecorder) -> None:
        self.cfg, self.info, self.strategy, self.recorder = cfg, info, strategy, recorder
        self.model, self.data = build_job(cfg, info.device)
        self.model = strategy.wrap(self.model)
        # After wrap: a sharded or split tier holds only its part.
        self.memory: dict[str, int] = {"parameters": parameter_bytes(self.model)}
        self.optimizer = strategy.make_optimizer(self.model, optimizer_factory(cfg))
        self.start = strategy.start_step  # > 0 when the tier resumed from a checkpoint
        self.batches = datasets.ShardedBatches(len(self.data), cfg.global_batch_size, strategy.data_rank,
                                               strategy.data_world, cfg.seed)
        self.steps: list[dict[str, float]] = []
        self.phases = recorder.phases

    def run(self) -> None:
        last_report = 0.0
        for step in range(self.start, self.cfg.steps):
            self.recorder.step = step
            self.strategy.on_step_start(step)
            row = self.step(step)
            self.strategy.on_step_end(step)
            self.steps.append(row)
            now = time.perf_counter()
            if now - last_report > _REPORT_EVERY_S or step == self.cfg.steps - 1:
                report(step=step + 1, total=self.cfg.steps, loss=row["loss"], desc=f"{self.cfg.tier} rank 0",
                       samples_per_s=row["samples"] * self.info.world_size / row["total"])
                last_report = now
        self.recorder.step = self.cfg.steps

    def step(self, step: int) -> dict[str, float]:
        clock, strategy, model = time.perf_counter, self.strategy, self.model
        t0 = clock()
        idx = self.batches.indices(step)
        x, y = self.data.train_x[idx].to(self.info.device), self.data.train_y[idx].to(self.info.device)
        t_data = clock()
        self.phases.append(("data", t0, t_data, step))
        if strategy.custom_step:  # e.g. a pipeline schedule: forward and backward interleave
            step_loss = strategy.run_step(model, x, y)
            t_fb = clock()
            self.phases.append(("forward_backward", t_data, t_fb, step))
            forward, backward = t_fb - t_data, 0.0
        else:
            step_loss, forward, backward = self.forward_backward(step, x, y)
        a = clock()
        strategy.sync_gradients(model)
        b = clock()
        if step == self.start:  # the first step is warm-up, left out of the medians: accounting costs nothing there
            self.memory["gradients"] = gradient_bytes(strategy.unwrap(model))
        o = clock()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        c = clock()
        self.phases += [("comm", a, b, step), ("optimizer", o, c, step)]
        if step == self.start:
            self.memory["optimizer_state"] = optimizer_state_bytes(self.optimizer)
        # NaN on ranks that compute no loss (early pipeline stages)
        return {"step": step, "loss": float(step_loss), "samples": len(idx), "data": t_data - t0,
                "forward": forward, "backward": backward, "comm": b - a, "optimizer": c - o, "total": c - t0}

    def forward_backward(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """Forward and backward over the step's micro-batches; all but the last under ``no_sync``."""
        clock, strategy, model = time.perf_counter, self.strategy, self.model
        accum = strategy.accumulation_steps
        micro_batches = zip(x.chunk(accum), y.chunk(accum)) if accum > 1 else [(x, y)]
        forward = backward = 0.0
        step_loss = torch.zeros(())
        for micro, (xm, ym) in enumerate(micro_batches):
            last = micro == accum - 1
            with strategy.no_sync(model) if not last else _nothing():
                a = clock()
                with SavedActivations() if step == self.start and micro == 0 else _nothing() as acts:
                    loss = models.loss(model(xm), ym)
                    if accum > 1:
                        loss = loss / accum
                if acts is not None:
                    self.memory["activations"] = acts.bytes(exclude=model.parameters())
                b = clock()
                loss.backward()
                c = clock()
            self.phases += [("forward", a, b, step), ("backward", b, c, step)]
            forward, backward = forward + b - a, backward + c - b
            step_loss += loss.detach()
        return step_loss, forward, backward

    def result(self) -> RankResult:
        self.memory.update(peak_process_bytes(self.info.device))
        state, evaluation = self.strategy.finish(self.model, self.data)  # on every rank: may be a collective
        checksum = float(sum(t.detach().double().sum() for t in state.values() if t.is_floating_point()))
        return RankResult(
            rank=self.info.rank, steps=self.steps, memory=self.memory, events=self.recorder.rows(),
            phases=self.recorder.phase_rows(), params_checksum=checksum,
            params=params_to_bytes(state) if self.info.is_main else None, evaluation=evaluation,
            strategy=self.strategy.describe(), provenance=provenance(self.info.backend, self.cfg.resolved_threads),
        )


def train(info: DistInfo, cfg: RunConfig) -> RankResult:
    """Run ``cfg`` as rank ``info.rank``. Called inside each rank process."""
    torch.set_num_threads(cfg.resolved_threads)
    # Not started when the launcher records nothing: phases are timed, collectives not.
    recorder = active() or CommRecorder(info.rank)
    spec = registry.get(cfg.tier)
    if spec.strategy is None:
        raise ValueError(f"tier {cfg.tier!r} does not run the SPMD training loop: start it with dtlab.run(cfg)")
    strategy = spec.strategy(cfg, info)
    try:
        loop = _Loop(cfg, info, strategy, recorder)
        loop.run()
        return loop.result()
    except BaseException as exc:
        strategy.on_error(exc)
        raise


class _nothing:  # noqa: N801 - reads like contextlib.nullcontext, but yields None cheaply
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
