"""User models by import path: ``package.module:factory``.

Any architecture can join a federation: the factory is imported (never ``eval``-ed), called with
the keyword arguments it accepts among ``n_classes`` and ``feature_dim`` (both if it takes
``**kwargs``), and must return an
``nn.Module`` with ``features(x) -> (B, D)`` and a ``head`` module (``(B, D) -> (B, K)``); the
model is checked on a dummy batch before any run starts. A model without its own ``forward`` gets
``forward(x) = head(features(x))``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import re
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.models.split import check_split_model, features_then_head

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_plugin_spec(text: str) -> bool:
    """True for ``package.module:factory`` strings."""
    return bool(_SPEC.match(text.strip()))


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """Import ``package.module:factory`` and return the callable.

    Raises:
        UserInputError: malformed spec, module not importable, attribute missing or not callable.
    """
    spec = spec.strip()
    if not is_plugin_spec(spec):
        raise UserInputError(f"{spec!r} is not package.module:factory", field="clients.models")
    mod_name, attr = spec.split(":")
    # like `python -m`, the current folder is searched (last, so it never shadows an installed
    # package): the `rafl` console script does not put it on sys.path
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise UserInputError(f"cannot import {mod_name!r} ({err.__class__.__name__}: {err}); the module must be "
                             "installed, on PYTHONPATH or in the current folder", field="clients.models") from None
    except (Exception, SystemExit) as err:  # the user's module fails while importing (SyntaxError, its own
        # errors, sys.exit: which would end rafl silently with the module's status)
        raise UserInputError(f"importing {mod_name!r} raised {err.__class__.__name__}: {err}",
                             field="clients.models") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserInputError(f"{mod_name!r} has no callable {attr!r}", field="clients.models")
    return factory


def _probe(spec: str, what: str, call, arg: torch.Tensor, arg_text: str, shape: tuple[int, int],
           meaning: str) -> torch.Tensor:
    """``call(arg)`` without gradients, checked to be a tensor of ``shape``; the user's exception or
    a wrong result becomes one UserInputError naming ``what`` and the expected shape."""
    try:
        with torch.no_grad():
            value = call(arg)
    except (Exception, SystemExit) as err:  # the user's code: report, do not crash with a traceback
        raise UserInputError(f"{spec}: {what} fails on {arg_text} ({err.__class__.__name__}: {err})",
                             field="clients.models") from None
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserInputError(f"{spec}: {what} gives {got}, expected a tensor of shape {list(shape)} {meaning}",
                             field="clients.models")
    return value


def build_plugin_model(spec: str, n_classes: int, feature_dim: int, in_channels: int = 3,
                       resolution: int = 32) -> nn.Module:
    """Build and check a user model.

    Args:
        spec: ``package.module:factory``.
        n_classes / feature_dim: passed to the factory if its signature accepts them.
        in_channels / resolution: shape of the dummy batch ``(2, C, R, R)`` used for the check.

    Returns:
        the model (train mode).

    Raises:
        UserInputError: the factory fails, returns something that is not an ``nn.Module`` with
            ``features``/``head``, or ``features`` does not give ``(2, D)`` / ``head`` not ``(2, K)``.
    """
    factory = load_factory(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in (("n_classes", n_classes), ("feature_dim", feature_dim)) if takes_any or k in params}
    try:
        model = factory(**kwargs)
    except (Exception, SystemExit) as err:  # the user's code (sys.exit too): report, do not crash or exit
        raise UserInputError(f"{spec} raised {err.__class__.__name__}: {err}", field="clients.models") from None
    if not isinstance(model, nn.Module):
        raise UserInputError(f"{spec} returned {type(model).__name__}, expected an nn.Module", field="clients.models")
    try:
        check_split_model(model)
    except UserInputError as err:  # the field is the option; the plug-in is named in the message
        raise UserInputError(f"{spec}: {err.message}", field="clients.models") from None
    if type(model).forward is nn.Module.forward:
        # bound to this instance; deepcopy rebinds it to the copy (copy's MethodType handler)
        model.forward = types.MethodType(features_then_head, model)
    # eval mode (evaluation, LARs, prototypes) and train mode (local training: a model may return
    # auxiliary outputs or other shapes there, as torchvision's GoogLeNet does); train mode on a
    # copy with the random state restored, so its BN statistics and dropout leave no trace
    _check_mode(spec, model, "", n_classes, feature_dim, in_channels, resolution)
    with torch.random.fork_rng(devices=[]):
        _check_mode(spec, copy.deepcopy(model).train(), " in train mode", n_classes, feature_dim, in_channels,
                    resolution)
    return model


def _check_mode(spec: str, model: nn.Module, mode: str, n_classes: int, feature_dim: int, in_channels: int,
                resolution: int) -> None:
    """``features`` -> (2, D), ``head`` -> (2, K) and ``forward`` -> (2, K) on a zero batch, with
    the model in eval mode (``mode == ""``, restored after) or as given (train mode)."""
    was = model.training
    if not mode:
        model.eval()
    batch = (2, in_channels, resolution, resolution)
    try:
        # features() first, its shape checked before head sees it: a (B, C, H, W) map from a conv
        # trunk without pooling is then named as such, not as head's matmul error
        feats = _probe(spec, f"features(){mode}", model.features, torch.zeros(batch), f"a {batch} batch",
                       (2, feature_dim), "(the group's common width D)")
        _probe(spec, f"head{mode}", model.head, feats, f"features of shape {list(feats.shape)}", (2, n_classes),
               "(logits)")
        _probe(spec, f"forward{mode}", model, torch.zeros(batch), f"a {batch} batch", (2, n_classes),
               "(the logits, i.e. head(features(x)); auxiliary outputs must be off)")
    finally:
        model.train(was)


__all__ = ["is_plugin_spec", "load_factory", "build_plugin_model"]
