"""Data: real datasets in one form, federated partitions, per-client splits, loaders.

    from rafl.data import load_dataset, make_partition, make_loader
    ds = load_dataset("digits")             # ds.images[idx]: (B, 3, 32, 32) float32, normalized per batch
    part = make_partition(ds.labels.numpy(), "dirichlet", n_clients=20, seed=0, alpha=0.1)
    loader = make_loader(ds, part.clients[0].train, batch_size=32, shuffle=True, seed=0)

Names are imported on first use (PEP 562), so reading a run config's dataset and partition
settings (:mod:`rafl.config`) loads neither torch nor the datasets.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DATASETS": "rafl.data.sources", "Dataset": "rafl.data.datasets", "Images": "rafl.data.datasets",
    "load_dataset": "rafl.data.datasets", "make_loader": "rafl.data.loader",
    **{name: "rafl.data.partition" for name in ("SCHEMES", "ClientSplit", "Partition", "carve_global_test",
                                                 "carve_public_pool", "make_partition", "split_client")},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rafl.data' has no attribute {name!r}")


__all__ = [*_LAZY]
