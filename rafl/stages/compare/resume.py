"""What ``rafl compare --resume`` checks: the settings each method's run started with
(:data:`STARTED_WITH`), a method's run dir as an output folder (:data:`METHOD_RUN`), the rows
already in ``compare.json``, and the comparison's own ``config.yaml`` read back
(:func:`load_compare_resume`, :func:`recorded_finetune`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from rafl.config import RunConfig, read_config_file
from rafl.errors import UserInputError, shown
from rafl.federation.algorithms import get_algorithm
from rafl.federation.engine import CHECKPOINT
from rafl.folders import COMPARISON_RECORD, Comparison, RunKind
from rafl.models import resolve_models
from rafl.models.plugin import is_plugin_spec, load_factory
from rafl.stages.compare.config import validate_compare_config

#: a method's run dir keeps the settings it was started with (compared on ``--resume``)
STARTED_WITH = "compare_started_with.json"

#: a method's run dir in a comparison, as an output folder (:class:`rafl.folders.RunFolder`):
#: ``clients.json`` and :data:`STARTED_WITH` first, ``checkpoint.safetensors`` once a round completed;
#: a new run of the method takes over an attempt that never completed a round
METHOD_RUN = RunKind(
    started=lambda p: any((p / f).is_file() for f in ("clients.json", STARTED_WITH, CHECKPOINT)),
    completed=lambda p: (p / CHECKPOINT).is_file(),
    foreign="already exists and is not a method's run dir of rafl compare; remove it to rerun the method",
    taken="already holds a method's run that completed a round; rafl compare --resume continues it")


def previous_rows(out: Path) -> dict[str, dict[str, Any]]:
    """The rows of ``out/compare.json`` by method ({} when there is none yet).

    Raises:
        UserInputError: the file exists but is not a compare table.
    """
    path = out / "compare.json"
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())["rows"]
        if not all(isinstance(r, dict) and isinstance(r["algorithm"], str) for r in rows):
            raise TypeError
        return {r["algorithm"]: r for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserInputError(f"is not a rafl compare table ({err.__class__.__name__}); delete it to rerun every "
                             "method that has no checkpoint", source=path) from None


def check_started_with(run_dir: Path, started: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """Refuse to resume a method whose run was started with other settings (an edited config.yaml);
    ``started`` is JSON-normalized like the file. A hyperparameter the method gained after the run
    started (absent from the file) counts as unchanged when it is at its default in ``defaults``:
    a new option's default keeps the behaviour the run started with."""
    path = run_dir / STARTED_WITH
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        raise UserInputError("is missing or unreadable, so the run cannot be checked against config.yaml; remove "
                             f"{run_dir} to rerun the method", source=path) from None
    old_hp, new_hp = before.get("hparams"), started.get("hparams")
    if defaults and isinstance(old_hp, dict) and isinstance(new_hp, dict):
        at_default = json.loads(json.dumps(defaults, default=str))
        before["hparams"] = {**{k: v for k, v in new_hp.items()
                                if k not in old_hp and k in at_default and at_default[k] == v}, **old_hp}
    changed = sorted(k for k in set(before) | set(started) if before.get(k) != started.get(k))
    if changed:
        raise UserInputError(f"config.yaml differs from the settings this method's run started with in {changed}; "
                             "restore them, or remove the method's run dir to rerun it", source=run_dir)


def recorded_finetune(out: str | Path) -> bool:
    """Whether the comparison in ``out`` makes the fine-tuned rows: its ``config.yaml``'s ``finetune``
    (``rafl compare --no-finetune`` records false), true in a record written before it held the key.

    Raises:
        UserInputError: ``finetune`` is not true or false.
    """
    path = Path(out) / COMPARISON_RECORD
    value = read_config_file(path).get("finetune", True)
    if not isinstance(value, bool):
        raise UserInputError(f"is {shown(value)}; allowed: true or false", source=path, field="finetune")
    return value


def load_compare_resume(out: str | Path) -> tuple[RunConfig, dict[str, dict[str, Any]], str, int]:
    """``(cfg, hparams, models, feature_dim)`` of the comparison in ``out`` (its ``config.yaml``).

    Raises:
        UserInputError: ``out`` holds no ``config.yaml`` written by ``rafl compare``, or it no longer
            validates (e.g. an unknown method).
    """
    out = Path(out)
    Comparison.check_resume(out)
    path = out / COMPARISON_RECORD
    data = read_config_file(path)
    if not isinstance(data.get("algorithms"), dict) or "models" not in data:
        raise UserInputError("is not a rafl compare config (no algorithms / models)", source=path, field="--resume")
    algorithms = data.pop("algorithms")
    models = str(data.pop("models"))
    try:
        for member in resolve_models(models):  # plug-ins are imported now, so a failure names config.yaml
            if is_plugin_spec(member):
                load_factory(member)
    except UserInputError as err:
        raise UserInputError(err.message, source=path, field="models") from None
    feature_dim = data.pop("feature_dim", 128)
    if isinstance(feature_dim, bool) or not isinstance(feature_dim, int) or feature_dim < 1:
        raise UserInputError(f"is {shown(feature_dim)}; allowed: an integer >= 1", source=path, field="feature_dim")
    data.pop("algorithm", None)
    data.pop("finetune", None)  # recorded_finetune's
    hps = {}
    for name, hp in algorithms.items():
        try:
            hps[name] = get_algorithm(name).check_hparams(dict(hp or {}))
        except UserInputError as err:
            key = err.field.removeprefix("algorithm.") if err.field else ""
            raise UserInputError(err.message, source=path,
                                 field=f"algorithms.{name}" + (f".{key}" if key else "")) from None
    # rafl writes this record's paths absolute (rafl.config.absolute_paths); in a record written
    # before it did, a relative path meant the current folder
    cfg = validate_compare_config(yaml.safe_dump({**data, "algorithm": {"name": "standalone"}}), [], str(path), Path.cwd())
    return cfg, hps, models, feature_dim
