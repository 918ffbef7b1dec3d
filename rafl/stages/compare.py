"""``rafl compare``: several FL methods on one partition with one seed, one table and one plot.

Every method runs through the same engine (:class:`rafl.federation.engine.Engine`) on the same
dataset, partition (built once), client models and seed, each in its own run dir
``OUT/<method>/``. The comparison table (``compare.md``, ``compare.csv``, ``compare.json``) holds,
per method, the final-round mean and std over clients of the deployed model's test accuracy
(``model``; plus ``proto`` = nearest-prototype accuracy for FedProto/FedTGP and the shared model's
accuracy where there is one), MB communicated (up + down, counted from the serialized payloads)
and wall time; ``compare.png`` plots accuracy (with std bars) and MB. The rows, tables and plots
are :mod:`rafl.reports.compare`; this module runs the methods and keeps their resume rules.

Client models: ``models="nas"`` uses the resource-aware subnets of the ``rafl federate`` pipeline
(:func:`rafl.stages.prepare.prepare`: the quickstart or given supernet, a subnet per device
profile); any other value is a model group / list for :mod:`rafl.models`, assigned round-robin
(:func:`build_group_federation`).
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from rafl.config import (
    AlgorithmConfig,
    RunConfig,
    blame,
    parse_overrides,
    participation,
    read_config_file,
    reject_compare_record,
    section_keys_that_apply,
)
from rafl.errors import UserInputError, shown, warn
from rafl.federation.algorithms import ALGORITHMS, get_algorithm
from rafl.federation.algorithms.hparams import LocalTraining, with_group_lr
from rafl.federation.bn_statistics import apply_policy
from rafl.federation.build import build_group_federation
from rafl.federation.checks import check_public_pool, check_same_clients
from rafl.federation.engine import CHECKPOINT, Federation
from rafl.federation.finetune import finetune_evaluate
from rafl.federation.metric_keys import MODEL, NEW_CLIENTS, NEW_CLIENTS_FT
from rafl.federation.payload import Payload
from rafl.federation.run_config import load_run_config, without_unused_pool
from rafl.federation.store import load_state
from rafl.folders import COMPARISON_RECORD, TUNE_DIR, TUNE_RECORD, Comparison, RunKind, check_folder
from rafl.io import atomic_write_json, atomic_write_yaml
from rafl.models import resolve_models
from rafl.models.plugin import is_plugin_spec, load_factory
from rafl.reports.compare import (
    FINETUNED,
    common_client_tiers,
    finetuned_clients,
    plot_accuracy_vs_mb,
    plot_compare,
    read_history,
    summarize_finetuned,
    summarize_run,
    write_table,
)
from rafl.stages.prepare import Prepared, engine_config, load_data_and_partition, prepare
from rafl.stages.runs import export_federated_supernet, run_engine, score_new_clients

# ---------------------------------------------------------------------- config
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
    from rafl.federation.algorithms.heterofl import HeteroFL

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
    cfg = _validate(tmp, rest, source, Path(path).parent if path is not None else Path.cwd())
    if models is None:
        models = cfg.clients.models if "models" in cfg.clients.model_fields_set else DEFAULT_MODELS
    hps = {name: with_group_lr(hp, given[name], models) for name, hp in hps.items()}
    return without_unused_pool(cfg, [(get_algorithm(n), hp) for n, hp in hps.items()], models), hps


def _validate(text: str, overrides: list[str], source: str, base: Path) -> RunConfig:
    """Validate a config text through :func:`rafl.federation.run_config.load_run_config` (its errors name
    ``source``; relative paths in it are taken against ``base``, those of ``--set`` against the
    current folder)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "run.yaml"
        p.write_text(text)
        try:
            return load_run_config(p, overrides, base=base)
        except UserInputError as err:
            raise UserInputError(err.message, source=source if err.source == str(p) else err.source,
                                 field=err.field) from None


# ---------------------------------------------------------------------- running
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


