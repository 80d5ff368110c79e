"""RankResult (what one rank measured) and RunResult (the run, for analysis).

A RunResult turns into DataFrames for plots and writes the CLI's files:
``result.json`` (summary), ``events.csv``, ``trace.json`` and ``params.pt`` (and,
for a run with ``flight_recorder``, each rank's Flight Recorder dump in
``flight_recorder/rank_<R>``).
"""

from __future__ import annotations

import datetime
import functools
import io
import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtlab.core.comm import chrome_trace, events_frame
from dtlab.core.version import __version__

PHASES = ("data", "forward", "backward", "comm", "optimizer")
# Steps that ``RunResult.steady`` leaves out by default. Step 0 is the one step that does one-off work in every
# tier: DDP builds (and then rebuilds) its buckets, the optimizer allocates its state, the first collectives set up
# their connections, memory is touched for the first time. From step 1 on a step does what every later step does,
# and a short teaching run (5-10 steps) keeps nearly all of its steps. A caller with its own reason to skip more
# passes its count explicitly (the cost model, the link sweep and the benchmarks do, and say why).
WARMUP_STEPS = 1


@dataclass
class RankResult:
    rank: int
    steps: list[dict[str, float]]  # step, loss, samples and one time per phase (s)
    memory: dict[str, int]
    events: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    params_checksum: float
    params: bytes | None = None  # torch.save'd state_dict, rank 0 only
    evaluation: dict[str, float] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(backend: str, threads: int) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "dtlab": __version__,
        "git_commit": _git_commit(),
        "backend": backend,
        "threads_per_rank": threads,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def params_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, buf)
    return buf.getvalue()


def params_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the floating-point entries of two state dicts."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())}")
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()]
    return max(diffs, default=0.0)



