"""Datasets in one documented form: images (N, C, H, W) normalized per batch, int64 labels, class names.

Pixels stay as compact as their source in memory: uint8 for CIFAR and FEMNIST (1/4 of float32:
CIFAR-10 at 32 px is 184 MB instead of 737 MB), float32 for digits (8x8 originals resized to a
non-integer grid, 5 MB). ``Dataset.images`` is an :class:`Images` view: indexing it
(``ds.images[idx]``) returns the normalized float32 batch, computed by the same elementwise ops as
a whole-array normalization would, so every batch is bit-identical to it.

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

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rafl.data import sources
from rafl.data.sources import DATASETS, first_per_class
from rafl.errors import UserInputError, allowed

# Per-channel statistics of the CIFAR training sets (pixel values in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class Images:
    """A dataset's images, ``(N, C, H, W)``, kept as stored pixels and normalized on indexing.

    Two storage forms:

    * ``uint8`` pixels in 0..255: ``x = p * (1 / (255 std)) + (-mean / std)`` per channel;
    * ``float32`` pixels in [0, 1]: ``x = (p - mean) / std`` per channel.

    ``images[idx]`` (any index torch accepts on the first dimension, or a full ``[...]`` slice)
    returns float32 normalized values; ``images.take(idx)`` returns another :class:`Images` over
    the selected samples (no float copy); ``images.view(idx)`` the same without copying pixels
    (a row map); ``images.keep_only(idx)`` the same numbering with only the samples ``idx`` in
    memory. ``shape`` is the images' shape; ``dtype`` the dtype indexing returns (float32);
    ``pixels`` the stored tensor; ``nbytes`` its size in bytes.

    Args:
        pixels: stored ``(M, C, H, W)`` uint8 or float32.
        mean, std: per-channel normalization constants (pixel scale [0, 1]).
        rows: None (sample ``i`` is ``pixels[i]``), or int64 ``(N,)``: sample ``i`` is
            ``pixels[rows[i]]``, ``-1`` a sample not kept in memory (indexing it raises
            ``IndexError``).

    Raises:
        ValueError: pixels not uint8/float32 ``(M, C, H, W)``, mean/std of another channel count,
            ``rows`` not 1-D or pointing past ``pixels``.
    """

    def __init__(self, pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...],
                 rows: torch.Tensor | None = None):
        if pixels.ndim != 4 or pixels.dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"pixels must be uint8 or float32 (N, C, H, W), got {pixels.dtype} {tuple(pixels.shape)}")
        if len(mean) != pixels.shape[1] or len(std) != pixels.shape[1]:
            raise ValueError(f"mean/std need {pixels.shape[1]} channels, got {len(mean)}/{len(std)}")
        if rows is not None:
            rows = torch.as_tensor(rows, dtype=torch.int64)
            if rows.ndim != 1 or (rows.numel() and int(rows.max()) >= pixels.shape[0]):
                raise ValueError(f"rows must be 1-D indices < {pixels.shape[0]} (or -1), got {tuple(rows.shape)}")
        self.pixels = pixels
        self.rows = rows
        self.mean, self.std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
        m = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        sd = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        if pixels.dtype == torch.uint8:
            self._a, self._b = 1.0 / (255.0 * sd), -m / sd  # x = p * a + b
        else:
            self._a, self._b = m, sd  # x = (p - a) / b

    @property
    def shape(self) -> torch.Size:
        """``(N, C, H, W)``."""
        return torch.Size((len(self), *self.pixels.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype indexing returns: float32."""
        return torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes of the stored pixels (and the row map)."""
        extra = 0 if self.rows is None else self.rows.numel() * 8
        return self.pixels.numel() * self.pixels.element_size() + extra

    def __len__(self) -> int:
        return int(self.pixels.shape[0] if self.rows is None else self.rows.shape[0])

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalized float32 copy of stored-form ``pixels`` ``(B, C, H, W)`` (on their device)."""
        # contiguous (N, C, H, W) whatever the stored strides: the same values and layout either way
        x = pixels.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        a, b = self._a.to(x.device), self._b.to(x.device)
        if self.pixels.dtype == torch.uint8:
            return x.mul_(a).add_(b)
        return x.sub_(a).div_(b)

    def _stored(self, idx):
        """The stored rows of samples ``idx`` (an index of the first dimension)."""
        if self.rows is None:
            return self.pixels[idx]
        rows = self.rows[idx]
        if rows.numel() and int(rows.min()) < 0:
            raise IndexError("a sample that is not kept in memory was indexed (Images.keep_only)")
        return self.pixels[rows]

    def __getitem__(self, idx) -> torch.Tensor:
        rest: tuple = ()
        if isinstance(idx, tuple):  # (samples, channels, rows, cols): normalize the samples, then index the rest
            idx, rest = idx[0], idx[1:]
        if isinstance(idx, (int, np.integer)) or (torch.is_tensor(idx) and idx.ndim == 0):
            i = int(idx) % max(1, len(self))
            return self.normalize(self._stored(slice(i, i + 1)))[0][rest]
        x = self.normalize(self._stored(idx))
        return x[(slice(None), *rest)] if rest else x

    def take(self, idx) -> Images:
        """The samples ``idx`` (first dimension) as another :class:`Images`, same storage form."""
        return Images(self._stored(idx).contiguous(), self.mean, self.std)

    def view(self, idx) -> Images:
        """The samples ``idx`` (1-D indices) as another :class:`Images` sharing these pixels (no copy):
        sample ``j`` of the view is sample ``idx[j]`` here."""
        idx = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        rows = idx if self.rows is None else self.rows[idx]
        return Images(self.pixels, self.mean, self.std, rows=rows)

    def keep_only(self, idx) -> Images:
        """The same samples, numbered as here, with only those in ``idx`` held in memory (a copy of
        their pixels, in index order); indexing another sample raises ``IndexError``. What a run
        that uses part of a dataset keeps (:meth:`Dataset.keep_only`)."""
        keep = np.unique(np.asarray(idx, dtype=np.int64))
        rows = torch.full((len(self),), -1, dtype=torch.int64)
        rows[torch.as_tensor(keep)] = torch.arange(len(keep))
        return Images(self._stored(torch.as_tensor(keep)).contiguous(), self.mean, self.std, rows=rows)

    def __repr__(self) -> str:
        kept = "" if self.rows is None else f", {self.pixels.shape[0]} in memory"
        return f"Images({tuple(self.shape)}, stored {str(self.pixels.dtype).removeprefix('torch.')}{kept})"


