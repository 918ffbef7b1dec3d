"""Federated partitions: which sample indices each client holds, and the server's public pool.

Partitioners (all deterministic for a seed; one ``numpy.random.Generator`` per call):

* ``iid`` -- a uniform random permutation cut into ``n_clients`` near-equal shares.
* ``pathological`` -- every client holds exactly ``k`` classes (McMahan et al., "Communication-
  Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017, Sec. 3; the "2/10"
  and "10/100" settings of FedGH, Yi et al., ACM MM 2023, Sec. 5.1). The classes are randomly
  permuted and client ``i`` gets the ``k`` classes at cyclic positions ``i*k .. i*k+k-1``, so each
  class goes to ``floor`` or ``ceil`` of ``n_clients*k/C`` clients; a class's samples are then cut
  into near-equal random shares among its holders. When ``n_clients*k < C`` some classes are held
  by nobody and their samples stay unassigned (``meta["unassigned"]`` counts them).
* ``dirichlet`` -- label skew (Hsu et al., "Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification", 2019, Sec. 3): for every class ``c`` draw
  ``p_c ~ Dir(alpha * 1_n)`` over the clients and cut the class's shuffled samples at the
  cumulative proportions. As in NIID-Bench (Li et al., ICDE 2022, Sec. 4.1; also FedLab's
  ``hetero_dir_partition`` and HtFLlib), a client that already holds ``>= N/n`` samples gets no
  more (``p_{c,j} = 0``); when that leaves no share (a small ``alpha`` puts a class on one full
  client), the class's shares are drawn from ``Dir(alpha)`` over the clients that are not full, so
  ``alpha -> 0`` gives one client per class, never an even spread. The whole draw is repeated until every client has ``>= min_samples``
  samples, at most :data:`MAX_DIRICHLET_TRIES` times, then :class:`~rafl.errors.UserInputError`.
* ``balanced-dirichlet`` -- equal client sizes with Dirichlet label mixtures (Hsu, Qi & Brown,
  "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
  2019, Sec. 3; FedLab's "balanced Dirichlet", ``balance=True, partition="dir"``): every client
  ``j`` draws class proportions ``q_j ~ Dir(alpha * C * p)``, ``p`` the class frequencies of the
  samples to partition (Hsu et al.'s ``Dir(alpha_H * p)`` with ``alpha_H = C * alpha``: under a
  uniform prior every class gets concentration ``alpha``, as in the ``dirichlet`` scheme and in
  FedLab, so one ``alpha`` means the same per-class skew in both schemes). Client sizes are
  near-equal (``floor(N/n)`` or ``ceil(N/n)``, the first ``N mod n`` clients one larger) and every
  sample is used exactly once: the ``N`` slots (client ``j`` repeated ``size_j`` times) are
  visited in a random order, and each slot draws a class from its client's ``q_j`` restricted to
  the classes that still have samples (Hsu et al.: sampling without replacement from the class
  pools), then takes that class's next sample of a shuffled pool. A client whose remaining classes
  all carry zero mass (``q_j`` underflows to 0 at tiny ``alpha``) draws from the remaining samples
  in proportion to the classes' counts (``meta["pool_draws"]`` counts these). The cross-device
  corner's scheme: with 500 clients, ``dirichlet`` at ``alpha = 0.1`` leaves some client a single
  image in every draw, this one gives every client ``floor(N/n)``. It cannot fill every client with
  ``min_samples`` only when ``N < n * min_samples``.
* ``natural`` -- one client per writer (FEMNIST, LEAF; Caldas et al., 2018). Writers with fewer than
  ``min_samples`` samples are skipped; if ``n_clients`` is smaller than the number of eligible
  writers, ``n_clients`` of them are drawn at random (the rest stay unassigned). Client order is
  the sorted writer id order of the chosen writers; ``meta["writers"]`` lists them.
* ``file:PATH`` -- a saved ``partition.json`` (see below), so that runs -- also of other
  libraries -- can share one exact split.

The public pool (:func:`carve_public_pool`) is carved FIRST (stratified, its own seed), then the
remaining indices are partitioned. Each client's share is split train/val/test (default 8:1:1) by
:func:`split_client`: stratified per class where a class has >= 3 samples on the client, the
classes with fewer samples pooled as one remainder stratum; a client with >= 3 samples always gets
>= 1 validation and >= 1 test sample.

``partition.json`` format (version 1), written by :meth:`Partition.save`::

    {
      "format": "rafl.partition",
      "version": 1,
      "meta": {"dataset": "digits", "scheme": "dirichlet", "params": {"alpha": 0.1, ...},
               "seed": 0, "n_samples": 1797, "n_classes": 10, "n_clients": 20,
               "public_fraction": 0.0, "public_seed": 0, "split": [0.8, 0.1, 0.1], ...},
      "public": [3, 17, ...],                       # server's public pool (labels withheld)
      "clients": {"0": {"train": [...], "val": [...], "test": [...]}, "1": {...}, ...}
    }

Indices are 0-based positions into the dataset as :func:`rafl.data.load_dataset` returns it
(the source's train samples first, then its test samples, each in sorted file/record order).
Client ids are the strings ``"0" .. "n-1"``. Index sets are pairwise disjoint (across clients,
splits and the public pool). ``meta`` is informational, except ``n_samples`` which is checked
against the dataset when the file is loaded with ``n_samples``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rafl import seeds
from rafl.errors import UserInputError, allowed, brief
from rafl.io import atomic_write_text, read_json_file

SCHEMES: tuple[str, ...] = ("iid", "pathological", "dirichlet", "balanced-dirichlet", "natural")
MAX_DIRICHLET_TRIES: int = 100
FORMAT = "rafl.partition"
VERSION = 1


@dataclass(frozen=True)
class ClientSplit:
    """One client's data: int64 index arrays (sorted) into the dataset, shapes (n_train,), (n_val,), (n_test,)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    @property
    def n_samples(self) -> int:
        """Total samples of the client over its three splits."""
        return int(len(self.train) + len(self.val) + len(self.test))

    def all(self) -> np.ndarray:
        """All of the client's indices, sorted int64 (n_samples,)."""
        return np.sort(np.concatenate([self.train, self.val, self.test])).astype(np.int64)


