"""Mini-batch loaders over a subset of an in-memory :class:`~rafl.data.datasets.Dataset`."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from rafl.data.datasets import Dataset
from rafl.errors import UserInputError


class IndexedTensors(torch.utils.data.Dataset):
    """The samples ``indices`` of a dataset; ``ds[list_of_positions]`` returns a whole batch at once.

    ``images`` is a tensor or an :class:`~rafl.data.datasets.Images` (normalized on indexing).

    ``len(ds)`` = number of samples; ``ds.indices`` are the dataset indices (int64).
    """

    def __init__(self, images, labels: torch.Tensor, indices: np.ndarray):
        self.images = images
        self.labels = labels
        self.indices = torch.as_tensor(np.asarray(indices, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.indices.numel())

    def __getitem__(self, pos):
        idx = self.indices[torch.as_tensor(pos, dtype=torch.long)]
        return self.images[idx], self.labels[idx]


def make_loader(dataset: Dataset, indices: np.ndarray, batch_size: int, shuffle: bool,
                seed: int = 0) -> DataLoader:
    """A DataLoader over ``dataset[indices]`` yielding ``(images, labels)`` batches.

    Images are float32 (B, C, H, W), labels int64 (B,); the last batch may be smaller
    (``drop_last=False``: small clients lose nothing). Batches are gathered with one tensor index
    each (no per-sample collation). Shuffling uses its own ``torch.Generator`` seeded with
    ``seed``: the sequence of epochs is the same for the same seed.

    Raises:
        UserInputError: batch_size < 1, indices not 1-D integers or out of range.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise UserInputError(f"is {batch_size!r}, allowed: an integer >= 1", field="batch_size")
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise UserInputError("must be a 1-D integer array of sample indices", field="indices")
    n = len(dataset)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise UserInputError(f"has index out of range, allowed 0..{n - 1}", field="indices")
    ds = IndexedTensors(dataset.images, dataset.labels, idx)
    if shuffle and len(ds) > 0:  # RandomSampler rejects an empty dataset
        base = RandomSampler(ds, generator=torch.Generator().manual_seed(int(seed)))
    else:
        base = SequentialSampler(ds)
    sampler = BatchSampler(base, batch_size=int(batch_size), drop_last=False)
    return DataLoader(ds, batch_size=None, sampler=sampler, num_workers=0)
