"""Pretrained supernets shipped with rafl, loaded by name and offline.

``rafl search --supernet cifar10``, ``supernet: cifar10`` (or ``supernet.path: cifar10``) in a run
config and ``rafl supernet info cifar10`` name a supernet shipped in the package
(``rafl/pretrained/<name>/``: ``supernet.safetensors``, ``supernet.json``, and beside them the
recipe's resolved ``config.json``, its ``metrics.json`` and a README with the exact command and
seed). A registered name always means the shipped supernet; a local folder of the same name is
given as a path (``./cifar10``).

Weights are stored as float16 (BN running statistics stay float32) and loaded into the float32
supernet; the SHA-256 of each weights file is recorded here, in the code, so an altered or
truncated file is refused even when its ``supernet.json`` was edited to match.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the shipped-name checks run before torch loads
    import torch

from rafl.errors import UserInputError, allowed

PRETRAINED_DIR = Path(__file__).resolve().parents[1] / "pretrained"

#: the file of a shipped supernet's measured subnets (arch -> server-val accuracy), beside its weights
MEASUREMENTS_NAME = "measurements.json"

#: the BN-calibration images of those measurements (stored uint8 pixels), beside them
#: (:mod:`rafl.supernet.calibration` writes and reads them)
CALIBRATION_NAME = "calibration.safetensors"

#: name -> SHA-256 of its ``supernet.safetensors`` (the shipped bytes).
PRETRAINED: dict[str, str] = {
    "cifar10": "db62210efb8f2f202f369738d99277abf2747727ef2f6a881396ff824465bcec",
    "cifar10-proxy5k": "cca0529f534b955e4e44ab48a4611920fb382d481229c8a4086ceab4dd1330df",
}

#: name -> SHA-256 of its ``measurements.json`` (made by ``bench/predictor_table.py``; it records
#: the SHA-256 of the weights it was measured on and of its ``calibration.safetensors``).
PRETRAINED_MEASUREMENTS: dict[str, str] = {
    "cifar10": "dc77c67b4bc36b5456ef3f835d1caa440626277feef90542ee53c6a62d06f773",
    "cifar10-proxy5k": "c43bc7c9eb1bee26e2099ed3bb3fbfe1a40d61bbed4ccdc0e29b9243a648aeed",
}


def is_pretrained_name(value: object) -> bool:
    """Whether ``value`` names a shipped supernet (a registered name, not a path)."""
    return isinstance(value, str) and value in PRETRAINED


def pretrained_path(name: str) -> Path:
    """The folder of shipped supernet ``name``, after checking its weights' SHA-256.

    Raises:
        UserInputError: an unknown name (listing the shipped ones), a missing folder or weights
            file (a broken install), or weights whose checksum is not the registered one.
    """
    if name not in PRETRAINED:
        raise UserInputError(f"is {name!r}, allowed: {allowed(sorted(PRETRAINED))}, or a supernet folder",
                             field="supernet")
    folder = PRETRAINED_DIR / name
    weights = folder / "supernet.safetensors"
    if not weights.is_file() or not (folder / "supernet.json").is_file():
        raise UserInputError(f"the shipped supernet {name!r} is missing from the installed package (expected "
                             "supernet.safetensors and supernet.json there); reinstall rafl", source=folder,
                             field="supernet")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != PRETRAINED[name]:
        raise UserInputError(f"the shipped supernet {name!r} has been altered or truncated (SHA-256 {digest[:12]}..., "
                             f"expected {PRETRAINED[name][:12]}...); reinstall rafl", source=weights, field="supernet")
    return folder


def resolve_supernet(value: str | Path) -> Path:
    """A supernet reference as a path: a shipped name -> its checked folder; anything else as given."""
    return pretrained_path(value) if is_pretrained_name(value) else Path(value)


def supernet_measurements(folder: str | Path) -> dict | None:
    """The measured subnets beside a supernet's weights (``measurements.json``, written by
    ``bench/predictor_table.py``), checked; None when the folder has none.

    Returns the parsed document: ``accuracy`` (canonical arch string -> top-1 fraction on the
    supernet's server-val split after BN recalibration), ``predictor_samples`` (``n``, ``seed``,
    ``archs`` in :func:`rafl.search.estimators.sample_across_space` order), ``measurement``
    (``batch_size``, ``calib_batches``), ``data``, ``predictor_fit``, ``noise_ceiling``, and
    ``calibration_path``: the checked calibration images beside it.

    Raises:
        UserInputError: a shipped supernet's file whose SHA-256 is not the registered one, a file
            measured on other weights (``supernet_sha256``), a calibration file that is missing or
            altered, or a malformed file.
    """
    folder = Path(folder)
    path = folder / MEASUREMENTS_NAME
    if not path.is_file():
        return None
    raw = path.read_bytes()
    shipped = [n for n in PRETRAINED if (PRETRAINED_DIR / n).resolve() == folder.resolve()]
    if shipped and hashlib.sha256(raw).hexdigest() != PRETRAINED_MEASUREMENTS.get(shipped[0]):
        raise UserInputError(f"the shipped measurements of {shipped[0]!r} have been altered (SHA-256 not the "
                             "registered one); reinstall rafl, or measure again with --remeasure", source=path)
    regen = "; make it again with bench/predictor_table.py, or measure with --remeasure"
    try:
        doc = json.loads(raw)
        acc = {str(k): float(v) for k, v in doc["accuracy"].items()}
        want_weights, cal = doc["supernet_sha256"], doc["calibration"]
        doc["predictor_samples"]["n"], doc["predictor_samples"]["seed"]  # noqa: B018 - required keys
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserInputError(f"not a rafl measurements file ({err.__class__.__name__}: {err}){regen}",
                             source=path) from None
    weights = folder / "supernet.safetensors"
    if weights.is_file() and hashlib.sha256(weights.read_bytes()).hexdigest() != want_weights:
        raise UserInputError(f"was measured on other weights than {weights.name} beside it{regen}", source=path)
    cal_path = folder / str(cal.get("file", CALIBRATION_NAME))
    if not cal_path.is_file() or hashlib.sha256(cal_path.read_bytes()).hexdigest() != cal.get("sha256"):
        raise UserInputError(f"is missing or not the one {MEASUREMENTS_NAME} was made with{regen}", source=cal_path)
    doc["accuracy"] = acc
    doc["calibration_path"] = str(cal_path)
    return doc


def measured_alike(table: dict, batch_size: int, calib_batches: int) -> bool:
    """Whether a measurements document (:func:`supernet_measurements`) was measured as a search
    with this ``batch_size`` (images per forward pass) and ``calib_batches`` (BN recalibration
    batches) measures: only then are its accuracies that search's own."""
    return table.get("measurement") == {"batch_size": batch_size, "calib_batches": calib_batches}


def half_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with floating-point weights as float16 and BatchNorm running statistics (and
    integer buffers) unchanged: the storage form of shipped supernets."""
    keep = ("running_mean", "running_var", "num_batches_tracked")
    return {k: (v.half() if v.is_floating_point() and not k.endswith(keep) else v) for k, v in state.items()}


__all__ = ["CALIBRATION_NAME", "MEASUREMENTS_NAME", "PRETRAINED", "PRETRAINED_DIR", "PRETRAINED_MEASUREMENTS",
           "half_state", "is_pretrained_name", "measured_alike", "pretrained_path", "resolve_supernet",
           "supernet_measurements"]