@dataclass
class Dataset:
    """A whole dataset in memory, every sample pooled (partitioned later by :mod:`rafl.data.partition`).

    Attributes:
        name: ``"digits"``, ``"cifar10"``, ``"cifar100"`` or ``"femnist"``.
        images: :class:`Images` (N, C, H, W): ``images[idx]`` is float32, normalized per channel
            with ``mean``/``std``; C = 3 for digits/CIFAR, 1 for FEMNIST; H = W = the requested
            resolution. Stored as uint8 (CIFAR, FEMNIST) or float32 (digits).
        labels: int64 (N,) class ids in ``0..num_classes-1``.
        classes: class names, position = class id.
        writers: (N,) str writer ids (FEMNIST), else None.
        origin: (N,) str ``"train"`` / ``"test"``: the source's own split.
        mean, std: the per-channel normalization constants (pixel scale [0, 1]).
    """

    name: str
    images: Images
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

    def keep_only(self, idx) -> Dataset:
        """The same dataset (same sample numbering, labels, origin) with only the images of the
        samples ``idx`` in memory (:meth:`Images.keep_only`): what a run keeps once it knows which
        samples its partition, public pool and global test use. Indexing another sample's image
        raises ``IndexError``; every kept image is bit-identical."""
        return replace(self, images=self.images.keep_only(idx))

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


def _channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    xd = x.double()
    mean = tuple(float(v) for v in xd.mean(dim=(0, 2, 3)))
    std = tuple(max(float(v), 1e-6) for v in xd.std(dim=(0, 2, 3)))
    return mean, std


