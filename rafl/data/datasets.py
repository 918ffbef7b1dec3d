"""Datasets in one documented form: normalized float32 images (N, C, H, W), int64 labels, class names.

Supported (``load_dataset(name, root, resolution, limit_per_class)``):

* ``digits`` -- the real handwritten digits shipped with scikit-learn (UCI "Optical Recognition of
  Handwritten Digits", 1,797 images of 8x8 pixels with values 0..16, 10 classes). Offline, the
  embedded default. Scaled to [0, 1], resized bilinearly to ``resolution`` and repeated to 3
  channels. There is no official split: every sample has ``origin == "train"``.
* ``cifar10`` -- CIFAR-10 (Krizhevsky 2009) from ``root``: the standard ``cifar-10-batches-py``
  pickles, or an ImageFolder JPEG tree (``train/<class>/*.jpg``, ``test/<class>/*.jpg``), or a
  ``.tar.gz`` of either (read with :mod:`tarfile`, nothing is extracted). See
  :mod:`rafl.data.sources` for the accepted layouts and the uint8 decode cache.
* ``cifar100`` -- CIFAR-100 from the standard ``cifar-100-python`` folder (fine labels, 100 classes).
* ``femnist`` -- FEMNIST from a LEAF directory of json shards (``users``, ``num_samples``,
  ``user_data``), 62 classes, 28x28 grayscale (C = 1), keeping the writer ids.

Samples are ordered: the source's train samples first, then its test samples (``origin`` says
which); every sample is pooled before partitioning. Normalization is per channel,
``(x - mean) / std`` with the dataset's constants for CIFAR and statistics computed on the loaded
images for digits and FEMNIST; ``Dataset.mean`` / ``Dataset.std`` record what was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rafl.errors import UserInputError, allowed

DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "femnist")

# Per-channel statistics of the CIFAR training sets (pixel values in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
FEMNIST_CLASSES = [str(d) for d in range(10)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [
    chr(c) for c in range(ord("a"), ord("z") + 1)]


@dataclass
class Dataset:
    """A whole dataset in memory, every sample pooled (partitioned later by :mod:`rafl.data.partition`).

    Attributes:
        name: ``"digits"``, ``"cifar10"``, ``"cifar100"`` or ``"femnist"``.
        images: float32 (N, C, H, W), normalized per channel with ``mean``/``std``; C = 3 for
            digits/CIFAR, 1 for FEMNIST; H = W = the requested resolution.
        labels: int64 (N,) class ids in ``0..num_classes-1``.
        classes: class names, position = class id.
        writers: (N,) str writer ids (FEMNIST), else None.
        origin: (N,) str ``"train"`` / ``"test"``: the source's own split.
        mean, std: the per-channel normalization constants (pixel scale [0, 1]).
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    writers: np.ndarray | None
    origin: np.ndarray
    mean: tuple[float, ...] = field(default=())
    std: tuple[float, ...] = field(default=())

    @property
    def num_classes(self) -> int:
        """Number of classes C."""
        return len(self.classes)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __repr__(self) -> str:
        n_train = int((self.origin == "train").sum())
        return (f"Dataset({self.name!r}, images={tuple(self.images.shape)}, classes={self.num_classes}, "
                f"train={n_train}, test={len(self) - n_train})")


def _resize(x: torch.Tensor, resolution: int, chunk: int = 4096) -> torch.Tensor:
    """Bilinear resize of float (N, C, h, w) to (N, C, r, r), antialiased when shrinking; chunked."""
    if x.shape[-1] == resolution and x.shape[-2] == resolution:
        return x
    shrink = resolution < max(x.shape[-2:])
    out = torch.empty((x.shape[0], x.shape[1], resolution, resolution), dtype=torch.float32)
    for s in range(0, x.shape[0], chunk):
        out[s:s + chunk] = F.interpolate(x[s:s + chunk], size=(resolution, resolution), mode="bilinear",
                                         align_corners=False, antialias=shrink)
    return out


def _normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def _channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    xd = x.double()
    mean = tuple(float(v) for v in xd.mean(dim=(0, 2, 3)))
    std = tuple(max(float(v), 1e-6) for v in xd.std(dim=(0, 2, 3)))
    return mean, std


def _limit(labels: np.ndarray, origin: np.ndarray, limit_per_class: int | None) -> np.ndarray:
    """Indices keeping the first ``limit_per_class`` samples of every (origin, class)."""
    if limit_per_class is None:
        return np.arange(len(labels))
    keep = np.zeros(len(labels), dtype=bool)
    for o in np.unique(origin):
        for c in np.unique(labels):
            idx = np.flatnonzero((origin == o) & (labels == c))[:limit_per_class]
            keep[idx] = True
    return np.flatnonzero(keep)


