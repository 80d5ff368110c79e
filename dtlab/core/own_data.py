"""Your own data set: a factory returning ``(inputs, targets)`` or a ``torch.utils.data.Dataset``.

``RunConfig.dataset`` takes, besides the built-in names, a callable or an import path
``package.module:factory``. The factory is called with no arguments, with torch's
generator seeded by ``RunConfig.seed`` (the caller's generator is left as it was):
twice when the ``RunConfig`` is made (the checks below, and to see that the same seed
gives the same tensors) and once on every rank. Every rank therefore holds the same
samples and splits them into train and held-out parts with the same seeded
permutation as the built-in sets (``data._split``), so the ranks' shares of a global
batch add up to ``single``'s batch, as with the built-in data.

Every error is one line, ``RunConfig.dataset=... is invalid: ...``, naming what is wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.core import data as datasets
from dtlab.core.dataset_spec import invalid, label

__all__ = ["Summary", "check", "invalid", "label", "load", "tensors"]


@dataclass(frozen=True)
class Summary:
    """What ``check`` found: the numbers the job is built from."""

    samples: int
    train_samples: int
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    num_classes: int


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _call(factory: Callable[..., Any], spec: str | Callable[..., Any], seed: int) -> Any:
    try:
        required = [p for p in inspect.signature(factory).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read (some builtins): let the call say
        required = []
    if required:
        raise invalid(spec, f"the factory is called with no arguments, but it needs {required[0].name!r} "
                            f"(torch's generator is seeded with RunConfig.seed before the call)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return factory()
        except Exception as exc:  # the user's code: one line, not its traceback
            raise invalid(spec, f"calling it raised {_first_line(exc)}") from None


def _as_tensor(value: Any, spec: str | Callable[..., Any], what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.as_tensor(value)
    except Exception as exc:
        raise invalid(spec, f"its {what} ({type(value).__name__}) are not a tensor: {_first_line(exc)}") from None


def _from_dataset(ds: torch.utils.data.Dataset, spec: str | Callable[..., Any]) -> tuple[Any, Any]:
    """A map-style Dataset's samples, stacked: dtlab's ranks index whole tensors."""
    tensors = getattr(ds, "tensors", None)
    if isinstance(ds, torch.utils.data.TensorDataset) and len(tensors) == 2:
        return tensors
    if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
        raise invalid(spec, f"its {type(ds).__name__} has no length: return a map-style Dataset (__len__ and "
                            f"__getitem__) or (inputs, targets) tensors")
    xs, ys = [], []
    for i in range(len(ds)):
        item = ds[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise invalid(spec, f"its Dataset's item {i} is {type(item).__name__}, not an (input, target) pair")
        x, y = (_as_tensor(v, spec, w) for v, w in zip(item, ("inputs", "targets")))
        if xs and (x.shape != xs[0].shape or y.shape != ys[0].shape):
            raise invalid(spec, f"its Dataset's items differ in shape: item 0 is ({tuple(xs[0].shape)}, "
                                f"{tuple(ys[0].shape)}), item {i} is ({tuple(x.shape)}, {tuple(y.shape)})")
        xs.append(x)
        ys.append(y)
    if not xs:
        raise invalid(spec, "its Dataset is empty")
    return torch.stack(xs), torch.stack(ys)


def tensors(factory: Callable[..., Any], spec: str | Callable[..., Any], seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``factory()``'s (inputs, targets), seeded, checked for what any model needs; targets as int64."""
    out = _call(factory, spec, seed)
    if isinstance(out, torch.utils.data.Dataset):
        out = _from_dataset(out, spec)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise invalid(spec, f"it returned {type(out).__name__}: return (inputs, targets) tensors or a "
                            f"torch.utils.data.Dataset")
    x, y = _as_tensor(out[0], spec, "inputs"), _as_tensor(out[1], spec, "targets")
    if x.dim() < 1 or y.dim() < 1 or len(x) != len(y):
        raise invalid(spec, f"the shapes do not match: inputs {tuple(x.shape)} and targets {tuple(y.shape)} must "
                            f"both start with the number of samples")
    if y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
        raise invalid(spec, f"its targets are {y.dtype}: the loss is cross-entropy, which needs integer class "
                            f"labels (0 .. classes-1)")
    if len(y) and int(y.min()) < 0:
        raise invalid(spec, f"its targets hold {int(y.min())}: class labels run from 0")
    if x.is_complex():
        raise invalid(spec, f"its inputs are {x.dtype}: use real numbers")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise invalid(spec, "its inputs hold NaN or inf")
    return x, y.long()


def _split(x: torch.Tensor, y: torch.Tensor, spec: str | Callable[..., Any], seed: int,
           dtype: torch.dtype) -> datasets.Dataset:
    if len(x) < 2:
        raise invalid(spec, f"it gives {len(x)} sample(s): at least 2 are needed (one is held out)")
    if x.is_floating_point():
        x = x.to(dtype)
    return datasets._split(label(spec), x, y, seed, int(y.max()) + 1)


def load(factory: Callable[..., Any], spec: str | Callable[..., Any], seed: int,
         dtype: torch.dtype = torch.float32) -> datasets.Dataset:
    """The data set, split as the built-in ones are; floating-point inputs in ``dtype`` (others stay)."""
    x, y = tensors(factory, spec, seed)
    return _split(x, y, spec, seed, dtype)


def check(factory: Callable[..., Any], spec: str | Callable[..., Any], seed: int, global_batch: int,
          builtin_model: str = "") -> Summary:
    """Every check ``RunConfig`` makes on the data set before any process starts.

    ``builtin_model``: the built-in model the job trains ("mlp", "cnn", "cnn-bn"), whose inputs must be
    floating-point samples with a feature dimension; "" for a model of one's own, which may take any.
    """
    x, y = tensors(factory, spec, seed)
    if builtin_model and not x.is_floating_point():
        raise invalid(spec, f"its inputs are {x.dtype}, but model={builtin_model!r} needs floating-point inputs: "
                            f"convert them (.float()) or bring a model that embeds them")
    if builtin_model and x.dim() < 2:
        raise invalid(spec, f"its inputs have shape {tuple(x.shape)}, but model={builtin_model!r} needs "
                            f"(samples, features...)")
    if builtin_model in ("cnn", "cnn-bn") and x.dim() != 4:
        raise invalid(spec, f"its inputs have shape {tuple(x.shape)}, but model={builtin_model!r} needs "
                            f"(samples, channels, height, width)")
    data = _split(x, y, spec, seed, x.dtype)
    n, n_train = len(x), len(data)
    if n_train < global_batch:
        raise invalid(spec, f"it gives {n} samples, {n_train} to train on after the held-out {n - n_train}: "
                            f"fewer than global_batch_size={global_batch}")
    # Every rank calls the factory itself: a second call must give the very same tensors.
    x2, y2 = tensors(factory, spec, seed)
    if x2.shape != x.shape or x2.dtype != x.dtype or not torch.equal(x2, x) or not torch.equal(y2, y):
        raise invalid(spec, "two calls with the same seed gave different tensors, so the ranks would train on "
                            "different data: draw random values with torch (seeded with RunConfig.seed before "
                            "each call) or seed your own generator")
    return Summary(n, n_train, data.input_shape, x.dtype, data.num_classes)