def from_uint8(name: str, images_nhwc: np.ndarray, labels: np.ndarray, origin: np.ndarray, classes: list[str],
               resolution: int, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
               writers: np.ndarray | None = None) -> Dataset:
    """Build a :class:`Dataset` from uint8 (N, H, W, C) pixels, kept as uint8 (N, C, H, W).

    At the source's own resolution the pixels are stored as they are (the same memory, an
    (N, C, H, W) view with channels-last strides); another ``resolution``
    resizes them (bilinear, antialiased when shrinking) and rounds back to uint8, in chunks.
    ``mean``/``std`` None = computed on the stored pixels (scale [0, 1]).
    """
    src = torch.from_numpy(np.ascontiguousarray(images_nhwc)).permute(0, 3, 1, 2)  # (N, C, H, W) uint8 view
    n, c = src.shape[:2]
    if src.shape[-1] == resolution and src.shape[-2] == resolution:
        # the source's own pixels, viewed (N, C, H, W) with channels-last strides: no second copy of the
        # dataset (a contiguous copy doubled the peak memory of loading it); batches are made
        # contiguous when normalized
        pix = src
    else:
        pix = torch.empty((n, c, resolution, resolution), dtype=torch.uint8)
        chunk = 1024
        for s in range(0, n, chunk):
            pix[s:s + chunk] = _resize(src[s:s + chunk].float(), resolution).round_().clamp_(0, 255).to(torch.uint8)
    if mean is None or std is None:
        mean, std = _channel_stats_uint8(pix)
    return Dataset(name=name, images=Images(pix, tuple(mean), tuple(std)),
                   labels=torch.as_tensor(np.asarray(labels, dtype=np.int64)), classes=list(classes),
                   writers=writers, origin=np.asarray(origin, dtype=str), mean=tuple(mean), std=tuple(std))


def _channel_stats_uint8(pix: torch.Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (scale [0, 1]) of uint8 (N, C, H, W), in float64 chunks."""
    c = pix.shape[1]
    total, sq = torch.zeros(c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64)
    for s in range(0, pix.shape[0], chunk):
        x = pix[s:s + chunk].double().div_(255.0)
        total += x.sum(dim=(0, 2, 3))
        sq += (x * x).sum(dim=(0, 2, 3))
    count = pix.shape[0] * pix.shape[2] * pix.shape[3]
    mean = total / count
    var = (sq - count * mean * mean) / max(1, count - 1)
    return tuple(float(v) for v in mean), tuple(max(float(v), 1e-6) for v in var.clamp_min(0).sqrt())


def _finish(name: str, x: torch.Tensor, labels: np.ndarray, origin: np.ndarray, classes: list[str],
            resolution: int, mean: tuple[float, ...] | None, std: tuple[float, ...] | None,
            writers: np.ndarray | None) -> Dataset:
    x = _resize(x, resolution).contiguous()
    if mean is None or std is None:
        mean, std = _channel_stats(x)
    return Dataset(name=name, images=Images(x, tuple(mean), tuple(std)), labels=torch.as_tensor(np.asarray(labels, dtype=np.int64)),
                   classes=list(classes), writers=writers, origin=np.asarray(origin, dtype=str),
                   mean=tuple(mean), std=tuple(std))


def load_digits(resolution: int = 32, limit_per_class: int | None = None) -> Dataset:
    """scikit-learn's real 8x8 handwritten digits, 3 x ``resolution`` x ``resolution``, normalized.

    Returns:
        :class:`Dataset` with 1,797 samples (fewer with ``limit_per_class``), 10 classes "0".."9",
        every ``origin == "train"``; mean/std computed on the resized images (the same for all 3 channels).
    """
    # scikit-learn (and scipy under it): heavy, loaded only for the digits dataset
    from sklearn.datasets import load_digits as _sk_digits  # noqa: PLC0415

    bunch = _sk_digits()
    labels = bunch.target.astype(np.int64)
    origin = np.full(len(labels), "train")
    keep = first_per_class(labels, origin, limit_per_class)
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
        :class:`Dataset`: images an :class:`Images` (N, C, resolution, resolution) whose batches
        are float32, labels int64 (N,).

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
    if root is None:
        root = sources.check_data_root(name, None)
    if name in ("cifar10", "cifar100"):
        raw = sources.load_cifar(name, root, limit_per_class, progress)
        mean, std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else (CIFAR100_MEAN, CIFAR100_STD)
        return from_uint8(name, raw.images, raw.labels, raw.origin, raw.classes, resolution, mean, std)
    raw = sources.load_femnist(root, limit_per_class, progress)
    return from_uint8("femnist", raw.images, raw.labels, raw.origin, raw.classes, resolution, writers=raw.writers)
