"""The job every rank (and every tier) starts from: the seeded model, the data and the optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtlab.core import data as datasets
from dtlab.core import models, own_data
from dtlab.core.config import RunConfig, dataset_factory
from dtlab.core.moe import Routing
from dtlab.core.muon import Muon, param_groups

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(cfg: RunConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``functools.partial(OptimizerClass, lr=...)``: tiers that shard it read ``.func`` and ``.keywords``."""
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "muon": Muon}[cfg.optimizer]
    return functools.partial(cls, lr=cfg.lr)


def optimizer_params(model: torch.nn.Module, build: OptimizerFactory) -> Iterable[Any]:
    """What ``build`` is called with: the model's parameters, or under Muon its two groups (``muon.param_groups``:
    hidden matrices to Muon, embeddings, input layer, head and 1-D parameters to AdamW)."""
    cls = getattr(build, "func", build)
    if isinstance(cls, type) and issubclass(cls, Muon):
        return param_groups(model)
    return model.parameters()


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer over ``model``, on one process (``optimizer_params`` of ``optimizer_factory``)."""
    build = optimizer_factory(cfg)
    return build(optimizer_params(model, build))


def routing(cfg: RunConfig) -> Routing:
    """The ``moe`` model's knobs from the job."""
    return Routing(cfg.experts, cfg.top_k, float(cfg.capacity_factor), float(cfg.aux_loss_coef))


def torch_dtype(cfg: RunConfig) -> torch.dtype:
    """``RunConfig.dtype`` as a torch dtype: the parameters' and the inputs'."""
    return getattr(torch, cfg.dtype)


def load_data(cfg: RunConfig) -> datasets.Dataset:
    """The job's data set, its floating-point inputs in the job's dtype.

    Data of one's own comes from its factory, called here on every rank (seeded as in RunConfig's checks), so
    every rank holds the same samples and the same train / held-out split.
    """
    factory = dataset_factory(cfg.dataset)
    if factory is not None:
        return own_data.load(factory, cfg.dataset, cfg.seed, torch_dtype(cfg))
    return datasets.load(cfg.dataset, cfg.dataset_size, cfg.seed, torch_dtype(cfg))


def build_job(cfg: RunConfig, device: torch.device) -> tuple[torch.nn.Module, datasets.Dataset]:
    """The seeded model and data every rank (and every tier) starts from."""
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model, data.input_shape, data.num_classes, cfg.model_size, cfg.model_depth,
                         routing(cfg), torch_dtype(cfg), cfg.model_heads).to(device)
    if cfg.activation_checkpointing:
        models.checkpoint_blocks(model)
    return model, data