def run_compare(cfg: RunConfig, hparams: dict[str, dict[str, Any]], out: str | Path, *, models: str = "htfe-tiny",
                feature_dim: int = 128, progress: bool = True, resume: bool = False,
                finetune: bool = True, validation: bool = False) -> list[dict[str, Any]]:
    """Run every method of ``hparams`` (in order) on one partition and seed; write the table and plot.

    Args:
        cfg: the shared run config (data, partition, clients, engine, train, seed).
        hparams: ``{method name: hyperparameters}`` (from :func:`load_compare_config`).
        out: output directory (must not exist or be empty); ``OUT/<method>/`` holds each run.
        models: ``"nas"`` or a model-group spec (:func:`rafl.models.resolve_models`).
        feature_dim: D for model groups.
        progress: tqdm bars.
        resume: continue an interrupted comparison in ``out`` (its own ``config.yaml``, see
            :func:`load_compare_resume`): a method whose row is in ``compare.json`` with all rounds
            is kept, one with a checkpoint continues from its last complete round (the engine's
            resume: same metrics as an uninterrupted run), one without starts afresh. A resumed
            method's wall time adds the per-round times of the rounds it had completed before.
            Every row's "non-default settings" is computed from the final hyperparameters of all
            methods (:func:`with_settings`), also for a kept row.
        finetune: after each global-model method (``Algorithm.global_model``: fedavg, fedprox,
            uniform, heterofl, fedrolex) add its fine-tuned variant's row ``<method>-ft``
            (:mod:`rafl.federation.finetune`).
        validation: score every method on its clients' validation splits instead of their test
            splits, and not on the global test set (:func:`validation_loaders`): the runs of
            ``--tune``, which never see test data.

    Returns:
        the table rows (also in ``compare.json``).

    Raises:
        UserInputError: ``out`` not empty (or, with ``resume``, not a compare output), bad models,
            or any method-specific check (all methods are prepared before the first one runs, so a
            bad input writes nothing).
    """
    out = Path(out)
    if resume:
        Comparison.check_resume(out)
    else:  # (a folder holding only the --tune trials is this comparison's own)
        Comparison.check_new(out)
    members = resolve_models(models)
    cfg = cfg.model_copy(deep=True)  # the record (config.yaml) says in clients.models which models ran
    cfg.clients.models, cfg.clients.feature_dim = models, feature_dim
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    build = _method_builder(cfg, hparams, members, feature_dim, progress, validation)
    tables: dict[str, list] = {}
    subnets: dict[str, dict[str, Any]] = {}  # nas: {method: {profile: arch, source, budgets}}
    built: dict[str, tuple[Federation, list, Any]] = {}  # the first method's, kept for its run
    for name in hparams:  # every method built and checked (e.g. header shapes) before anything is written
        fed, tables[name], prep = build(name)
        fed.algorithm.init_server(fed.server)
        if prep is not None:
            subnets[name] = prep.extra.get("profiles", {})
        if not built:
            built[name] = (fed, tables[name], prep)
        del fed, prep  # one method's models in memory at a time (it is built again for its run)
    if cfg.engine.backend != "in-process":
        raise UserInputError(f"is {cfg.engine.backend!r}; rafl compare runs its methods in-process (allowed: "
                             "in-process); run one method on Flower with rafl federate", field="engine.backend")
    ecfg = engine_config(cfg)
    participation(ecfg, cfg.clients.n)  # a count larger than the population is an error before writing
    # held while this comparison writes (the kernel drops it when the process ends, also on kill -9):
    # a second live compare or --resume of the same folder is refused, a dead one's folder resumes; a
    # compare started together into the same --out stops at the claim of config.yaml: one error, not a mix
    with Comparison.open(out, resume=resume, field="--resume" if resume else "--out") as comparison:
        previous: dict[str, dict[str, Any]] = _previous_rows(out) if resume else {}
        shared = {**cfg.resolved(), "algorithm": None, "models": models, "feature_dim": feature_dim}
        if not resume:
            atomic_write_yaml(out / COMPARISON_RECORD, {**shared, "algorithms": hparams})
        rows = []
        for name, table in tables.items():
            fed, _, prep = built.pop(name) if name in built else build(name)
            run_dir = out / name
            check_folder(run_dir, None)  # a method's run dir
            # what the method's run was started with: a resumed run must continue with the same settings
            # (engine left out: only the number of rounds may differ, and it is checked per row)
            # (clients.models / clients.feature_dim are the top-level models / feature_dim: compared there,
            # so folders written before the clients section had them still resume)
            clients = {k: v for k, v in shared["clients"].items() if k not in ("models", "feature_dim")}
            started = json.loads(json.dumps({**shared, "clients": clients, "engine": None, "hparams": hparams[name]},
                                            default=str))
            done = previous.get(name) if run_dir.is_dir() else None  # its run dir removed: rerun it (the hints say so)
            continuing = resume and (run_dir / CHECKPOINT).is_file()
            if done is not None or continuing:
                _check_started_with(run_dir, started, get_algorithm(name).defaults)
                check_same_clients(run_dir, table, cfg.partition.scheme)
                completed = len(read_history(run_dir))
                if completed > ecfg.rounds:
                    raise UserInputError(f"is {ecfg.rounds}, but {name} has completed {completed} rounds; allowed: "
                                         f"an integer >= {completed}", source=out / "config.yaml", field="engine.rounds")
            if done is not None and done.get("rounds") == ecfg.rounds:
                rows.append(with_new_clients(done, prep, run_dir, ecfg.rounds, validation))
                if finetune and fed.algorithm.global_model:
                    rows.append(_finetuned_row(fed, cfg.seed, ecfg.rounds, run_dir, done, table))
                continue
            earlier_s = sum(r.get("time_s", 0.0) for r in read_history(run_dir)) if continuing else 0.0
            # a new run takes over an attempt that never completed round 1
            run = comparison.method(name, METHOD_RUN, resume=continuing)
            try:
                if not continuing:  # clients.json as federate's
                    group = {} if members == ["nas"] else {"models": models, "feature_dim": feature_dim}
                    atomic_write_json(run_dir / "clients.json", {"clients": table, **group})
                    atomic_write_json(run_dir / STARTED_WITH, started)
                t0 = time.perf_counter()
                summary = run_engine(fed, ecfg, run_dir, resume=continuing, progress=progress)
            except BaseException as err:
                comparison.discard_failed(run)
                if isinstance(err, UserInputError):  # say which method failed; its keys as compare names them
                    raise _method_error(err, name, hparams[name], out) from None
                raise
            finally:
                run.close()
            wall = time.perf_counter() - t0 + earlier_s
            if prep is not None:  # heterofl / fedrolex over NAS subnets: the federated supernet, as rafl federate writes it
                export_federated_supernet(prep, run_dir, summary)
            rows.append(with_new_clients(summarize_run(name, summary, read_history(run_dir), wall, table,
                                                       subnets.get(name)), prep, run_dir, ecfg.rounds, validation))
            if finetune and fed.algorithm.global_model:
                rows.append(_finetuned_row(fed, cfg.seed, ecfg.rounds, run_dir, rows[-1], table))
            write_table(out, with_settings(rows, hparams), models)
        rows = with_settings(rows, hparams)
        if members == ["nas"]:
            common_client_tiers(rows, out, next(iter(tables.values())))
        write_table(out, rows, models)  # also when every method was already finished (resume)
        plot_compare(out / "compare.png", rows)
        plot_accuracy_vs_mb(out / "compare_curve.png", {r["algorithm"]: read_history(out / r["algorithm"]) for r in rows})
        return rows


