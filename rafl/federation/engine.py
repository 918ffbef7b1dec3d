"""The in-process federation engine: rounds, sampling, faults, communication counting, checkpoints.

The engine moves :class:`~rafl.federation.payload.Payload` s between an algorithm's client and
server steps and knows no algorithm by name. One round ``t``:

1. *Sporadic participation* (RaFL's sporadic setting): a share ``sporadic_rate`` of the currently
   available clients leaves and is replaced by clients drawn from the rest of the population.
2. *Sampling*: ``clients_per_round`` clients (a count, or a fraction of the available ones) are
   drawn without replacement, seeded by round ``t``'s sampling node of the run's seed tree
   (:class:`rafl.seeds.SeedTree`: run -> round -> sampling / server / client).
3. *Dropout*: each sampled client fails with probability ``dropout`` after downloading; it uploads
   nothing and its state is not updated. The round completes with the rest (failures counted).
4. Every surviving client: its committed state is loaded from disk (or ``init_client`` on first
   use), ``client_update`` runs with loaders and torch RNG seeded by the tree's ``(t, client)`` node, the
   new state is written to disk, the upload is screened (:mod:`rafl.federation.screening`: size,
   dtypes, finite values in range, shapes vs ``upload_spec``, the method's ``check_upload``); a
   rejected upload is logged and counted and its client's new state discarded; below
   ``min_valid_uploads`` valid uploads the round is reported failed and changes no state. An
   accepted upload's ``n_samples`` is the client's registered count, never its own claim.
   A *client runner* (:mod:`rafl.federation.runners`) does the client part:
   :class:`~rafl.federation.runners.InProcessClients`, one client after the other,
   :class:`rafl.federation.workers.WorkerClients` in ``engine.workers`` forked processes, or
   :class:`rafl.federation.flower_runner.FlowerClients` as Flower ClientApps on SuperNodes
   (a node that fails or times out loses its clients for the round: counted as failed).
5. ``server_aggregate`` produces the next broadcast. A server step whose own training diverges on
   the accepted uploads (:class:`~rafl.errors.DivergedError`: FedDF's distillation, FedTGP's
   prototypes, FedGH's header) fails the round instead of the run: no new state, the reason in
   ``failed_round_reasons`` (the uploads may be what diverged; a learning rate too large fails
   every round, and ``rafl federate`` then exits 3 naming it).
6. Every ``eval_every`` rounds (and the last; only the last for an algorithm whose models never
   change, ``static_models``): each client's test split is evaluated
   (``prepare_evaluation`` + ``evaluate``); reported per model ``m``: ``m.acc_mean_over_clients``,
   ``m.acc_sample_weighted`` (sum correct / sum samples), ``m.acc_std_over_clients``.
7. Communication: bytes of every download (``client_broadcast(...)``, counted by
   :meth:`~rafl.federation.payload.Payload.count`; the counted, frozen payload is what the client
   receives) and every upload (counted as the client returned it; the sender id travels beside
   it, in the runner's ``(client_id, upload)`` pairs) per round and cumulative.
   ``co_mb_to_target`` (FedGH's communication overhead, Yi et al. Sec. 5.3): the cumulative MB
   (up + down) at the first evaluated round whose ``model.acc_mean_over_clients`` reaches
   ``target_accuracy``. These are per-client payload bytes (the papers' communication
   cost: every client's copy of a broadcast counts). A runner that sends messages (Flower) also
   reports the bytes its messages carried (``wire_bytes_down``/``_up``/``_eval_down``,
   ``cum_wire_mb``: a broadcast the clients of one node share travels once to that node).
8. The round's record (a :class:`~rafl.federation.round_record.RoundRecord`: its counters, its
   evaluation's accuracies by model name, its seconds; :meth:`~rafl.federation.round_record.RoundRecord.as_row`
   is its line of ``metrics.jsonl``) is appended to the history and handed to every
   :class:`RunObserver` (:class:`rafl.reports.run.RunReport` writes the metrics files), then
   ``checkpoint.safetensors`` (server state, broadcast, available set, committed
   client-state versions, counters, metrics so far) is written atomically. After the last round
   the observers get the history and the summary (:func:`make_summary`). The engine itself writes
   only ``clients/`` and the checkpoint.

``resume`` continues from the last complete round; because every random draw is seeded by its
node of the seed tree (round, then sampling / server / client) and client states are versioned (:mod:`rafl.federation.store`), a
resumed run ends with the same metrics as an uninterrupted one. That holds bit for bit on CPU (what
the tests check); on CUDA, cuDNN's default convolution algorithms are not deterministic, so runs
(resumed or not) agree up to floating-point noise unless the caller sets
``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from rafl.config import EngineConfig, participation
from rafl.errors import DivergedError, UserInputError, warn
from rafl.federation.aggregation import AggregationRule, ClipBounds
from rafl.federation.algorithms.base import ServerContext
from rafl.federation.events import report
from rafl.federation.metric_keys import (
    GLOBAL_SUFFIX,
    GLOBAL_TEST_SAMPLES,
    TEST_SAMPLES,
    ModelKeys,
    client_accuracies,
    counted_models,
    is_count,
    totals,
)
from rafl.federation.payload import CountedPayload, Payload
from rafl.federation.round_record import ModelAccuracy, RoundEvaluation, RoundRecord
from rafl.federation.run_files import CHECKPOINT
from rafl.federation.runners import Federation, RunnerFactory
from rafl.federation.screening import ClientError, UploadPolicy, screen_uploads
from rafl.federation.store import ClientStore, load_state, save_state
from rafl.federation.workers import runner
from rafl.io import remove_orphaned_tmp
from rafl.seeds import SeedTree

#: Added to a NaN/Inf upload's error: an honest client's non-finite upload is training that
#: diverged (e.g. one step at a huge learning rate leaves finite but huge weights, whose features
#: then overflow), which the loss check cannot see.
DIVERGED_UPLOAD = (" (the client's local training diverged); allowed: a smaller algorithm.lr, or a model whose "
                   "features stay finite")


def sporadic_update(available: list[int], population: int, rate: float, rng: np.random.Generator) -> list[int]:
    """Replace ``round(rate * len(available))`` available clients by clients not available now.

    Returns the new sorted list of available ids (same length)."""
    n_swap = min(int(round(rate * len(available))), population - len(available))
    if n_swap <= 0:
        return sorted(available)
    outside = np.setdiff1d(np.arange(population), np.asarray(available, dtype=np.int64))
    leave = rng.choice(np.asarray(available), size=n_swap, replace=False)
    join = rng.choice(outside, size=n_swap, replace=False)
    return sorted(set(available) - set(int(v) for v in leave) | set(int(v) for v in join))


def sample_clients(available: list[int], k: int, rng: np.random.Generator) -> list[int]:
    """``k`` distinct ids drawn uniformly from ``available`` (sorted)."""
    return sorted(int(v) for v in rng.choice(np.asarray(available), size=min(k, len(available)), replace=False))


@dataclass
class RoundTimes:
    """Seconds spent in one round, by part (``engine`` = everything else: state I/O, payload
    serialization/validation, sampling, metrics, checkpoint)."""

    total: float = 0.0
    client_update: float = 0.0
    aggregate: float = 0.0
    evaluate: float = 0.0

    @property
    def engine(self) -> float:
        return max(0.0, self.total - self.client_update - self.aggregate - self.evaluate)


@dataclass
class RunState:
    """What carries a run from one round to the next (what the checkpoint holds besides the
    client-state versions): the server state, the last broadcast, the available clients, every
    round's record so far and the running counters (bytes, failures, CO to target)."""

    server_state: Any
    broadcast: Payload
    available: list[int]
    history: list[RoundRecord]
    counters: dict[str, Any]