@dataclass
class Partition:
    """A federated partition of one dataset.

    Attributes:
        clients: one :class:`ClientSplit` per client; list position = client id.
        public: sorted int64 indices of the server's public pool (labels withheld from FL
            algorithms; for ensemble distillation and server-side stages), possibly empty.
        meta: dataset, scheme, params, seed, n_samples, n_classes, n_clients, public_fraction,
            public_seed, split (and ``writers`` for ``natural``, ``unassigned`` counts).
    """

    clients: list[ClientSplit]
    public: np.ndarray
    meta: dict = field(default_factory=dict)
    #: sorted int64 indices of the held-out balanced global test set (:func:`carve_global_test`),
    #: given to no client and never in the public pool; empty when the run has none
    global_test: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def n_clients(self) -> int:
        return len(self.clients)

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict of the documented ``partition.json`` format."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "meta": _jsonable(self.meta),
            "public": [int(i) for i in self.public],
            "clients": {
                str(cid): {
                    "train": [int(i) for i in c.train],
                    "val": [int(i) for i in c.val],
                    "test": [int(i) for i in c.test],
                }
                for cid, c in enumerate(self.clients)
            },
        }
        if len(self.global_test):
            out["global_test"] = [int(i) for i in self.global_test]
        return out

    def save(self, path: str | Path) -> None:
        """Write ``partition.json`` (format in the module docstring) atomically to ``path``.

        ``meta`` is indented; every index list is on one line (one line per client).
        """
        obj = self.to_json()
        meta_items = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in obj["meta"].items()]
        meta = "{\n" + ",\n".join(meta_items) + "\n  }" if meta_items else "{}"
        lines = [
            "{",
            f'  "format": {json.dumps(obj["format"])},',
            f'  "version": {obj["version"]},',
            f'  "meta": {meta},',
            f'  "public": {json.dumps(obj["public"])},',
            *([f'  "global_test": {json.dumps(obj["global_test"])},'] if "global_test" in obj else []),
            '  "clients": {',
        ]
        items = list(obj["clients"].items())
        for i, (cid, c) in enumerate(items):
            lines.append(f"    {json.dumps(cid)}: {json.dumps(c)}" + ("," if i < len(items) - 1 else ""))
        lines += ["  }", "}"]
        atomic_write_text(path, "\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path, n_samples: int | None = None) -> Partition:
        """Read a ``partition.json`` written by :meth:`save` (or by another tool in that format).

        Args:
            path: the JSON file.
            n_samples: size of the dataset it will index; when given, every index must be
                ``< n_samples`` and ``meta.n_samples`` (if present) must equal it.

        Raises:
            UserInputError: missing/unreadable file, wrong format, non-integer or negative or
                out-of-range indices (``0..2**62 - 1``, below ``n_samples``), a ``meta`` integer
                outside ``+-2**53``, client ids not ``"0".."n-1"``, overlapping index sets.
        """
        path = Path(path)
        if not path.is_file():
            raise UserInputError("partition file not found (expected a partition.json written by "
                                 "`rafl data --out DIR`)", source=path)
        try:
            obj = read_json_file(path)
        except (OSError, UnicodeDecodeError) as err:
            raise UserInputError(f"not valid JSON ({err.__class__.__name__})", source=path) from None
        if not isinstance(obj, dict):
            raise UserInputError("top level must be an object with 'clients' (and 'public', 'meta')",
                                 source=path)
        if "format" in obj and obj["format"] != FORMAT:
            raise UserInputError(f"is {brief(obj['format'])}, allowed: {FORMAT!r}", source=path, field="format")
        if "version" in obj and obj["version"] != VERSION:
            raise UserInputError(f"is {brief(obj['version'])}, allowed: {VERSION}", source=path, field="version")
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise UserInputError("must be an object", source=path, field="meta")
        _check_meta_ints(meta, path, "meta")
        if n_samples is not None and "n_samples" in meta and meta["n_samples"] != n_samples:
            raise UserInputError(
                f"is {brief(meta['n_samples'])}, but the dataset has {n_samples} samples "
                "(the partition was made for another dataset or --limit-per-class)", source=path, field="meta.n_samples")
        raw_clients = obj.get("clients")
        if isinstance(raw_clients, list):  # tolerate a list of clients (position = id)
            raw_clients = {str(i): c for i, c in enumerate(raw_clients)}
        if not isinstance(raw_clients, dict) or not raw_clients:
            raise UserInputError("must be a non-empty object mapping client id -> {train, val, test}",
                                 source=path, field="clients")
        expected = [str(i) for i in range(len(raw_clients))]
        if sorted(raw_clients, key=lambda s: (len(s), s)) != expected:
            raise UserInputError(f"client ids must be \"0\"..\"{len(raw_clients) - 1}\"", source=path,
                                 field="clients")
        clients = []
        for cid in expected:
            entry = raw_clients[cid]
            if not isinstance(entry, dict):
                raise UserInputError("must be an object with train, val, test", source=path,
                                     field=f"clients.{cid}")
            arrays = {s: _index_array(entry.get(s, []), path, f"clients.{cid}.{s}", n_samples)
                      for s in ("train", "val", "test")}
            unknown = set(entry) - {"train", "val", "test"}
            if unknown:
                raise UserInputError(f"unknown keys {sorted(unknown)}, allowed: train, val, test",
                                     source=path, field=f"clients.{cid}")
            if len(arrays["train"]) == 0:  # a client with nothing to train on failed only in round 1
                raise UserInputError("is empty; allowed: at least one training sample per client",
                                     source=path, field=f"clients.{cid}.train")
            clients.append(ClientSplit(**arrays))
        public = _index_array(obj.get("public", []), path, "public", n_samples)
        global_test = _index_array(obj.get("global_test", []), path, "global_test", n_samples)
        part = cls(clients=clients, public=public, meta=dict(meta), global_test=global_test)
        _check_disjoint(part, path)
        part.meta.setdefault("n_clients", len(clients))
        return part

    def class_counts(self, labels: np.ndarray, n_classes: int | None = None) -> np.ndarray:
        """Samples per (client, class) over all three splits: int64 (n_clients, n_classes)."""
        labels = np.asarray(labels)
        if n_classes is None:
            n_classes = int(self.meta.get("n_classes") or (int(labels.max()) + 1 if len(labels) else 0))
        out = np.zeros((len(self.clients), n_classes), dtype=np.int64)
        for cid, c in enumerate(self.clients):
            idx = c.all()
            if len(idx):
                out[cid] = np.bincount(labels[idx], minlength=n_classes)[:n_classes]
        return out

    def assigned(self) -> np.ndarray:
        """All indices held by some client (not the public pool), sorted int64."""
        if not self.clients:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate([c.all() for c in self.clients])).astype(np.int64)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


