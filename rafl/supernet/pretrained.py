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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the shipped-name checks run before torch loads
    import torch

from rafl.errors import UserInputError, allowed

PRETRAINED_DIR = Path(__file__).resolve().parents[1] / "pretrained"

#: name -> SHA-256 of its ``supernet.safetensors`` (the shipped bytes).
PRETRAINED: dict[str, str] = {
    "cifar10": "47c364b3e2aefd679e4bf4d39704be1eafc014791c22bb235c5434b22932d5f7",
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


def half_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with floating-point weights as float16 and BatchNorm running statistics (and
    integer buffers) unchanged: the storage form of shipped supernets."""
    keep = ("running_mean", "running_var", "num_batches_tracked")
    return {k: (v.half() if v.is_floating_point() and not k.endswith(keep) else v) for k, v in state.items()}


__all__ = ["PRETRAINED", "PRETRAINED_DIR", "is_pretrained_name", "pretrained_path", "resolve_supernet",
           "half_state"]