@dataclass
class RoundResult:
    """One round as :meth:`Engine._round` returns it: its record (its seconds still to add), its
    :class:`RoundTimes` and, in an evaluated round, every evaluated client's evaluation-contract
    counts (client id -> ``m.correct`` / ``m.total`` / ...)."""

    record: RoundRecord
    times: RoundTimes
    client_counts: dict[int, dict[str, float]] | None = None


class RunObserver(Protocol):
    """Who records a run: the engine hands it every round's record
    (:class:`~rafl.federation.round_record.RoundRecord`; ``as_row()`` is its line of
    ``metrics.jsonl``) and the summary (:class:`rafl.reports.run.RunReport` writes the run dir's
    metrics files, summary and plots). Called in the engine's thread; an exception propagates into
    the run."""

    def round_done(self, history: list[RoundRecord]) -> None:
        """After every completed round, before its checkpoint: the records of all rounds so far
        (resumed ones included; the last is this round's, its ``time_s`` / ``time_engine_s``
        without the observers' and the checkpoint's time)."""

    def run_done(self, history: list[RoundRecord], summary: dict[str, Any]) -> None:
        """After the last round (also when a resumed run had none left): every round's record,
        with complete timing, and :func:`make_summary`'s summary."""


class Engine:
    """Runs a :class:`Federation` for ``config.rounds`` rounds into ``run_dir``.

    Args:
        fed: the federation.
        config: :class:`rafl.config.EngineConfig` (the run config's engine section and seed).
        run_dir: an existing directory (the CLI creates it only after validation); the engine
            writes ``clients/`` and ``checkpoint.safetensors`` there.
        progress: show a tqdm bar over rounds.
        clients: the client runner, built from the engine's store (``clients(fed, store, seed)``);
            default :class:`~rafl.federation.runners.InProcessClients`, or
            :class:`rafl.federation.workers.WorkerClients` with ``config.workers`` > 1. :mod:`rafl.stages.flower` passes one that runs
            the client steps as Flower ClientApps on SuperNodes.
        observers: :class:`RunObserver` s told every round's record and the summary, in order
            (e.g. ``[rafl.reports.run.RunReport(run_dir)]``: ``metrics.jsonl``, ``summary.json``, ...).

    Raises:
        UserInputError: bad engine values, a population the algorithm rejects, or (on resume) a
            checkpoint that does not belong to this run.
    """

    def __init__(self, fed: Federation, config: EngineConfig, run_dir: str | Path, progress: bool = True,
                 clients: RunnerFactory | None = None,
                 observers: Sequence[RunObserver] = ()):
        self.fed = fed
        self.observers = tuple(observers)
        self.cfg = config
        self.run_dir = Path(run_dir)
        self.progress = progress
        n = len(fed.clients)
        if n < 1:
            raise UserInputError("needs at least one client", field="clients")
        if [c.client_id for c in fed.clients] != list(range(n)):
            raise UserInputError("client ids must be 0..n-1 in order", field="clients")
        self.n_available, self.n_sampled = participation(config, n)
        self.rule = AggregationRule(config.aggregation, config.trim_fraction, config.clip_norm)
        self.policy = UploadPolicy(config.max_upload_mb, config.max_abs_value, config.min_valid_uploads)
        fed.algorithm.check_population(fed.clients)
        self.store = ClientStore(self.run_dir / "clients")
        self.seeds = SeedTree(config.seed)  # the engine's streams of the run's seed tree (rafl.seeds)
        if clients is None:
            clients = runner(config.workers, self.n_sampled, fed.device)
        self.clients = clients(fed, self.store, config.seed)
        self.times: list[RoundTimes] = []

    # ------------------------------------------------------------------ contexts
    def _server_ctx(self, rnd: int) -> ServerContext:
        s = self.fed.server
        s.round = rnd
        s.seed = self.seeds.server(rnd)
        s.aggregation = self.rule
        return s

    # ------------------------------------------------------------------ checkpoint
    def _checkpoint(self, rnd: int, server_state: Any, broadcast: Payload, available: list[int],
                    history: list[RoundRecord], counters: dict) -> None:
        committed = self.store.commit()
        save_state(self.run_dir / CHECKPOINT, {
            "round": rnd,
            "server_state": server_state,
            "broadcast_tensors": dict(broadcast.tensors),
            "broadcast_meta": json.dumps(dict(broadcast.meta)),
            "available": list(available),
            "committed": {str(k): v for k, v in committed.items()},
            "history": json.dumps([record.as_row() for record in history]),
            "counters": json.dumps(counters),
            "config": json.dumps(self.cfg.model_dump(mode="json")),
            "n_clients": len(self.fed.clients),
            "algorithm": self.fed.algorithm.name,
        })
        self.store.cleanup()

    def _load_checkpoint(self) -> dict:
        path = self.run_dir / CHECKPOINT
        if not path.is_file():
            raise UserInputError("has no checkpoint.safetensors (not a rafl federate run dir, or it never "
                                 "completed a round)", source=self.run_dir)
        ck = load_state(path)
        if ck.get("algorithm") != self.fed.algorithm.name or ck.get("n_clients") != len(self.fed.clients):
            raise UserInputError(f"checkpoint is for algorithm {ck.get('algorithm')!r} with "
                                 f"{ck.get('n_clients')} clients, the config says {self.fed.algorithm.name!r} "
                                 f"with {len(self.fed.clients)}", source=path)
        return ck

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, rnd: int, broadcast: Payload) -> tuple[RoundEvaluation, dict[int, dict[str, float]]]:
        """Evaluate the clients ``engine.eval_clients`` names on their test splits: what the round
        measured, and each client's evaluation-contract counts (the clients evaluated one by one)."""
        ids = list(range(len(self.fed.clients))) if self.cfg.eval_clients == "all" else sorted(self.store.committed)
        untrained = [cid for cid in ids if not self.store.has(cid)]
        shared = (bool(untrained) and self.fed.algorithm.shared_initial_evaluation
                  and self.clients.shares_initial_evaluation)
        if shared:  # clients that never trained: one evaluation per architecture, not one each
            ids = [cid for cid in ids if self.store.has(cid)]
        per_client, lost = self.clients.evaluate(rnd, ids, broadcast)
        evaluation = summarize_eval(per_client)
        if shared:
            groups, lost_untrained = self.clients.evaluate_untrained(rnd, untrained, broadcast)
            summarize_untrained(evaluation, per_client, groups)
            lost.update(lost_untrained)
        evaluation.lost = dict(lost)  # a Flower node that failed or timed out: its clients are in no accuracy
        return evaluation, per_client

    def _count_wire(self, record: RoundRecord, counters: dict[str, Any]) -> None:
        """A runner that sends messages (Flower) reports the bytes they carried (``take_traffic``):
        the round's ``wire_bytes_down`` / ``wire_bytes_up`` (training: a broadcast several clients of
        a node share counted once per node) and ``wire_bytes_eval_down`` (evaluation), and
        ``cum_wire_mb`` (training, down + up); beside the per-client payload bytes
        (``bytes_down`` / ``bytes_up``, the papers' communication cost, every client's copy)."""
        sent = self.clients.take_traffic()
        if sent is None:
            return
        for key in ("down", "up", "eval_down"):
            counters[f"cum_wire_bytes_{key}"] = counters.get(f"cum_wire_bytes_{key}", 0) + int(sent[key])
        record.wire_bytes_down, record.wire_bytes_up = int(sent["down"]), int(sent["up"])
        record.wire_bytes_eval_down = int(sent["eval_down"])
        record.cum_wire_mb = (counters["cum_wire_bytes_down"] + counters["cum_wire_bytes_up"]) / 1e6

    # ------------------------------------------------------------------ main loop
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or continue) the federation; returns the summary (:func:`make_summary`, also
        handed to the observers)."""
        try:
            return self._run(resume)
        finally:
            self.clients.close()  # a runner's worker processes

    def _start(self, resume: bool) -> tuple[RunState, int]:
        """The run's state before its first round to run, and that round: from the checkpoint
        (``resume``), else the algorithm's initial server state and the initial available set."""
        fed, algo = self.fed, self.fed.algorithm
        if resume:
            for folder in (self.run_dir, self.run_dir / "clients"):  # what a kill -9 mid-write left behind
                remove_orphaned_tmp(folder)
            ck = self._load_checkpoint()
            try:
                history = [RoundRecord.from_row(row) for row in json.loads(ck["history"])]
            except ValueError as err:  # a checkpoint another rafl version wrote, or edited by hand
                raise UserInputError(f"{err}; allowed: a checkpoint this rafl version wrote",
                                     source=self.run_dir / CHECKPOINT, field="history") from None
            self.store.committed = {int(k): int(v) for k, v in ck["committed"].items()}
            self.store.cleanup()
            return RunState(server_state=ck["server_state"],
                            broadcast=Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"])),
                            available=[int(v) for v in ck["available"]],
                            history=history,
                            counters=json.loads(ck["counters"])), int(ck["round"]) + 1
        torch.manual_seed(self.seeds.server(0))
        server_state, broadcast = algo.init_server(self._server_ctx(0))
        rng0 = self.seeds.sampling_generator(0)
        available = sorted(int(v) for v in rng0.choice(len(fed.clients), size=self.n_available, replace=False))
        return RunState(server_state=server_state, broadcast=broadcast, available=available, history=[],
                        counters={"cum_bytes_up": 0, "cum_bytes_down": 0, "failures": 0, "co_mb_to_target": None,
                                  "co_round": None}), 1

    def _run(self, resume: bool) -> dict[str, Any]:
        cfg, algo = self.cfg, self.fed.algorithm
        st, start = self._start(resume)
        bar = tqdm(range(start, cfg.rounds + 1), desc=f"{algo.name} rounds", disable=not self.progress,
                   initial=start - 1, total=cfg.rounds)
        last_counts: dict[int, dict[str, float]] | None = None
        for rnd in bar:
            t0 = time.perf_counter()
            done = self._round(rnd, st)
            times, record = done.times, done.record
            if done.client_counts is not None:
                last_counts = done.client_counts
            self._count_wire(record, st.counters)
            times.total = time.perf_counter() - t0
            record.time_s, record.time_client_update_s = times.total, times.client_update
            record.time_aggregate_s, record.time_evaluate_s = times.aggregate, times.evaluate
            st.history.append(record)
            tw = time.perf_counter()
            for observer in self.observers:  # e.g. metrics.jsonl: on disk before the round's checkpoint
                observer.round_done(st.history)
            self._checkpoint(rnd, st.server_state, st.broadcast, st.available, st.history, st.counters)
            times.total += time.perf_counter() - tw
            record.time_s = times.total  # and so its time_engine_s
            self.times.append(times)
            report("round_end", round=rnd)
            acc = record.mean_accuracy()
            if acc is not None:
                bar.set_postfix(acc=f"{acc:.3f}", comm=tqdm.format_sizeof(record.cum_mb * 1e6, "B", 1000))
        bar.close()
        if last_counts is None:  # resumed after the final round: re-evaluate from the checkpoint
            last_counts = self._evaluate(cfg.rounds, st.broadcast)[1]
        summary = make_summary(algo.name, st.history, st.counters, last_counts, cfg)
        for observer in self.observers:
            observer.run_done(st.history, summary)
        return summary

    def _downloads(self, sampled: list[int], failed: list[int], st: RunState
                   ) -> tuple[list[tuple[int, CountedPayload]], dict[int, int], int]:
        """What every sampled client downloads, counted: the jobs of the clients that did not drop
        out, the largest upload the server accepts from each, and the bytes sent down."""
        fed, algo = self.fed, self.fed.algorithm
        bytes_down = 0
        # id(download) -> (download, its counted copy): a payload sent to several clients (the
        # common broadcast) is counted once and stays one object (a runner sends it once per node)
        counted: dict[int, tuple[Payload, CountedPayload]] = {}
        jobs: list[tuple[int, CountedPayload]] = []
        limits: dict[int, int] = {}  # the largest upload the server accepts, per client
        for cid in sampled:
            down = algo.client_broadcast(st.broadcast, fed.clients[cid])
            if id(down) not in counted:
                counted[id(down)] = (down, down.count())
            sent = counted[id(down)][1]
            down_bytes = sent.nbytes()
            bytes_down += down_bytes
            if cid not in failed:
                jobs.append((cid, sent))
                limits[cid] = self.policy.byte_limit(algo.upload_spec(st.server_state, fed.clients[cid]), down_bytes)
        return jobs, limits, bytes_down

    def _fail_round(self, st: RunState, why: str) -> None:
        """A failed round: no client's new state is committed, ``why`` joins the run's
        ``failed_round_reasons`` and one warning line says the server state is unchanged."""
        self.store.pending.clear()
        st.counters.setdefault("failed_round_reasons", []).append(why)
        warn(f"{why}; the server state is unchanged")

    def _round(self, rnd: int, st: RunState) -> RoundResult:
        """Round ``rnd`` (module docstring, steps 1-7) on the run's state ``st``, which it advances
        (available set, server state, broadcast, counters); the record's timing is the caller's."""
        fed, cfg, algo = self.fed, self.cfg, self.fed.algorithm
        times = RoundTimes()
        rng = self.seeds.sampling_generator(rnd)
        if cfg.sporadic_rate > 0 and rnd > 1:
            st.available = sporadic_update(st.available, len(fed.clients), cfg.sporadic_rate, rng)
        sampled = sample_clients(st.available, self.n_sampled, rng)
        failed = [cid for cid, u in zip(sampled, rng.random(len(sampled))) if u < cfg.dropout]
        jobs, limits, bytes_down = self._downloads(sampled, failed, st)
        report("round", round=rnd, rounds=cfg.rounds, clients=len(jobs))
        results, lost, times.client_update = self.clients.train(rnd, jobs, limits)
        report("trained", done=len(results))
        del jobs
        failed = failed + sorted(lost)
        # the sender names the client's model: a NaN upload usually means that model diverged
        screened = screen_uploads(
            results, algo, st.server_state, fed.clients, fed.server.n_classes, self.policy, limits=limits,
            sender=lambda c: f"client {c} (model {fed.clients[c].model_key}){self.clients.where(c)}",
            nonfinite_hint=DIVERGED_UPLOAD)
        uploads, bytes_up = screened.accepted, screened.bytes_up
        errors = [u for _, u in results if isinstance(u, ClientError)]
        if errors and len(uploads) < self.policy.min_valid_uploads:
            # a client's error, and too few valid uploads remain without it: the error is the run's
            # (every client's lr too large, a broken config), the first one in job order, as one line
            self.store.pending.clear()
            raise errors[0].error()
        # every upload of several clients refused: the server state they answered is suspect, not
        # each client (a poisoned aggregate makes honest uploads outliers); one line says so below
        suspect_server = not uploads and len(screened.rejected) - len(screened.client_errors) > 1
        for cid, why in screened.rejected.items():
            self.store.pending.pop(cid, None)  # a rejected client's new state is not committed
            if cid in screened.client_errors:
                warn(f"round {rnd}: left out {why}")
            elif not suspect_server:
                warn(f"round {rnd}: rejected the upload of {why}")
        round_failed = bool(results) and len(uploads) < self.policy.min_valid_uploads
        if round_failed:  # too few valid uploads: the round changes no server or client state
            self._fail_round(st, failed_round_reason(rnd, len(results), len(uploads), self.policy.min_valid_uploads,
                                                     screened.rejected))
        else:
            torch.manual_seed(self.seeds.server(rnd))
            ta = time.perf_counter()
            ctx = self._server_ctx(rnd)
            ctx.clip_bounds = ClipBounds.from_json(st.counters.get("clip_bounds"))  # this round's copy
            try:
                new_state, new_broadcast = algo.server_aggregate(uploads, st.server_state, ctx)
                bad = unusable_state(new_broadcast)
            except DivergedError as err:  # the server's own training on these uploads: a failed round, no new state
                round_failed = True
                self._fail_round(st, f"round {rnd} failed: the server step diverged on the round's {len(uploads)} "
                                     f"accepted upload(s): {err}")
            else:
                if bad is not None:  # a model that outputs NaN: never the next state, never an accuracy
                    round_failed = True
                    self._fail_round(st, f"round {rnd} failed: the aggregate of the accepted upload(s) of "
                                         f"{upload_names(screened.accepted_ids)} {bad}")
                else:
                    st.server_state, st.broadcast = new_state, new_broadcast
                    st.counters["clip_bounds"] = ctx.clip_bounds.to_json()
            times.aggregate = time.perf_counter() - ta
        del uploads
        counters = st.counters
        counters["rejected"] = counters.get("rejected", 0) + len(screened.rejected)
        counters["failed_rounds"] = counters.get("failed_rounds", 0) + int(round_failed)
        counters["cum_bytes_up"] += bytes_up
        counters["cum_bytes_down"] += bytes_down
        counters["failures"] += len(failed)
        record = RoundRecord(
            round=rnd, sampled=len(sampled), failed=len(failed), bytes_up=bytes_up, bytes_down=bytes_down,
            cum_bytes_up=counters["cum_bytes_up"], cum_bytes_down=counters["cum_bytes_down"],
            rejected_reasons=dict(screened.rejected), bytes_rejected=screened.bytes_rejected,
            n_samples_overridden=list(screened.claims_overridden), round_failed=round_failed, lost=dict(lost))
        client_counts = None
        if (rnd % cfg.eval_every == 0 and not fed.algorithm.static_models) or rnd == cfg.rounds:
            self.store.commit()  # evaluation reads this round's states
            te = time.perf_counter()
            report("evaluate", clients=len(fed.clients) if cfg.eval_clients == "all" else len(self.store.committed))
            record.evaluation, client_counts = self._evaluate(rnd, st.broadcast)
            times.evaluate = time.perf_counter() - te
            acc = record.mean_accuracy()
            if (cfg.target_accuracy is not None and counters["co_mb_to_target"] is None
                    and acc is not None and acc >= cfg.target_accuracy):
                counters["co_mb_to_target"] = record.cum_mb
                counters["co_round"] = rnd
        return RoundResult(record=record, times=times, client_counts=client_counts)