def from_uint8(name: str, images_nhwc: np.ndarray, labels: np.ndarray, origin: np.ndarray, classes: list[str],
               resolution: int, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
               writers: np.ndarray | None = None) -> Dataset:
    """Build a :class:`Dataset` from uint8 (N, H, W, C) pixels: scale to [0, 1], resize, normalize.

    ``mean``/``std`` None = computed on the resized images. With known ``mean``/``std`` the
    conversion runs in chunks straight into the output (no full-size float temporaries).
    """
    src = torch.from_numpy(np.ascontiguousarray(images_nhwc)).permute(0, 3, 1, 2)  # (N, C, H, W) uint8 view
    if mean is None or std is None:
        return _finish(name, src.float().div_(255.0), labels, origin, classes, resolution, mean, std, writers)
    n, c = src.shape[:2]
    scale = (1.0 / (255.0 * torch.tensor(std, dtype=torch.float32))).view(1, -1, 1, 1)
    shift = (-torch.tensor(mean, dtype=torch.float32) / torch.tensor(std, dtype=torch.float32)).view(1, -1, 1, 1)
    out = torch.empty((n, c, resolution, resolution), dtype=torch.float32)
    chunk = 1024
    for s in range(0, n, chunk):
        block = out[s:s + chunk]
        if src.shape[-1] == resolution and src.shape[-2] == resolution:
            block.copy_(src[s:s + chunk])  # uint8 -> float32 and NHWC -> NCHW in one pass
        else:
            block.copy_(_resize(src[s:s + chunk].float(), resolution))
        block.mul_(scale).add_(shift)  # (x/255 - mean) / std
    return Dataset(name=name, images=out, labels=torch.as_tensor(np.asarray(labels, dtype=np.int64)),
                   classes=list(classes), writers=writers, origin=np.asarray(origin, dtype=str),
                   mean=tuple(mean), std=tuple(std))


def _finish(name: str, x: torch.Tensor, labels: np.ndarray, origin: np.ndarray, classes: list[str],
            resolution: int, mean: tuple[float, ...] | None, std: tuple[float, ...] | None,
            writers: np.ndarray | None) -> Dataset:
    x = _resize(x, resolution).contiguous()
    if mean is None or std is None:
        mean, std = _channel_stats(x)
    x = _normalize(x, mean, std)
    return Dataset(name=name, images=x, labels=torch.as_tensor(np.asarray(labels, dtype=np.int64)),
                   classes=list(classes), writers=writers, origin=np.asarray(origin, dtype=str),
                   mean=tuple(mean), std=tuple(std))


def load_digits(resolution: int = 32, limit_per_class: int | None = None) -> Dataset:
    """scikit-learn's real 8x8 handwritten digits, 3 x ``resolution`` x ``resolution``, normalized.

    Returns:
        :class:`Dataset` with 1,797 samples (fewer with ``limit_per_class``), 10 classes "0".."9",
        every ``origin == "train"``; mean/std computed on the resized images (the same for all 3 channels).
    """
    from sklearn.datasets import load_digits as _sk_digits

    bunch = _sk_digits()
    labels = bunch.target.astype(np.int64)
    origin = np.full(len(labels), "train")
    keep = _limit(labels, origin, limit_per_class)
    x = torch.from_numpy(bunch.images[keep].astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    x = _resize(x, resolution)
    mean, std = _channel_stats(x)
    x = x.repeat(1, 3, 1, 1)
    return _finish("digits", x, labels[keep], origin[keep], [str(d) for d in range(10)], resolution,
                   mean * 3, std * 3, None)


def load_dataset(name: str, root: str | Path | None = None, resolution: int = 32,
                 limit_per_class: int | None = None, progress: bool = True) -> Dataset:
    """Load a dataset in rafl's common form (see :class:`Dataset` and the module docstring).

    Args:
        name: ``"digits"`` (embedded, offline), ``"cifar10"``, ``"cifar100"`` or ``"femnist"``.
        root: where the data is (not used for digits); accepted layouts in
            :mod:`rafl.data.sources`. None = ``$RAFL_DATA_ROOT`` or ``~/.cache/rafl-data``.
        resolution: output height = width in pixels (4..1024).
        limit_per_class: keep only the first this-many samples of every class in each of the
            source's splits (for quick runs and tests); None = all.
        progress: show progress bars while a source is read and decoded (a cache miss).

    Returns:
        :class:`Dataset`: images float32 (N, C, resolution, resolution), labels int64 (N,).

    Raises:
        UserInputError: unknown name, bad resolution/limit, missing or malformed data root
            (the message names the files expected there), a corrupted cache file.
    """
    if name not in DATASETS:
        raise UserInputError(f"is {name!r}, allowed: {allowed(DATASETS)}", field="dataset")
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or not 4 <= resolution <= 1024:
        raise UserInputError(f"is {resolution!r}, allowed: an integer 4..1024 (pixels)", field="resolution")
    if limit_per_class is not None and (isinstance(limit_per_class, bool)
                                        or not isinstance(limit_per_class, (int, np.integer)) or limit_per_class < 1):
        raise UserInputError(f"is {limit_per_class!r}, allowed: an integer >= 1 or None", field="limit_per_class")
    resolution = int(resolution)
    if name == "digits":
        return load_digits(resolution, limit_per_class)
    from rafl.data import sources

    if root is None:
        root = sources.default_data_root()
        if not root.exists():
            raise UserInputError(
                f"dataset {name!r} needs a data root (--data-root, or $RAFL_DATA_ROOT; default {root} does "
                f"not exist); expected there: {sources.EXPECTED[name]}", field="data_root")
    if name in ("cifar10", "cifar100"):
        raw = sources.load_cifar(name, root, limit_per_class, progress)
        mean, std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else (CIFAR100_MEAN, CIFAR100_STD)
        return from_uint8(name, raw.images, raw.labels, raw.origin, raw.classes, resolution, mean, std)
    raw = sources.load_femnist(root, limit_per_class, progress)
    return from_uint8("femnist", raw.images, raw.labels, raw.origin, raw.classes, resolution, writers=raw.writers)
