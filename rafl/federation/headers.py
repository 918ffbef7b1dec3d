"""The split of a client model into a feature extractor and a header (classifier).

Every HtFL method here relies on the split-model interface of :mod:`rafl.models.split`:
``features(x) -> (B, D)`` (the representation, same width D for every client) and ``head: (B, D)
-> (B, K)`` (FedGH's "header", LG-FedAvg's global layers). These helpers check that interface
(:func:`~rafl.models.split.check_split_model`) and move header weights in and out of models with
clear errors instead of shape crashes mid-round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.models.split import check_split_model


def head_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The header's ``state_dict`` (detached CPU clones)."""
    return {k: v.detach().to("cpu").clone() for k, v in model.head.state_dict().items()}


def head_spec(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of the header's state."""
    return {k: tuple(v.shape) for k, v in model.head.state_dict().items()}


def load_head(model: nn.Module, state: Mapping[str, torch.Tensor], who: str = "client") -> nn.Module:
    """Replace ``model``'s header weights by ``state`` (FedGH: the global header replaces the local
    one; LG-FedAvg: the averaged global layers).

    Raises:
        UserInputError: the keys or shapes differ from the model's header.
    """
    own = head_spec(model)
    got = {k: tuple(v.shape) for k, v in state.items()}
    if own != got:
        raise UserInputError(f"global header {got} does not fit this model's header {own}", field=who)
    model.head.load_state_dict(dict(state), strict=True)
    return model


def feature_dim(model: nn.Module) -> int:
    """D: ``model.feature_dim`` if present, else the ``in_features`` of the header's first Linear.

    Raises:
        UserInputError: neither is available.
    """
    d = getattr(model, "feature_dim", None)
    if isinstance(d, int) and d > 0:
        return d
    for m in model.head.modules():
        if isinstance(m, nn.Linear):
            return int(m.in_features)
    raise UserInputError(f"cannot tell the representation width D of {type(model).__name__}; set a "
                         "feature_dim attribute", field="model.feature_dim")


def common_header(make_model: Callable[..., nn.Module], clients: list, method: str) -> nn.Module:
    """One client model per distinct architecture, checked for the split interface and identical
    header shapes (a global header must fit every client). Returns the model of client 0.

    Args:
        make_model: the server's factory (``make_model(client_id=i)`` = client i's model).
        clients: the population's ``ClientInfo`` list.
        method: the algorithm name (for the message).

    Raises:
        UserInputError: a model without ``features``/``head``, or two clients whose headers
            differ in shape (naming both clients and shapes) -- before round 1, never mid-round.
    """
    ref_model = None
    ref_spec = None
    ref_id = None
    seen: set[str] = set()
    for info in clients:
        if info.model_key in seen:
            continue
        seen.add(info.model_key)
        model = make_model(client_id=info.client_id)
        check_split_model(model, f"client {info.client_id} model")
        spec = head_spec(model)
        if ref_spec is None:
            ref_model, ref_spec, ref_id = model, spec, info.client_id
        elif spec != ref_spec:
            raise UserInputError(
                f"{method} shares one header, but client {ref_id}'s header has shapes {ref_spec} and client "
                f"{info.client_id}'s {spec}; allowed: models whose features() have the same width D and "
                "whose heads are identical (e.g. Linear(D, n_classes))", field="clients.models")
    if ref_model is None:
        raise UserInputError("needs at least one client", field="clients")
    return ref_model


__all__ = ["check_split_model", "head_state", "head_spec", "load_head", "feature_dim", "common_header"]
