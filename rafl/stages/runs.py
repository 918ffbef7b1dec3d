"""Running a prepared federation (:func:`rafl.stages.prepare.prepare`) in its run dir: the
engine with the client runner the caller picked, the run's reports, the summary with the
per-client table, and the federated supernet a weight-sharing method leaves."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rafl.errors import UserInputError
from rafl.federation.bn_statistics import effective
from rafl.federation.checks import DEPLOYMENT, check_resumable_here, check_same_clients
from rafl.federation.engine import CHECKPOINT, Engine, EngineConfig, Federation
from rafl.federation.metric_keys import MODEL, is_client_accuracy
from rafl.federation.new_clients import evaluate_new_clients, new_clients_summary
from rafl.federation.payload import Payload
from rafl.federation.store import ClientStore, load_state
from rafl.io import atomic_write_json, atomic_write_yaml
from rafl.reports.progress import round_progress
from rafl.reports.run import RunReport
from rafl.stages.prepare import Prepared
from rafl.supernet.checkpoint import save_supernet

#: ``summary.json``'s ``backend``: this process, Flower's Simulation Runtime, or a Flower App on a
#: SuperLink (``rafl flower-app``), whose nodes keep the client states on their own disks.
BACKENDS = ("in-process", "flower-simulation", "flower-superlink")


def run_engine(fed: Federation, config: EngineConfig, run_dir: Path, *, resume: bool = False, progress: bool = True,
               clients: Any = None) -> dict[str, Any]:
    """The engine's rounds of ``fed`` in ``run_dir`` (which exists), with the run's reports
    (:class:`rafl.reports.run.RunReport`: metrics files, summary, plots) and the round's progress
    bar; ``clients``: the client runner factory (:class:`~rafl.federation.engine.Engine`).
    Returns the engine's summary, with ``bn_statistics``: where the deployed models' BatchNorm statistics
    came from (``train.bn_statistics`` or the method's own rule, :func:`rafl.federation.bn_statistics.effective`),
    also in ``summary.json``."""
    engine = Engine(fed, config, run_dir, progress=progress, clients=clients, observers=[RunReport(run_dir)])
    with round_progress(progress):  # clients done / sampled and the local epoch, inside each round
        summary = engine.run(resume=resume)
    summary["bn_statistics"] = effective(fed.algorithm, fed.bn_statistics)
    path = Path(run_dir) / "summary.json"
    if path.is_file():
        atomic_write_json(path, {**json.loads(path.read_text()), "bn_statistics": summary["bn_statistics"]})
    return summary


def run_prepared(prep: Prepared, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 clients: Any = None, backend: str = "in-process", deployment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the prepared federation in ``run_dir``, the run dir its caller holds (a new run's is
    empty: :meth:`rafl.stages.rundir.RunDir.claim` checks it; created here if missing); returns the
    summary extended with the per-client table (``summary["table"]``), the means and the
    ``backend`` that ran this session (:data:`BACKENDS`).

    ``clients``: the engine's client runner factory (:class:`~rafl.federation.engine.Engine`);
    None: the engine's default (this process, or ``engine.workers`` forked processes); the
    Flower stages pass theirs (:func:`rafl.stages.flower.app.run_on_grid`). ``backend``: what the
    runner is, as ``summary.json`` names it. ``deployment``: the runner keeps
    client states outside the run dir (a SuperLink's nodes); a new run records it in
    ``clients.json`` (:data:`~rafl.federation.checks.DEPLOYMENT`), so ``rafl federate --resume``
    refuses the run dir (:func:`~rafl.federation.checks.check_resumable_here`).

    Raises:
        UserInputError: resuming on other clients than the run started with (:func:`check_same_clients`),
            or held-out clients on a deployment that keeps the client states on its nodes."""
    if deployment is not None and prep.new_clients is not None:
        raise UserInputError("holds out clients, whose scores need the trained clients' states in the run dir; a "
                             "SuperLink deployment keeps them on its nodes; allowed there: 0",
                             field="clients.held_out_fraction")
    if resume:
        if deployment is None:  # this process or the Simulation Runtime: the states must be in the run dir
            check_resumable_here(run_dir, "resume")
        check_same_clients(run_dir, prep.clients_table, prep.cfg.partition.scheme)
    run_dir = Path(run_dir)
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_yaml(run_dir / "config.yaml", prep.cfg.resolved())
        atomic_write_json(run_dir / "clients.json", {"clients": prep.clients_table, **prep.extra,
                                                     **({DEPLOYMENT: deployment} if deployment else {})})
    t0 = time.perf_counter()
    summary = run_engine(prep.federation, prep.engine_config, run_dir, resume=resume, progress=progress,
                         clients=clients)
    summary["wall_s"] = time.perf_counter() - t0
    summary["backend"] = backend
    rows = []
    for row in prep.clients_table:
        accs = summary["clients"].get(str(row["client"]), {})
        rows.append({**row, **{k: v for k, v in accs.items() if is_client_accuracy(k)}})
    summary["table"] = rows
    acc_keys = sorted({k for r in rows for k in r if is_client_accuracy(k)})  # model.acc, proto.acc, knowledge.acc, ...
    summary["means"] = {k: float(np.mean([r[k] for r in rows if r.get(k) is not None]))
                        for k in ("macs_m", "params_m", *acc_keys)
                        if any(r.get(k) is not None for r in rows)}
    held = score_new_clients(prep, run_dir, prep.engine_config.rounds)
    if held is not None:
        summary["new_clients"] = held
    atomic_write_json(run_dir / "summary.json", summary)
    export_federated_supernet(prep, run_dir, summary)
    return summary


#: a run dir's new-clients scores (:func:`score_new_clients`), kept so a resumed comparison reuses them
NEW_CLIENTS = "new_clients.json"


def score_new_clients(prep: Prepared, run_dir: Path, rounds: int, finetune: bool = True) -> dict[str, Any] | None:
    """The new-clients protocol of a finished run (``clients.held_out_fraction`` > 0; None without it):
    the held-out clients scored on the final checkpoint's broadcast and client states
    (:func:`rafl.federation.new_clients.evaluate_new_clients`), as ``summary.json``'s ``new_clients``
    (:func:`~rafl.federation.new_clients.new_clients_summary`), kept in ``run_dir/new_clients.json``
    for ``rounds``."""
    if prep.new_clients is None:
        return None
    path = Path(run_dir) / NEW_CLIENTS
    if path.is_file():
        try:
            kept = json.loads(path.read_text())
            if kept.get("rounds") == rounds and kept.get("finetune") == finetune:
                return kept["new_clients"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # damaged: score again
    ck = load_state(Path(run_dir) / CHECKPOINT)
    store = ClientStore(Path(run_dir) / "clients", {int(k): int(v) for k, v in ck["committed"].items()})
    broadcast = Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))
    got = evaluate_new_clients(prep.federation, store, prep.new_clients, prep.engine_config.seed, rounds, broadcast,
                               finetune=finetune)
    result = new_clients_summary(got, prep.held_out, prep.new_clients_table)
    atomic_write_json(path, {"rounds": rounds, "finetune": finetune, "new_clients": result})
    return result


