"""Client models that are not supernet subnets: classic heterogeneous groups and user plug-ins.

``clients.models`` (``rafl compare --models``) takes ``nas`` (the resource-aware subnets, handled by
the federation pipeline), a
group name (``htfe4``, ``htfe8``, ``htfe-tiny``) or a comma-separated list whose items are model
names (:data:`rafl.models.zoo.BACKBONES`), groups, or ``package.module:factory`` plug-ins.
Clients get the listed models round-robin.
"""

from __future__ import annotations

from torch import nn

from rafl.errors import UserInputError
from rafl.models.plugin import build_plugin_model, is_plugin_spec, load_factory
from rafl.models.zoo import (BACKBONES, DEFAULT_FEATURE_DIM, GROUPS, KNOWLEDGE_MODEL, HeteroModel, SmallCNN,
                             build_model)


def resolve_models(spec: str) -> list[str]:
    """``"htfe4"`` / ``"cnn4,resnet18"`` / ``"pkg.mod:fn,cnn4"`` -> the ordered list of members.

    Raises:
        UserInputError: an empty spec, ``nas`` mixed with others, or an unknown name.
    """
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not items:
        raise UserInputError("is empty; allowed: nas, a group (" + ", ".join(GROUPS) + "), model names or "
                             "package.module:factory", field="clients.models")
    if "nas" in items and len(items) > 1:
        raise UserInputError("nas cannot be mixed with other models", field="clients.models")
    out: list[str] = []
    for it in items:
        if it == "nas":
            out.append(it)
        elif it in GROUPS:
            out.extend(GROUPS[it])
        elif it in BACKBONES or is_plugin_spec(it):
            out.append(it)
        else:
            raise UserInputError(f"unknown model {it!r}; allowed: nas, a group ({', '.join(GROUPS)}), "
                                 f"one of {', '.join(sorted(BACKBONES))}, or package.module:factory",
                                 field="clients.models")
    return out


def make_member(name: str, n_classes: int, feature_dim: int = DEFAULT_FEATURE_DIM, in_channels: int = 3,
                resolution: int = 32) -> nn.Module:
    """A fresh model for one member name of :func:`resolve_models` (zoo model or plug-in)."""
    if is_plugin_spec(name):
        return build_plugin_model(name, n_classes, feature_dim, in_channels, resolution)
    return build_model(name, n_classes, feature_dim)


__all__ = ["HeteroModel", "SmallCNN", "BACKBONES", "GROUPS", "KNOWLEDGE_MODEL", "DEFAULT_FEATURE_DIM", "build_model",
           "build_plugin_model", "load_factory", "is_plugin_spec", "resolve_models", "make_member"]