def unusable_state(broadcast: Payload) -> str | None:
    """Why the aggregate ``broadcast`` cannot be the next global state, or None: a floating tensor
    with a NaN/Inf value, or a BatchNorm running variance below 0 (``*running_var``: BN divides by
    ``sqrt(var + eps)``, so every output of the model would be NaN)."""
    for name, t in broadcast.tensors.items():
        if not t.is_floating_point() or not t.numel():
            continue
        if not bool(torch.isfinite(t).all()):
            return f"has NaN or Inf values in {name}"
        if name.endswith("running_var") and float(t.min()) < 0:
            return f"has a negative BatchNorm running variance in {name} ({float(t.min()):.3g})"
    return None


def upload_names(ids: Sequence[int]) -> str:
    """``client 3`` / ``clients 1, 4`` for a failure reason."""
    return f"client {ids[0]}" if len(ids) == 1 else "clients " + ", ".join(str(c) for c in ids)


def failed_round_reason(rnd: int, uploaded: int, valid: int, needed: int, rejected: dict[int, str]) -> str:
    """One line saying why round ``rnd`` failed: its valid uploads against ``engine.min_valid_uploads``
    and the first rejection's reason; when every upload was rejected, also that the server state
    they answered may be what is wrong (a poisoned aggregate makes honest uploads look like
    outliers, so no client is blamed then)."""
    line = f"round {rnd} failed: {valid} valid upload(s) of {uploaded}, engine.min_valid_uploads is {needed}"
    if not rejected:
        return line
    first = rejected[min(rejected)]
    line += f"; {len(rejected)} rejected, e.g. {first[:200]}"
    if valid == 0 and uploaded > 1:
        line += (f" (all {uploaded} clients were refused: the server state they trained from may be what is "
                 "wrong, e.g. a poisoned aggregate; allowed: engine.aggregation norm_clip, median or trimmed_mean)")
    return line