def export_federated_supernet(prep: Prepared, run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """Write the server's final global model as a supernet (``run_dir/supernet.safetensors`` +
    ``supernet.json``, :func:`rafl.supernet.save_supernet`) when the method keeps one (HeteroFL and
    FedRolex over NAS subnets: ``federated_supernet``); ``rafl search --supernet RUN_DIR`` and
    ``supernet.path: RUN_DIR`` then use it. It keeps the original supernet's training config (its
    data and public pool) and metrics, plus ``metrics.federated`` (method, rounds, source supernet).
    Returns the JSON path, or None."""
    algorithm = prep.federation.algorithm
    if not algorithm.exports_supernet or prep.supernet_meta is None:
        return None
    ck = load_state(Path(run_dir) / CHECKPOINT)
    net = algorithm.federated_supernet(ck["server_state"], prep.federation.server)
    if net is None:
        return None
    meta = prep.supernet_meta
    metrics = {**meta.get("metrics", {}), "federated": {"algorithm": prep.federation.algorithm.name,
                                                        "rounds": int(ck["round"]),
                                                        "supernet": prep.extra.get("supernet"),
                                                        "acc_mean_over_clients": summary.get("final", {}).get(
                                                            MODEL.acc_mean_over_clients)}}
    return save_supernet(run_dir, net, config=meta.get("config", {}), metrics=metrics)

__all__ = ["BACKENDS", "NEW_CLIENTS", "export_federated_supernet", "run_engine", "run_prepared", "score_new_clients"]
