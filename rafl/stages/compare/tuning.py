"""Hyperparameter tuning before a comparison (``rafl compare --tune``): each method's grid of
trials, the same budget for every tuned method (:func:`parse_grid`), and the trials run on the
clients' validation splits, the best per method picked (:func:`run_tuning`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml

from rafl.config import RunConfig
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.metric_keys import MODEL
from rafl.folders import COMPARISON_RECORD, TUNE_DIR, TUNE_RECORD, Comparison
from rafl.io import atomic_write_json
from rafl.reports.compare import read_history
from rafl.stages.compare.methods import run_compare


def parse_grid(specs: list[str] | tuple[str, ...], hparams: dict[str, dict[str, Any]]
               ) -> dict[str, list[dict[str, Any]]]:
    """The tuning trials of every method from ``--tune KEY=V1,V2,...`` specs.

    ``KEY`` is a hyperparameter shared by several methods (``lr``: every method that has it) or one
    method's own (``fedgh.server_lr``). A method's trials are the product of the grids that apply to
    it, each value checked by the method's hyperparameter model. Every tuned method gets the same
    number of trials (the same budget); a method that has none of the keys (``pretrained``) is
    not tuned.

    Returns:
        ``{method: [hyperparameters of trial 0, trial 1, ...]}`` for the tuned methods.

    Raises:
        UserInputError: a spec without ``=`` or with no value, a key no method has, a value out of
            a method's range, or methods whose grids differ in size (naming the counts).
    """
    grids: list[tuple[str | None, str, list[Any]]] = []
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip().removeprefix("algorithm.")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not key or not items:
            raise UserInputError(f"is {spec!r}; allowed: KEY=V1,V2,... with at least one value, e.g. lr=0.01,0.03,0.1",
                                 field="--tune")
        method, _, name = key.rpartition(".")
        if method and get_algorithm(method).name not in hparams:
            raise UserInputError(f"is {spec!r}, but {method} is not compared (selected: {', '.join(hparams)})",
                                 field="--tune")
        grids.append((get_algorithm(method).name if method else None, name, [yaml.safe_load(v) for v in items]))
    trials: dict[str, list[dict[str, Any]]] = {}
    for m, hp in hparams.items():
        cls = get_algorithm(m)
        mine = [(k, vals) for owner, k, vals in grids if (owner == m or owner is None) and k in cls.defaults]
        for owner, k, _ in grids:
            if owner == m and k not in cls.defaults:
                raise UserInputError(f"{m} has no hyperparameter {k!r}; allowed: {sorted(cls.defaults)}", field="--tune")
        if not mine:
            continue
        out = []
        for combo in itertools.product(*(vals for _, vals in mine)):
            trial = {**hp, **dict(zip((k for k, _ in mine), combo))}
            try:
                out.append(cls.check_hparams(trial))
            except UserInputError as err:
                key = (err.field or "").removeprefix("algorithm.")
                raise UserInputError(f"{key + ' ' if key else ''}{err.message} (for {m})", field="--tune") from None
        trials[m] = out
    if not trials:
        raise UserInputError(f"no compared method has the hyperparameter(s) {sorted({k for _, k, _ in grids})}",
                             field="--tune")
    sizes = {m: len(t) for m, t in trials.items()}
    if len(set(sizes.values())) > 1:
        raise UserInputError(f"gives the methods different budgets ({', '.join(f'{m}: {n}' for m, n in sizes.items())} "
                             "trials); allowed: the same number of trials for every tuned method", field="--tune")
    return trials


def run_tuning(cfg: RunConfig, hparams: dict[str, dict[str, Any]], trials: dict[str, list[dict[str, Any]]],
               out: str | Path, *, models: str = "htfe-tiny", feature_dim: int = 128,
               progress: bool = True) -> dict[str, dict[str, Any]]:
    """Pick each tuned method's hyperparameters on validation data, with the same budget for all.

    Trial ``i`` runs every method (its ``i``-th grid point; untuned methods are left out) through
    :func:`run_compare` with ``validation=True`` in ``OUT/tune/trial<i>/`` (same data, partition,
    clients, seed and rounds as the comparison); a method's score is the pooled accuracy over all
    clients' validation splits, averaged over the last 3 evaluated rounds. The best trial per method
    wins (ties: the earlier trial). An interrupted tuning continues: a finished trial folder is kept.

    Returns:
        ``hparams`` with each tuned method's pick; the record ``OUT/tune.json`` lists every trial.

    Raises:
        UserInputError: ``out`` cannot take a comparison (:meth:`rafl.folders.Comparison.check_new`:
            checked before the first trial), or what :func:`run_compare` refuses.
    """
    out = Path(out)
    Comparison.check_new(out)  # the comparison that follows the trials writes there too
    n = len(next(iter(trials.values())))
    record: dict[str, Any] = {"criterion": "pooled accuracy over all clients' validation splits, mean of the last 3 "
                                           "evaluated rounds", "trials": {m: [] for m in trials}}
    for i in range(n):
        folder = out / TUNE_DIR / f"trial{i}"
        hp_i = {m: trials[m][i] for m in trials}
        resume = (folder / COMPARISON_RECORD).is_file()
        rows = run_compare(cfg, hp_i, folder, models=models, feature_dim=feature_dim, progress=progress,
                           resume=resume, finetune=False, validation=True)
        for r in rows:
            hist = read_history(folder / r["algorithm"])
            vals = [h[MODEL.acc_sample_weighted] for h in hist if MODEL.acc_sample_weighted in h][-3:]
            record["trials"][r["algorithm"]].append({"hparams": hp_i[r["algorithm"]],
                                                     "val_acc": float(sum(vals) / len(vals)) if vals else None})
    picked = dict(hparams)
    for m, rec in record["trials"].items():
        best = max(range(len(rec)), key=lambda j: (rec[j]["val_acc"] if rec[j]["val_acc"] is not None else -1, -j))
        picked[m] = rec[best]["hparams"]
        record.setdefault("picked", {})[m] = {"trial": best, **{k: v for k, v in rec[best]["hparams"].items()
                                                                  if any(t["hparams"].get(k) != rec[best]["hparams"].get(k)
                                                                         for t in rec)}}
    atomic_write_json(out / TUNE_RECORD, record)
    return picked