# ---------------------------------------------------------------------- metrics
def summarize_eval(per_client: dict[int, dict[str, float]]) -> RoundEvaluation:
    """What an evaluation of the clients one by one measured, per model ``m`` (keys
    ``m.correct``/``m.total`` of the evaluation contract): the unweighted mean of the clients'
    accuracies, the sample-weighted accuracy (sum correct / sum total) and the population std of
    the clients' accuracies (:class:`~rafl.federation.round_record.ModelAccuracy`). Clients with an
    empty test split are skipped; a model no client could score has no figures. Other numeric keys
    are averaged over the clients that report them (``means``)."""
    out = RoundEvaluation()
    for m in map(ModelKeys, counted_models(k for r in per_client.values() for k in r)):
        accs, correct, total = [], 0.0, 0.0
        for r in per_client.values():
            tot = r.get(m.total, 0.0)
            if tot > 0:
                accs.append(r[m.correct] / tot)
                correct += r[m.correct]
                total += tot
        if accs:
            out.accuracies[m.model] = ModelAccuracy(acc_mean_over_clients=float(np.mean(accs)),
                                                    acc_sample_weighted=correct / total,
                                                    acc_std_over_clients=float(np.std(accs)))
    extra = sorted({k for r in per_client.values() for k in r if not is_count(k)})
    for k in extra:
        vals = [r[k] for r in per_client.values() if k in r]
        out.means[k] = float(np.mean(vals))
    return out


