"""The server's data for supernet training: the public pool only, plus a held-out test sample.

No leakage into clients: the supernet trains on ``carve_public_pool(labels, public_fraction,
public_seed, origin)`` (drawn from the source's train split only) (the same pool
:func:`rafl.data.make_partition` withholds from the clients). The pool
is split, stratified and deterministically, into pool-train (what the supernet learns from, and
what BN recalibration uses) and server-val (per-phase validation). Test accuracy is measured on
samples the supernet never trained on: non-pool samples of the source's own test split when it
has one (CIFAR), otherwise all non-pool samples (digits), at most ``test_samples`` of them (a fixed,
stratified random sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rafl import seeds
from rafl.data import Dataset, carve_public_pool
from rafl.errors import UserInputError


@dataclass(frozen=True)
class ServerSplit:
    """Index arrays (int64, into the Dataset) of the server's data.

    Attributes:
        pool_train: the part of the public pool the supernet trains on.
        pool_val: the server-val part of the public pool.
        test: held-out samples (never in the pool) for the final test accuracy.
        test_source: how ``test`` was chosen (for reports).
    """

    pool_train: np.ndarray
    pool_val: np.ndarray
    test: np.ndarray
    test_source: str


def _stratified_take(indices: np.ndarray, labels: np.ndarray, fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split ``indices`` into (taken, rest) with ``round(fraction * n_c)`` taken per class."""
    taken, rest = [], []
    for c in np.unique(labels[indices]):
        idx = rng.permutation(indices[labels[indices] == c])
        k = int(round(fraction * len(idx)))
        taken.append(idx[:k])
        rest.append(idx[k:])
    return (np.sort(np.concatenate(taken)).astype(np.int64),
            np.sort(np.concatenate(rest)).astype(np.int64))


def server_split(dataset: Dataset, public_fraction: float = 0.3, public_seed: int = 0,
                 val_fraction: float = 0.1, test_samples: int | None = 2000) -> ServerSplit:
    """The server's pool-train / server-val / held-out test indices (see the module docstring).

    Raises:
        UserInputError: ``public_fraction`` not in (0, 1), ``val_fraction`` not in [0, 1), or a
            pool too small to train on.
    """
    labels = dataset.labels.numpy()
    if not 0.0 < public_fraction < 1.0:
        raise UserInputError(f"is {public_fraction}, allowed 0 < fraction < 1 (the supernet trains "
                             "on the public pool)", field="public_fraction")
    if not 0.0 <= val_fraction < 1.0:
        raise UserInputError(f"is {val_fraction}, allowed 0 <= fraction < 1", field="val_fraction")
    pool = carve_public_pool(labels, public_fraction, public_seed, dataset.origin)
    rng = seeds.generator("server-val", public_seed)
    pool_val, pool_train = _stratified_take(pool, labels, val_fraction, rng)
    if len(pool_train) < 2:
        raise UserInputError(f"the public pool has only {len(pool)} samples", field="public_fraction")
    non_pool = np.setdiff1d(np.arange(len(labels)), pool)
    held_test = non_pool[dataset.origin[non_pool] == "test"]
    source = "non-pool samples of the test split" if len(held_test) else "all non-pool samples"
    candidates = held_test if len(held_test) else non_pool
    if test_samples is not None and len(candidates) > test_samples:
        test, _ = _stratified_take(candidates, labels, test_samples / len(candidates),
                                   seeds.generator("server-test", public_seed))
        source = f"a fixed stratified sample of {len(test)} {source}"
    else:
        test = candidates.astype(np.int64)
        source = f"{source} ({len(test)})"
    return ServerSplit(pool_train, pool_val, test, source)


#: BN recalibration of a deployed subnet (the searched subnets, the no-training floor, HeteroFL's
#: server statistics): this many public images (:func:`calibration_sample`) in batches of
#: ``CALIBRATION_BATCH``
CALIBRATION_IMAGES, CALIBRATION_BATCH = 512, 64


def calibration_sample(indices: np.ndarray, n: int, seed: int | None = None) -> np.ndarray:
    """A fixed random sample of ``min(n, len(indices))`` entries of ``indices`` for BN
    recalibration, in random order.

    Never the first ``n``: a source stored class by class (CIFAR's ImageFolder JPEG tree) would
    recalibrate BatchNorm on one class only. Deterministic for ``(indices, n, seed)``: ``seed``
    None draws from the seed tree's fixed ``calibration`` leaf (a deployed subnet, the search),
    an int from its ``supernet-calibration`` leaf (a supernet's training seed); the two are one
    stream for ``seed`` 0.
    """
    indices = np.asarray(indices, dtype=np.int64)
    rng = seeds.generator("calibration") if seed is None else seeds.generator("supernet-calibration", seed)
    return indices[rng.permutation(len(indices))[:max(0, int(n))]]


def random_crop_flip(x: Tensor, pad: int, hflip: bool, generator: torch.Generator) -> Tensor:
    """Standard small-image augmentation on a batch ``(B, C, H, W)``, same shape out.

    Zero padding by ``pad`` pixels (zero = the mean colour of normalized data), a random
    ``H x W`` crop per sample, and (if ``hflip``) a horizontal flip with probability 1/2 per sample.
    Random numbers come from ``generator`` (CPU), so a run is reproducible.
    """
    b, _, h, w = x.shape
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        rows = oy[:, None] + torch.arange(h, device=x.device)  # (B, H)
        cols = ox[:, None] + torch.arange(w, device=x.device)  # (B, W)
        bidx = torch.arange(b, device=x.device)[:, None, None]
        x = xp[bidx, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
    if hflip:
        flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x


def cutout(x: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """Cutout (DeVries & Taylor 2017, "Improved Regularization of Convolutional Neural Networks with
    Cutout", Sec. 3): one ``size x size`` square per sample, centred on a uniformly random pixel and
    clipped at the image's border, set to 0 (the mean colour of normalized data); ``(B, C, H, W)``
    in, same shape out. ``size`` 0 returns ``x``. Random numbers come from ``generator`` (CPU)."""
    if size <= 0:
        return x
    b, _, h, w = x.shape
    cy = torch.randint(0, h, (b,), generator=generator).to(x.device)
    cx = torch.randint(0, w, (b,), generator=generator).to(x.device)
    lo = size // 2
    rows = torch.arange(h, device=x.device)[None, :]  # (1, H)
    cols = torch.arange(w, device=x.device)[None, :]
    in_rows = (rows >= (cy - lo)[:, None]) & (rows < (cy - lo + size)[:, None])  # (B, H)
    in_cols = (cols >= (cx - lo)[:, None]) & (cols < (cx - lo + size)[:, None])  # (B, W)
    hole = in_rows[:, :, None] & in_cols[:, None, :]  # (B, H, W)
    return x.masked_fill(hole[:, None], 0)


__all__ = ["ServerSplit", "server_split", "random_crop_flip", "cutout", "calibration_sample"]
