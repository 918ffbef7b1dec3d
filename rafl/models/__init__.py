"""Client models that are not supernet subnets: classic heterogeneous groups and user plug-ins.

``clients.models`` (``rafl compare --models``) takes ``nas`` (the resource-aware subnets, handled by
the federation pipeline), a
group name (``htfe4``, ``htfe8``, ``htfe-tiny``) or a comma-separated list whose items are model
names (:data:`rafl.models.zoo.BACKBONES`), groups, or ``package.module:factory`` plug-ins.
Clients get the listed models round-robin.
"""

from __future__ import annotations

from difflib import get_close_matches

from torch import nn

from rafl.errors import UserInputError
from rafl.models.plugin import build_plugin_model, is_plugin_spec, load_factory
from rafl.models.sliced import GROUPS as SLICED_GROUPS
from rafl.models.sliced import SlicedNet, parse_sliced
from rafl.models.zoo import BACKBONES, DEFAULT_FEATURE_DIM, GROUPS, KNOWLEDGE_MODEL, HeteroModel, SmallCNN, build_model


def resolve_models(spec: str) -> list[str]:
    """``"htfe4"`` / ``"cnn4,resnet18"`` / ``"pkg.mod:fn,cnn4"`` -> the ordered list of members.

    Raises:
        UserInputError: an empty spec or list item, ``nas`` mixed with others, a malformed plug-in spec or
            an unknown name (with the nearest known one, if any).
    """
    raw = [s.strip() for s in str(spec).split(",")]
    items = [s for s in raw if s]
    if not items and len(raw) == 1:
        raise UserInputError("is empty; allowed: nas, a group (" + ", ".join(GROUPS) + "), model names or "
                             "package.module:factory", field="clients.models")
    if len(items) != len(raw):
        # "cnn4,,cnn3-small" or a trailing comma: most likely a name was lost while editing
        raise UserInputError(f"item {raw.index('') + 1} of {spec!r} is empty; give a model name between "
                             "every two commas", field="clients.models")
    if "nas" in items and len(items) > 1:
        raise UserInputError("nas cannot be mixed with other models", field="clients.models")
    known = ["nas", *GROUPS, *SLICED_GROUPS, *sorted(BACKBONES)]
    out: list[str] = []
    for it in items:
        if it == "nas":
            out.append(it)
        elif it in GROUPS:
            out.extend(GROUPS[it])
        elif it in SLICED_GROUPS:  # width-sliced families (HeteroFL's rates)
            out.extend(SLICED_GROUPS[it])
        elif it in BACKBONES or is_plugin_spec(it) or parse_sliced(it) is not None:
            out.append(it)
        elif ":" in it:
            raise UserInputError(f"{it!r} is not package.module:factory (a plug-in names its module and the "
                                 "factory in it, e.g. mypkg.models:make_model)", field="clients.models")
        else:
            # names are exact (case-sensitive); point at the one meant ("CNN4", "resnet-18")
            near = get_close_matches(it.lower(), known, n=1, cutoff=0.75)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise UserInputError(f"unknown model {it!r}; {hint}allowed: nas, a group "
                                 f"({', '.join([*GROUPS, *SLICED_GROUPS])}), a width-sliced <base>@<rate> (cnn4@0.5, "
                                 f"resnet18@0.25), one of {', '.join(sorted(BACKBONES))}, or package.module:factory",
                                 field="clients.models")
    return out


def make_member(name: str, n_classes: int, feature_dim: int = DEFAULT_FEATURE_DIM, in_channels: int = 3,
                resolution: int = 32) -> nn.Module:
    """A fresh model for one member name of :func:`resolve_models` (zoo model or plug-in)."""
    if is_plugin_spec(name):
        return build_plugin_model(name, n_classes, feature_dim, in_channels, resolution)
    sliced = parse_sliced(name)
    if sliced is not None:
        return SlicedNet(sliced[0], sliced[1], n_classes, feature_dim)
    return build_model(name, n_classes, feature_dim)


__all__ = ["HeteroModel", "SmallCNN", "SlicedNet", "BACKBONES", "GROUPS", "KNOWLEDGE_MODEL", "DEFAULT_FEATURE_DIM",
           "build_model", "build_plugin_model", "load_factory", "is_plugin_spec", "resolve_models", "make_member"]
