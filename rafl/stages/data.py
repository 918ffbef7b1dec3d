"""``rafl data``: check the options (:func:`check_options`), load a dataset and partition it
over federated clients (:func:`partition_dataset`), and write ``partition.json`` and the class
heat map atomically (:func:`write_partition`).

Every option is checked before any data or disk is touched, and before torch loads (so bad
input answers at once): the dataset and partition modules are imported inside the functions.
Errors name the command's options (``--clients``, ``--out``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rafl.errors import UserInputError, allowed
from rafl.folders import OnceKind

#: the files an output folder receives
OUT_FILES = ("partition.json", "class_heatmap.png")

#: ``rafl data``'s output folder, written once (:class:`rafl.folders.OnceKind`): a new or empty
#: folder, or an earlier output (:data:`OUT_FILES`), which is replaced
DATA_OUTPUT = OnceKind("`rafl data`", owns=lambda p: p.name in OUT_FILES)

#: :func:`rafl.data.make_partition`'s argument names -> this command's options, for its errors
PARTITION_OPTIONS = {"k": "--k", "alpha": "--alpha", "min_samples": "--min-samples", "n_clients": "--clients",
                     "public_fraction": "--public-fraction", "split": "--split", "partition": "--partition"}

#: the options that shape a new partition (their parameter names -> flags): a saved one
#: (``--partition file:PATH``) is used as saved, so giving one of them is refused
SHAPING_OPTIONS = {"clients": "--clients", "k": "--k", "alpha": "--alpha", "min_samples": "--min-samples",
                   "public_fraction": "--public-fraction", "public_seed": "--public-seed", "split_text": "--split",
                   "seed": "--seed"}

#: clients of a partition when --clients is not given (but for the natural one: one per writer)
DEFAULT_CLIENTS = 20


@dataclass
class Partitioned:
    """A dataset and its partition, as :func:`partition_dataset` made them: the dataset ``ds``,
    its ``labels`` (numpy), the ``partition`` and its clients x classes sample ``counts``."""

    dataset: str
    ds: Any
    labels: Any
    partition: Any
    counts: Any


def parse_split(text: str) -> tuple[float, float, float]:
    """``text`` (``8:1:1`` or ``0.8,0.1,0.1``) as train/val/test fractions summing to 1.

    Raises:
        UserInputError: (field ``--split``) not three non-negative numbers with train > 0.
    """
    try:
        vals = tuple(float(v) for v in text.replace(":", ",").split(","))
    except ValueError:
        vals = ()
    if len(vals) != 3 or any(v < 0 or math.isnan(v) for v in vals) or vals[0] <= 0 or sum(vals) <= 0:
        raise UserInputError(f"is {text!r}, allowed: three non-negative numbers train:val:test with train > 0, "
                             "like 8:1:1 or 0.8,0.1,0.1",
                             field="--split")
    total = sum(vals)
    return tuple(v / total for v in vals)  # type: ignore[return-value]


def check_options(dataset: str, scheme: str, *, data_root: Path | None = None, clients: int | None = None,
                  k: int | None = None, alpha: float = 0.5, min_samples: int = 10, public_fraction: float = 0.0,
                  public_seed: int = 0, split_text: str = "8:1:1", seed: int = 0, out: Path = Path("runs/data"),
                  given: Collection[str] = ()) -> tuple[int | None, tuple[float, float, float]]:
    """Check every option before any data or disk is touched (and before torch loads).

    ``given`` names the parameters set explicitly (keys of :data:`SHAPING_OPTIONS`): with a saved
    partition (``scheme`` ``file:PATH``) each of them is refused.

    Returns:
        ``(clients, split)``: the number of clients (:data:`DEFAULT_CLIENTS` when None, but for
        the natural partition) and the train/val/test fractions (:func:`parse_split`).

    Raises:
        UserInputError: an unknown dataset or scheme, a missing partition file, an option that
            shapes a partition given with a saved one, a bad option value, a non-digits dataset
            without a data root, a natural partition of a dataset without writers, or an ``out``
            that :data:`DATA_OUTPUT` refuses (a file, or a folder holding other files).
    """
    from rafl.data import DATASETS, SCHEMES

    if dataset not in DATASETS:
        raise UserInputError(f"is {dataset!r}, allowed: {allowed(DATASETS)}", field="--dataset")
    if not (scheme in SCHEMES or scheme.startswith("file:")):
        raise UserInputError(f"is {scheme!r}, allowed: {allowed([*SCHEMES, 'file:PATH'])}", field="--partition")
    if scheme.startswith("file:") and not Path(scheme[5:]).is_file():
        raise UserInputError("partition file not found", source=scheme[5:], field="--partition")
    if scheme.startswith("file:"):  # a saved split is used as saved: an option that would shape one is a slip
        shaping = [flag for param, flag in SHAPING_OPTIONS.items() if param in given]
        if shaping:
            raise UserInputError(f"is only used to make a partition; --partition {scheme} is used as saved (its "
                                 "clients, pool and splits)", field=shaping[0])
    if clients is None and scheme != "natural":
        clients = DEFAULT_CLIENTS
    if clients is not None and clients <= 0:
        raise UserInputError(f"is {clients}, allowed: an integer >= 1", field="--clients")
    if k is not None and scheme != "pathological":
        raise UserInputError(f"is only used with --partition pathological (got --partition {scheme})", field="--k")
    if scheme == "pathological":
        if k is None:
            raise UserInputError("is required with --partition pathological (classes per client, 1..C)", field="--k")
        if k <= 0:
            raise UserInputError(f"is {k}, allowed: an integer 1..C (number of classes)", field="--k")
    if scheme in ("dirichlet", "balanced-dirichlet") and not (alpha > 0 and math.isfinite(alpha)):
        raise UserInputError(f"is {alpha}, allowed: a finite number > 0", field="--alpha")
    if min_samples < 1:
        raise UserInputError(f"is {min_samples}, allowed: an integer >= 1", field="--min-samples")
    if not 0.0 <= public_fraction < 1.0:
        raise UserInputError(f"is {public_fraction}, allowed: 0 <= fraction < 1", field="--public-fraction")
    if seed < 0 or public_seed < 0:
        raise UserInputError("seeds must be integers >= 0", field="--seed")
    split = parse_split(split_text)
    if dataset != "digits" and data_root is None:
        from rafl.data.sources import EXPECTED, default_data_root

        if not default_data_root().exists():
            raise UserInputError(f"is required for {dataset} (or set $RAFL_DATA_ROOT; {default_data_root()} "
                                 f"does not exist); expected there: {EXPECTED[dataset]}", field="--data-root")
    if scheme == "natural" and dataset != "femnist":
        raise UserInputError(f"natural needs writer ids; allowed with --dataset femnist, not {dataset}",
                             field="--partition")
    DATA_OUTPUT.check(out)
    return clients, split


def partition_dataset(dataset: str, scheme: str, clients: int | None, seed: int, split: tuple[float, float, float],
                      *, data_root: Path | None = None, k: int | None = None, alpha: float = 0.5,
                      min_samples: int = 10, public_fraction: float = 0.0, public_seed: int = 0,
                      resolution: int = 32, limit_per_class: int | None = None,
                      progress: bool = True) -> Partitioned:
    """Load ``dataset`` and partition it (:func:`rafl.data.make_partition`) with options that
    :func:`check_options` passed; nothing is written.

    Raises:
        UserInputError: bad data (field ``--data-root`` for the data root), or a partition the
            options cannot make (the field names the option).
    """
    from rafl.data import load_dataset, make_partition

    try:
        ds = load_dataset(dataset, data_root, resolution=resolution, limit_per_class=limit_per_class,
                          progress=progress)
    except UserInputError as err:  # the library's argument name -> the option
        if err.field != "data_root":
            raise
        raise UserInputError(err.message, source=err.source, field="--data-root") from None
    labels = ds.labels.numpy()
    try:
        part = make_partition(labels, scheme, clients, seed, k=k, alpha=alpha, min_samples=min_samples,
                              public_fraction=public_fraction, public_seed=public_seed, writers=ds.writers,
                              split=split, dataset=dataset, origin=ds.origin)
    except UserInputError as err:  # the library names its arguments (k, min_samples): say the options
        if err.source is not None or err.field not in PARTITION_OPTIONS:
            raise
        raise UserInputError(err.message, field=PARTITION_OPTIONS[err.field]) from None
    if limit_per_class is not None:
        part.meta["limit_per_class"] = limit_per_class
    counts = part.class_counts(labels, ds.num_classes)
    return Partitioned(dataset=dataset, ds=ds, labels=labels, partition=part, counts=counts)


def write_partition(out: Path, made: Partitioned) -> list[Path]:
    """Write ``out``/:data:`OUT_FILES` atomically (:meth:`DATA_OUTPUT.write <rafl.folders.OnceKind.write>`):
    everything lands under ``out`` at once (a previous ``rafl data`` output is replaced), or nothing
    does. Returns the files' paths.

    Raises:
        UserInputError: ``out`` holds other files by now (:data:`DATA_OUTPUT`)."""
    from rafl.data.report import plot_class_heatmap

    part = made.partition
    params = ", ".join(f"{k_}={v}" for k_, v in part.meta.get("params", {}).items())
    title = f"{made.dataset}: {part.meta.get('scheme')}{f' ({params})' if params else ''}, {part.n_clients} clients"
    with DATA_OUTPUT.write(out) as tmp:
        part.save(tmp / "partition.json")
        plot_class_heatmap(made.counts, made.ds.classes, tmp / "class_heatmap.png", title=title)
    return [out / name for name in OUT_FILES]


__all__ = ["DATA_OUTPUT", "DEFAULT_CLIENTS", "OUT_FILES", "PARTITION_OPTIONS", "SHAPING_OPTIONS", "Partitioned",
           "check_options", "parse_split", "partition_dataset", "write_partition"]
