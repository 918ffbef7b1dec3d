"""Shipped supernet training recipes (``rafl supernet train --preset NAME``), one YAML of
:class:`~rafl.supernet.train.TrainConfig` fields each."""

from __future__ import annotations

from pathlib import Path

from rafl.errors import UserInputError, allowed

PRESET_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    """The shipped preset names (file stems), sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``.

    Raises:
        UserInputError: an unknown name, listing the shipped ones.
    """
    path = PRESET_DIR / f"{name}.yaml"
    if name not in preset_names():
        raise UserInputError(f"is {name!r}, allowed: {allowed(preset_names())}", field="--preset")
    return path


__all__ = ["preset_names", "preset_path", "PRESET_DIR"]
