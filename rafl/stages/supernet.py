"""``rafl supernet``: train a supernet into a run folder (:func:`train`, new or ``--resume``) and
describe a trained one (:func:`describe`).

:func:`train` resolves the run's :class:`~rafl.supernet.train.TrainConfig` from a preset or a
config file, the options given (only those not None) and, with ``resume``, the run folder's own
``config.json``; it checks the run folder before anything is written and calls
:func:`rafl.supernet.train.train_supernet`. Errors name the command's options (``--out``,
``--resume``, ...). This is a work module (it imports torch): what ``rafl supernet train``
answers before torch loads (a new run's data root) is :func:`rafl.stages.checks.check_supernet_data`,
which the command calls before it imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rafl.errors import UserInputError
from rafl.folders import RunFolder
from rafl.io import load_yaml
from rafl.search.cost import check_training_memory
from rafl.supernet.arch import SearchSpace
from rafl.supernet.checkpoint import load_meta, load_supernet
from rafl.supernet.presets import preset_path
from rafl.supernet.pretrained import is_pretrained_name, pretrained_path
from rafl.supernet.quickstart import supernet_path
from rafl.supernet.train import (
    CONFIG_NAME,
    MAX_RESOLUTION,
    SUPERNET_RUN,
    TrainConfig,
    holds_supernet_run,
    train_supernet,
)


@dataclass
class SupernetInfo:
    """A trained supernet as :func:`describe` found it: ``path`` (its folder or ``supernet.json``),
    its search ``space`` and ``meta`` (``supernet.json``'s content: feature width, size, metrics)."""

    path: Path
    space: Any
    meta: dict[str, Any]


def parse_resolutions(text: str | None, option: str = "--resolutions") -> tuple[int, ...] | None:
    """``text`` (comma-separated pixels like ``16,20,24``) as a tuple; None stays None.

    Raises:
        UserInputError: (field ``option``) an empty item, a non-integer, or a value outside
            4..:data:`rafl.supernet.train.MAX_RESOLUTION`.
    """
    if text is None:
        return None

    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(","))  # an empty item ("12,,14") is an error
    except ValueError:
        values = ()
    if not values or any(not 4 <= v <= MAX_RESOLUTION for v in values):
        raise UserInputError(f"is {text!r}, allowed: comma-separated integers in 4..{MAX_RESOLUTION} like 16,20,24",
                             field=option)
    return values


