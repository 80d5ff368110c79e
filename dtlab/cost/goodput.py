"""Goodput (useful steps per wall second) against the mean time between failures: the analytic model.

Three ways to survive a fault, each described by a few measured costs:

- **restart from a checkpoint** (``elastic``): every ``k`` steps the job saves
  (``save_s``, what the save blocks the training for); a fault stops the world,
  which restarts and loads the last checkpoint (``restart_s``: detection,
  restart, rendezvous, load) and computes the steps since it again. With faults
  a Poisson process of mean ``M`` seconds of training between them, a segment
  of ``T = k·step_s + save_s`` seconds takes on average
  ``(M + restart_s)·(exp(T / M) − 1)`` (each failed try costs its partial work
  and a restart; no fault strikes during a restart). The interval ``k`` comes
  from Young's ``sqrt(2·save_s·M)`` with Daly's higher-order correction.
  An asynchronous save blocks only for its staging; the checkpoint becomes
  durable ``persist_s`` later, which a fault then also loses (added to the
  restart, a first-order charge).
- **recover per step** (``ft``) and **synchronise rarely** (``diloco``): a
  fault costs a fixed ``lost_s`` (the survivors' lost time plus the dead
  group's missing share of the batch, as time), nothing is rolled back, so
  ``M`` seconds of training take ``M + lost_s``; their ``step_s`` is slower
  than ``elastic``'s (a quorum per step; a synchronisation every H steps).

``M`` is the mean *training* time between faults (the clock stops during a
restart), the way the measured runs inject faults: a Poisson process over the
steps a run executes.

When per-step fault tolerance pays: its cost on every step against what it saves at each fault.

A run of ``ft`` pays ``step_ft_s - step_base_s`` more than the baseline
(``elastic``, or ``ddp`` restarted from a snapshot) on every step, and loses
``lost_ft_s`` instead of ``lost_base_s`` at each fault. With one fault every
``n`` steps the two spend the same time when

    n x (step_ft_s - step_base_s) = lost_base_s - lost_ft_s

so ft is the faster of the two while faults come more often than every
``break_even_steps(...)`` steps, and never if it loses as much per fault as the
baseline. While a replica group is down the others commit steps on their share
of the global batch only: ``samples_lost`` counts the samples those steps left
out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["LLAMA3", "PerFault", "Projection", "Restart", "break_even_hours", "break_even_mtbf", "break_even_overhead",
           "break_even_steps", "daly_interval", "goodput", "interval_steps", "per_fault_goodput", "restart_goodput",
           "samples_lost", "segment_s", "young_interval"]


@dataclass(frozen=True)
class Restart:
    """Restart from a checkpoint: a step, a save's blocking cost, a restart's cost (seconds)."""

    step_s: float
    save_s: float
    restart_s: float
    persist_s: float = 0.0  # async saves: durable this long after the step goes on


@dataclass(frozen=True)
class PerFault:
    """Recovery without rollback: a step, and the time-equivalent a fault costs (seconds)."""

    step_s: float
    lost_s: float


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young (1974): the compute time between checkpoints that minimises the waste, sqrt(2·δ·M)."""
    _positive(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: sqrt(2δM)·(1 + sqrt(δ/2M)/3 + (δ/2M)/9) − δ for δ < 2M, else M."""
    _positive(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def interval_steps(c: Restart, mtbf_s: float) -> int:
    """Daly's interval in whole steps (at least one)."""
    return max(1, round(daly_interval(max(c.save_s, 1e-12), mtbf_s) / c.step_s))


def segment_s(work_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall time to get ``work_s`` of training plus its save done, faults at rate 1/M."""
    _positive(mtbf_s=mtbf_s)
    return (mtbf_s + restart_s) * math.expm1((work_s + save_s) / mtbf_s)


def restart_goodput(c: Restart, mtbf_s: float, every: int | None = None) -> float:
    """Steps per second, checkpointing every ``every`` steps (default: Daly's interval)."""
    k = every or interval_steps(c, mtbf_s)
    if math.isinf(mtbf_s):
        return k / (k * c.step_s + c.save_s)
    return k / segment_s(k * c.step_s, c.save_s, c.restart_s + c.persist_s, mtbf_s)


def per_fault_goodput(c: PerFault, mtbf_s: float) -> float:
    """Steps per second when each fault costs ``lost_s`` and nothing is rolled back."""
    _positive(mtbf_s=mtbf_s)
    return 1.0 / (c.step_s * (1.0 + c.lost_s / mtbf_s))


def goodput(c: Restart | PerFault, mtbf_s: float) -> float:
    """Either model, by the costs' kind."""
    return restart_goodput(c, mtbf_s) if isinstance(c, Restart) else per_fault_goodput(c, mtbf_s)


def break_even_overhead(restart_fraction: float, per_step_fraction: float) -> float:
    """The per-step overhead (a fraction of a step) at which per-step recovery, keeping ``per_step_fraction`` of
    its own fault-free throughput, falls to ``restart_fraction`` of the restart's: f_p / (1 + o) = f_r."""
    _positive(restart_fraction=restart_fraction)
    return per_step_fraction / restart_fraction - 1.0


def break_even_mtbf(a: Restart | PerFault, b: Restart | PerFault, low: float = 1e-3,
                    high: float = 1e9) -> float | None:
    """The MTBF (s) where ``a`` and ``b`` have equal goodput (bisection on log M); None if they do not cross."""
    diff: Callable[[float], float] = lambda m: goodput(a, m) - goodput(b, m)  # noqa: E731
    lo, hi = math.log(low), math.log(high)
    if diff(math.exp(lo)) * diff(math.exp(hi)) > 0:
        return None
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if diff(math.exp(lo)) * diff(math.exp(mid)) <= 0:
            hi = mid
        else:
            lo = mid
    return math.exp((lo + hi) / 2.0)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} is invalid: must be > 0 seconds")


# -- the published cluster -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Projection:
    """A published run's failure rate, and the costs the projection assumes (not measured here)."""

    source: str
    gpus: int
    days: float
    unexpected: int
    interruptions: int
    step_s: float  # assumed: see ASSUMED below
    save_s: float
    async_save_s: float
    persist_s: float
    restart_s: float
    ft_lost_s: float

    @property
    def mtbf_s(self) -> float:
        """Mean time between unexpected interruptions for the whole job."""
        return self.days * 86400.0 / self.unexpected

    def mtbf_at(self, gpus: Iterable[int]) -> list[float]:
        """The job's MTBF at other sizes, failures independent per GPU: M · published GPUs / GPUs."""
        return [self.mtbf_s * self.gpus / g for g in gpus]


# Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4 (Reliability and Operational Challenges):
# 466 job interruptions (419 unexpected) in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
# The costs are ASSUMED, round figures of the right order, for the projection only: a step of 6 s
# (6·405e9 parameters·16M tokens / (16,384 GPUs · 400 TFLOP/s)), a synchronous save blocking 60 s
# and an asynchronous one 5 s (durable 60 s later), a restart of 10 minutes (detect, reschedule,
# rendezvous, load); per-step recovery losing 30 s per fault (detection, the redone step, and the lost
# group's share while it rejoins).
LLAMA3 = Projection(source="Dubey et al. 2024, The Llama 3 Herd of Models, section 3.3.4", gpus=16384, days=54.0,
                    unexpected=419, interruptions=466, step_s=6.0, save_s=60.0, async_save_s=5.0, persist_s=60.0,
                    restart_s=600.0, ft_lost_s=30.0)

def _finite(name: str, value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number of seconds")
    return float(value)


def _number(name: str, value: float, *, positive: bool = False) -> float:
    _finite(name, value)
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} is invalid: must be {'> 0' if positive else '>= 0'} seconds")
    return float(value)


def break_even_steps(extra_step_s: float, saved_per_fault_s: float) -> float:
    """Steps between faults below which per-step recovery finishes first, to first order: N = saved / extra, with
    ``extra_step_s`` what it costs more on every step and ``saved_per_fault_s`` what it loses less at each fault.
    ``inf`` where its steps cost no more (it always pays), ``0.0`` where it saves nothing per fault (it never
    pays)."""
    extra, saved = _finite("extra_step_s", extra_step_s), _finite("saved_per_fault_s", saved_per_fault_s)
    if saved <= 0:
        return 0.0
    return math.inf if extra <= 0 else saved / extra


def break_even_hours(steps: float, step_s: float) -> float:
    """``steps`` between faults as hours of training at ``step_s`` seconds per step."""
    if not isinstance(steps, int | float) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps={steps!r} is invalid: must be a number of steps >= 0")
    return steps * _number("step_s", step_s, positive=True) / 3600.0


def samples_lost(participants: Iterable[int], groups: int, global_batch: int) -> float:
    """Samples the committed steps left out: each step with ``p`` of ``groups`` replica groups in it averages
    ``p / groups`` of the ``global_batch``, so it leaves out ``(groups - p) / groups x global_batch``."""
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups={groups!r} is invalid: must be an integer >= 1")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} is invalid: must be an integer >= 1")
    total = 0.0
    for p in participants:
        if not 0 < p <= groups:
            raise ValueError(f"participants {p!r} is invalid: a committed step has 1..{groups} groups in it")
        total += (groups - p) / groups * global_batch
    return total
