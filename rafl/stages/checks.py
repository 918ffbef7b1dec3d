"""The stages' checks that need no torch: what the commands answer before torch loads.

Importing torch takes seconds; a typo should not. The commands (``rafl.cli``) call these first,
and the work modules (:mod:`rafl.stages.prepare`, :mod:`rafl.stages.rundir`, ...) call the same
functions again where they run without the command line (the Flower App, ``rafl compare``'s
methods), so each rule is written once. This module imports no torch, directly or through what it
imports, and keeps its imports at the top (``lint-imports``' contract "check modules import no
torch", ``pyproject.toml``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import yaml

from rafl.config import ConfigSource, RunConfig, client_profiles, is_compare_record, read_run_config
from rafl.data.sources import DATASETS, check_data_root
from rafl.errors import UserInputError
from rafl.federation.catalog import check_hyperparameter_names, method_names
from rafl.federation.run_files import CHECKPOINT
from rafl.folders import OnceKind, RunKind
from rafl.io import load_yaml, read_text_file
from rafl.search.profile import DeviceProfile, list_profiles

#: the file a run dir is recognised by
CONFIG = "config.yaml"

#: a ``rafl federate`` run dir as an output folder (:class:`rafl.folders.RunFolder`): ``config.yaml``
#: is written first, ``checkpoint.safetensors`` once a round completed; a new run under the name of a
#: run killed before its first checkpoint takes its folder over
FEDERATE_RUN = RunKind(
    started=lambda p: (p / CONFIG).is_file(),
    completed=lambda p: (p / CHECKPOINT).is_file(),
    foreign="already exists and is not a rafl federate run dir (choose another name or --out)",
    taken="already exists (choose another name or --out, or --resume it)")

#: ``rafl search``'s output folder (:class:`rafl.folders.OnceKind`): ``search.json`` (the index),
#: ``pareto.png`` and one folder per profile (with its ``result.json``), each written once and
#: replaced by a later search of that profile; the other profiles' folders are kept
SEARCH_OUTPUT = OnceKind("`rafl search`", owns=lambda p: p.name in ("search.json", "pareto.png")
                         or (p / "result.json").is_file())


def is_compare_folder(path: str | Path) -> bool:
    """Whether ``path`` holds the ``config.yaml`` that ``rafl compare`` writes
    (:func:`rafl.config.is_compare_record`), not a run dir's."""
    cfg_file = Path(path) / CONFIG
    try:
        return is_compare_record(load_yaml(read_text_file(cfg_file), cfg_file))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, UserInputError):
        return False  # not readable as a compare config: the caller's checks say what it is


def check_resume_dir(path: str | Path, field: str = "--resume") -> Path:
    """``path`` is a ``rafl federate`` run dir that completed a round (what
    :meth:`rafl.stages.rundir.RunDir.resume` opens), by its files alone.

    Raises:
        UserInputError: ``path`` does not exist, is not a run dir, is a ``rafl compare`` folder
            (naming the command that continues it), or never completed a round.
    """
    path = Path(path)
    if is_compare_folder(path):
        raise UserInputError("is a rafl compare folder, not a rafl federate run dir; continue it with: rafl "
                             f"compare --resume {shlex.quote(str(path))}", source=path, field=field)
    if (path / CONFIG).is_file() and not (path / CHECKPOINT).is_file():
        raise UserInputError("never completed a round (no checkpoint.safetensors), so there is nothing to "
                             "resume: run the command again under the same name (the folder is reused)",
                             source=path, field=field)
    if not (path / CONFIG).is_file():
        raise UserInputError("does not exist" if not path.exists() else
                             "is not a rafl federate run dir (no config.yaml)", source=path, field=field)
    return path


def check_data(cfg: RunConfig, field: str = "data.root") -> None:
    """The run's dataset can be found: ``data.root`` (or the default data root) exists and holds
    one of the dataset's layouts (:func:`rafl.data.sources.check_data_root`, by file names; the
    files themselves are checked when read). ``field``: what the error names (``--data-root``
    when the command line gave it).

    Raises:
        UserInputError: no such data root, or one holding none of the dataset's layouts.
    """
    if cfg.data.dataset == "digits":
        return
    try:
        check_data_root(cfg.data.dataset, cfg.data.root)
    except UserInputError as err:
        raise UserInputError(err.message, source=err.source, field=field) from None


