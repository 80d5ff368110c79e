"""Your own data set: ``RunConfig.dataset`` as a callable or an import path, checked before any process starts,
trained by the data-parallel and sharded tiers to single's parameters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dtlab import RunConfig
from dtlab.core import data as datasets
from dtlab.core import registry
from dtlab.core.config import DATASETS, needs_text
from dtlab.core.job import build_job, load_data
from dtlab.experiments.parity import FLOAT64_BOUND, gap
from dtlab.launch import cluster
from dtlab.train import run

N, FEATURES, CLASSES = 240, 6, 3


def blobs():
    """Three seeded clusters in six dimensions: someone's own (inputs, targets)."""
    y = torch.arange(N) % CLASSES
    centres = 2 * torch.randn(CLASSES, FEATURES)
    return centres[y] + torch.randn(N, FEATURES), y


class Blobs(torch.utils.data.Dataset):
    """The same samples as a map-style Dataset whose items are numpy arrays and ints."""

    def __init__(self):
        self.x, self.y = blobs()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i].numpy(), int(self.y[i])


def blobs_dataset():
    return Blobs()


def short_targets():
    x, y = blobs()
    return x, y[:200]


def integer_inputs():
    return torch.randint(0, 10, (N, FEATURES)), torch.arange(N) % CLASSES


def float_targets():
    x, _ = blobs()
    return x, torch.rand(N)


def unseeded():
    return torch.from_numpy(np.random.default_rng().random((N, FEATURES))), torch.arange(N) % CLASSES


def broken():
    raise OSError("no such file: blobs.csv\nsecond line")


def not_a_pair():
    return blobs()[0]


def stream():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    return Stream()


BAD = [
    (dict(dataset=short_targets), "shapes do not match: inputs (240, 6) and targets (200,)"),
    (dict(dataset=integer_inputs), "inputs are torch.int64, but model='mlp' needs floating-point"),
    (dict(dataset=blobs, global_batch_size=256), "192 to train on after the held-out 48: fewer than "
                                                 "global_batch_size=256"),
    (dict(dataset="no_such_package.data:blobs"), "cannot import module 'no_such_package.data'"),
    (dict(dataset="tests.test_own_data:no_such_factory"), "has no attribute 'no_such_factory'"),
    (dict(dataset=blobs, tier="cp", world_size=2), "the cp tier splits the built-in charformer over the text's "
                                                   "tokens, so it needs dataset='text'"),
    (dict(dataset=blobs, tier="nd", world_size=4), "the nd tier splits the built-in charformer"),
    (dict(dataset=blobs, tier="ep", world_size=2, model="moe"), "model='moe' reads the built-in token data"),
    (dict(dataset=blobs, model="charformer"), "model='charformer' reads the built-in token data"),
    (dict(dataset=blobs, model="cnn"), "shape (240, 6), but model='cnn' needs (samples, channels, height, width)"),
    (dict(dataset=float_targets), "targets are torch.float32: the loss is cross-entropy"),
    (dict(dataset=unseeded), "two calls with the same seed gave different tensors"),
    (dict(dataset=broken), "calling it raised OSError: no such file: blobs.csv"),
    (dict(dataset=not_a_pair), "it returned Tensor: return (inputs, targets)"),
    (dict(dataset=stream), "its Stream has no length"),
    (dict(dataset=lambda n: blobs()), "called with no arguments, but it needs 'n'"),
    (dict(dataset=3), "choose one of synthetic, digits, text, an import path"),
]


@pytest.mark.parametrize("changes,words", BAD, ids=[w.split(":")[0][:40] for _, w in BAD])
def test_bad_data_gets_one_line_naming_the_field_and_the_fault(changes, words):
    with pytest.raises(ValueError) as info:
        RunConfig(**changes)
    message = str(info.value)
    assert message.startswith("RunConfig.dataset=") and " is invalid: " in message
    assert words in message
    assert "\n" not in message


def test_own_tensors_split_into_train_and_held_out_as_the_built_in_sets_are():
    cfg = RunConfig(dataset=blobs, dtype="float64", global_batch_size=32)
    model, data = build_job(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.seed)
    x, y = blobs()
    expected = datasets._split("blobs", x.double(), y, cfg.seed, CLASSES)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(data, name), getattr(expected, name)), name
    assert (len(data), len(data.test_x)) == (192, 48)
    assert data.train_x.dtype == torch.float64 and data.train_y.dtype == torch.int64
    assert (data.input_shape, data.num_classes) == ((FEATURES,), CLASSES)
    assert model[-1].out_features == CLASSES and next(model.parameters()).dtype == torch.float64
    again = load_data(cfg)
    assert torch.equal(again.train_x, data.train_x)  # every rank builds the same split
    assert not torch.equal(load_data(cfg.replace(seed=1)).train_x, data.train_x)  # the seed draws and splits


