"""The settings of a comparison: the run config every method shares and each method's
hyperparameters (``--config``, ``--set``: :func:`load_compare_config`), the client models when none
are given (:func:`default_models`), and each row's non-default settings as the table shows them
(:func:`method_settings`, :func:`with_settings`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from rafl.config import (
    RunConfig,
    blame,
    parse_overrides,
    read_config_file,
    reject_compare_record,
    section_keys_that_apply,
)
from rafl.errors import UserInputError, shown, warn
from rafl.federation.algorithms import ALGORITHMS, get_algorithm
from rafl.federation.algorithms.heterofl import HeteroFL
from rafl.federation.algorithms.hparams import LocalTraining, with_group_lr
from rafl.federation.run_config import load_run_config, without_unused_pool

#: the client models of ``rafl compare`` when neither ``--models`` nor the config's ``clients.models`` is given
DEFAULT_MODELS = "htfe-tiny"


def default_models(algorithms: list[str]) -> tuple[str, str | None]:
    """``(models, note)``: the client models of a comparison whose ``--models`` and
    ``clients.models`` are not given. :data:`DEFAULT_MODELS` (note None), unless a weight-sharing
    method (HeteroFL, FedRolex: every client model a width-slice of one global model) is among
    ``algorithms``: htfe-tiny's four architectures are not slices of one another, so then ``nas``
    (every client a subnet of one supernet, which every method runs on), with a one-line note.

    Raises:
        UserInputError: an unknown method name (field ``--algorithms``).
    """
    try:
        sharing = [a for a in algorithms if issubclass(get_algorithm(a), HeteroFL)]
    except UserInputError as err:
        raise UserInputError(err.message, field="--algorithms") from None
    if not sharing:
        return DEFAULT_MODELS, None
    return "nas", (f"--models: nas (a searched subnet of the supernet per device profile, for every method): "
                   f"{', '.join(sharing)} average(s) width-slices of one model, which the default {DEFAULT_MODELS} "
                   "is not; --models heterofl-cnn4 gives width-sliced CNNs instead")


def load_compare_config(path: str | Path | None, overrides: list[str] | tuple[str, ...],
                        algorithms: list[str], models: str | None = None) -> tuple[RunConfig, dict[str, dict[str, Any]]]:
    """The run config shared by every method plus each method's hyperparameters.

    ``models``: the client models (``--models``), or None for the config's ``clients.models`` if
    it sets one, else :data:`DEFAULT_MODELS`; for a model group a method's ``lr`` that nobody set
    is :data:`rafl.federation.algorithms.hparams.GROUP_LR`.

    The ``algorithm`` section (file or ``--set algorithm.key=value``) holds keys shared by the
    methods (e.g. ``local_epochs``, ``lr``: applied to every method that has them) and optional
    per-method sub-sections (``algorithm: {fedtgp: {server_epochs: 50}}``). Its ``name`` is ignored.

    Raises:
        UserInputError: unreadable YAML, an invalid field, an unknown method, or a hyperparameter
            no method accepts (from ``--set``: no selected method); a file's shared key that only
            unselected methods have is theirs and left out.
    """
    data = read_config_file(path)
    reject_compare_record(data, path)
    source = str(path) if path is not None else "--set"
    algo_section = data.pop("algorithm", None)
    if algo_section is None:
        algo_section = {}
    if not isinstance(algo_section, dict):
        raise UserInputError(f"is {shown(algo_section)}; allowed: a mapping of hyperparameters (shared keys such "
                             "as lr, and per-method sections such as fedtgp: {server_epochs: 50})",
                             source=source, field="algorithm")
    algo_section = dict(algo_section)
    rest: list[str] = []
    parsed = parse_overrides(list(overrides))
    # the --set keys, shared algorithm keys also as every method's own (errors name a method's key)
    set_keys = [k for k, _ in parsed] + [f"algorithm.{a}.{k.split('.', 1)[1]}" for k, _ in parsed
                                         if k.startswith("algorithm.") and k.count(".") == 1 for a in algorithms]
    for key, value in parsed:
        if key.startswith("algorithm."):
            parts = key.split(".")[1:]
            node = algo_section
            for part in parts[:-1]:
                if node.get(part) is None:  # absent, or an empty section in the file (`fedtgp:`)
                    node[part] = {}
                node = node[part]
                if not isinstance(node, dict):
                    raise UserInputError(f"is not a section in {source if path is not None else 'the config'} "
                                         f"(it is {shown(node)}), so --set {key} cannot set a key in it",
                                         source="--set", field=f"algorithm.{part}")
            node[parts[-1]] = value
        else:
            rest.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    if algo_section.pop("name", None) is not None:
        warn("algorithm.name is ignored by compare; the methods come from --algorithms")
    try:
        classes = {a: get_algorithm(a) for a in algorithms}
    except UserInputError as err:
        raise UserInputError(err.message, field="--algorithms") from None
    # per-method sections: any registered method (sections of methods not selected are ignored)
    per_method = {k: algo_section.pop(k) for k in list(algo_section) if k.lower() in ALGORITHMS}
    spellings: dict[str, list[str]] = {}
    for k in per_method:
        spellings.setdefault(get_algorithm(k).name, []).append(k)
    twice = {name: ks for name, ks in spellings.items() if len(ks) > 1}
    if twice:  # `FedTGP:` and `fedtgp:` in one file: which one wins would be a guess
        name, ks = next(iter(twice.items()))
        raise UserInputError(f"has {len(ks)} sections for {name} ({', '.join(ks)}); allowed: one per method",
                             source=source, field="algorithm")
    selected = {cls.name for cls in classes.values()}
    for key, _ in parsed:  # a --set for a method not compared is a slip (a file may hold sections for many)
        parts = key.split(".")
        if parts[0] == "algorithm" and len(parts) > 2 and parts[1].lower() in ALGORITHMS \
                and get_algorithm(parts[1]).name not in selected:
            raise UserInputError(f"sets a hyperparameter of {parts[1]}, which --algorithms does not select "
                                 f"(selected: {', '.join(sorted(selected))})", source="--set", field=key)
    from_set = {k.split(".", 1)[1] for k, _ in parsed if k.startswith("algorithm.") and k.count(".") == 1}
    for key in algo_section:
        # a shared key of the file that only unselected methods have is theirs (the headline config's
        # local_epochs with --algorithms pretrained), like their sections; a typo or a --set is a slip
        known = any(key in get_algorithm(a).defaults for a in ALGORITHMS)
        if not any(key in cls.defaults for cls in classes.values()) and (not known or key in from_set):
            raise UserInputError(f"no selected method accepts {key!r}; allowed: "
                                 f"{sorted(set().union(*(c.defaults for c in classes.values())))}",
                                 source=blame(f"algorithm.{key}", set_keys, source), field=f"algorithm.{key}")
    hps: dict[str, dict[str, Any]] = {}
    given: dict[str, set[str]] = {}
    for a, cls in classes.items():
        hp = {k: v for k, v in algo_section.items() if k in cls.defaults}
        own = next((v for k, v in per_method.items() if k.lower() == cls.name), None) or {}
        if not isinstance(own, dict):
            raise UserInputError("expected a mapping of hyperparameters", source=blame(f"algorithm.{a}", set_keys, source),
                                 field=f"algorithm.{a}")
        hp.update(section_keys_that_apply(a, own, (k for k, _ in parsed)))  # the method's own keys
        given[cls.name] = set(hp)
        try:
            hps[cls.name] = cls.check_hparams(hp)
        except UserInputError as err:
            key = err.field[len("algorithm"):] if err.field and err.field.startswith("algorithm") else ""
            message = err.message
            if key.lstrip(".").split(".")[0] in own or not key:
                field = f"algorithm.{a}{key}"  # the method's own section (or the section as a whole)
            else:  # a shared key, named as the user wrote it; which method refused it, when several
                field = f"algorithm{key}"
                message += f" (for {cls.name})" if len(classes) > 1 else ""
            raise UserInputError(message, source=blame(field, set_keys, source), field=field) from None
    tmp = yaml.safe_dump({**data, "algorithm": {"name": "standalone"}})
    cfg = validate_compare_config(tmp, rest, source, Path(path).parent if path is not None else Path.cwd())
    if models is None:
        models = cfg.clients.models if "models" in cfg.clients.model_fields_set else DEFAULT_MODELS
    hps = {name: with_group_lr(hp, given[name], models) for name, hp in hps.items()}
    return without_unused_pool(cfg, [(get_algorithm(n), hp) for n, hp in hps.items()], models), hps


def validate_compare_config(text: str, overrides: list[str], source: str, base: Path) -> RunConfig:
    """Validate a config text through :func:`rafl.federation.run_config.load_run_config` (its errors name
    ``source``; relative paths in it are taken against ``base``, those of ``--set`` against the
    current folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "run.yaml"
        p.write_text(text)
        try:
            return load_run_config(p, overrides, base=base)
        except UserInputError as err:
            raise UserInputError(err.message, source=source if err.source == str(p) else err.source,
                                 field=err.field) from None


def method_settings(name: str, hp: dict[str, Any], all_hparams: dict[str, dict[str, Any]] | None = None) -> str:
    """The method's hyperparameters that differ from its defaults, ``"key=value, ..."`` (e.g.
    ``"label_prior=local"``, which changes what FedGH's ``acc`` measures), so the table says which
    variant each row is. A local-training key shared by every method (``local_epochs``, ``lr``, ...)
    is left out when all methods of the comparison (``all_hparams``) use the same value: it is then
    the same on every row (e.g. ``--set algorithm.lr=0.01``); a per-method value
    (``--set algorithm.fedgh.lr=0.5``) is shown."""
    others = all_hparams or {name: hp}

    def shared(key: str) -> bool:
        return key in LocalTraining.keys() and len({repr(h[key]) for h in others.values() if key in h}) <= 1

    defaults = get_algorithm(name).defaults
    return ", ".join(f"{k}={v}" for k, v in sorted(hp.items())
                     if k in defaults and defaults[k] != v and not shared(k))


def with_settings(rows: list[dict[str, Any]], hparams: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each one's ``settings`` (the table's "non-default settings",
    :func:`method_settings`) computed from the hyperparameters of all methods in ``hparams``, the
    comparison's final ones: whether a shared key is shown on a row depends on the other methods'
    values, so a row kept by ``--resume`` after another method's value was edited in config.yaml
    gets the column a fresh comparison with that config would write. (Each method's run dir keeps
    the settings it started with, :data:`STARTED_WITH`.)"""
    def settings(r: dict[str, Any]) -> str:
        name = r.get("finetuned_from") or r["algorithm"]  # a fine-tuned row: its base method's settings
        return method_settings(name, hparams[name], hparams)

    return [r | {"settings": settings(r)} for r in rows]
