"""Data sets and the sharding that keeps the global batch identical at any world size.

Every rank loads the whole (small) data set and takes its share of each global
batch with ``DistributedSampler``'s own index arithmetic: rank r of w takes
positions r, r+w, r+2w, ... of the epoch's permutation. The union of the ranks'
b-sample slices for step t is exactly the single-device batch t, so every tier
sees the same global batch as ``single``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

DATA_DIR = Path(os.environ.get("DTLAB_DATA", Path(__file__).resolve().parents[2] / "data"))
TEXT_FILE = "sonnets.txt"
SEQ_LEN = 32
TEST_FRACTION = 0.2


@dataclass
class Dataset:
    """Tensors for a train and a held-out test split."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int

    def __len__(self) -> int:
        return len(self.train_x)


def _split(name: str, x: torch.Tensor, y: torch.Tensor, seed: int, num_classes: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    n_test = max(1, int(len(x) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], tuple(x.shape[1:]), num_classes)


def synthetic(size: int, seed: int) -> Dataset:
    """8x8 'images' labelled by a fixed random teacher network: learnable, any size."""
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(size, 1, 8, 8, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    y = (torch.tanh(x.flatten(1)) @ teacher).argmax(1)
    return _split("synthetic", x, y, seed, 10)


def _digits_arrays() -> tuple[Any, Any]:
    """(images 1797x8x8, labels) from the file scikit-learn ships.

    Read directly: importing sklearn.datasets costs about 1.4 s, paid again by
    every worker torchrun starts (load_digits reads this same file).
    """
    import gzip
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def digits(seed: int) -> Dataset:
    """scikit-learn's bundled hand-written digits (1,797 8x8 images); no download."""
    images, labels = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    return _split("digits", x, y, seed, 10)


def text(seed: int, seq_len: int = SEQ_LEN) -> Dataset:
    """Character windows of the shipped public-domain text; target = next character."""
    path = DATA_DIR / TEXT_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; set DTLAB_DATA to the folder holding {TEXT_FILE}")
    chars = path.read_text(encoding="utf-8")
    vocab = sorted(set(chars))
    ids = torch.tensor([vocab.index(c) for c in chars], dtype=torch.long)
    starts = torch.arange(0, len(ids) - seq_len - 1, seq_len // 2)
    x = torch.stack([ids[s:s + seq_len] for s in starts])
    y = torch.stack([ids[s + 1:s + seq_len + 1] for s in starts])
    return _split("text", x, y, seed, len(vocab))


def load(name: str, size: int, seed: int, dtype: torch.dtype = torch.float32) -> Dataset:
    """The data set ``name``; floating-point inputs in ``dtype`` (labels and character ids stay integers).

    The values are made in float32 and then converted, so a float64 job sees the same
    samples as a float32 one, only carried with more digits.
    """
    if name == "synthetic":
        data = synthetic(size, seed)
    elif name == "digits":
        data = digits(seed)
    elif name == "text":
        data = text(seed)
    else:
        raise ValueError(f"unknown dataset {name!r}")
    if data.train_x.is_floating_point() and data.train_x.dtype != dtype:
        data.train_x, data.test_x = data.train_x.to(dtype), data.test_x.to(dtype)
    return data


class ShardedBatches:
    """This rank's slice of global batch ``step``; a pure function of the step.

    Being stateless in the step is what lets a resumed run continue with exactly
    the batches it would have seen.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int) -> None:
        if global_batch > num_samples:
            raise ValueError(f"global batch {global_batch} is larger than the data set ({num_samples} samples)")
        self.sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.per_rank = global_batch // world_size
        # floor(floor(N/w)/b) == floor(N/B): every world size has the same epochs.
        self.steps_per_epoch = len(self.sampler) // self.per_rank
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def indices(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._epoch = torch.tensor(list(self.sampler), dtype=torch.long), epoch
        return self._order[i * self.per_rank:(i + 1) * self.per_rank]