@pytest.mark.parametrize("spec", ["tests.test_own_data:blobs", blobs_dataset,
                                  lambda: torch.utils.data.TensorDataset(*blobs())],
                         ids=["import path", "map-style Dataset", "TensorDataset"])
def test_an_import_path_and_a_dataset_give_the_same_data_as_the_tensors(spec):
    reference = load_data(RunConfig(dataset=blobs, global_batch_size=32))
    data = load_data(RunConfig(dataset=spec, global_batch_size=32))
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(data, name), getattr(reference, name)), name


def test_checking_the_factory_leaves_the_callers_generator_alone():
    state = torch.get_rng_state()
    RunConfig(dataset=blobs, global_batch_size=32)
    assert torch.equal(torch.get_rng_state(), state)


def embedded(input_shape, num_classes):
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(4 * input_shape[0], num_classes))


def test_a_model_of_ones_own_may_take_integer_inputs():
    cfg = RunConfig(dataset=integer_inputs, model=embedded, global_batch_size=32)
    model, data = build_job(cfg, torch.device("cpu"))
    assert data.train_x.dtype == torch.int64  # not cast to the job's dtype: they are ids
    assert model(data.train_x[:4]).shape == (4, CLASSES)


def test_the_built_in_names_load_as_before():
    for name in DATASETS:
        model = "charformer" if name == "text" else "mlp"
        cfg = RunConfig(dataset=name, model=model, dataset_size=256)
        data, expected = load_data(cfg), datasets.load(name, 256, cfg.seed)
        assert data.name == name and torch.equal(data.train_x, expected.train_x)


def test_results_and_config_files_name_the_factory(tmp_path):
    cfg = RunConfig(dataset=blobs, global_batch_size=32)
    assert cfg.to_dict()["dataset"] == "blobs"
    json.dumps(cfg.to_dict())
    path = RunConfig(dataset="tests.test_own_data:blobs", global_batch_size=32)
    assert RunConfig.from_dict(path.to_dict()) == path
    with pytest.raises(ValueError, match=r"RunConfig\.dataset=.*cannot be sent to a cluster"):
        cluster.plan(cfg.replace(tier="ddp"), workdir=tmp_path / "w", nnodes=2, nproc_per_node=1,
                     master_addr="10.1.2.3")


def test_the_docs_name_every_tier_that_needs_the_token_data():
    token_tiers = {n for n in registry.names() if needs_text(registry.get(n))}
    assert token_tiers == {"cp", "ep", "nd"}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tiers.md").read_text()
    section = doc[doc.index("### Your own data"):]
    section = section[:section.index("\n## ")]
    needs = re.search(r"need the built-in token data[^.]*\.", section)
    assert needs is not None
    for name in token_tiers:
        assert f"`{name}`" in needs.group(0), name


# -- trained on ranks -------------------------------------------------------------------------------------------
REFERENCES: dict[RunConfig, dict[str, torch.Tensor]] = {}  # single's parameters, shared by the tests below


def _job(**changes) -> RunConfig:
    # 8 steps of 32 from 192 training samples: the second epoch's reshuffle is crossed too
    return RunConfig(**{**dict(dataset=blobs, steps=8, global_batch_size=32, optimizer="adam", lr=0.01,
                               threads_per_rank=1), **changes})


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
@pytest.mark.parametrize("tier", ["ddp", "fsdp"])
def test_a_tier_trains_own_tensors_to_singles_parameters_in_float64(tier):
    row = gap(_job(tier=tier, world_size=2), "float64", REFERENCES)
    assert row["param_dtypes"] == "torch.float64"
    assert row["gap"] <= FLOAT64_BOUND, row


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_a_torch_dataset_trains_on_ddp_to_singles_parameters_on_the_same_tensors():
    reference = REFERENCES.get(_job(dtype="float64")) or run(_job(dtype="float64"), progress=False).params()
    result = run(_job(tier="ddp", world_size=2, dataset=blobs_dataset, dtype="float64"), progress=False)
    assert result.max_param_diff(reference) <= FLOAT64_BOUND
    assert len({r.params_checksum for r in result.ranks}) == 1
    assert result.ranks[0].evaluation["accuracy"] > 1 / CLASSES  # the held-out part, learnt from the train part
    assert result.summary()["dataset"] == "blobs_dataset"
