"""Readers for the on-disk dataset formats, and the uint8 decode cache.

CIFAR-10 / CIFAR-100 (``load_cifar``) accept as ``root``:

* the standard python-pickle folder (what torchvision downloads): ``cifar-10-batches-py/`` with
  ``data_batch_1`` .. ``data_batch_5``, ``test_batch``, ``batches.meta``; ``cifar-100-python/`` with
  ``train``, ``test``, ``meta`` (fine labels) -- given as the folder itself or its parent;
* an ImageFolder tree ``train/<class>/*.jpg`` and ``test/<class>/*.jpg`` (PNG too), given as the
  folder holding ``train``/``test`` or its parent holding ``cifar10/`` (``cifar100/``), as the
  shared ``cifar10-jpeg.tar.gz`` unpacks; class ids are the sorted class folder names;
* a ``.tar.gz`` / ``.tgz`` / ``.tar`` file holding either layout (read as a stream with
  :mod:`tarfile`; nothing is extracted), or a folder holding such a file under its usual name.

Pickles are read with a restricted unpickler that only rebuilds numpy arrays (no arbitrary code).
The decoded pixels are cached once as one uncompressed ``.npz`` (``images`` uint8 (N, 32, 32, 3),
``labels`` int64, ``origin`` str, ``classes`` str) under ``$RAFL_CACHE_DIR/datasets`` (default
``~/.cache/rafl/datasets``), keyed by the dataset, the resolved source path, its size and mtime (for
folders: those of the files/class folders read) and ``limit_per_class``. A cache file that cannot
be read back raises :class:`~rafl.errors.UserInputError` naming it (delete it and it is rebuilt).

FEMNIST (``load_femnist``) reads a LEAF directory (Caldas et al., "LEAF: A Benchmark for Federated
Settings", 2018): json shards, each ``{"users": [...], "num_samples": [...], "user_data":
{user: {"x": [[784 floats in 0..1]], "y": [class ids 0..61]}}}``, found in ``train/`` and
``test/`` (origin train/test; also under ``data/``) or directly in the folder / ``all_data/``
(origin train). Writer ids are kept; the parsed shards are cached like CIFAR (uint8, plus writers).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes, read_json_file

#: the datasets rafl reads (:func:`rafl.data.load_dataset`)
DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "femnist")

CACHE_VERSION = 1
IMAGE_EXTS = (".jpg", ".jpeg", ".png")

_PICKLE_FILES = {
    "cifar10": {"dir": "cifar-10-batches-py", "train": [f"data_batch_{i}" for i in range(1, 6)],
                "test": ["test_batch"], "meta": "batches.meta", "names_key": "label_names", "labels_key": "labels"},
    "cifar100": {"dir": "cifar-100-python", "train": ["train"], "test": ["test"], "meta": "meta",
                 "names_key": "fine_label_names", "labels_key": "fine_labels"},
}
_TARBALL_NAMES = {"cifar10": ("cifar10-jpeg.tar.gz", "cifar-10-python.tar.gz"),
                  "cifar100": ("cifar100-jpeg.tar.gz", "cifar-100-python.tar.gz")}

EXPECTED = {
    "cifar10": ("cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}, or an ImageFolder tree "
                "train/<class>/*.jpg + test/<class>/*.jpg (also under cifar10/), or a .tar.gz of either"),
    "cifar100": ("cifar-100-python/{train, test, meta}, or an ImageFolder tree train/<class>/*.jpg + "
                 "test/<class>/*.jpg (also under cifar100/), or a .tar.gz of either"),
    "femnist": ("LEAF json shards (users, num_samples, user_data) in train/ and test/ (or data/train, "
                "data/test), or *.json directly in the folder or in all_data/"),
}


#: FEMNIST's 62 classes: digits, upper-case, lower-case letters (LEAF's label order)
FEMNIST_CLASSES = [str(d) for d in range(10)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [
    chr(c) for c in range(ord("a"), ord("z") + 1)]


def first_per_class(labels: np.ndarray, origin: np.ndarray, limit_per_class: int | None) -> np.ndarray:
    """Indices (ascending, int64) keeping the first ``limit_per_class`` samples of every (origin, class)
    of ``labels`` (N,) and ``origin`` (N,); all ``N`` when ``limit_per_class`` is None."""
    if limit_per_class is None:
        return np.arange(len(labels))
    keep = np.zeros(len(labels), dtype=bool)
    for o in np.unique(origin):
        for c in np.unique(labels):
            idx = np.flatnonzero((origin == o) & (labels == c))[:limit_per_class]
            keep[idx] = True
    return np.flatnonzero(keep)


@dataclass
class RawImages:
    """Raw dataset arrays: images uint8 (N, H, W, C), labels int64 (N,), origin str (N,), writers str (N,) or None."""

    images: np.ndarray
    labels: np.ndarray
    origin: np.ndarray
    classes: list[str]
    writers: np.ndarray | None = None


def default_data_root() -> Path:
    """Where datasets are looked for without an explicit root: ``$RAFL_DATA_ROOT`` or ``~/.cache/rafl-data``.

    (``tar xzf cifar10-jpeg.tar.gz -C ~/.cache/rafl-data`` gives ``~/.cache/rafl-data/cifar10/train/...``,
    which this finds; so does a copy of the tarball itself in that folder.)
    """
    return Path(os.environ.get("RAFL_DATA_ROOT") or Path.home() / ".cache" / "rafl-data").expanduser()


def cache_dir() -> Path:
    """rafl's cache folder: ``$RAFL_CACHE_DIR`` or ``~/.cache/rafl``."""
    return Path(os.environ.get("RAFL_CACHE_DIR") or Path.home() / ".cache" / "rafl")


