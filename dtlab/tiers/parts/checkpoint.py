"""Distributed Checkpoint (DCP): sharded saves that load at any world size.

``save`` writes one file of shards per rank plus a ``.metadata`` file that
rank 0 writes last; it records every tensor's *global* shape and where each
piece lies. ``load`` reads the pieces the loading rank needs under its own
sharding, so a checkpoint saved by 2 ranks loads into 1 or 4 (DCP reshards on
load), and one saved by ``ddp`` (full tensors) loads into ``fsdp`` (shards).

Safety: a save goes to a hidden sibling directory and is renamed into place
only once ``.metadata`` exists, so an interrupted save never replaces the last
good checkpoint; ``verify`` names what is missing from an incomplete one.

``Periodic`` is what a tier uses: resume in ``make_optimizer``, then save every
k optimizer steps into ``checkpoint_dir/step-NNNNNNNN``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.instrument.recorder import tagged

__all__ = ["METADATA", "CheckpointError", "Knobs", "Periodic", "latest", "load", "preflight", "resolve", "save",
           "saved_step", "step_dir", "validate_knobs", "validate_options", "verify"]

METADATA = ".metadata"  # DCP's index, written by rank 0 after every rank's shards
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or does not fit the model."""


def _dcp() -> Any:
    # Imported on first use: it costs about 1 s, paid by every torchrun worker that imports a tier.
    import torch.distributed.checkpoint as dcp

    return dcp


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Where periodic saves put the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"step-{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> dict[str, Any]:
    # get_state_dict names entries by the plain module's FQNs (no DDP "module." prefix,
    # no FSDP wrapper), so every tier's checkpoint has the same keys.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    world = dist.get_world_size() if dist.is_initialized() else 1
    state["dtlab"] = {"step": step, "world_size": world}
    return state


def _no_dist() -> bool:
    return not dist.is_initialized()  # DCP then runs as one process (and says so in a warning)


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
         directory: str | os.PathLike[str]) -> Path:
    """Save model (and optimizer) state after ``step`` steps; a collective: every rank calls it.

    Written to ``.<name>.incomplete`` beside ``directory`` and renamed into place
    when complete. An existing checkpoint of the same name is moved aside first
    and deleted only after the new one is in place.
    """
    target = Path(directory).absolute()
    tmp = target.with_name(f".{target.name}.incomplete")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        tmp.mkdir(parents=True)
    _barrier()  # nobody writes into tmp before rank 0 has cleared it
    _dcp().save(_state(model, optimizer, step), checkpoint_id=tmp, no_dist=_no_dist())
    # dcp.save returns on every rank only after rank 0 wrote .metadata: the save is complete.
    if _rank() == 0:
        if target.exists():
            old = target.with_name(f".{target.name}.replaced")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)  # atomic: the checkpoint appears whole or not at all
    _barrier()  # no rank goes on (and maybe loads) before the rename
    return target


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete ``step-*`` checkpoint with the highest step under ``root`` (None if none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m[1]), child) for child in root.iterdir()
             if (m := _STEP_DIR.match(child.name)) and (child / METADATA).is_file()]
    return max(found)[1] if found else None


def resolve(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory, or a folder of ``step-*`` checkpoints (its latest), verified."""
    path = Path(path)
    if path.is_dir() and not (path / METADATA).exists() and not any(path.glob("*.distcp")):
        found = latest(path)
        if found is None:
            raise CheckpointError(f"{path} holds no checkpoint: no {METADATA} and no complete step-* directory")
        path = found
    verify(path)
    return path


def verify(directory: str | os.PathLike[str]) -> Any:
    """Check that ``directory`` is a complete dtlab checkpoint; return its DCP metadata.

    Raises CheckpointError naming what is missing: the directory, ``.metadata``
    (the save never finished), a shard file the metadata lists, or bytes of one.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if not (path / METADATA).is_file():
        partial = sorted(p.name for p in path.glob("*.distcp"))
        found = f" (it holds only {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"checkpoint {path} is incomplete: {METADATA} is missing{found}; rank 0 writes it "
                              f"last, so the save that made it did not finish")
    try:
        metadata = _dcp().FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or overwritten pickle
        raise CheckpointError(f"checkpoint {path}: {METADATA} is unreadable ({type(exc).__name__}: {exc})") from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing "
                              f"(listed in {METADATA})")
    for name, end in sorted(needed.items()):
        size = (path / name).stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {size} bytes, {METADATA} "
                                  f"expects at least {end}")
    if "dtlab.step" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {path} is not a dtlab checkpoint: it has no 'dtlab.step' entry")
    return metadata


def _failure(exc: BaseException) -> str:
    """The first rank's own error out of DCP's CheckpointException (which wraps them all)."""
    for inner, _trace in getattr(exc, "failures", {}).values():
        return f"{type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike[str]) -> int:
    """Load a checkpoint into ``model`` (and ``optimizer``) under their current sharding.

    A collective: every rank calls it. Returns the step it was saved after.
    ``directory`` may also be a folder of ``step-*`` checkpoints (the latest loads).
    """
    path = resolve(directory)
    metadata = verify(path)
    if optimizer is not None and not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it with optimizer=None")
    state = _state(model, optimizer, step=-1)
    try:
        _dcp().load(state, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, _dcp().CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {_failure(exc)}") from None
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["dtlab"]["step"])


