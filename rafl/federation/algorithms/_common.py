"""Helpers shared by the method modules (not an algorithm; not auto-registered)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.federation.algorithms.base import ClientContext
from rafl.federation.algorithms.hparams import LocalTraining
from rafl.federation.metric_keys import ModelKeys
from rafl.federation.training import make_optimizer

#: Local-training hyperparameters every method accepts, with their defaults (:class:`LocalTraining`).
LOCAL_DEFAULTS: dict[str, Any] = LocalTraining.defaults()



def build(client: ClientContext, weights: Mapping[str, torch.Tensor] | None = None, arch: Any = None) -> nn.Module:
    """A fresh model from the client's factory (own model, or subnet ``arch``) with ``weights``
    loaded (strict) when given, on ``client.device``, in train mode.

    Raises:
        UserInputError: ``weights`` (a stored client state, e.g. of a resumed run) do not fit the
            model the factory builds now (a user's model changed between the run and its resume);
            the engine adds the client and model.
    """
    model = client.make_model() if arch is None else client.make_model(arch)
    if weights is not None:
        try:
            model.load_state_dict(dict(weights), strict=True)
        except RuntimeError as err:  # missing / unexpected keys, size mismatches
            detail = " ".join(str(err).split())
            raise UserInputError(f"its stored state does not fit the model built now ({detail[:300]}); allowed: "
                                 "the model the run was started with (a changed model starts a new run)") from None
    return model.to(client.device).train()


def optimizer_for(model: nn.Module, hp: Mapping[str, Any], lr: float | None = None) -> torch.optim.Optimizer:
    """The local optimizer from the hyperparameters (a new one every round: FL methods here keep
    no optimizer state across rounds, as in FedAvg's Alg. 1)."""
    return make_optimizer(model, hp["optimizer"], lr=hp["lr"] if lr is None else lr,
                          momentum=hp["momentum"], weight_decay=hp["weight_decay"])


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` detached, cloned, on CPU (safe to store and send)."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}


def divergence_keys(hp: Mapping[str, Any], defaults: Mapping[str, Any], weight: str) -> tuple[str, str | None]:
    """What a diverged local loss with a regularizer of weight ``hp[weight]`` blames: the weight when
    the user raised it and kept the learning rate, else the learning rate; the other key is named
    too (:func:`rafl.federation.training.check_finite_loss`)."""
    raised = float(hp[weight]) > float(defaults[weight]) and float(hp["lr"]) <= float(defaults["lr"])
    return (f"algorithm.{weight}", "algorithm.lr") if raised else ("algorithm.lr", f"algorithm.{weight}")


def eval_counts(name: str, correct: int, total: int) -> dict[str, float]:
    """The evaluation contract's counts of model ``name`` (an :class:`Accuracy`'s prefix)."""
    m = ModelKeys(name)
    return {m.correct: float(correct), m.total: float(total)}
