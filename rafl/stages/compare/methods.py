"""The method runs of a comparison (:func:`run_compare`): every method built and checked on one
partition and seed before anything is written (:func:`method_builder`), then run through the
engine in its own run dir ``OUT/<method>/`` (new, continued or kept on ``--resume``), its row
scored (the new clients, the fine-tuned variant) and the table and plots written. With
``validation`` the clients' validation splits stand in for their test splits
(:func:`validation_loaders`: the tuning runs)."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from rafl.config import AlgorithmConfig, RunConfig, participation
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.bn_statistics import apply_policy
from rafl.federation.build import build_group_federation
from rafl.federation.checks import check_public_pool, check_same_clients
from rafl.federation.engine import CHECKPOINT, Federation
from rafl.federation.metric_keys import MODEL, NEW_CLIENTS, NEW_CLIENTS_FT
from rafl.folders import COMPARISON_RECORD, Comparison, check_folder
from rafl.io import atomic_write_json, atomic_write_yaml
from rafl.models import resolve_models
from rafl.reports.compare import (
    common_client_tiers,
    plot_accuracy_vs_mb,
    plot_compare,
    read_history,
    summarize_run,
    write_table,
)
from rafl.stages.compare.config import with_settings
from rafl.stages.compare.finetune import finetuned_row
from rafl.stages.compare.resume import METHOD_RUN, STARTED_WITH, check_started_with, previous_rows
from rafl.stages.prepare import Prepared, engine_config, load_data_and_partition, prepare
from rafl.stages.runs import export_federated_supernet, run_engine, score_new_clients


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
    build = method_builder(cfg, hparams, members, feature_dim, progress, validation)
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
        previous: dict[str, dict[str, Any]] = previous_rows(out) if resume else {}
        shared = {**cfg.resolved(), "algorithm": None, "models": models, "feature_dim": feature_dim}
        if not resume:
            atomic_write_yaml(out / COMPARISON_RECORD, {**shared, "algorithms": hparams, "finetune": bool(finetune)})
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
                check_started_with(run_dir, started, get_algorithm(name).defaults)
                check_same_clients(run_dir, table, cfg.partition.scheme)
                completed = len(read_history(run_dir))
                if completed > ecfg.rounds:
                    raise UserInputError(f"is {ecfg.rounds}, but {name} has completed {completed} rounds; allowed: "
                                         f"an integer >= {completed}", source=out / "config.yaml", field="engine.rounds")
            if done is not None and done.get("rounds") == ecfg.rounds:
                rows.append(with_new_clients(done, prep, run_dir, ecfg.rounds, validation))
                if finetune and fed.algorithm.global_model:
                    rows.append(finetuned_row(fed, cfg.seed, ecfg.rounds, run_dir, done, table))
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
                rows.append(finetuned_row(fed, cfg.seed, ecfg.rounds, run_dir, rows[-1], table))
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


def method_builder(cfg: RunConfig, hparams: dict[str, dict[str, Any]], members: list[str], feature_dim: int,
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