def saved_step(directory: str | os.PathLike[str]) -> int:
    """The step a checkpoint was saved after, read in this process alone (no process group)."""
    state: dict[str, Any] = {"dtlab": {"step": -1}}
    with _quiet():
        _dcp().load(state, checkpoint_id=resolve(directory), no_dist=True)
    return int(state["dtlab"]["step"])


@contextlib.contextmanager
def _quiet() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass(frozen=True)
class Knobs:
    """The checkpoint options a tier composes into its own (``class Options(Knobs, ...)``)."""

    checkpoint_dir: str = ""  # DCP saves go to checkpoint_dir/step-NNNNNNNN
    checkpoint_every: int = 0  # save every k steps; with checkpoint_dir set, always after the last step
    resume_from: str = ""  # a checkpoint (or a checkpoint_dir: its latest) to load before training


def validate_knobs(cfg: Any, saves_muon: bool) -> None:
    """``validate_options`` on a job whose tier options have the ``Knobs``; ``saves_muon``: whether the tier
    checkpoints the muon optimizer's state."""
    o, name = cfg.tier_options, f"{cfg.tier} tier_options"
    validate_options(name, o.checkpoint_dir, o.checkpoint_every)
    if cfg.optimizer == "muon" and not saves_muon and (o.checkpoint_dir or o.resume_from):
        raise ValueError(f"{name}.checkpoint_dir/resume_from are invalid with RunConfig.optimizer='muon': its "
                         "state is not checkpointed yet; use adam or sgd")


def preflight(cfg: Any) -> None:
    """A tier's preflight when its options have the ``Knobs``: ``check_resume`` on ``resume_from``."""
    check_resume(f"{cfg.tier} tier_options", cfg.tier_options.resume_from, cfg.steps)


def validate_options(name: str, checkpoint_dir: str, checkpoint_every: Any) -> None:
    """The checks a tier with checkpoint options runs in ``validate(cfg)``; ``name`` prefixes the errors."""
    if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 0:
        raise ValueError(f"{name}.checkpoint_every={checkpoint_every!r} is invalid: must be an integer >= 0")
    if checkpoint_every and not checkpoint_dir:
        raise ValueError(f"{name}.checkpoint_every={checkpoint_every} needs checkpoint_dir to save into")


def check_resume(name: str, resume_from: str, steps: int) -> None:
    """A tier's preflight: ``resume_from`` must be a readable checkpoint with steps left to train."""
    if resume_from:
        try:
            step = saved_step(resume_from)
        except CheckpointError as exc:
            raise ValueError(f"{name}.resume_from={resume_from!r} is invalid: {exc}") from None
        if step >= steps:
            raise ValueError(f"{name}.resume_from={resume_from!r} is invalid: it was saved after step {step} and "
                             f"RunConfig.steps={steps} counts the whole run, resumed part included, so nothing "
                             f"is left to train")


class Periodic:
    """Resume before training and save every ``every`` optimizer steps (and after the last one).

    The tier calls ``after_step`` from its Strategy's ``on_step_end``; like every
    DCP save, a save is a collective, run by every rank.
    """

    @classmethod
    def of(cls, options: Any, total_steps: int) -> Periodic:
        """From a tier's options: its ``Knobs`` if it has them, otherwise saving nothing."""
        return cls(getattr(options, "checkpoint_dir", ""), getattr(options, "checkpoint_every", 0),
                   getattr(options, "resume_from", ""), total_steps)

    def __init__(self, directory: str, every: int, resume_from: str, total_steps: int) -> None:
        self.directory, self.every, self.resume_from, self.total_steps = directory, every, resume_from, total_steps
        self.start_step = 0
        self.steps_done = 0
        self.saved: list[str] = []

    def describe(self) -> dict[str, Any]:
        """What the result should say: the step a run resumed from, the checkpoints it saved."""
        out: dict[str, Any] = {}
        if self.resume_from:
            out["resumed_from_step"] = self.start_step
        if self.saved:
            out["checkpoints"] = self.saved
        return out

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              hyperparameters: dict[str, Any] | None = None) -> int:
        """Load ``resume_from`` (if set); returns the step to start at. ``after_step`` then saves.

        ``hyperparameters`` (e.g. the run's lr) replace the checkpoint's in every param group.
        """
        if self.resume_from:
            self.start_step = load(model, optimizer, self.resume_from)
            for group in optimizer.param_groups:
                group.update(hyperparameters or {})
        self.model, self.optimizer = model, optimizer
        return self.start_step

    def after_step(self, step: int) -> None:
        """Save after step ``step`` (0-based) when one is due: ``step + 1`` steps are then done."""
        done = step + 1
        if self.directory and ((self.every and done % self.every == 0) or done == self.total_steps):
            with tagged("checkpoint"):
                self.saved.append(str(save(self.model, self.optimizer, done, step_dir(self.directory, done))))