def with_new_clients(row: dict[str, Any], prep: Prepared | None, run_dir: Path, rounds: int,
                     validation: bool) -> dict[str, Any]:
    """``row`` with the new-clients protocol's means (``new.acc_mean``: the held-out clients' deployed
    models on their own test splits; ``new-ft.acc_mean``: after the local fine-tune) when the run holds
    clients out (:func:`rafl.stages.runs.score_new_clients`); the tuning runs (``validation``) skip it."""
    held = None if prep is None or validation else score_new_clients(prep, run_dir, rounds)
    if held is None:
        return row
    row = {**row, "new_clients": len(held["held_out"])}
    for key, column in ((MODEL.acc_mean, NEW_CLIENTS.acc_mean), (MODEL.acc_ft_mean, NEW_CLIENTS_FT.acc_mean)):
        if key in held:
            row[column] = held[key]
    return row


def _method_builder(cfg: RunConfig, hparams: dict[str, dict[str, Any]], members: list[str], feature_dim: int,
                    progress: bool, validation: bool):
    """``build(name) -> (federation, clients table, Prepared or None)`` of one method of a comparison:
    :func:`prepare` for NAS subnets, :func:`build_group_federation` for a model group. Every method
    shares one copy of the images and the partition (loaded by the first build); with ``validation``
    the clients' test splits are their validation splits and there is no global test set.

    Raises:
        UserInputError: (when called) what :func:`prepare` raises, an unknown method named as
            ``--algorithms``, a method that needs a public pool the partition lacks.
    """
    data: list = []  # [(dataset, partition)] once loaded
    device = torch.device(cfg.train.device)

    def build(name: str):
        hp = hparams[name]
        prep = None
        if members == ["nas"]:
            c = cfg.model_copy(deep=True)
            c.algorithm = AlgorithmConfig(name=name, **hp)
            try:
                prep = prepare(c, progress=progress, data=data[0] if data else None, keep_all_images=True)
            except UserInputError as err:
                if err.field != "algorithm.name":
                    raise
                raise UserInputError(err.message, source=err.source, field="--algorithms") from None
            data[:] = [(prep.dataset, prep.partition)]
            fed, table = prep.federation, prep.clients_table
        else:
            if not data:
                data.append(load_data_and_partition(cfg, progress))
            ds, part = data[0]
            algo = get_algorithm(name)(**hp)
            check_public_pool(algo, hp, part)
            fed, table = build_group_federation(ds, part, members, algo, feature_dim=feature_dim,
                                                batch_size=cfg.train.batch_size, device=device, seed=cfg.seed)
            apply_policy(fed, cfg.train.bn_statistics)
        if validation:
            fed.loaders, fed.global_test = validation_loaders(fed.loaders), None
        return fed, table, prep

    return build