def check_supernet_data(dataset: str | None, data_root: Path | None) -> None:
    """``rafl supernet train --dataset NAME``'s data root (``--data-root``, else
    ``$RAFL_DATA_ROOT``, as :meth:`rafl.supernet.train.TrainConfig.from_options` takes it) exists
    and holds one of the dataset's layouts (:func:`rafl.data.sources.check_data_root`). Nothing is
    checked for digits, an unknown name or no root at all (the training config refuses those).

    Raises:
        UserInputError: no such data root, or one holding none of the dataset's layouts (field
            ``--data-root``).
    """
    root = data_root if data_root is not None else os.environ.get("RAFL_DATA_ROOT") or None
    if dataset is None or dataset == "digits" or dataset not in DATASETS or root is None:
        return
    try:  # named as the run records it: absolute, against the current folder
        check_data_root(dataset, Path(root).expanduser().resolve())
    except UserInputError as err:
        raise UserInputError(err.message, source=err.source, field="--data-root") from None


def check_nas_config(cfg: RunConfig, profiles: Sequence[DeviceProfile] | None = None) -> list[DeviceProfile]:
    """The settings of a run on a supernet's subnets (``clients.models: nas``) that contradict
    each other, checked without data or model: the quickstart supernet (``supernet.path`` null)
    is for digits only; ``clients.budgets`` / ``clients.archs`` name profiles a client uses (or
    shipped ones); the search needs the server's public pool (``partition.public_fraction`` > 0,
    unless a saved partition brings its own). ``profiles``: :func:`rafl.config.client_profiles`
    of ``cfg`` if already read.

    Returns:
        The device profiles of ``clients.profiles``.

    Raises:
        UserInputError: naming the field at fault.
    """
    if cfg.supernet.path is None and cfg.data.dataset != "digits":
        raise UserInputError("the quickstart supernet is for digits; give supernet.path for "
                             f"{cfg.data.dataset!r}", field="supernet.path")
    profiles = client_profiles(cfg) if profiles is None else list(profiles)
    # budgets or archs for shipped profiles this run does not use are fine (the defaults name pi4
    # and jetson-nano); any other name is a typo
    known = set(cfg.clients.profiles) | {pr.name for pr in profiles} | set(list_profiles())
    for key, named in (("clients.budgets", cfg.clients.budgets), ("clients.archs", cfg.clients.archs)):
        if set(named) - known:
            raise UserInputError(f"names profile(s) {sorted(set(named) - known)} that no client uses; "
                                 f"clients.profiles is {cfg.clients.profiles}", field=key)
    p = cfg.partition
    if p.public_fraction == 0 and not p.scheme.startswith("file:"):
        raise UserInputError("the search and BN recalibration need the server's public pool; set "
                             "partition.public_fraction > 0", field="partition.public_fraction")
    return profiles


def precheck_run(config_path: str | Path | None, overrides: Sequence[str], *, data_root_given: bool = False,
                 data: bool = True) -> tuple[RunConfig, ConfigSource]:
    """Everything of a new ``rafl federate`` run that can be checked before torch loads: the file,
    every ``--set``, every key and value but the method's hyperparameters, the fields that
    contradict each other (:func:`rafl.config.check_cross_fields`), the method's name and its
    hyperparameters' names (:func:`rafl.federation.catalog.check_hyperparameter_names`; their values
    need the method's model), the device profiles, and, unless ``data`` is False
    (``--show-config`` prints a config without running it), the data root (:func:`check_data`;
    named ``--data-root`` when ``data_root_given``) and then the settings of a supernet run
    (:func:`check_nas_config`).

    Returns:
        ``(config, source)`` as :func:`rafl.config.read_run_config` gives them.

    Raises:
        UserInputError: the first check that fails, naming the file or ``--set`` and the field.
    """
    cfg, source = read_run_config(config_path, list(overrides), methods=method_names())
    try:
        check_hyperparameter_names(cfg.algorithm.name, cfg.algorithm.hparams())
    except UserInputError as err:
        raise source.error(err) from None
    if data:  # the data before the supernet, as a run reads them
        check_data(cfg, "--data-root" if data_root_given else "data.root")
    if cfg.clients.models.strip() == "nas" and data:
        check_nas_config(cfg)
    elif cfg.clients.models.strip() == "nas":
        client_profiles(cfg)
    return cfg, source


__all__ = ["CONFIG", "FEDERATE_RUN", "SEARCH_OUTPUT", "check_data", "check_nas_config", "check_supernet_data",
           "check_resume_dir", "is_compare_folder", "precheck_run"]
