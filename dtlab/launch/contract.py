"""The contract every launcher keeps: what it takes, what it returns, how it fails.

``launch`` (local processes), ``launch_torchrun`` (torchrun's agents) and
``launch_rpc`` (named RPC workers) take the same settings, checked once in
``LaunchOptions``, and return a ``LaunchResult``: the ranks' values in rank
order (it still reads as that list: ``out[0]``, ``len(out)``, ``list(out)``),
each rank's output, the wall time and the run's events. A failed launch raises
``launch_error``'s RankError (or CollectiveTimeout), culprit first; a stopped
one raises ``LaunchStopped``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtlab.core.config import BACKENDS, DEVICES
from dtlab.core.failures import CollectiveTimeout, OpState, RankError, RankFailure

Progress = bool | Callable[[dict[str, Any]], None]


class LaunchStopped(RuntimeError):
    """The caller asked a running launch to stop; every rank was killed."""


def _invalid(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {why}")


def _seconds(value: Any) -> bool:
    """A finite number of seconds > 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class LaunchOptions:
    """What every launcher takes, checked before any process starts.

    ``timeout_s`` bounds one collective (the process group's timeout, and the
    local launcher's watchdog a little later); ``deadline_s`` optionally bounds
    the whole launch. ``progress`` shows rank 0's ``report()`` calls with tqdm
    (True), nothing (False), or passes every rank's to a callable. ``record``
    switches the CommRecorder on in each rank. ``env`` is added to every rank's
    environment. ``flight_recorder`` switches PyTorch's Flight Recorder on in every
    rank and collects each rank's dump (``dtlab.launch.flight``). Setting ``stop``
    (from another thread: a widget's Stop button) kills every rank and raises
    ``LaunchStopped``.
    """

    backend: str = "auto"
    device: str = "auto"
    timeout_s: float = 60.0
    deadline_s: float | None = None
    progress: Progress = True
    record: bool = True
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    stop: threading.Event | None = None
    flight_recorder: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise _invalid("backend", self.backend, f"choose one of {', '.join(BACKENDS)}")
        if self.device not in DEVICES:
            raise _invalid("device", self.device, f"choose one of {', '.join(DEVICES)}")
        if self.device == "cpu" and self.backend == "nccl":
            raise _invalid("backend", self.backend, "nccl needs CUDA devices; use gloo with device='cpu'")
        if not _seconds(self.timeout_s):
            raise _invalid("timeout_s", self.timeout_s, "must be > 0 seconds")
        if self.deadline_s is not None and not _seconds(self.deadline_s):
            raise _invalid("deadline_s", self.deadline_s, "must be > 0 seconds, or None for no deadline")
        if not isinstance(self.progress, bool) and not callable(self.progress):
            raise _invalid("progress", self.progress, "give True, False or a callable taking a dict")
        if not isinstance(self.record, bool):
            raise _invalid("record", self.record, "give True or False")
        if not isinstance(self.flight_recorder, bool):
            raise _invalid("flight_recorder", self.flight_recorder, "give True or False")
        if self.env is not None and not isinstance(self.env, Mapping):
            raise _invalid("env", self.env, "give a dict of environment variables")
        if self.stop is not None and not callable(getattr(self.stop, "is_set", None)):
            raise _invalid("stop", self.stop, "give a threading.Event, or None")
        # A copy, with string values: the caller's dict may change after the launch starts.
        object.__setattr__(self, "env", {str(k): str(v) for k, v in (self.env or {}).items()})

    def stop_requested(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def for_ranks(self) -> RankOptions:
        """The part a rank process needs (picklable: no callable, no event)."""
        return RankOptions(self.backend, self.device, self.timeout_s, self.record, dict(self.env))


@dataclass(frozen=True)
class RankOptions:
    """What a rank process needs to set itself up, sent to it with its function.

    ``env`` is set in the rank's environment by the local launcher (torchrun's
    agents hand it down in theirs). ``gloo_ifname``: the interface gloo binds in
    dtlab's own launches; None for a cluster's ranks, which take the interface
    their host name resolves to.
    """

    backend: str
    device: str
    timeout_s: float
    record: bool = True
    env: dict[str, str] = field(default_factory=dict)
    gloo_ifname: str | None = "lo"


@dataclass(eq=False, repr=False)
class LaunchResult(Sequence[Any]):
    """The ranks' return values in rank order, with each rank's output, the wall time and the run's events.

    It reads as the list of values (``out[0]``, ``len(out)``, ``list(out)``,
    iteration, ``out == [...]``, and its repr) as launches returned before it
    grew fields. ``logs`` is keyed by rank (by node for torchrun, whose agents
    interleave their ranks' output); ``events`` holds what the workers reported
    with ``dtlab.core.events.emit`` under torchrun (empty for local launches);
    ``flight`` holds each rank's Flight Recorder dump, when the launch asked for them.
    """

    values: list[Any]
    logs: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    flight: dict[int, bytes] = field(default_factory=dict)

    def __getitem__(self, index: Any) -> Any:
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return self.values == other
        if type(other) is type(self):
            return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like the list it stands for

    def __repr__(self) -> str:
        return repr(self.values)


def launch_error(failures: list[RankFailure], ops: list[OpState] | None = None, note: str = "",
                 events: list[dict[str, Any]] | None = None, flight: dict[int, bytes] | None = None) -> RankError:
    """The exception a failed launch raises: CollectiveTimeout when anything timed out, else RankError.

    ``note`` says why the launcher ended the run (a watchdog, a deadline), if it did; ``flight`` (the
    ranks' Flight Recorder dumps, if asked for) rides along as ``error.flight``.
    """
    timed_out = bool(note) or any(f.kind == "timeout" or "timed out" in f.message.lower() for f in failures)
    error = (CollectiveTimeout if timed_out else RankError)(failures, ops, note)
    # RankError takes no events: the run's timeline rides along as an attribute.
    error.events = list(events or [])  # type: ignore[attr-defined]
    error.flight = dict(flight or {})  # type: ignore[attr-defined]
    return error


class ProgressBar:
    """tqdm (notebook-aware) over rank 0's reports, created on the first one; or every report to a callable."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.bar: Any = None

    def update(self, info: dict[str, Any]) -> None:
        if callable(self.progress):
            self.progress(info)
            return
        if not self.progress or "step" not in info or info.get("rank", 0) != 0:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=info.get("total"), desc=info.get("desc", "rank 0"), unit="step", leave=False)
        self.bar.n = info["step"]
        if "loss" in info:
            self.bar.set_postfix(loss=f"{info['loss']:.4f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