def validation_loaders(loaders):
    """A federation's loader factory whose ``"test"`` split is the client's validation split: what
    hyperparameter tuning scores on (never test data; the caller drops the global test set too).

    Raises:
        UserInputError: (when called) a client without a validation split
            (``partition.split`` with a val share of 0).
    """
    def swapped(cid: int, split: str, seed: int):
        if split == "test":
            val = loaders(cid, "val", seed)
            if val is None:
                raise UserInputError(f"client {cid} has no validation split to tune on; allowed: partition.split "
                                     "with a val share > 0, e.g. [0.8, 0.1, 0.1]", field="partition.split")
            return val
        return loaders(cid, split, seed)

    return swapped


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
    import itertools

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


def _finetuned_row(fed: Federation, seed: int, rounds: int, run_dir: Path, base_row: dict[str, Any],
                   table: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``<method>-ft`` row of a finished global-model method: the final broadcast (its
    checkpoint) fine-tuned and scored on every client (:func:`rafl.federation.finetune.finetune_evaluate`),
    kept in ``run_dir/finetuned.json`` so a resumed comparison reuses it."""
    path = run_dir / FINETUNED
    if path.is_file():
        try:
            kept = json.loads(path.read_text())
            if kept.get("rounds") == rounds:
                return summarize_finetuned(base_row, kept["clients"], float(kept["seconds"]), table)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # damaged: fine-tune again
    ck = load_state(run_dir / CHECKPOINT)
    broadcast = Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))
    t0 = time.perf_counter()
    clients = finetuned_clients(finetune_evaluate(fed, seed, rounds + 1, broadcast))
    seconds = time.perf_counter() - t0
    atomic_write_json(path, {"rounds": rounds, "seconds": seconds, "clients": clients})
    return summarize_finetuned(base_row, clients, seconds, table)


def _method_error(err: UserInputError, name: str, hp: dict[str, Any], out: Path) -> UserInputError:
    """``err`` of method ``name``'s run as ``rafl compare`` says it: the method in front, its keys
    as compare names them (``algorithm.<method>.<key>``, in the field and in the message), and for
    a diverged training how to rerun that method with another value."""
    def own(m: re.Match) -> str:
        return f"algorithm.{name}.{m.group(1)}" if m.group(1) in hp else m.group(0)

    field = err.field
    if field and field.startswith("algorithm.") and field.count(".") == 1:
        field = own(re.match(r"algorithm\.(\w+)", field))
    message = re.sub(r"\balgorithm\.(\w+)\b(?!\.)", own, err.message)
    if "diverged" in message:
        key = field if field and field.startswith(f"algorithm.{name}.") else f"algorithm.{name}.lr"
        if (out / "config.yaml").is_file():  # other methods' results are kept: rerun just this one
            q = shlex.quote(str(out))
            message += (f"; to rerun {name} with another value, edit {key.replace('algorithm.', 'algorithms.', 1)} in "
                        f"{q}/config.yaml, delete {q}/{name}/ and run rafl compare --resume {q}")
        else:
            message += f"; nothing was kept: run the command again with --set {key}=<value>"
    return UserInputError(message, source=f"{name}, {err.source}" if err.source else name, field=field)


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


def _previous_rows(out: Path) -> dict[str, dict[str, Any]]:
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


def _check_started_with(run_dir: Path, started: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
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
    cfg = _validate(yaml.safe_dump({**data, "algorithm": {"name": "standalone"}}), [], str(path), Path.cwd())
    return cfg, hps, models, feature_dim


__all__ = ["default_models", "DEFAULT_MODELS", "load_compare_config", "load_compare_resume",
           "method_settings", "run_compare", "with_settings", "parse_grid", "run_tuning", "validation_loaders",
           "TUNE_RECORD"]