#: every integer of ``partition.json`` outside the index lists (``meta``: seeds, counts) lies within
#: ``+-MAX_META_INT`` (2**53: exact as a float, as in run configs and profiles)
MAX_META_INT = 2**53
#: sample indices lie in ``0..MAX_INDEX - 1`` (and below the dataset's size when it is known)
MAX_INDEX = 2**62


def _check_meta_ints(value: Any, path: Path, fieldname: str) -> None:
    """Refuse any integer of ``value`` (nested dicts and lists) outside ``+-MAX_META_INT``.

    Raises:
        UserInputError: naming the field and the allowed range."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_meta_ints(v, path, f"{fieldname}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_meta_ints(v, path, f"{fieldname}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool) and not -MAX_META_INT <= value <= MAX_META_INT:
        raise UserInputError(f"is {brief(value)}; allowed: an integer within +-2**53", source=path, field=fieldname)


def _index_array(value: Any, path: Path, fieldname: str, n_samples: int | None) -> np.ndarray:
    """``value`` (a JSON list of sample indices) as a sorted int64 array ``(n,)``.

    Raises:
        UserInputError: not a list of integers, an index below 0 or at/above ``MAX_INDEX`` (checked
            on the Python integers, before any conversion to int64), or at/above ``n_samples``."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UserInputError("must be a list of integer sample indices", source=path, field=fieldname)
    if value and max(value) >= MAX_INDEX:
        raise UserInputError(f"has index {brief(max(value))}; allowed: indices below 2**62", source=path,
                             field=fieldname)
    if value and min(value) < 0:
        raise UserInputError(f"has negative index {brief(min(value))}; allowed: indices >= 0", source=path,
                             field=fieldname)
    arr = np.asarray(value, dtype=np.int64)
    if n_samples is not None and len(arr) and arr.max() >= n_samples:
        raise UserInputError(f"has index {int(arr.max())}, allowed 0..{n_samples - 1} (dataset size {n_samples})",
                             source=path, field=fieldname)
    return np.sort(arr)


