"""The split-model interface every client model follows: ``features(x) -> (B, D)`` (the
representation, the same width D for every client of a federation) and a ``head`` module
``(B, D) -> (B, K)`` (the classifier: FedGH's "header", LG-FedAvg's global layers).

rafl's supernet subnets (:class:`rafl.supernet.Subnet`), the model-group members
(:mod:`rafl.models.zoo`, :mod:`rafl.models.sliced`) and the plug-ins (:mod:`rafl.models.plugin`)
implement it; :mod:`rafl.federation.headers` moves header weights between such models.
"""

from __future__ import annotations

import torch
from torch import nn

from rafl.errors import UserInputError


def check_split_model(model: nn.Module, who: str = "client model") -> None:
    """Raise UserInputError unless ``model`` has a callable ``features`` and an ``nn.Module`` ``head``."""
    if not callable(getattr(model, "features", None)) or not isinstance(getattr(model, "head", None), nn.Module):
        raise UserInputError(f"{type(model).__name__} lacks features(x) -> (B, D) and/or a head module; "
                             "allowed: a model with both (rafl Subnet, rafl.models, or a plug-in factory's model)",
                             field=who)


def features_then_head(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``head(features(x))``: ``x`` (B, C, H, W) -> logits (B, K); the ``forward`` a plug-in model
    without its own gets."""
    return self.head(self.features(x))


__all__ = ["check_split_model", "features_then_head"]
