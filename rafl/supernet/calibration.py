"""The BN-calibration images stored beside a shipped supernet's measurements
(:data:`rafl.supernet.pretrained.CALIBRATION_NAME`): :func:`save_calibration` writes them as uint8
pixels with their normalization, :func:`load_calibration` reads them back as the normalized images
the measurements used.

They are a search's work (torch); the shipped supernets' names, paths and checksums
(:mod:`rafl.supernet.pretrained`) are checked without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors

from rafl.data.datasets import Images
from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes


def save_calibration(path: str | Path, pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """Write BN-calibration images as stored pixels ``(M, C, H, W)`` uint8 (or float32 in [0, 1])
    with their normalization (``mean``, ``std`` per channel) in the metadata; read by
    :func:`load_calibration`. A file already holding the same pixels and normalization is left
    as it is: safetensors writes its metadata in no fixed order, so a rewrite would change the
    bytes (and the SHA-256 a measurements file records) without changing the content."""
    meta = {"format": "rafl-calibration/1", "mean": json.dumps(list(mean)), "std": json.dumps(list(std))}
    try:
        with safe_open(str(path), framework="pt") as fh:
            if fh.metadata() == meta and torch.equal(fh.get_tensor("pixels"), pixels):
                return
    except (OSError, SafetensorError):
        pass  # no file yet, or not a readable one: write it
    atomic_write_bytes(path, save_safetensors({"pixels": pixels.contiguous()}, metadata=meta))


def load_calibration(path: str | Path) -> torch.Tensor:
    """The normalized float32 images ``(M, C, H, W)`` of a :func:`save_calibration` file (normalized
    as :class:`rafl.data.Images` does: bit for bit the images the measurements used).

    Raises:
        UserInputError: a missing or malformed file.
    """
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            pixels = fh.get_tensor("pixels")
        images = Images(pixels, tuple(json.loads(meta["mean"])), tuple(json.loads(meta["std"])))
    except (OSError, KeyError, ValueError, SafetensorError) as err:
        raise UserInputError(f"not a rafl calibration file ({err.__class__.__name__}: {err})", source=path) from None
    return images[...]


__all__ = ["load_calibration", "save_calibration"]