def train(out: Path | None, *, dataset: str | None = None, data_root: Path | None = None,
          epochs_per_phase: int | None = None, device: str | None = None, seed: int | None = None,
          width_mult: float | None = None, resolutions: tuple[int, ...] | None = None, batch_size: int | None = None,
          limit_per_class: int | None = None, config_file: Path | None = None, preset: str | None = None,
          resume: Path | None = None, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Train a supernet by progressive shrinking into the run folder ``out`` (or continue the run
    in ``resume``); the options (None: not given) override ``preset`` or ``config_file``, whose
    paths are recorded absolute. Under torchrun only rank 0 writes (and cleans up).

    Returns:
        ``(run folder, metrics)`` (:func:`rafl.supernet.train.train_supernet`'s metrics).

    Raises:
        UserInputError: ``resume`` with ``config_file`` or ``preset``, ``preset`` with
            ``config_file``, an unknown preset, a missing or malformed config file, a ``resume``
            folder that is not a supernet run (or ``out`` another folder, or options that differ
            from its saved config but ``device``), no ``out``, an ``out`` that
            :data:`~rafl.supernet.train.SUPERNET_RUN` refuses for a new run (a file, a non-empty
            folder not holding a supernet run, or one holding a run: ``--resume`` it), what
            :meth:`~rafl.supernet.train.TrainConfig.from_options` refuses, or what
            :func:`~rafl.supernet.train.train_supernet` refuses (a new run that diverged is
            removed first: its checkpoints cannot be resumed with another learning rate).
    """
    # paths are recorded absolute (config.json), so --resume works from any folder: --data-root
    # against the current folder, a config file's data_root against the file's folder
    options = {"dataset": dataset, "data_root": None if data_root is None else str(data_root.expanduser().resolve()),
               "epochs_per_phase": epochs_per_phase, "device": device, "seed": seed, "width_mult": width_mult,
               "resolutions": resolutions, "batch_size": batch_size, "limit_per_class": limit_per_class}
    given = {k: v for k, v in options.items() if v is not None}
    if resume is not None and config_file is not None:
        raise UserInputError("cannot be combined with --resume (the run folder's config.json is used)",
                             field="--config")
    if preset is not None:
        if resume is not None:
            raise UserInputError("cannot be combined with --resume (the run folder's config.json is used)",
                                 field="--preset")
        if config_file is not None:
            raise UserInputError("cannot be combined with --config (a preset is a config file: copy it from "
                                 f"{preset_path(preset)} and edit it)", field="--preset")
        config_file = preset_path(preset)
    base: dict = {}
    source: Path | None = None
    if config_file is not None:
        if not config_file.is_file():
            raise UserInputError("no such file", source=config_file, field="--config")
        try:
            base = load_yaml(config_file.read_text(), config_file) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            raise UserInputError("not valid YAML/JSON", source=config_file, field="--config") from None
        if not isinstance(base, dict):
            raise UserInputError("expected a mapping of TrainConfig fields", source=config_file, field="--config")
        if isinstance(base.get("data_root"), str) and base["data_root"]:
            base["data_root"] = str((config_file.parent / Path(base["data_root"]).expanduser()).resolve())
        source = config_file
    if resume is not None:
        if not resume.exists():
            raise UserInputError("does not exist", source=resume, field="--resume")
        if out is not None and out.resolve() != resume.resolve():
            raise UserInputError(f"is {out}, but --resume continues the run in {resume}; omit --out",
                                 field="--out")
        out = resume
        saved = resume / CONFIG_NAME
        if not saved.is_file():
            raise UserInputError(f"has no {CONFIG_NAME}: not a `rafl supernet train` run folder",
                                 source=resume, field="--resume")
        if not holds_supernet_run(resume):  # another tool's config.json: --resume would start a run there
            raise UserInputError(f"its {CONFIG_NAME} was not written by `rafl supernet train` (no ks_choices, "
                                 "epochs_full, ...): not a supernet run folder", source=saved, field="--resume")
        try:
            base = json.loads(saved.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserInputError("not valid JSON (truncated or corrupted?)", source=saved, field="--resume") from None
        source = saved
        per_phase = given.pop("epochs_per_phase", None)
        if per_phase is not None:
            given.update({f"epochs_{p}": per_phase for p in ("full", "kernel", "depth", "expand")})
        changed = [k for k, v in given.items() if k != "device" and base.get(k) != (list(v) if isinstance(v, tuple) else v)]
        if changed:
            raise UserInputError(f"option(s) {changed} differ from the saved run's config; --resume continues "
                                 "with the saved config (only --device may change)", source=saved, field="--resume")
    if out is None:
        raise UserInputError("is required (the run folder to write)", field="--out")
    if resume is None:
        RunFolder.check_new(out, SUPERNET_RUN, "--out")
    config = TrainConfig.from_options(source=source, **{**base, **given})
    # a new run that fails before its first epoch completed, or diverges, leaves nothing (train_supernet)
    _, metrics = train_supernet(config, out, resume=resume is not None, progress=progress,
                                check_memory=check_training_memory)
    return out, metrics


def describe(path: str | Path, field: str | None = None) -> SupernetInfo:
    """The trained supernet at ``path``: a ``rafl supernet train`` run folder (or its
    ``supernet.json``), ``quickstart`` (the cached quickstart supernet) or a shipped name
    (``cifar10``); its weights are verified (checksum, every tensor's shape, finite values).
    ``field`` names ``path`` in the error of a quickstart supernet that cannot be made.

    Raises:
        UserInputError: an unknown or altered shipped supernet, a path without a
            ``supernet.json`` written by ``rafl supernet train``, or weights that fail the checks.
    """
    if is_pretrained_name(str(path)):
        path = pretrained_path(str(path))
    path = supernet_path(path, field)  # `quickstart`: the cached quickstart supernet's folder
    meta = load_meta(path)
    if not isinstance(meta, dict) or "search_space" not in meta:
        raise UserInputError("is not a supernet.json written by `rafl supernet train`", source=path)
    space = SearchSpace.from_dict(meta["search_space"], source=path)
    folder = path if path.is_dir() else path.parent
    load_supernet(folder)  # verifies the weights (checksum, every tensor's shape, finite values)
    return SupernetInfo(path=path, space=space, meta=meta)


__all__ = ["SupernetInfo", "describe", "parse_resolutions", "train"]