def max_per_kind(memories: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per kind, the most bytes any rank holds (each kind's maximum may come from another rank):
    ``memory_max_over_ranks`` in a run's summary, and in the estimate's JSON for the prediction."""
    kinds = list(dict.fromkeys(k for memory in memories for k in memory))
    return {k: max(memory.get(k, 0) for memory in memories) for k in kinds}

@dataclass
class RunResult:
    config: Any  # RunConfig
    ranks: list[RankResult]
    wall_s: float
    logs: dict[int, str] = field(default_factory=dict)
    # What torchrun-launched workers reported (starts, restarts, snapshots, faults): see dtlab.core.events.emit.
    run_events: list[dict[str, Any]] = field(default_factory=list)
    # Each rank's Flight Recorder dump (torch's pickle, read by dtlab.core.flight), when the run asked for them.
    flight: dict[int, bytes] = field(default_factory=dict)

    # -- tables -------------------------------------------------------------------
    def steps_frame(self) -> Any:
        import pandas as pd

        rows = [{"rank": r.rank, **s} for r in self.ranks for s in r.steps]
        return pd.DataFrame(rows)

    def loss_curve(self) -> Any:
        """The global training loss per step: the mean of the ranks' equal-sized shares.

        Ranks that compute no loss (early pipeline stages) report NaN and are left out.
        """
        return self.steps_frame().groupby("step")["loss"].mean()  # mean() skips NaN

    def events_frame(self) -> Any:
        return events_frame([e for r in self.ranks for e in r.events])

    def phases_frame(self) -> Any:
        import pandas as pd

        rows = [p for r in self.ranks for p in r.phases]
        return pd.DataFrame(rows, columns=["rank", "phase", "start", "end", "step"])

    def steady(self, warmup_steps: int = WARMUP_STEPS) -> Any:
        """The steps frame without its first ``warmup_steps`` steps: the run's steady state.

        Steps are counted from the first one this run made (a resumed run starts
        past 0), on every rank alike; a run too short to skip them all keeps its
        last step. Default: ``WARMUP_STEPS`` (step 0 only; see there why).
        """
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: must be an integer >= 0")
        df = self.steps_frame()
        if df.empty:
            return df
        steps = sorted(df["step"].unique())
        first = steps[min(warmup_steps, len(steps) - 1)]
        return df[df["step"] >= first]

    def step_times(self) -> Any:
        """Per step, the slowest rank's time: a synchronous step ends when its last rank does."""
        return self.steps_frame().groupby("step")["total"].max()

    @property
    def label(self) -> str:
        return f"{self.config.tier} w{self.config.world_size}"

    def phase_medians(self) -> dict[str, float]:
        """Median seconds per phase over the steady steps (``steady()``), slowest rank per step."""
        per_step = self.steady().groupby("step")[list(PHASES)].max()
        return {p: float(per_step[p].median()) for p in PHASES}

    # -- numbers ------------------------------------------------------------------
    def median_step_s(self, warmup_steps: int = WARMUP_STEPS) -> float:
        """Median step time over the steady steps (``steady(warmup_steps)``), a step taking its slowest rank's."""
        return float(self.steady(warmup_steps).groupby("step")["total"].max().median())

    def samples_per_s(self) -> float:
        return self.config.global_batch_size / self.median_step_s()

    def final_loss(self) -> float:
        return float(self.loss_curve().iloc[-1])

    def params(self) -> dict[str, torch.Tensor]:
        data = self.ranks[0].params
        if data is None:
            raise ValueError("this result holds no parameters")
        return params_from_bytes(data)

    def max_param_diff(self, other: RunResult | dict[str, torch.Tensor]) -> float:
        theirs = other.params() if isinstance(other, RunResult) else other
        return max_param_diff(self.params(), theirs)

    def comm_summary(self) -> dict[str, dict[str, float]]:
        """Per op: calls and bytes on rank 0, over the whole run and per training step."""
        df = self.events_frame()
        df = df[df["rank"] == 0]
        steps = self.config.steps
        out = {}
        for op, group in df.groupby("op"):
            # leaves out set-up traffic (DDP's initial broadcast) and the final state's gathering (step == steps)
            in_steps = group[(group["step"] >= 0) & (group["step"] < steps)]
            out[str(op)] = {"calls": int(len(group)), "bytes": int(group["bytes"].sum()),
                            "calls_per_step": len(in_steps) / steps,
                            "bytes_per_step": float(in_steps["bytes"].sum()) / steps,
                            "seconds": float(group["duration_s"].sum())}
        return out

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        mem_max = max_per_kind([r.memory for r in self.ranks])
        return {
            "tier": cfg.tier,
            "world_size": cfg.world_size,
            "processes": len(self.ranks),
            "steps": cfg.steps,
            "global_batch_size": cfg.global_batch_size,
            "model": cfg.to_dict()["model"],
            "dataset": cfg.to_dict()["dataset"],
            "median_step_s": self.median_step_s(),
            "samples_per_s": self.samples_per_s(),
            "final_loss": self.final_loss(),
            **{f"test_{k}": v for k, v in self.ranks[0].evaluation.items()},
            "wall_s": self.wall_s,
            "comm": self.comm_summary(),
            "memory_rank0": self.ranks[0].memory,
            "memory_max_over_ranks": mem_max,
            "strategy": self.ranks[0].strategy,
            "config": cfg.to_dict(),
            "provenance": self.ranks[0].provenance,
        }

    # -- files --------------------------------------------------------------------
    def save(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write result.json, events.csv, trace.json and params.pt into ``out_dir``.

        Each file is written under a temporary name and renamed, so a run that
        fails midway never leaves a half-written file behind.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "result.json", json.dumps(self.summary(), indent=2, default=str).encode())
        atomic_write(out / "events.csv", self.events_frame().to_csv(index=False).encode())
        atomic_write(out / "steps.csv", self.steps_frame().to_csv(index=False).encode())
        events = [e for r in self.ranks for e in r.events]
        phases = [p for r in self.ranks for p in r.phases]
        atomic_write(out / "trace.json", json.dumps(chrome_trace(events, phases), default=str).encode())
        if self.run_events:
            import pandas as pd

            atomic_write(out / "run_events.csv", pd.DataFrame(self.run_events).to_csv(index=False).encode())
        if self.ranks[0].params is not None:
            atomic_write(out / "params.pt", self.ranks[0].params)
        if self.flight:
            save_flight(self.flight, out)
        return out


FLIGHT_DIR = "flight_recorder"


def save_flight(dumps: Mapping[int, bytes], out_dir: str | os.PathLike[str]) -> Path:
    """Each rank's Flight Recorder dump as ``out_dir/flight_recorder/rank_<R>``: a folder torch's analyser
    reads as it is (``python -m torch.distributed.flight_recorder.fr_trace out_dir/flight_recorder``)."""
    folder = Path(out_dir) / FLIGHT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for rank, data in dumps.items():
        atomic_write(folder / f"rank_{rank}", data)
    return folder


def atomic_write(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: readers never see a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_params(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a ``params.pt`` written by ``RunResult.save`` (tensors only, no code)."""
    return torch.load(path, weights_only=True)
