"""A run config checked against the algorithm registry: what every command that runs a
federation loads (:func:`load_run_config`).

:func:`rafl.config.read_run_config` validates everything but the ``algorithm`` section, which
holds the method's name and hyperparameters as given; here the name is looked up in the registry
(:func:`rafl.federation.algorithms.get_algorithm`) and the hyperparameters are checked by the
method's own model (:meth:`Algorithm.check_hparams`), with a model group's own learning rate
(:func:`~rafl.federation.algorithms.hparams.with_group_lr`) and no public pool where nothing uses
it (:func:`without_unused_pool`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rafl.config import AlgorithmConfig, ConfigSource, RunConfig, read_run_config
from rafl.errors import UserInputError
from rafl.federation.algorithms import ALGORITHMS, get_algorithm
from rafl.federation.algorithms.hparams import with_group_lr


def method_names() -> dict[str, str]:
    """Every registered method: lower-case name -> the name it is registered under."""
    return {key: cls.name for key, cls in ALGORITHMS.items()}


def resolve_algorithm(cfg: RunConfig, source: ConfigSource = ConfigSource()) -> RunConfig:
    """``cfg`` with its ``algorithm`` section resolved: the registered name and every
    hyperparameter (defaults filled in, checked by the method's model), then
    :func:`without_unused_pool`.

    Raises:
        UserInputError: an unknown algorithm or hyperparameter, a value of the wrong type or out
            of range -- naming the field as written (``source``) and ``--set`` or the file.
    """
    try:
        cls = get_algorithm(cfg.algorithm.name)
        hp = cls.check_hparams(cfg.algorithm.hparams())
    except UserInputError as err:
        raise source.error(err) from None
    hp = with_group_lr(hp, cfg.algorithm.hparams(), cfg.clients.models)  # a model group's own default lr
    cfg.algorithm = AlgorithmConfig(name=cls.name, **hp)
    return without_unused_pool(cfg, [(cls, hp)])


def load_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                    base: str | Path | None = None) -> RunConfig:
    """Defaults <- YAML file ``path`` <- ``--set`` overrides, validated
    (:func:`rafl.config.read_run_config`), with the algorithm name and its hyperparameters checked
    against the registry (:func:`resolve_algorithm`). Relative paths are made absolute: from the
    file against ``base`` (default: the file's folder), from ``--set`` against the current folder.

    Raises:
        UserInputError: unreadable/malformed YAML, an unknown key (anywhere, including algorithm
            hyperparameters), a value out of range, or an unknown algorithm -- naming the file and
            the dotted field and listing the allowed values.
    """
    cfg, source = read_run_config(path, overrides, base=base, methods=method_names())
    return resolve_algorithm(cfg, source)


def without_unused_pool(cfg: RunConfig, methods: Iterable[tuple[Any, dict[str, Any]]],
                        models: str | None = None) -> RunConfig:
    """``cfg`` with ``partition.public_fraction`` 0 when nothing would use the server's public pool:
    a model group (``models``, default ``cfg.clients.models``: no supernet to train, search or
    BN-recalibrate on it), no method that distils on it (``methods``: ``(class,
    hyperparameters)``), and no ``public_fraction`` given. The 30% the default carves would
    otherwise be taken from the clients for nothing."""
    models = cfg.clients.models if models is None else models
    if (models.strip().lower() == "nas" or "public_fraction" in cfg.partition.model_fields_set
            or any(cls.needs_public_pool(hp) for cls, hp in methods)):
        return cfg
    return cfg.model_copy(update={"partition": cfg.partition.model_copy(update={"public_fraction": 0.0})})


__all__ = ["load_run_config", "method_names", "resolve_algorithm", "without_unused_pool"]