def summarize_untrained(evaluation: RoundEvaluation, per_client: dict[int, dict[str, float]],
                        groups: list[tuple[list[int], dict[str, float]]]) -> None:
    """Adds to ``evaluation`` the figures of the shared evaluation of the clients that have not
    trained (``groups``: their ids and pooled counts), per model of the evaluation contract:
    ``acc_untrained_sample_weighted`` (sum correct / sum total over those groups) and
    ``acc_all_sample_weighted`` (with the clients evaluated one by one, ``per_client``, added:
    every client's test samples); ``trained_clients`` and ``untrained_clients`` count the clients
    behind each."""
    evaluation.trained_clients = len(per_client)
    evaluation.untrained_clients = sum(len(g) for g, _ in groups)
    counts = [c for _, c in groups]
    for m in map(ModelKeys, counted_models(k for c in counts for k in c)):
        acc = evaluation.accuracies.get(m.model, ModelAccuracy())
        correct = sum(c.get(m.correct, 0.0) for c in counts)
        total = sum(c.get(m.total, 0.0) for c in counts)
        if total > 0:
            acc.acc_untrained_sample_weighted = correct / total
        correct += sum(r.get(m.correct, 0.0) for r in per_client.values())
        total += sum(r.get(m.total, 0.0) for r in per_client.values())
        if total > 0:
            acc.acc_all_sample_weighted = correct / total
        if acc != ModelAccuracy():
            evaluation.accuracies[m.model] = acc


