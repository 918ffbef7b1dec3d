"""Data: real datasets in one form, federated partitions, per-client splits, loaders.

    from rafl.data import load_dataset, make_partition, make_loader
    ds = load_dataset("digits")             # ds.images[idx]: (B, 3, 32, 32) float32, normalized per batch
    part = make_partition(ds.labels.numpy(), "dirichlet", n_clients=20, seed=0, alpha=0.1)
    loader = make_loader(ds, part.clients[0].train, batch_size=32, shuffle=True, seed=0)
"""

from rafl.data.datasets import DATASETS, Dataset, Images, load_dataset
from rafl.data.loader import make_loader
from rafl.data.partition import (
    SCHEMES,
    ClientSplit,
    Partition,
    carve_global_test,
    carve_public_pool,
    make_partition,
    split_client,
)

__all__ = [
    "DATASETS", "SCHEMES", "Dataset", "Images", "load_dataset", "make_loader", "ClientSplit", "Partition",
    "carve_global_test", "carve_public_pool", "make_partition", "split_client",
]
