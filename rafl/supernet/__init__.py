"""The once-for-all MobileNet-V3 supernet: search space, supernet, subnet extraction, training.

Public API (torch-heavy names are imported lazily, so ``from rafl.supernet import ArchConfig`` is
cheap)::

    SearchSpace, ArchConfig                     # rafl.supernet.arch
    Supernet, Subnet, build_supernet, extract_subnet, narrow_width, subnet_from_arch,
    recalibrate_bn
                                                # rafl.supernet.model
    save_supernet, load_supernet                # rafl.supernet.checkpoint
    TrainConfig, train_supernet                 # rafl.supernet.train
    quickstart_supernet                         # rafl.supernet.quickstart
"""

from __future__ import annotations

import importlib
from typing import Any

from rafl.supernet.arch import ArchConfig, SearchSpace, make_divisible

_LAZY = {
    "Supernet": "rafl.supernet.model",
    "Subnet": "rafl.supernet.model",
    "build_supernet": "rafl.supernet.model",
    "extract_subnet": "rafl.supernet.model",
    "narrow_width": "rafl.supernet.model",
    "subnet_from_arch": "rafl.supernet.model",
    "recalibrate_bn": "rafl.supernet.model",
    "save_supernet": "rafl.supernet.checkpoint",
    "load_supernet": "rafl.supernet.checkpoint",
    "TrainConfig": "rafl.supernet.train",
    "train_supernet": "rafl.supernet.train",
    "quickstart_supernet": "rafl.supernet.quickstart",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rafl.supernet' has no attribute {name!r}")


__all__ = ["ArchConfig", "SearchSpace", "make_divisible", *_LAZY]
