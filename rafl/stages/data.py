"""``rafl data``'s work: load a dataset and partition it over federated clients
(:func:`partition_dataset`), and write ``partition.json`` and the class heat map atomically
(:func:`write_partition`).

The options were checked before this module loads torch (:mod:`rafl.stages.data_checks`, which
the command calls first). Errors name the command's options (``--data-root``, ``--k``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rafl.data import load_dataset, make_partition
from rafl.data.report import plot_class_heatmap
from rafl.errors import UserInputError
from rafl.stages.data_checks import DATA_OUTPUT, OUT_FILES

#: :func:`rafl.data.make_partition`'s argument names -> this command's options, for its errors
PARTITION_OPTIONS = {"k": "--k", "alpha": "--alpha", "min_samples": "--min-samples", "n_clients": "--clients",
                     "public_fraction": "--public-fraction", "split": "--split", "partition": "--partition"}

@dataclass
class Partitioned:
    """A dataset and its partition, as :func:`partition_dataset` made them: the dataset ``ds``,
    its ``labels`` (numpy), the ``partition`` and its clients x classes sample ``counts``."""

    dataset: str
    ds: Any
    labels: Any
    partition: Any
    counts: Any


def partition_dataset(dataset: str, scheme: str, clients: int | None, seed: int, split: tuple[float, float, float],
                      *, data_root: Path | None = None, k: int | None = None, alpha: float = 0.5,
                      min_samples: int = 10, public_fraction: float = 0.0, public_seed: int = 0,
                      resolution: int = 32, limit_per_class: int | None = None,
                      progress: bool = True) -> Partitioned:
    """Load ``dataset`` and partition it (:func:`rafl.data.make_partition`) with options that
    :func:`~rafl.stages.data_checks.check_options` passed; nothing is written.

    Raises:
        UserInputError: bad data (field ``--data-root`` for the data root), or a partition the
            options cannot make (the field names the option).
    """
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
    part = made.partition
    params = ", ".join(f"{k_}={v}" for k_, v in part.meta.get("params", {}).items())
    title = f"{made.dataset}: {part.meta.get('scheme')}{f' ({params})' if params else ''}, {part.n_clients} clients"
    with DATA_OUTPUT.write(out) as tmp:
        part.save(tmp / "partition.json")
        plot_class_heatmap(made.counts, made.ds.classes, tmp / "class_heatmap.png", title=title)
    return [out / name for name in OUT_FILES]


__all__ = ["PARTITION_OPTIONS", "Partitioned", "partition_dataset", "write_partition"]
