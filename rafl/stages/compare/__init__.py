"""``rafl compare``: several FL methods on one partition with one seed, one table and one plot.

Every method runs through the same engine (:class:`rafl.federation.engine.Engine`) on the same
dataset, partition (built once), client models and seed, each in its own run dir
``OUT/<method>/``. The comparison table (``compare.md``, ``compare.csv``, ``compare.json``) holds,
per method, the final-round mean and std over clients of the deployed model's test accuracy
(``model``; plus ``proto`` = nearest-prototype accuracy for FedProto/FedTGP and the shared model's
accuracy where there is one), MB communicated (up + down, counted from the serialized payloads)
and wall time; ``compare.png`` plots accuracy (with std bars) and MB. The rows, tables and plots
are :mod:`rafl.reports.compare`; this package runs the methods and keeps their resume rules, one
module per job:

- :mod:`~rafl.stages.compare.config`: the run config every method shares, each method's
  hyperparameters, the default client models, a row's non-default settings;
- :mod:`~rafl.stages.compare.methods`: every method's run in its run dir, the table and plots
  (:func:`~rafl.stages.compare.methods.run_compare`);
- :mod:`~rafl.stages.compare.resume`: what ``--resume`` checks a method's run against, and the
  comparison's ``config.yaml`` read back;
- :mod:`~rafl.stages.compare.finetune`: the fine-tuned rows (``<method>-ft``);
- :mod:`~rafl.stages.compare.tuning`: ``--tune``, each method's hyperparameters picked on the
  clients' validation splits.

Their imports run one way: ``config`` < ``resume`` < ``finetune`` < ``methods`` < ``tuning``.

Client models: ``models="nas"`` uses the resource-aware subnets of the ``rafl federate`` pipeline
(:func:`rafl.stages.prepare.prepare`: the quickstart or given supernet, a subnet per device
profile); any other value is a model group / list for :mod:`rafl.models`, assigned round-robin
(:func:`rafl.federation.build.build_group_federation`).
"""

from __future__ import annotations

from rafl.folders import TUNE_RECORD
from rafl.stages.compare.config import (
    DEFAULT_MODELS,
    default_models,
    load_compare_config,
    method_settings,
    with_settings,
)
from rafl.stages.compare.methods import run_compare, validation_loaders
from rafl.stages.compare.resume import METHOD_RUN, load_compare_resume, recorded_finetune
from rafl.stages.compare.tuning import parse_grid, run_tuning

__all__ = ["default_models", "DEFAULT_MODELS", "load_compare_config", "load_compare_resume", "recorded_finetune",
           "method_settings", "run_compare", "with_settings", "parse_grid", "run_tuning", "validation_loaders",
           "TUNE_RECORD", "METHOD_RUN"]
