"""RunConfig: one frozen, validated description of a training job.

Every check runs in ``__post_init__`` so that a bad value fails in the
notebook cell that made it, before any process is started.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtlab.core import registry
from dtlab.core.dataset_spec import invalid as invalid_dataset
from dtlab.core.dataset_spec import label as dataset_label

MODELS = ("mlp", "cnn", "cnn-bn", "charformer", "moe")
TEXT_MODELS = ("charformer", "moe")  # the models that read characters (dataset="text")
DATASETS = ("synthetic", "digits", "text")
OPTIMIZERS = ("sgd", "adam", "muon")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
DTYPES = ("float32", "float64")


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"RunConfig.{field_name}={value!r} is invalid: {allowed}")


def resolve_import_path(path: str, kind: str = "model factory") -> Callable[..., Any]:
    """Turn ``package.module:factory`` into the callable it names (``kind``: what errors call it)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} names {type(obj).__name__}, not a callable {kind}")
    return obj


def dataset_factory(spec: str | Callable[..., Any]) -> Callable[..., Any] | None:
    """The factory behind ``RunConfig.dataset`` (a callable or an import path); None for a built-in name."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        return resolve_import_path(spec, "data set factory")
    return None


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_slow_rank(text: str) -> tuple[int, float]:
    """``"1:5ms"`` -> (1, 0.005): the rank and its extra seconds of compute per step."""
    rank, sep, delay = str(text).partition(":")
    unit = next((u for u in ("us", "ms", "s") if delay.endswith(u)), "")
    try:
        value, who = float(delay[: len(delay) - len(unit)]) * _UNITS.get(unit, 0.0), int(rank)
    except ValueError:
        value, who = -1.0, -1
    if not sep or not unit or who < 0 or not 0 < value <= 60:
        raise ValueError(f"RunConfig.slow_rank={text!r} is invalid: write RANK:DELAY with DELAY in us, ms or s "
                         f"(at most 60 s), e.g. '1:5ms'")
    return who, value


def shared_threads(ranks: int) -> int:
    """Torch threads per rank when this process's cores are shared out among ``ranks`` processes (at least 1).

    This process's cores: on a shared server a learner may be given only some of the machine's (a cpuset).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks)


MAX_WORLD_SIZE_ENV = "DTLAB_MAX_WORLD_SIZE"


def check_world_cap(ranks: int, what: str = "world_size") -> None:
    """Refuse a launch of more than ``DTLAB_MAX_WORLD_SIZE`` rank processes (unset or empty: no limit).

    The cap is the machine's, not the job's: an instructor sets it for every learner of a shared server,
    so it is checked where processes are about to start, not in RunConfig (a cluster job may be larger).
    """
    raw = os.environ.get(MAX_WORLD_SIZE_ENV, "").strip()
    if not raw:
        return
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_WORLD_SIZE_ENV}={raw!r} is invalid: must be an integer >= 1 (unset it: no limit)")
    if ranks > int(raw):
        raise ValueError(f"{what}={ranks} is over this machine's limit {MAX_WORLD_SIZE_ENV}={raw} (set for everyone "
                         f"sharing it): use at most {raw} ranks")


def needs_text(spec: registry.TierSpec) -> bool:
    """Whether a tier splits only the built-in token models, so needs ``dataset='text'``."""
    return bool(spec.models) and set(spec.models) <= set(TEXT_MODELS)


