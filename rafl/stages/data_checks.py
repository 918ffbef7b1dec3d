"""``rafl data``'s checks: every option, before any data or disk is touched and before torch loads
(:func:`check_options`), and its output folder (:data:`DATA_OUTPUT`).

The command calls :func:`check_options` first and imports the work module (:mod:`rafl.stages.data`:
the dataset, its partition and the atomic write) only once it passed, so bad input answers at
once. This module imports no torch, directly or through what it imports (``lint-imports``' contract
"check modules import no torch"). Errors name the command's options (``--clients``, ``--out``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path

from rafl.data.partition import SCHEMES
from rafl.data.sources import DATASETS, EXPECTED, default_data_root
from rafl.errors import UserInputError, allowed
from rafl.folders import OnceKind

#: the files an output folder receives
OUT_FILES = ("partition.json", "class_heatmap.png")

#: ``rafl data``'s output folder, written once (:class:`rafl.folders.OnceKind`): a new or empty
#: folder, or an earlier output (:data:`OUT_FILES`), which is replaced
DATA_OUTPUT = OnceKind("`rafl data`", owns=lambda p: p.name in OUT_FILES)

#: the options that shape a new partition (their parameter names -> flags): a saved one
#: (``--partition file:PATH``) is used as saved, so giving one of them is refused
SHAPING_OPTIONS = {"clients": "--clients", "k": "--k", "alpha": "--alpha", "min_samples": "--min-samples",
                   "public_fraction": "--public-fraction", "public_seed": "--public-seed", "split_text": "--split",
                   "seed": "--seed"}

#: clients of a partition when --clients is not given (but for the natural one: one per writer)
DEFAULT_CLIENTS = 20


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
        if not default_data_root().exists():
            raise UserInputError(f"is required for {dataset} (or set $RAFL_DATA_ROOT; {default_data_root()} "
                                 f"does not exist); expected there: {EXPECTED[dataset]}", field="--data-root")
    if scheme == "natural" and dataset != "femnist":
        raise UserInputError(f"natural needs writer ids; allowed with --dataset femnist, not {dataset}",
                             field="--partition")
    DATA_OUTPUT.check(out)
    return clients, split


__all__ = ["DATA_OUTPUT", "DEFAULT_CLIENTS", "OUT_FILES", "SHAPING_OPTIONS", "check_options", "parse_split"]