# --------------------------------------------------------------------------------------------
# safe pickle


class _NumpyOnlyUnpickler(pickle.Unpickler):
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only numpy arrays are allowed)")


def _load_pickle(data: bytes, source: str) -> dict:
    try:
        obj = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as err:  # noqa: BLE001 - any failure of a foreign file is bad input
        raise UserInputError(f"not a readable CIFAR python batch ({type(err).__name__}: {err})", source=source) from None
    if not isinstance(obj, dict):
        raise UserInputError("not a CIFAR python batch (expected a dict)", source=source)
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


def _decode_batches(name: str, files: dict[str, bytes], where: str) -> RawImages:
    spec = _PICKLE_FILES[name]
    missing = [f for f in [*spec["train"], *spec["test"], spec["meta"]] if f not in files]
    if missing:
        raise UserInputError(f"missing {', '.join(missing)} (expected {EXPECTED[name]})", source=where)
    meta = _load_pickle(files[spec["meta"]], f"{where}/{spec['meta']}")
    names = meta.get(spec["names_key"])
    if not isinstance(names, list) or not names:
        raise UserInputError(f"has no {spec['names_key']!r} list", source=f"{where}/{spec['meta']}")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    imgs, labels, origin = [], [], []
    for split in ("train", "test"):
        for fname in spec[split]:
            src = f"{where}/{fname}"
            batch = _load_pickle(files[fname], src)
            data, lab = batch.get("data"), batch.get(spec["labels_key"])
            if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072 or lab is None:
                raise UserInputError(f"needs 'data' uint8 (n, 3072) and {spec['labels_key']!r}", source=src)
            lab = np.asarray(lab, dtype=np.int64)
            if len(lab) != len(data) or (len(lab) and (lab.min() < 0 or lab.max() >= len(classes))):
                raise UserInputError(f"{spec['labels_key']!r} must have {len(data)} ids in 0..{len(classes) - 1}",
                                     source=src)
            imgs.append(data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels.append(lab)
            origin.append(np.full(len(lab), split))
    return RawImages(np.concatenate(imgs), np.concatenate(labels), np.concatenate(origin), classes)


# --------------------------------------------------------------------------------------------
# image folders


def _decode_images(items: list[tuple[str, str, str, bytes | Path]], where: str, progress: bool = True) -> RawImages:
    """items: (split, class, sort key, bytes or path) -> decoded uint8 (N, 32, 32, 3)."""
    # PIL: ~25 ms more for every check that imports this check module; loaded only to decode images
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    classes = sorted({c for _, c, _, _ in items})
    cidx = {c: i for i, c in enumerate(classes)}
    items = sorted(items, key=lambda t: (t[0] != "train", t[1], t[2]))
    out = np.empty((len(items), 32, 32, 3), dtype=np.uint8)
    for i, (split, cls, key, blob) in enumerate(tqdm(items, desc=f"decoding {where}", unit="img",
                                                     disable=not progress or len(items) < 2000, leave=False)):
        try:
            with Image.open(io.BytesIO(blob) if isinstance(blob, bytes) else blob) as im:
                arr = np.asarray(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as err:
            raise UserInputError(f"cannot decode image ({err})", source=f"{where}:{key}") from None
        if arr.shape != (32, 32, 3):
            raise UserInputError(f"image is {arr.shape[1]}x{arr.shape[0]}, CIFAR images must be 32x32",
                                 source=f"{where}:{key}")
        out[i] = arr
    labels = np.array([cidx[c] for _, c, _, _ in items], dtype=np.int64)
    origin = np.array([s for s, _, _, _ in items])
    return RawImages(out, labels, origin, classes)


def _select_first(items: list[tuple[str, str, str, bytes | Path]], limit: int | None) -> list:
    if limit is None:
        return items
    groups: dict[tuple[str, str], list] = {}
    for it in items:
        groups.setdefault((it[0], it[1]), []).append(it)
    return [it for g in groups.values() for it in sorted(g, key=lambda t: t[2])[:limit]]


def _folder_items(base: Path) -> list[tuple[str, str, str, Path]]:
    items = []
    for split in ("train", "test"):
        d = base / split
        if not d.is_dir():
            continue
        for cdir in sorted(p for p in d.iterdir() if p.is_dir()):
            for f in sorted(cdir.iterdir()):
                if f.suffix.lower() in IMAGE_EXTS:
                    items.append((split, cdir.name, f"{split}/{cdir.name}/{f.name}", f))
    return items


# --------------------------------------------------------------------------------------------
# tarballs


_IMG_RE = re.compile(r"(?:^|/)(train|test)/([^/]+)/([^/]+\.(?:jpe?g|png))$", re.IGNORECASE)


def _read_tarball(name: str, path: Path, limit: int | None, progress: bool = True) -> RawImages:
    spec = _PICKLE_FILES[name]
    wanted = {*spec["train"], *spec["test"], spec["meta"]}
    pickles: dict[str, bytes] = {}
    images: list[tuple[str, str, str, bytes]] = []
    try:
        with tarfile.open(path, "r|*") as tar:
            for m in tqdm(tar, desc=f"reading {path.name}", unit="file", leave=False, mininterval=1.0,
                          disable=not progress):
                if not m.isfile():
                    continue
                parts = m.name.split("/")
                if parts[-1] in wanted and len(parts) >= 2 and parts[-2] == spec["dir"]:
                    pickles[parts[-1]] = tar.extractfile(m).read()
                    continue
                hit = _IMG_RE.search(m.name)
                if hit:
                    split, cls, fname = hit.groups()
                    images.append((split, cls, m.name, tar.extractfile(m).read()))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise UserInputError(f"cannot read the archive ({type(err).__name__}: {err})", source=path) from None
    if pickles and not images:
        return _decode_batches(name, pickles, f"{path}:{spec['dir']}")
    if not images:
        raise UserInputError(f"archive holds no CIFAR data; expected {EXPECTED[name]}", source=path)
    return _decode_images(_select_first(images, limit), str(path), progress)


def check_data_root(name: str, root: str | Path | None) -> Path:
    """Where dataset ``name`` (not digits) is read from: ``root``, else :func:`default_data_root`;
    checked to exist and to hold one of the dataset's layouts (:data:`EXPECTED`) by file names
    alone, without reading a file (the commands call this before torch loads).

    Raises:
        UserInputError: the root (given or default) does not exist, or holds none of the dataset's
            layouts (field ``data_root``).
    """
    if root is None:
        root = default_data_root()
        if not root.exists():
            raise UserInputError(
                f"dataset {name!r} needs a data root (--data-root, or $RAFL_DATA_ROOT; default {root} does "
                f"not exist); expected there: {EXPECTED[name]}", field="data_root")
    root = Path(root).expanduser()
    if not root.exists():
        raise UserInputError(f"does not exist; expected {EXPECTED[name]}", source=root, field="data_root")
    if name in _PICKLE_FILES:
        _locate_cifar(name, root)
    elif name == "femnist":
        _locate_femnist(root)
    return root


# --------------------------------------------------------------------------------------------
# CIFAR entry point


def _locate_cifar(name: str, root: Path) -> tuple[str, Path, list[Path]]:
    """-> (kind in pickles|folder|tar, the source path, the files/dirs whose stat keys the cache)."""
    spec = _PICKLE_FILES[name]
    if not root.exists():
        raise UserInputError(f"does not exist; expected {EXPECTED[name]}", source=root, field="data_root")
    if root.is_file():
        if root.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "tar", root, [root]
        raise UserInputError(f"is a file but not a .tar.gz/.tgz/.tar archive; expected {EXPECTED[name]}",
                             source=root, field="data_root")
    for d in (root, root / spec["dir"]):
        if (d / spec["meta"]).is_file() or (d / spec["train"][0]).is_file():
            files = [d / f for f in [*spec["train"], *spec["test"], spec["meta"]]]
            return "pickles", d, files
    for d in (root, root / name):
        if (d / "train").is_dir() or (d / "test").is_dir():
            dirs = [p for s in ("train", "test") if (d / s).is_dir() for p in [d / s, *sorted((d / s).iterdir())]]
            return "folder", d, dirs
    for tname in _TARBALL_NAMES[name]:
        if (root / tname).is_file():
            return "tar", root / tname, [root / tname]
    raise UserInputError(f"holds no {name} data; expected {EXPECTED[name]}", source=root, field="data_root")


def _cache_key(name: str, src: Path, stats: list[Path], limit: int | None) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}|{name}|{src.resolve()}|limit={limit}".encode())
    for p in stats:
        try:
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        except OSError:
            h.update(f"|{p.name}:missing".encode())
    return h.hexdigest()[:20]


def _read_cache(path: Path, source: Path) -> RawImages:
    hint = f"delete it and rafl rebuilds it from {source}"
    try:
        with np.load(path, allow_pickle=False) as z:
            raw = RawImages(z["images"], z["labels"].astype(np.int64), z["origin"].astype(str),
                            [str(c) for c in z["classes"]], z["writers"].astype(str) if "writers" in z else None)
    except Exception as err:  # noqa: BLE001 - truncated zip, missing key, bad header ...
        raise UserInputError(f"corrupted cache file ({type(err).__name__}: {err}); {hint}", source=path) from None
    n = len(raw.labels)
    if (raw.images.dtype != np.uint8 or raw.images.ndim != 4 or raw.images.shape[0] != n or len(raw.origin) != n
            or (raw.writers is not None and len(raw.writers) != n)
            or (n and (raw.labels.min() < 0 or raw.labels.max() >= len(raw.classes)))):
        raise UserInputError(f"corrupted cache file (inconsistent arrays); {hint}", source=path)
    return raw


def _write_cache(path: Path, raw: RawImages) -> None:
    buf = io.BytesIO()
    arrays = {"images": raw.images, "labels": raw.labels, "origin": raw.origin.astype("<U5"),
              "classes": np.array(raw.classes, dtype=str)}
    if raw.writers is not None:
        arrays["writers"] = np.asarray(raw.writers, dtype=str)
    np.savez(buf, **arrays)
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError as err:
        warnings.warn(f"could not write the dataset cache {path} ({err}); continuing without it", stacklevel=3)


def load_cifar(name: str, root: str | Path, limit_per_class: int | None = None, progress: bool = True) -> RawImages:
    """CIFAR-10/100 pixels from any accepted layout (module docstring), via the uint8 cache.

    Returns:
        :class:`RawImages` with images uint8 (N, 32, 32, 3), labels int64 (N,), origin train/test,
        train samples first; at most ``limit_per_class`` samples per (split, class).

    Raises:
        UserInputError: missing root or files (names the files expected), unreadable archive,
            pickle or image, a corrupted cache file.
    """

    root = Path(root).expanduser()
    kind, src, stats = _locate_cifar(name, root)
    cache = cache_dir() / "datasets" / f"{name}-{_cache_key(name, src, stats, limit_per_class)}.npz"
    if cache.exists():
        return _read_cache(cache, src)
    if kind == "tar":
        raw = _read_tarball(name, src, limit_per_class, progress)
    elif kind == "pickles":
        spec = _PICKLE_FILES[name]
        files = {}
        for f in [*spec["train"], *spec["test"], spec["meta"]]:
            if (src / f).is_file():
                files[f] = (src / f).read_bytes()
        raw = _decode_batches(name, files, str(src))
    else:
        raw = _decode_images(_select_first(_folder_items(src), limit_per_class), str(src), progress)
    if kind == "pickles" and limit_per_class is not None:
        keep = first_per_class(raw.labels, raw.origin, limit_per_class)
        raw = RawImages(raw.images[keep], raw.labels[keep], raw.origin[keep], raw.classes)
    expected_classes = 10 if name == "cifar10" else 100
    if len(raw.classes) != expected_classes:
        raise UserInputError(f"found {len(raw.classes)} classes ({', '.join(raw.classes[:12])}"
                             f"{', ...' if len(raw.classes) > 12 else ''}), {name} has {expected_classes}",
                             source=src, field="data_root")
    _write_cache(cache, raw)
    return raw


# --------------------------------------------------------------------------------------------
# FEMNIST (LEAF)


def _leaf_shards(root: Path) -> list[tuple[str, Path]]:
    for base in (root, root / "data"):
        found = [(split, f) for split in ("train", "test") if (base / split).is_dir()
                 for f in sorted((base / split).glob("*.json"))]
        if found:
            return found
    for base in (root, root / "all_data", root / "data" / "all_data"):
        found = [("train", f) for f in sorted(base.glob("*.json"))] if base.is_dir() else []
        if found:
            return found
    return []


def _locate_femnist(root: Path) -> list[tuple[str, Path]]:
    """The LEAF shards under ``root`` (:func:`_leaf_shards`).

    Raises:
        UserInputError: ``root`` is not a folder or holds no json shards (field ``data_root``).
    """
    if not root.is_dir():
        raise UserInputError(f"is not a folder; expected {EXPECTED['femnist']}", source=root, field="data_root")
    shards = _leaf_shards(root)
    if not shards:
        raise UserInputError(f"holds no json shards; expected {EXPECTED['femnist']}", source=root, field="data_root")
    return shards


def load_femnist(root: str | Path, limit_per_class: int | None = None, progress: bool = True) -> RawImages:
    """FEMNIST from LEAF json shards (module docstring), via the uint8 cache.

    Pixels are stored as uint8 ``round(255 * x)`` (LEAF's values are already multiples of 1/255),
    so a first load and a cached load give the same images.

    Returns:
        :class:`RawImages` with images uint8 (N, 28, 28, 1), labels int64 (N,) in 0..61, origin
        train/test (train samples first), writers (N,) str; at most ``limit_per_class`` samples per
        (split, class).

    Raises:
        UserInputError: missing root, no shards, a shard that is not LEAF json (names file and key),
            a corrupted cache file.
    """

    root = Path(root).expanduser()
    shards = _locate_femnist(root)
    key = _cache_key("femnist", root, [f for _, f in shards], limit_per_class)
    cache = cache_dir() / "datasets" / f"femnist-{key}.npz"
    if cache.exists():
        return _read_cache(cache, root)
    xs, ys, ws, origin = [], [], [], []
    for split, f in tqdm(shards, desc="reading LEAF shards", unit="shard", disable=not progress or len(shards) < 4,
                         leave=False):
        try:
            obj = read_json_file(f)
        except (OSError, UnicodeDecodeError) as err:
            raise UserInputError(f"not valid JSON ({err.__class__.__name__})", source=f) from None
        if not isinstance(obj, dict) or not all(k in obj for k in ("users", "num_samples", "user_data")):
            raise UserInputError("needs the LEAF keys users, num_samples, user_data", source=f)
        if len(obj["users"]) != len(obj["num_samples"]):
            raise UserInputError("users and num_samples differ in length", source=f, field="num_samples")
        for user, n in zip(obj["users"], obj["num_samples"]):
            ud = obj["user_data"].get(user)
            if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
                raise UserInputError("needs {x, y}", source=f, field=f"user_data.{user}")
            try:
                x = np.asarray(ud["x"], dtype=np.float32)
                y = np.asarray(ud["y"], dtype=np.int64)
            except (TypeError, ValueError):
                x = y = np.zeros((0, 0))
            if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1 or len(y) != len(x) or len(y) != n:
                raise UserInputError(f"x must be {n} rows of 784 pixels and y {n} labels (num_samples)",
                                     source=f, field=f"user_data.{user}")
            if len(y) and (y.min() < 0 or y.max() >= len(FEMNIST_CLASSES)):
                raise UserInputError(f"labels must be 0..{len(FEMNIST_CLASSES) - 1}", source=f,
                                     field=f"user_data.{user}.y")
            if x.size and (x.min() < 0 or x.max() > 1):
                raise UserInputError("pixels must be in 0..1 (LEAF)", source=f, field=f"user_data.{user}.x")
            xs.append(np.rint(x * 255.0).astype(np.uint8).reshape(-1, 28, 28, 1))
            ys.append(y)
            ws.append(np.full(len(y), str(user), dtype=object))
            origin.append(np.full(len(y), split))
    images, labels, origin_arr = np.concatenate(xs), np.concatenate(ys), np.concatenate(origin)
    writers = np.concatenate(ws).astype(str)
    order = np.argsort(origin_arr != "train", kind="stable")  # train samples first
    keep = order[first_per_class(labels[order], origin_arr[order], limit_per_class)]
    raw = RawImages(images[keep], labels[keep], origin_arr[keep], list(FEMNIST_CLASSES), writers[keep])
    _write_cache(cache, raw)
    return raw