def make_summary(algorithm: str, history: list[RoundRecord], counters: dict,
                 per_client: dict[int, dict[str, float]], cfg: EngineConfig) -> dict[str, Any]:
    """The run summary: final-round metrics (not best-round), best-round accuracy (named as such),
    communication totals, CO to target, failures, per-client final accuracies, timing."""
    evals = [r for r in history if r.mean_accuracy() is not None]
    final = evals[-1].evaluation if evals else None
    clients = {}
    for cid, r in sorted(per_client.items()):
        clients[str(cid)] = client_accuracies(r)
        sizes = totals(r)
        clients[str(cid)][TEST_SAMPLES] = next((n for m, n in sizes.items() if not m.endswith(GLOBAL_SUFFIX)), 0)
        held = next((n for m, n in sizes.items() if m.endswith(GLOBAL_SUFFIX)), None)
        if held is not None:  # the held-out global test set's size (the same images for every client)
            clients[str(cid)][GLOBAL_TEST_SAMPLES] = held
    accepted = sum(r.accepted for r in history)  # cum_bytes_up counts the accepted uploads only
    tot = sum(r.time_s for r in history)
    eng = sum(r.time_engine_s for r in history)
    return {
        "algorithm": algorithm,
        "rounds": len(history),
        "final": final.accuracy_row() if final is not None else {},
        "best_round_model_acc_mean_over_clients": max((r.mean_accuracy() for r in evals), default=None),
        "cum_bytes_up": counters["cum_bytes_up"],
        "cum_bytes_down": counters["cum_bytes_down"],
        "cum_mb": (counters["cum_bytes_up"] + counters["cum_bytes_down"]) / 1e6,
        "mean_bytes_up_per_client_per_round": (counters["cum_bytes_up"] / accepted) if accepted else 0.0,
        **({"cum_wire_bytes_down": counters["cum_wire_bytes_down"], "cum_wire_bytes_up": counters["cum_wire_bytes_up"],
            "cum_wire_bytes_eval_down": counters["cum_wire_bytes_eval_down"],
            "cum_wire_mb": (counters["cum_wire_bytes_down"] + counters["cum_wire_bytes_up"]) / 1e6}
           if "cum_wire_bytes_down" in counters else {}),
        "target_accuracy": cfg.target_accuracy,
        "co_mb_to_target": counters["co_mb_to_target"],
        "co_round": counters["co_round"],
        "failures": counters["failures"],
        "rejected_uploads": counters.get("rejected", 0),
        "failed_rounds": counters.get("failed_rounds", 0),
        **({"failed_round_reasons": counters["failed_round_reasons"]} if counters.get("failed_round_reasons") else {}),
        "clients": clients,
        "time_s": tot,
        "engine_overhead_share": eng / tot if tot > 0 else 0.0,
        **({"eval_coverage": eval_coverage(final)} if final is not None and final.untrained_clients is not None
           else {}),
    }


def eval_coverage(evaluation: RoundEvaluation) -> dict[str, str]:
    """Which clients each figure of an ``evaluation`` that evaluated the clients that had not
    trained together covers, in words (``summary.json``'s ``eval_coverage``)."""
    trained, untrained = int(evaluation.trained_clients or 0), int(evaluation.untrained_clients or 0)
    m = ModelKeys("m")  # any model
    return {
        f"{m.acc_mean_over_clients}, {m.acc_std_over_clients}, {m.acc_sample_weighted}, clients":
            f"the {trained} clients that have trained (their committed states, one evaluation each)",
        m.acc_untrained_sample_weighted:
            f"the {untrained} clients that have not trained yet, pooled: one evaluation per architecture of the "
            "initial model of its first such client on all their test splits",
        m.acc_all_sample_weighted: f"all {trained + untrained} clients' test samples (both of the above)",
    }


__all__ = ["Engine", "EngineConfig", "eval_coverage", "failed_round_reason", "unusable_state", "upload_names",
           "RoundResult", "RoundTimes", "RunState",
           "summarize_eval", "summarize_untrained",
           "make_summary", "RunObserver", "sample_clients", "sporadic_update"]