def _check_disjoint(part: Partition, path: Path | str | None) -> None:
    held = np.asarray(part.global_test, dtype=np.int64)
    if len(held):
        others = [part.public] + [a for c in part.clients for a in (c.train, c.val, c.test)]
        overlap = int(np.isin(held, np.concatenate(others)).sum())
        if overlap:
            raise UserInputError(f"overlaps the public pool and client splits in {overlap} sample(s); allowed: a "
                                 "global test set held out from every client and from the server's pool",
                                 source=path, field="global_test")
    arrays = [part.public] + [a for c in part.clients for a in (c.train, c.val, c.test)]
    allidx = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    uniq, counts = np.unique(allidx, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[counts > 1][0])
        raise UserInputError(f"index {dup} appears more than once (client splits and the public pool "
                             "must be disjoint)", source=path, field="clients")


def carve_global_test(labels: np.ndarray, per_class: int, seed: int = 0, origin: np.ndarray | None = None,
                      exclude: np.ndarray | None = None) -> np.ndarray:
    """A balanced global test set: ``per_class`` random samples of every class, held out from the
    clients (the global-accuracy protocol of HeteroFL, Diao et al., ICLR 2021, Sec. 4, and
    FedRolex, Alam et al., NeurIPS 2022, Sec. 5: every model scored on one balanced test set).

    Drawn from the source's *test* split (``origin == "test"``: CIFAR's 10,000 test images), so
    the supernet's public pool (train split only) never overlaps it; a source without a test split
    (digits) draws from the samples outside ``exclude`` (the public pool). The draw uses its own
    generator (the seed tree's ``global-test`` leaf of ``seed``, the public seed), so every run seed
    scores on the same images.

    Args:
        labels: int (N,) class labels of the whole dataset.
        per_class: samples per class (>= 0; 0 = no global test set).
        seed: seed of the draw.
        origin: (N,) ``"train"``/``"test"`` per sample, or None.
        exclude: indices that may not be drawn (the public pool).

    Returns:
        sorted int64 (C * per_class,) indices (empty for ``per_class == 0``).

    Raises:
        UserInputError: a class has fewer than ``per_class`` candidate samples (names the class
            and how many it has).
    """
    per_class = _check_int(per_class, "global_test_per_class", 0)
    labels = np.asarray(labels)
    if per_class == 0 or not len(labels):
        return np.zeros(0, dtype=np.int64)
    candidates = np.ones(len(labels), dtype=bool)
    if origin is not None and (np.asarray(origin) == "test").any():
        candidates &= np.asarray(origin) == "test"
    if exclude is not None and len(exclude):
        candidates[np.asarray(exclude, dtype=np.int64)] = False
    rng = seeds.generator("global-test", seed)
    taken = []
    for c in range(int(labels.max()) + 1):
        idx = np.flatnonzero(candidates & (labels == c))
        if len(idx) < per_class:
            raise UserInputError(f"is {per_class}, but class {c} has only {len(idx)} samples to hold out; allowed: "
                                 f"0..{len(idx)}", field="global_test_per_class")
        taken.append(rng.choice(idx, size=per_class, replace=False))
    return np.sort(np.concatenate(taken)).astype(np.int64)


# --------------------------------------------------------------------------------------------
# public pool


def carve_public_pool(labels: np.ndarray, fraction: float, seed: int = 0,
                      origin: np.ndarray | None = None) -> np.ndarray:
    """Stratified server-side public pool: ``round(fraction * n_c)`` random samples of every class c.

    The pool is drawn from the source's *train* split only (``origin == "train"``, where ``n_c``
    counts class c's train samples), so a supernet trained on it never sees the source's test split
    (CIFAR's 10,000 test images stay out of it). Datasets without an official split (digits) have
    every sample ``origin == "train"``, where this is the same as drawing from all samples.

    Args:
        labels: int (N,) class labels of the whole dataset.
        fraction: share of every class (of its train-split samples) that goes to the pool, ``0 <= fraction < 1``.
        seed: the public seed (the seed tree's ``pool`` leaf: independent of the partition seed).
        origin: (N,) str ``"train"``/``"test"`` (:attr:`rafl.data.Dataset.origin`); None = every
            sample may go to the pool.

    Returns:
        sorted int64 (M,) indices, deterministic for ``(labels, fraction, seed)``; empty if fraction is 0.

    Raises:
        UserInputError: fraction outside ``[0, 1)``.
    """
    labels = np.asarray(labels)
    fraction = float(fraction)
    if not (0.0 <= fraction < 1.0) or math.isnan(fraction):
        raise UserInputError(f"is {fraction}, allowed 0 <= fraction < 1", field="public_fraction")
    if fraction == 0.0 or len(labels) == 0:
        return np.zeros(0, dtype=np.int64)
    if origin is not None and len(np.asarray(origin)) != len(labels):
        raise UserInputError(f"has {len(np.asarray(origin))} entries for {len(labels)} labels", field="origin")
    eligible = np.ones(len(labels), dtype=bool) if origin is None else (np.asarray(origin) == "train")
    rng = seeds.generator("pool", seed)
    picked = []
    for c in np.unique(labels):
        idx = np.flatnonzero((labels == c) & eligible)
        n_pub = int(round(fraction * len(idx)))
        picked.append(rng.permutation(idx)[:n_pub])
    return np.sort(np.concatenate(picked)).astype(np.int64)