def check_fields(job: Any) -> None:
    """The checks every tier shares, on anything with ``RunConfig``'s fields (ValueError naming the field).

    No tier is imported (nor torch): the command line runs these on its flags before it loads either.
    """
    if job.tier not in registry.names():
        _fail("tier", job.tier, f"choose one of {', '.join(registry.names())}")
    for name in ("world_size", "steps", "global_batch_size", "model_size", "model_depth", "model_heads",
                 "dataset_size"):
        value = getattr(job, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(name, value, "must be an integer >= 1")
    if job.global_batch_size % job.world_size:
        _fail(
            "global_batch_size",
            job.global_batch_size,
            f"must be divisible by world_size={job.world_size} so every rank gets the same share",
        )
    if isinstance(job.model, str):
        if ":" in job.model:
            try:
                resolve_import_path(job.model)
            except ValueError as exc:
                _fail("model", job.model, str(exc))
        elif job.model not in MODELS:
            _fail("model", job.model, f"choose one of {', '.join(MODELS)} or 'package.module:factory'")
    elif not callable(job.model):
        _fail("model", job.model, "must be a name, an import path or a callable")
    own_data = callable(job.dataset) or isinstance(job.dataset, str) and ":" in job.dataset
    if job.model in TEXT_MODELS and job.dataset != "text" and not own_data:  # own data: the tier check says more
        _fail("model", job.model, f"{job.model} reads characters: use dataset='text'")
    if job.dataset == "text" and job.model in ("mlp", "cnn", "cnn-bn"):
        _fail("dataset", job.dataset, "the text data set needs model='charformer' or 'moe'")
    if job.model in TEXT_MODELS and job.model_size % job.model_heads:
        _fail("model_heads", job.model_heads, f"the {job.model}'s width model_size={job.model_size} must "
              "split into whole heads: use a divisor of it")
    if job.optimizer not in OPTIMIZERS:
        _fail("optimizer", job.optimizer, f"choose one of {', '.join(OPTIMIZERS)}")
    if not job.lr > 0:
        _fail("lr", job.lr, "must be > 0")
    if job.backend not in BACKENDS:
        _fail("backend", job.backend, f"choose one of {', '.join(BACKENDS)}")
    if job.device not in DEVICES:
        _fail("device", job.device, f"choose one of {', '.join(DEVICES)}")
    if job.device == "cpu" and job.backend == "nccl":
        _fail("backend", job.backend, "nccl needs CUDA devices; use gloo with device='cpu'")
    if not isinstance(job.threads_per_rank, int) or job.threads_per_rank < 0:
        _fail("threads_per_rank", job.threads_per_rank, "must be an integer >= 0 (0 = automatic)")
    if not job.timeout_s > 0:
        _fail("timeout_s", job.timeout_s, "must be > 0 seconds")
    if job.slow_rank:
        rank, _ = parse_slow_rank(job.slow_rank)
        if rank >= job.world_size:
            _fail("slow_rank", job.slow_rank, f"rank {rank} does not exist (ranks 0..{job.world_size - 1})")


@dataclass(frozen=True)
class RunConfig:
    """A training job. Tier-specific knobs live in ``tier_options``.

    ``model`` is a built-in name (see ``MODELS``), an import path
    ``package.module:factory`` or a callable ``factory(input_shape, num_classes)``
    (a function defined in a notebook cell works: it is sent to the ranks with
    cloudpickle). ``dataset`` likewise: a built-in name (see ``DATASETS``), or an
    import path or callable ``factory()`` returning ``(inputs, targets)`` tensors or a
    ``torch.utils.data.Dataset`` (see ``dtlab.core.own_data``; ``dataset_size`` is then unused).
    """

    tier: str = "single"
    world_size: int = 1
    model: str | Callable[..., Any] = "mlp"
    model_size: int = 64
    model_depth: int = 2  # hidden layers of the mlp, blocks of the charformer
    model_heads: int = 2  # the charformer's (and the moe model's) attention heads; each is model_size / heads wide
    dataset: str | Callable[..., Any] = "digits"
    dataset_size: int = 2048
    global_batch_size: int = 64
    steps: int = 50
    lr: float = 0.01
    optimizer: str = "adam"
    seed: int = 0
    backend: str = "auto"
    device: str = "auto"
    threads_per_rank: int = 0  # 0: the machine's cores divided among the ranks
    timeout_s: float = 60.0
    # "RANK:DELAY" (e.g. "1:5ms"): that rank computes DELAY longer every step, a straggler for teaching
    slow_rank: str = ""
    # Recompute each block's forward in backward (torch.utils.checkpoint): activation memory for compute
    activation_checkpointing: bool = False
    precision: str = "fp32"  # "bf16": forward and loss under autocast (bf16 matmuls, fp32 parameters)
    # The parameters' and inputs' dtype; "float64" makes tiers' parity independent of float32 summation order
    dtype: str = "float32"
    # model="moe" only (dtlab.core.moe): experts per layer, experts per token, the capacity per expert as a
    # multiple of an even share (0: dropless) and the load-balancing loss's weight in the loss
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    # PyTorch's Flight Recorder in every rank: each leaves its dump (RunResult.flight; on failure error.flight)
    flight_recorder: bool = False
    tier_options: Any = None

    def __post_init__(self) -> None:
        check_fields(self)
        # The tier's own checks after: they import its module (and torch).
        spec = registry.get(self.tier)
        own = self._check_dataset_kind(spec)
        if self.optimizer not in spec.optimizers:
            able = [n for n in registry.names() if self.optimizer in registry.get(n).optimizers]
            _fail("optimizer", self.optimizer, f"the {self.tier} tier steps {' and '.join(spec.optimizers)} only; "
                  f"{self.optimizer} runs on {', '.join(able)}")
        self._check_flight_recorder(spec)
        self._check_compute(spec)
        self._check_experts(spec)
        if self.tier_options is None:
            object.__setattr__(self, "tier_options", spec.options())
        elif type(self.tier_options) is not spec.options:
            _fail("tier_options", self.tier_options, f"tier {self.tier!r} takes {spec.options.__module__}.Options")
        spec.validate(self)
        if own:  # last: it calls the factory, after every check that costs nothing
            self._check_own_data()

    def _check_dataset_kind(self, spec: registry.TierSpec) -> bool:
        """A built-in name, or data of one's own that the tier and the model can train on (True)."""
        try:
            own = dataset_factory(self.dataset) is not None
        except ValueError as exc:
            _fail("dataset", self.dataset, str(exc))
        if not own:
            if not isinstance(self.dataset, str) or self.dataset not in DATASETS:
                _fail("dataset", self.dataset, f"choose one of {', '.join(DATASETS)}, an import path "
                      f"'package.module:factory' or a callable factory()")
            return False
        if self.model in TEXT_MODELS:
            raise invalid_dataset(self.dataset, f"model={self.model!r} reads the built-in token data "
                                   f"(dataset='text'); data of your own trains mlp, cnn, cnn-bn or a model of your own")
        if needs_text(spec):
            able = [n for n in registry.names() if not needs_text(registry.get(n))]
            raise invalid_dataset(self.dataset, f"the {self.tier} tier splits the built-in "
                                   f"{' / '.join(spec.models)} over the text's tokens, so it needs dataset='text'; "
                                   f"data of your own runs on {', '.join(able)}")
        return True

    def _check_own_data(self) -> None:
        builtin = self.model if isinstance(self.model, str) and self.model in MODELS else ""
        # Imported here, by name: checking tensors needs torch, and a RunConfig without data of one's own does not.
        own_data = importlib.import_module("dtlab.core.own_data")
        own_data.check(dataset_factory(self.dataset), self.dataset, self.seed, self.global_batch_size, builtin)

    def _check_flight_recorder(self, spec: registry.TierSpec) -> None:
        if not isinstance(self.flight_recorder, bool):
            _fail("flight_recorder", self.flight_recorder, "must be True or False")
        if self.flight_recorder and spec.launcher not in ("local", "torchrun"):
            able = [n for n in registry.names() if registry.get(n).launcher in ("local", "torchrun")]
            _fail("flight_recorder", True, f"the {self.tier} tier's processes are started by its own launcher "
                  f"({spec.launcher}), which collects no Flight Recorder dumps; use one of {', '.join(able)}")

    def _check_compute(self, spec: registry.TierSpec) -> None:
        if self.precision not in PRECISIONS:
            _fail("precision", self.precision, f"choose one of {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and not spec.autocast:
            _fail("precision", self.precision, f"the {self.tier} tier runs its own forward and backward: fp32 only")
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"choose one of {', '.join(DTYPES)}")
        if self.dtype != "float32" and self.precision != "fp32":
            _fail("dtype", self.dtype, f"precision={self.precision!r} autocasts float32 parameters: use float32")
        if not isinstance(self.activation_checkpointing, bool):
            _fail("activation_checkpointing", self.activation_checkpointing, "must be True or False")
        if self.activation_checkpointing:
            if not spec.activation_checkpointing:
                able = [n for n in registry.names() if registry.get(n).activation_checkpointing]
                _fail("activation_checkpointing", True, f"the {self.tier} tier does not run the model's blocks "
                      f"itself; use one of {', '.join(able)}")
            if isinstance(self.model, str) and self.model in MODELS and self.model not in TEXT_MODELS:
                _fail("activation_checkpointing", True, f"model={self.model!r} has no blocks to recompute: "
                      f"use model='charformer' (or a model with a .blocks list)")

    def _check_experts(self, spec: registry.TierSpec) -> None:
        for name in ("experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "must be an integer >= 1")
        if self.top_k > self.experts:
            _fail("top_k", self.top_k, f"each token picks top_k of the {self.experts} experts: at most experts")
        if isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, (int, float)) \
                or not 0 <= self.capacity_factor < float("inf"):
            _fail("capacity_factor", self.capacity_factor, "must be a number >= 0 (0: dropless)")
        if isinstance(self.aux_loss_coef, bool) or not isinstance(self.aux_loss_coef, (int, float)) \
                or not 0 <= self.aux_loss_coef < float("inf"):
            _fail("aux_loss_coef", self.aux_loss_coef, "must be a number >= 0 (0: no load-balancing loss)")
        # The load-balancing loss joins the loss where the loop runs the model's forward (dtlab.core.models)
        if self.model == "moe" and ("moe" not in spec.models if spec.models else not spec.autocast):
            able = [n for n in registry.names() if "moe" in registry.get(n).models
                    or not registry.get(n).models and registry.get(n).autocast]
            why = f"it splits {' and '.join(spec.models)} only" if spec.models else "its forward and loss are its own"
            _fail("model", self.model, f"the {self.tier} tier does not run the moe model ({why}); use one of "
                  f"{', '.join(able)}")

    # Derived values, so that every rank computes them the same way.
    @property
    def per_rank_batch(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def resolved_threads(self) -> int:
        return self.threads_per_rank or shared_threads(self.world_size)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed (validated again)."""
        if "tier" in changes and "tier_options" not in changes:
            changes["tier_options"] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The inverse of ``to_dict`` (for a config file), validated; the model and the data set must be names
        or import paths."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown RunConfig field(s) {unknown}: choose from {sorted(fields)}")
        data = dict(data)
        options = data.pop("tier_options", None) or {}
        options_type = registry.get(data.get("tier", "single")).options
        # JSON has no tuples: lists come back as the tuples the options hold.
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        try:
            data["tier_options"] = options_type(**options)
        except TypeError as exc:
            raise ValueError(f"tier_options for tier {data.get('tier', 'single')!r}: {exc}") from None
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tier_options"}
        if callable(self.model):
            target = getattr(self.model, "func", self.model)  # functools.partial: name the function
            out["model"] = getattr(target, "__qualname__", type(target).__name__)
        if callable(self.dataset):
            out["dataset"] = dataset_label(self.dataset)
        out["tier_options"] = dataclasses.asdict(self.tier_options)
        return out

