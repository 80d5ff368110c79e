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
from dtlab.core.config import RunConfig, parse_slow_rank
from dtlab.core.env import DistInfo
from dtlab.core.job import build_job, optimizer_factory, torch_dtype
from dtlab.core.memory import (
    SavedActivations,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    peak_process_bytes,
)
from dtlab.core.progress import report
from dtlab.core.results import RankResult, params_to_bytes, provenance
from dtlab.core.timing import StepClock
from dtlab.instrument.channels import Channel, to_open
from dtlab.instrument.recorder import CommRecorder, active
from dtlab.tiers.parts.base import Strategy

_REPORT_EVERY_S = 0.25


class _Loop:
    """One rank's run of the job: state shared by the step and its phases."""

    def __init__(self, cfg: RunConfig, info: DistInfo, strategy: Strategy, recorder: CommRecorder,
                 channels: list[Channel]) -> None:
        self.cfg, self.info, self.strategy, self.recorder = cfg, info, strategy, recorder
        self.channels = channels  # opened before wrap: a tier declares what they measure as it shards
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
        self.clock = StepClock(info.device)
        recorder.clock = self.clock if self.clock.cuda else None  # its events on the GPU's clock too
        slow, delay = parse_slow_rank(cfg.slow_rank) if cfg.slow_rank else (-1, 0.0)
        self.delay_s = delay if slow == info.rank else 0.0  # this rank's extra compute per step (a straggler)
        self.recomputed = 0.0  # seconds of activation-checkpointing recomputation so far

    def run(self) -> None:
        last_report = 0.0
        step = self.start
        while step < self.cfg.steps:
            self.recorder.step = step
            for channel in self.channels:
                channel.step_started(step)
            self.strategy.on_step_start(step)
            row = self.step(step)
            for channel in self.channels:
                channel.step_ended(step)
            self.strategy.on_step_end(step)
            self.steps.append(row)
            now = time.perf_counter()
            if now - last_report > _REPORT_EVERY_S or step == self.cfg.steps - 1:
                report(step=step + 1, total=self.cfg.steps, loss=row["loss"], desc=f"{self.cfg.tier} rank 0",
                       samples_per_s=row["samples"] * self.info.world_size / row["total"])
                last_report = now
            step = self.strategy.next_step(step)  # step + 1, unless the tier must repeat or skip ahead
        self.recorder.step = self.cfg.steps

    def step(self, step: int) -> dict[str, float]:
        strategy, model, phase = self.strategy, self.model, self.recorder.phase
        first_event, first_phase = len(self.recorder.events), len(self.phases)
        with phase("data"):
            idx = self.batches.indices(step)
            x, y = self.data.train_x[idx].to(self.info.device), self.data.train_y[idx].to(self.info.device)
        if strategy.custom_step:  # e.g. a pipeline schedule: forward and backward interleave
            with phase("forward_backward"):
                self.straggle()
                step_loss = strategy.run_step(model, x, y)
        else:
            step_loss = self.forward_backward(step, x, y)
        with phase("comm"):
            strategy.sync_gradients(model)
        if step == self.start:  # the first step is warm-up, left out of the medians: accounting costs nothing there
            self.memory["gradients"] = gradient_bytes(strategy.unwrap(model))
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        # On CUDA the phases' marks become the GPU's times here, once per step (a no-op on the CPU).
        self.recorder.retime(self.clock.resolve(), first_event, first_phase)
        if step == self.start:
            self.memory["optimizer_state"] = optimizer_state_bytes(self.optimizer)
        # NaN on ranks that compute no loss (early pipeline stages)
        row = {"step": step, "loss": float(step_loss), "samples": len(idx), **self.step_times(first_phase),
               **models.step_stats(model)}
        if self.cfg.activation_checkpointing:  # part of backward: seconds spent running blocks again
            recomputed = models.recompute_seconds(model)
            row["recompute"], self.recomputed = recomputed - self.recomputed, recomputed
        return row

    def step_times(self, first_phase: int) -> dict[str, float]:
        """The step's seconds per phase, from the phases it recorded (so on CUDA, the GPU's)."""
        spans = self.phases[first_phase:]
        seconds = dict.fromkeys(("data", "forward", "backward", "comm", "optimizer", "forward_backward"), 0.0)
        for name, start, end, _ in spans:
            if name in seconds:
                seconds[name] += end - start
        joint = seconds.pop("forward_backward")
        if self.strategy.custom_step:
            parts = self.strategy.split_step(joint)
            seconds["forward"], seconds["backward"] = parts["forward"], parts["backward"]
            seconds["comm"] += parts["comm"]  # what the schedule waited: transfers and bubble
        step_spans = [(start, end) for name, start, end, _ in spans if name in ("data", "optimizer")]
        seconds["total"] = max(e for _, e in step_spans) - min(s for s, _ in step_spans)
        return seconds

    def forward_backward(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches; all but the last under ``no_sync``."""
        strategy, model = self.strategy, self.model
        accum = strategy.accumulation_steps
        micro_batches = zip(x.chunk(accum), y.chunk(accum)) if accum > 1 else [(x, y)]
        step_loss = torch.zeros((), dtype=torch_dtype(self.cfg), device=self.info.device)  # float64 jobs: float64
        for micro, (xm, ym) in enumerate(micro_batches):
            last = micro == accum - 1
            with strategy.no_sync(model) if not last else _nothing(), strategy.step_context():
                with self.recorder.phase("forward"):
                    with SavedActivations() if step == self.start and micro == 0 else _nothing() as acts:
                        with self.autocast():  # the forward and the loss only: backward follows the forward's dtypes
                            loss = models.training_loss(model, model(xm), ym)
                        if accum > 1:
                            loss = loss / accum
                    if micro == 0:
                        self.straggle()
                    if acts is not None:
                        self.memory["activations"] = acts.bytes(exclude=model.parameters())
                with self.recorder.phase("backward"):
                    loss.backward()
            step_loss += _local(loss.detach())
        return step_loss

    def autocast(self) -> torch.autocast | _nothing:
        if self.cfg.precision == "bf16":
            return torch.autocast(self.info.device.type, dtype=torch.bfloat16)
        return _nothing()

    def straggle(self) -> None:
        """A slow rank's extra compute (``RunConfig.slow_rank``): it arrives late at the step's collectives."""
        if self.delay_s:
            time.sleep(self.delay_s)

    def result(self) -> RankResult:
        self.memory.update(self.strategy.memory())  # kinds the strategy measured: over the loop's own
        for channel in self.channels:  # and those the instrument layer measured for it
            self.memory.update(channel.memory())
        self.memory.update(peak_process_bytes(self.info.device))
        state, evaluation = self.strategy.finish(self.model, self.data)  # on every rank: may be a collective
        facts = self.strategy.describe()  # after finish, as before: a tier may describe what finish found
        for channel in self.channels:
            facts.update(channel.describe())
        checksum = float(sum(t.detach().double().sum() for t in state.values() if t.is_floating_point()))
        return RankResult(
            rank=self.info.rank, steps=self.steps, memory=self.memory, events=self.recorder.rows(),
            phases=self.recorder.phase_rows(), params_checksum=checksum,
            params=params_to_bytes(state) if self.info.is_main or self.strategy.params_on_every_rank else None,
            evaluation=evaluation,
            strategy=facts, provenance=provenance(self.info.backend, self.cfg.resolved_threads),
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
    # The channels name calls that carry no tag of their own (a layer's DTensor collectives, DDP's buckets), or
    # measure (FSDP2's gathered bytes: those open whether the run records or not)
    channels = to_open(strategy.comm_channels, recording=active() is not None)
    try:
        with recorder.channels(channels) as opened:
            loop = _Loop(cfg, info, strategy, recorder, opened)
            loop.run()
            return loop.result()
    except BaseException as exc:
        strategy.on_error(exc)
        raise


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor (a tensor-parallel loss is a replicated DTensor)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class _nothing:  # noqa: N801 - reads like contextlib.nullcontext, but yields None cheaply
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