# --------------------------------------------------------------------------------------------
# per-client train/val/test split


def validate_split(split: Sequence[float]) -> tuple[float, float, float]:
    try:
        vals = tuple(float(s) for s in split)
    except (TypeError, ValueError):
        raise UserInputError(f"is {split!r}, allowed: three numbers train, val, test summing to 1",
                             field="split") from None
    if len(vals) != 3 or any(v < 0 or math.isnan(v) for v in vals) or vals[0] <= 0 or abs(sum(vals) - 1) > 1e-6:
        raise UserInputError(f"is {split!r}, allowed: three fractions train > 0, val >= 0, test >= 0 "
                             "summing to 1 (e.g. 0.8, 0.1, 0.1)", field="split")
    return vals  # type: ignore[return-value]


def _allocate(sizes: np.ndarray, total: int) -> np.ndarray:
    """Split ``total`` draws over strata proportional to ``sizes`` (largest remainder, ties -> larger stratum, then first)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if total <= 0 or sizes.sum() == 0:
        return np.zeros_like(sizes)
    exact = sizes * (total / sizes.sum())
    base = np.minimum(np.floor(exact).astype(np.int64), sizes)
    rest = total - int(base.sum())
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - base[i]), -sizes[i], i))
    for i in order:
        if rest <= 0:
            break
        if base[i] < sizes[i]:
            base[i] += 1
            rest -= 1
    return base


def split_client(indices: np.ndarray, labels: np.ndarray, split: Sequence[float] = (0.8, 0.1, 0.1),
                 rng: np.random.Generator | None = None) -> ClientSplit:
    """Split one client's indices train/val/test, stratified by class.

    Strata: every class with >= 3 samples on the client is one stratum; the classes with fewer
    samples are pooled into one remainder stratum. Targets: ``n_test = round(test * n)`` and
    ``n_val = round(val * n)``, each at least 1 when ``n >= 3`` and its fraction is > 0; they are
    allocated to the strata proportionally (largest remainder), drawn at random within a stratum.

    Args:
        indices: int (n,) the client's sample indices.
        labels: int (N,) labels of the whole dataset.
        split: (train, val, test) fractions summing to 1.
        rng: generator for the within-stratum shuffles (default: the seed tree's ``client-split`` leaf
            of seed 0).

    Returns:
        :class:`ClientSplit` with sorted int64 arrays.

    Raises:
        UserInputError: malformed ``split``.
    """
    fr_train, fr_val, fr_test = validate_split(split)
    rng = rng if rng is not None else seeds.generator("client-split", 0)
    indices = np.sort(np.asarray(indices, dtype=np.int64))
    n = len(indices)
    if n < 3:
        empty = np.zeros(0, dtype=np.int64)
        return ClientSplit(train=indices, val=empty.copy(), test=empty.copy())
    n_test = int(round(fr_test * n))
    n_val = int(round(fr_val * n))
    if fr_test > 0:
        n_test = max(1, n_test)
    if fr_val > 0:
        n_val = max(1, n_val)
    while n_test + n_val > n - 1:  # keep >= 1 training sample
        if n_val >= n_test and n_val > 0:
            n_val -= 1
        else:
            n_test -= 1
    y = np.asarray(labels)[indices]
    classes, counts = np.unique(y, return_counts=True)
    strata = [rng.permutation(indices[y == c]) for c, k in zip(classes, counts) if k >= 3]
    small = [c for c, k in zip(classes, counts) if k < 3]
    if small:
        strata.append(rng.permutation(indices[np.isin(y, small)]))
    sizes = np.array([len(s) for s in strata], dtype=np.int64)
    take_test = _allocate(sizes, n_test)
    take_val = _allocate(sizes - take_test, n_val)
    test, val, train = [], [], []
    for s, kt, kv in zip(strata, take_test, take_val):
        test.append(s[:kt])
        val.append(s[kt:kt + kv])
        train.append(s[kt + kv:])
    cat = lambda parts: np.sort(np.concatenate(parts)).astype(np.int64)  # noqa: E731
    return ClientSplit(train=cat(train), val=cat(val), test=cat(test))


# --------------------------------------------------------------------------------------------
# partitioners (return one index array per client)


def _iid(pool: np.ndarray, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(a) for a in np.array_split(rng.permutation(pool), n_clients)]


def _pathological(pool: np.ndarray, labels: np.ndarray, n_clients: int, k: int, n_classes: int,
                  rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    classes = rng.permutation(n_classes)
    held = [sorted(int(classes[(i * k + j) % n_classes]) for j in range(k)) for i in range(n_clients)]
    holders: dict[int, list[int]] = {c: [] for c in range(n_classes)}
    for cid, cls in enumerate(held):
        for c in cls:
            holders[c].append(cid)
    shares: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    unassigned = 0
    pool_labels = labels[pool]
    for c in range(n_classes):
        idx = rng.permutation(pool[pool_labels == c])
        who = holders[c]
        if not who:
            unassigned += len(idx)
            continue
        if len(idx) < len(who):
            raise UserInputError(
                f"class {c} has {len(idx)} samples but {len(who)} clients must hold it "
                f"(n_clients*k/C = {n_clients}*{k}/{n_classes}); lower --clients or --k",
                field="k")
        for cid, part in zip(who, np.array_split(idx, len(who))):
            shares[cid].append(part)
    out = [np.sort(np.concatenate(s)).astype(np.int64) for s in shares]
    return out, {"classes_per_client": held, "unassigned": unassigned}


def _dirichlet(pool: np.ndarray, labels: np.ndarray, n_clients: int, alpha: float, min_samples: int,
               n_classes: int, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    n = len(pool)
    pool_labels = labels[pool]
    per_class = [pool[pool_labels == c] for c in range(n_classes)]
    best = 0
    for attempt in range(1, MAX_DIRICHLET_TRIES + 1):
        batches: list[list[int]] = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for c in range(n_classes):
            idx = rng.permutation(per_class[c])
            if len(idx) == 0:
                continue
            p = rng.dirichlet(np.full(n_clients, alpha))
            open_ = sizes < n / n_clients
            p = p * open_  # NIID-Bench balancing: full clients get no more
            if p.sum() <= 0:
                # every share fell on full clients (a small alpha puts all of a class on one client):
                # draw the class's shares over the open clients, Dir(alpha) restricted to them (the
                # renormalized sub-vector of a Dirichlet is Dirichlet), never an even spread
                p = np.zeros(n_clients)
                p[open_] = rng.dirichlet(np.full(int(open_.sum()), alpha)) if open_.any() else 0.0
                if p.sum() <= 0:
                    p = np.full(n_clients, 1.0 / n_clients)  # unreachable: some client is below N/n
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for cid, part in enumerate(np.split(idx, cuts)):
                batches[cid].extend(part.tolist())
                sizes[cid] += len(part)
        best = max(best, int(sizes.min()))
        if sizes.min() >= min_samples:
            return [np.sort(np.asarray(b, dtype=np.int64)) for b in batches], {"tries": attempt}
    raise UserInputError(
        f"no Dirichlet(alpha={alpha}) draw gave every one of {n_clients} clients >= {min_samples} samples "
        f"in {MAX_DIRICHLET_TRIES} tries (best smallest client: {best}); raise --alpha, lower "
        "--min-samples or lower --clients", field="min_samples")


def _balanced_dirichlet(pool: np.ndarray, labels: np.ndarray, n_clients: int, alpha: float, n_classes: int,
                        rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Near-equal clients with ``Dir(alpha * C * p)`` label mixtures (the module docstring's
    ``balanced-dirichlet``; Hsu et al. 2019, Sec. 3).

    Args:
        pool: int64 (N,) the indices to partition.
        labels: int (N_total,) labels of the whole dataset.
        n_clients: clients (1..N, checked by the caller).
        alpha: per-class concentration under a uniform prior (> 0).
        n_classes: C.
        rng: the partition's generator (the only source of randomness).

    Returns:
        one sorted int64 index array per client, of ``floor(N/n)`` or ``ceil(N/n)`` samples, pairwise
        disjoint and together exactly ``pool``; ``{"pool_draws": int}``.
    """
    n = len(pool)
    pool_labels = labels[pool]
    per_class = [rng.permutation(pool[pool_labels == c]) for c in range(n_classes)]
    remaining = np.array([len(a) for a in per_class], dtype=np.int64)
    prior = remaining / max(n, 1)
    conc = np.maximum(alpha * n_classes * prior, 0.0)
    present = conc > 0                                    # a class absent from the pool gets no mass
    q = np.zeros((n_clients, n_classes))
    if present.any():
        q[:, present] = rng.dirichlet(conc[present], size=n_clients)
    sizes = np.full(n_clients, n // n_clients, dtype=np.int64)
    sizes[: n % n_clients] += 1
    slots = rng.permutation(np.repeat(np.arange(n_clients), sizes))
    draws = rng.random(n)
    taken = np.zeros(n_classes, dtype=np.int64)           # next position in each class's shuffled pool
    open_mask = remaining > 0

    def cumulative(weights: np.ndarray) -> list[float]:
        return np.cumsum(weights * open_mask).tolist()

    cums = [cumulative(q[j]) for j in range(n_clients)]
    out: list[list[int]] = [[] for _ in range(n_clients)]
    pool_draws = 0
    for j, u in zip(slots.tolist(), draws.tolist()):
        cum = cums[j]
        if cum[-1] > 0:
            c = min(bisect.bisect_right(cum, u * cum[-1]), n_classes - 1)
            while not open_mask[c]:                       # float ties at a closed class's edge
                c -= 1
        else:                                             # none of the client's classes is left
            pool_draws += 1
            left = np.cumsum(remaining).tolist()
            c = min(bisect.bisect_right(left, u * left[-1]), n_classes - 1)
            while remaining[c] == 0:
                c -= 1
        out[j].append(int(per_class[c][taken[c]]))
        taken[c] += 1
        remaining[c] -= 1
        if remaining[c] == 0:                             # class exhausted: renormalize every client over the rest
            open_mask[c] = False
            cums = [cumulative(q[i]) for i in range(n_clients)]
    return [np.sort(np.asarray(o, dtype=np.int64)) for o in out], {"pool_draws": pool_draws}


def _natural(pool: np.ndarray, writers: np.ndarray, n_clients: int | None, min_samples: int,
             rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    pool_writers = np.asarray(writers)[pool]
    ids, inverse = np.unique(pool_writers, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(ids))
    eligible = np.flatnonzero(counts >= min_samples)
    if len(eligible) == 0:
        raise UserInputError(f"no writer has >= {min_samples} samples; lower --min-samples", field="min_samples")
    if n_clients is None:
        n_clients = len(eligible)
    if n_clients > len(eligible):
        raise UserInputError(
            f"is {n_clients}, but only {len(eligible)} writers have >= {min_samples} samples "
            f"(natural partition: one client per writer); allowed 1..{len(eligible)}", field="n_clients")
    chosen = eligible if n_clients == len(eligible) else np.sort(rng.choice(eligible, n_clients, replace=False))
    out = [np.sort(pool[inverse == w]).astype(np.int64) for w in chosen]
    return out, {"writers": [str(ids[w]) for w in chosen], "unassigned": int(len(pool) - sum(len(o) for o in out))}


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng_txt = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UserInputError(f"is {value!r}, allowed: an integer {rng_txt}", field=name)
    return int(value)


def _check_alpha(alpha: Any, scheme: str) -> float:
    """``alpha`` as a finite float > 0.

    Raises:
        UserInputError: missing, not a number, <= 0 or not finite (field ``alpha``)."""
    if alpha is None:
        raise UserInputError(f"is required for --partition {scheme} (concentration > 0)", field="alpha")
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise UserInputError(f"is {alpha!r}, allowed: a number > 0", field="alpha") from None
    if not (alpha > 0) or not math.isfinite(alpha):
        raise UserInputError(f"is {alpha}, allowed: a finite number > 0", field="alpha")
    return alpha


def make_partition(labels: np.ndarray, scheme: str, n_clients: int | None, seed: int, *, k: int | None = None,
                   alpha: float | None = None, min_samples: int = 10, public_fraction: float = 0.0,
                   public_seed: int = 0, writers: np.ndarray | None = None,
                   split: tuple[float, float, float] = (0.8, 0.1, 0.1), dataset: str | None = None,
                   origin: np.ndarray | None = None, global_test_per_class: int = 0) -> Partition:
    """Partition a dataset over ``n_clients`` federated clients (scheme details: module docstring).

    Args:
        labels: int (N,) class labels of the whole dataset.
        scheme: ``"iid"``, ``"pathological"``, ``"dirichlet"``, ``"balanced-dirichlet"``, ``"natural"`` or
            ``"file:PATH"``.
        n_clients: number of clients (>= 1). ``natural`` accepts None = one client per eligible writer.
        seed: the partition's seed (the seed tree's ``partition`` leaf; the split draws from its
            ``client-split`` leaf).
        k: classes per client (``pathological``; 1..C).
        alpha: Dirichlet concentration (``dirichlet``, ``balanced-dirichlet``; > 0; small = more skew).
        min_samples: ``dirichlet``: smallest allowed client (redraws up to
            :data:`MAX_DIRICHLET_TRIES`); ``balanced-dirichlet``: smallest allowed client (clients hold
            ``floor(N/n)`` or more, so ``N >= n * min_samples``); ``natural``: smallest eligible writer.
        public_fraction: share of every class carved FIRST into the server's public pool
            (:func:`carve_public_pool` with ``public_seed``).
        writers: (N,) writer ids, required by ``natural``.
        split: per-client (train, val, test) fractions, default 8:1:1 (:func:`split_client`).
        dataset: dataset name recorded in ``meta``.
        origin: (N,) ``"train"``/``"test"`` of every sample: the public pool is drawn from the train
            split only (:func:`carve_public_pool`); None = from every sample.
        global_test_per_class: samples per class held out SECOND (after the pool) as the balanced
            global test set (:func:`carve_global_test`, seeded by ``public_seed``); 0 = none.

    Returns:
        :class:`Partition`; disjoint client index sets, complete over the non-public indices for
        ``iid``, ``dirichlet`` and ``balanced-dirichlet`` (and ``pathological`` when ``n_clients*k >= C``).

    Raises:
        UserInputError: unknown scheme; n_clients <= 0 or more clients than samples; k missing or
            not in 1..C; alpha missing, <= 0 or not finite; writers missing for ``natural``;
            no Dirichlet draw meeting ``min_samples``; a bad ``file:`` partition.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or (len(labels) and not np.issubdtype(labels.dtype, np.integer)):
        raise UserInputError("must be a 1-D integer array", field="labels")
    n_total = len(labels)
    if not isinstance(scheme, str):
        raise UserInputError(f"is {scheme!r}, allowed: {allowed([*SCHEMES, 'file:PATH'])}", field="partition")
    if scheme.startswith("file:"):
        part = Partition.load(scheme[5:], n_samples=n_total)
        if labels.size and "n_classes" not in part.meta:
            part.meta["n_classes"] = int(labels.max()) + 1
        return part
    if scheme not in SCHEMES:
        raise UserInputError(f"is {scheme!r}, allowed: {allowed([*SCHEMES, 'file:PATH'])}", field="partition")
    seed = _check_int(seed, "seed", 0)
    min_samples = _check_int(min_samples, "min_samples", 1)
    public_seed = _check_int(public_seed, "public_seed", 0)
    split = validate_split(split)
    if n_clients is not None or scheme != "natural":
        n_clients = _check_int(n_clients, "n_clients", 1)
    n_classes = int(labels.max()) + 1 if n_total else 0

    public = carve_public_pool(labels, public_fraction, public_seed, origin)
    global_test = carve_global_test(labels, global_test_per_class, public_seed, origin, exclude=public)
    mask = np.ones(n_total, dtype=bool)
    mask[public] = False
    mask[global_test] = False
    pool = np.flatnonzero(mask).astype(np.int64)

    def pool_too_large(need: int, what: str) -> None:
        """The public pool, not the clients, is what leaves fewer than ``need`` samples: say so, with the
        largest ``public_fraction`` that leaves them (bisection over the same carving, 1e-3 precise)."""
        if not len(public) or n_total - len(carve_global_test(labels, global_test_per_class, public_seed, origin,
                                                               exclude=np.zeros(0, dtype=np.int64))) < need:
            return
        lo, hi = 0.0, float(public_fraction)
        for _ in range(12):
            mid = (lo + hi) / 2
            pub = carve_public_pool(labels, mid, public_seed, origin)
            left = n_total - len(pub) - len(carve_global_test(labels, global_test_per_class, public_seed, origin,
                                                               exclude=pub))
            lo, hi = (mid, hi) if left >= need else (lo, mid)
        raise UserInputError(f"is {public_fraction}: the server's pool takes {len(public)} samples and leaves "
                             f"{len(pool)} to partition, fewer than {what} = {need}; allowed: a fraction in "
                             f"[0, {math.floor(lo * 1000) / 1000}]", field="public_fraction")

    if n_clients is not None and n_clients > len(pool):
        pool_too_large(n_clients, f"one per client ({n_clients} clients)")
        raise UserInputError(f"is {n_clients}, but only {len(pool)} samples are left to partition "
                             f"(after a public pool of {len(public)}); allowed 1..{len(pool)}", field="n_clients")

    part_rng, split_rng = seeds.generator("partition", seed), seeds.generator("client-split", seed)
    params: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if scheme == "iid":
        shares = _iid(pool, n_clients, part_rng)
    elif scheme == "pathological":
        if k is None:
            raise UserInputError("is required for --partition pathological (classes per client)", field="k")
        k = _check_int(k, "k", 1, n_classes)
        params["k"] = k
        shares, extra = _pathological(pool, labels, n_clients, k, n_classes, part_rng)
    elif scheme in ("dirichlet", "balanced-dirichlet"):
        alpha = _check_alpha(alpha, scheme)
        params.update(alpha=alpha, min_samples=min_samples)
        if n_clients * min_samples > len(pool):
            pool_too_large(n_clients * min_samples, f"{n_clients} clients x min_samples {min_samples}")
            raise UserInputError(
                f"{n_clients} clients x {min_samples} samples > {len(pool)} samples to partition; "
                "lower --clients or --min-samples" if scheme == "dirichlet" else
                f"is {min_samples}, but {len(pool)} samples over {n_clients} equal clients give each "
                f"{len(pool) // n_clients}; allowed: 1..{max(len(pool) // n_clients, 1)} (or lower clients.n)",
                field="min_samples")
        shares, extra = (_dirichlet(pool, labels, n_clients, alpha, min_samples, n_classes, part_rng)
                         if scheme == "dirichlet" else
                         _balanced_dirichlet(pool, labels, n_clients, alpha, n_classes, part_rng))
    else:  # natural
        if writers is None:
            raise UserInputError("the natural partition needs writer ids (dataset 'femnist')", field="partition")
        writers = np.asarray(writers)
        if writers.shape != labels.shape:
            raise UserInputError(f"has shape {writers.shape}, needs {labels.shape} like labels", field="writers")
        params["min_samples"] = min_samples
        shares, extra = _natural(pool, writers, n_clients, min_samples, part_rng)
        n_clients = len(shares)

    clients = [split_client(s, labels, split, split_rng) for s in shares]
    meta = {
        "dataset": dataset, "scheme": scheme, "params": params, "seed": seed,
        "n_samples": n_total, "n_classes": n_classes, "n_clients": n_clients,
        "public_fraction": float(public_fraction), "public_seed": public_seed, "split": list(split),
        **({"global_test_per_class": int(global_test_per_class)} if len(global_test) else {}),
        **extra,
    }
    meta.setdefault("unassigned", int(len(pool) - sum(len(s) for s in shares)))
    return Partition(clients=clients, public=public, meta=meta, global_test=global_test)
