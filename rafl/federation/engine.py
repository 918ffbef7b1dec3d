"""The in-process federation engine: rounds, sampling, faults, communication counting, checkpoints.

The engine moves :class:`~rafl.federation.payload.Payload` s between an algorithm's client and
server steps and knows no algorithm by name. One round ``t``:

1. *Sporadic participation* (RaFL's sporadic setting): a share ``sporadic_rate`` of the currently
   available clients leaves and is replaced by clients drawn from the rest of the population.
2. *Sampling*: ``clients_per_round`` clients (a count, or a fraction of the available ones) are
   drawn without replacement, seeded by ``(seed, t)``.
3. *Dropout*: each sampled client fails with probability ``dropout`` after downloading; it uploads
   nothing and its state is not updated. The round completes with the rest (failures counted).
4. Every surviving client: its committed state is loaded from disk (or ``init_client`` on first
   use), ``client_update`` runs with loaders and torch RNG seeded by ``(seed, client, t)``, the
   new state is written to disk, the upload is screened (:mod:`rafl.federation.screening`: size,
   dtypes, finite values in range, shapes vs ``upload_spec``, the method's ``check_upload``); a
   rejected upload is logged and counted and its client's new state discarded; below
   ``min_valid_uploads`` valid uploads the round is reported failed and changes no state. An
   accepted upload's ``n_samples`` is the client's registered count, never its own claim.
   A *client runner* does the client part: :class:`InProcessClients` here, one client after the
   other, :class:`rafl.federation.workers.WorkerClients` in ``engine.workers`` forked processes, or :class:`rafl.federation.flower.FlowerClients` as Flower ClientApps on SuperNodes
   (a node that fails or times out loses its clients for the round: counted as failed).
5. ``server_aggregate`` produces the next broadcast.
6. Every ``eval_every`` rounds (and the last): each client's test split is evaluated
   (``prepare_evaluation`` + ``evaluate``); reported per model ``m``: ``m.acc_mean_over_clients``,
   ``m.acc_sample_weighted`` (sum correct / sum samples), ``m.acc_std_over_clients``.
7. Communication: bytes of every download (``client_broadcast(...).nbytes()``) and every upload
   (``nbytes()`` of what the client returned; the sender id travels in the envelope) per round and
   cumulative. ``co_mb_to_target`` (FedGH's communication overhead, Yi et al. Sec. 5.3): the
   cumulative MB (up + down) at the first evaluated round whose ``model.acc_mean_over_clients``
   reaches ``target_accuracy``. These are per-client payload bytes (the papers' communication
   cost: every client's copy of a broadcast counts). A runner that sends messages (Flower) also
   reports the bytes its messages carried (``wire_bytes_down``/``_up``/``_eval_down``,
   ``cum_wire_mb``: a broadcast the clients of one node share travels once to that node).
8. ``metrics.jsonl``/``metrics.csv`` rewritten, then ``checkpoint.safetensors`` (server state, broadcast,
   available set, committed client-state versions, counters, metrics so far) written atomically.

``resume`` continues from the last complete round; because every random draw is seeded by
``(seed, round[, client])`` and client states are versioned (:mod:`rafl.federation.store`), a
resumed run ends with the same metrics as an uninterrupted one. That holds bit for bit on CPU (what
the tests check); on CUDA, cuDNN's default convolution algorithms are not deterministic, so runs
(resumed or not) agree up to floating-point noise unless the caller sets
``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rafl.config import EngineConfig
from rafl.errors import UserInputError, shown, warn
from rafl.federation.aggregation import AggregationRule
from rafl.federation.algorithms.base import Algorithm, ClientContext, ClientInfo, Loader, ServerContext
from rafl.federation.payload import Payload
from rafl.federation.progress import report
from rafl.federation.screening import UploadPolicy, screen_uploads
from rafl.federation.store import ClientStore, load_state, save_state
from rafl.io import atomic_write_json, atomic_write_text, remove_orphaned_tmp
from rafl.reports.tables import accuracy_name, fmt_bytes

#: ``loaders(client_id, split, seed) -> Loader`` with split in {"train", "val", "test"}; train
#: loaders shuffle with ``seed``, val/test loaders do not; "val" may return None.
LoaderFactory = Callable[[int, str, int], Loader | None]
#: ``client_model(client_id, arch=None) -> nn.Module`` (see ``ClientContext.make_model``).
ClientModelFactory = Callable[..., torch.nn.Module]

CHECKPOINT = "checkpoint.safetensors"
#: Added to a NaN/Inf upload's error: an honest client's non-finite upload is training that
#: diverged (e.g. one step at a huge learning rate leaves finite but huge weights, whose features
#: then overflow), which the loss check cannot see.
DIVERGED_UPLOAD = (" (the client's local training diverged); allowed: a smaller algorithm.lr, or a model whose "
                   "features stay finite")


def _count(spec: float | int, n: int, name: str, of: str) -> int:
    if isinstance(spec, float) and 0 < spec <= 1:
        return max(1, int(math.ceil(spec * n - 1e-9)))
    if isinstance(spec, int) and not isinstance(spec, bool) and 1 <= spec <= n:
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool) and spec > n:
        raise UserInputError(f"is {spec}, more than the {n} {of}; allowed: a fraction in (0, 1] or a count "
                             f"in 1..{n}", field=f"engine.{name}")
    raise UserInputError(f"is {shown(spec)}; allowed: a fraction in (0, 1] or a count >= 1", field=f"engine.{name}")


def participation(config: EngineConfig, n_clients: int) -> tuple[int, int]:
    """``(available, sampled per round)`` client counts of ``config`` for ``n_clients`` clients.

    Raises:
        UserInputError: ``engine.available`` or ``engine.clients_per_round`` is not a fraction in
            (0, 1] or a count >= 1, or a count larger than the clients it picks from (the
            population, resp. the available clients).
    """
    available = _count(config.available, n_clients, "available", "clients (clients.n)")
    return available, _count(config.clients_per_round, available, "clients_per_round",
                             "available clients" if available < n_clients else "clients (clients.n)")


def seed_of(*parts: int) -> int:
    """A 63-bit seed derived from integers (numpy SeedSequence), stable across runs/platforms."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


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
class Federation:
    """Everything the engine needs for one run (built by :mod:`rafl.federation.pipeline` or tests).

    Attributes:
        algorithm: the method instance.
        clients: the population's :class:`ClientInfo` (ids 0..n-1, in order).
        loaders: :data:`LoaderFactory`.
        client_model: :data:`ClientModelFactory`.
        server: the :class:`ServerContext` (its ``round``/``rng`` are set by the engine).
        n_classes: number of classes.
        hparams: the algorithm's hyperparameters (copied into every context).
        device: torch device of local computation.
    """

    algorithm: Algorithm
    clients: list[ClientInfo]
    loaders: LoaderFactory
    client_model: ClientModelFactory
    server: ServerContext
    n_classes: int
    hparams: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def client_context(fed: Federation, seed: int, cid: int, rnd: int) -> ClientContext:
    """The :class:`ClientContext` of client ``cid`` in round ``rnd`` of a run seeded ``seed``:
    loaders and ``rng`` seeded by ``seed_of(seed, cid, rnd)``. Every runner (in this process, or a
    Flower ClientApp on a SuperNode) builds the same context, so the backends draw the same numbers."""
    cseed = seed_of(seed, cid, rnd)
    info = fed.clients[cid]
    return ClientContext(
        info=info,
        make_model=lambda arch=None, _cid=cid: fed.client_model(_cid, arch),
        train_loader=fed.loaders(cid, "train", cseed),
        val_loader=fed.loaders(cid, "val", cseed),
        test_loader=fed.loaders(cid, "test", cseed),
        n_classes=fed.n_classes, device=fed.device, seed=cseed, init_seed=seed_of(seed, cid, 1),
        rng=np.random.default_rng(cseed), round=rnd, hparams=dict(fed.hparams), space=fed.server.space)


@contextlib.contextmanager
def naming_client(ctx: ClientContext) -> Iterator[None]:
    """Re-raise a :class:`UserInputError` without a source (a method's own check: diverged
    training, a stored state that does not fit the model) with the client and its model as the
    source, so the one error line says where it happened."""
    try:
        yield
    except UserInputError as err:
        if err.source is not None:
            raise
        raise UserInputError(err.message, source=f"client {ctx.client_id} (model {ctx.info.model_key})",
                             field=err.field) from None


def load_or_init(fed: Federation, store: ClientStore, ctx: ClientContext) -> Any:
    """The client's committed state from ``store``, or ``init_client`` (torch seeded by the
    context's ``init_seed``: the same initial model in every round) for a client that has none yet."""
    if store.has(ctx.client_id):
        return store.load(ctx.client_id)
    torch.manual_seed(ctx.init_seed)
    return fed.algorithm.init_client(ctx)


def train_client(fed: Federation, store: ClientStore, ctx: ClientContext, down: Payload) -> tuple[Payload, float]:
    """One client step: load (or init) the state, ``client_update`` with torch seeded by the
    context's seed, save the new state as a pending version of round ``ctx.round``.

    Returns:
        ``(upload, seconds)``: seconds of client computation (init and update; loading a stored
        state is not counted).

    Raises:
        UserInputError: from ``client_update`` (e.g. diverged local training), naming the client.
    """
    cid = ctx.client_id
    fresh = not store.has(cid)
    tc = time.perf_counter()
    state = load_or_init(fed, store, ctx)
    if not fresh:
        tc = time.perf_counter()  # loading a stored state is engine time
    torch.manual_seed(ctx.seed)
    report("client", client=cid)
    with naming_client(ctx):  # e.g. diverged local training: say which client and model
        state, upload = fed.algorithm.client_update(state, down, ctx)
    seconds = time.perf_counter() - tc
    report("client_done", client=cid)
    store.save(cid, ctx.round, state)
    return upload, seconds


def evaluate_client(fed: Federation, store: ClientStore, ctx: ClientContext, broadcast: Payload) -> dict[str, float]:
    """Evaluate the client's committed state (``prepare_evaluation`` with its view of
    ``broadcast``, then ``evaluate``): the evaluation contract's ``m.correct``/``m.total``.

    Raises:
        UserInputError: from the method (e.g. a stored state that does not fit the model), naming
            the client.
    """
    algo = fed.algorithm
    with naming_client(ctx):
        state = load_or_init(fed, store, ctx)
        state = algo.prepare_evaluation(state, algo.client_broadcast(broadcast, ctx.info), ctx)
        return algo.evaluate(state, ctx)


class InProcessClients:
    """Runs the client steps in this process, one client after the other (the default runner).

    Client states live in the engine's :class:`ClientStore` (``run_dir/clients``), written in the
    background while the next client computes (on disk before the round's commit)."""

    def __init__(self, fed: Federation, store: ClientStore, seed: int):
        self.fed, self.store, self.seed = fed, store, seed
        store.background = True

    def train(self, rnd: int, jobs: list[tuple[int, Payload]]) -> tuple[list[tuple[int, Payload]], dict[int, str], float]:
        """Run ``client_update`` for every ``(client_id, broadcast)`` in ``jobs``.

        Returns:
            ``(uploads, failed, seconds)``: ``(client_id, upload)`` in job order, the clients that
            failed with their reason (never any here: an error in this process stops the run),
            and the seconds of client computation."""
        uploads, seconds = [], 0.0
        for cid, down in jobs:
            upload, sec = train_client(self.fed, self.store, client_context(self.fed, self.seed, cid, rnd), down)
            uploads.append((cid, upload))
            seconds += sec
        return uploads, {}, seconds

    def where(self, cid: int) -> str:
        """Where client ``cid`` computes, as errors append it ("" here; Flower: " on node ...")."""
        return ""

    def evaluate(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
        """The evaluation contract's counts of every client in ``ids`` (committed states), and the
        clients that could not be evaluated with the reason (never any here)."""
        return {cid: evaluate_client(self.fed, self.store, client_context(self.fed, self.seed, cid, rnd), broadcast)
                for cid in ids}, {}

    def evaluate_untrained(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[list, dict[int, str]]:
        """The shared evaluation of clients without a state (:func:`rafl.federation.workers.evaluate_untrained`)."""
        from rafl.federation.workers import evaluate_untrained

        return evaluate_untrained(self.fed, self.store, self.seed, rnd, ids, broadcast), {}


class Engine:
    """Runs a :class:`Federation` for ``config.rounds`` rounds into ``run_dir``.

    Args:
        fed: the federation.
        config: :class:`rafl.config.EngineConfig` (the run config's engine section and seed).
        run_dir: an existing directory (the CLI creates it only after validation); the engine
            writes ``clients/``, ``checkpoint.safetensors``, ``metrics.jsonl``, ``metrics.csv``,
            ``summary.json``, ``accuracy_vs_round.png``, ``accuracy_vs_mb.png`` there.
        progress: show a tqdm bar over rounds.
        clients: the client runner, built from the engine's store (``clients(fed, store, seed)``);
            default :class:`InProcessClients`, or :class:`rafl.federation.workers.WorkerClients`
            with ``config.workers`` > 1. :mod:`rafl.federation.flower` passes one that runs
            the client steps as Flower ClientApps on SuperNodes.

    Raises:
        UserInputError: bad engine values, a population the algorithm rejects, or (on resume) a
            checkpoint that does not belong to this run.
    """

    def __init__(self, fed: Federation, config: EngineConfig, run_dir: str | Path, progress: bool = True,
                 clients: Callable[[Federation, ClientStore, int], Any] | None = None):
        self.fed = fed
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
        if clients is None:
            from rafl.federation.workers import runner

            clients = runner(config.workers, self.n_sampled, fed.device)
        self.clients = clients(fed, self.store, config.seed)
        self.times: list[RoundTimes] = []

    # ------------------------------------------------------------------ contexts
    def _server_ctx(self, rnd: int) -> ServerContext:
        s = self.fed.server
        s.round = rnd
        s.seed = self.cfg.seed
        s.rng = np.random.default_rng(seed_of(self.cfg.seed, rnd, 7))
        s.hparams = dict(self.fed.hparams)
        s.aggregation = self.rule
        return s

    # ------------------------------------------------------------------ checkpoint
    def _checkpoint(self, rnd: int, server_state: Any, broadcast: Payload, available: list[int],
                    history: list[dict], counters: dict) -> None:
        committed = self.store.commit()
        save_state(self.run_dir / CHECKPOINT, {
            "round": rnd,
            "server_state": server_state,
            "broadcast_tensors": broadcast.tensors,
            "broadcast_meta": json.dumps(broadcast.meta),
            "available": list(available),
            "committed": {str(k): v for k, v in committed.items()},
            "history": json.dumps(history),
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
    def _evaluate(self, rnd: int, broadcast: Payload) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
        ids = list(range(len(self.fed.clients))) if self.cfg.eval_clients == "all" else sorted(self.store.committed)
        untrained = [cid for cid in ids if not self.store.has(cid)]
        shared = bool(untrained) and self.fed.algorithm.shared_initial_evaluation and hasattr(self.clients, "evaluate_untrained")
        if shared:  # clients that never trained: one evaluation per architecture, not one each
            ids = [cid for cid in ids if self.store.has(cid)]
        per_client, lost = self.clients.evaluate(rnd, ids, broadcast)
        summary: dict[str, Any] = summarize_eval(per_client)
        if shared:
            from rafl.federation.workers import summarize_untrained

            groups, lost_untrained = self.clients.evaluate_untrained(rnd, untrained, broadcast)
            summary.update(summarize_untrained(per_client, groups))
            lost.update(lost_untrained)
        if lost:  # a Flower node that failed or timed out: its clients are left out of this round's accuracies
            summary["eval_lost"] = {str(cid): why for cid, why in sorted(lost.items())}
        return summary, per_client

    def _count_wire(self, row: dict[str, Any], counters: dict[str, Any]) -> None:
        """A runner that sends messages (Flower) reports the bytes they carried (``take_traffic``):
        the round's ``wire_bytes_down`` / ``wire_bytes_up`` (training: a broadcast several clients of
        a node share counted once per node) and ``wire_bytes_eval_down`` (evaluation), and
        ``cum_wire_mb`` (training, down + up); beside the per-client payload bytes
        (``bytes_down`` / ``bytes_up``, the papers' communication cost, every client's copy)."""
        take = getattr(self.clients, "take_traffic", None)
        if take is None:
            return
        sent = take()
        for key in ("down", "up", "eval_down"):
            row[f"wire_bytes_{key}"] = int(sent[key])
            counters[f"cum_wire_bytes_{key}"] = counters.get(f"cum_wire_bytes_{key}", 0) + int(sent[key])
        row["cum_wire_mb"] = (counters["cum_wire_bytes_down"] + counters["cum_wire_bytes_up"]) / 1e6

    # ------------------------------------------------------------------ main loop
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or continue) the federation; returns the summary (also in ``summary.json``)."""
        try:
            return self._run(resume)
        finally:
            close = getattr(self.clients, "close", None)  # a runner's worker processes
            if close is not None:
                close()

    def _run(self, resume: bool) -> dict[str, Any]:
        fed, cfg, algo = self.fed, self.cfg, self.fed.algorithm
        n = len(fed.clients)
        if resume:
            for folder in (self.run_dir, self.run_dir / "clients"):  # what a kill -9 mid-write left behind
                remove_orphaned_tmp(folder)
            ck = self._load_checkpoint()
            start = int(ck["round"]) + 1
            server_state = ck["server_state"]
            broadcast = Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))
            available = [int(v) for v in ck["available"]]
            self.store.committed = {int(k): int(v) for k, v in ck["committed"].items()}
            self.store.cleanup()
            history = json.loads(ck["history"])
            counters = json.loads(ck["counters"])
        else:
            torch.manual_seed(seed_of(cfg.seed, 0, 7))
            server_state, broadcast = algo.init_server(self._server_ctx(0))
            rng0 = np.random.default_rng(seed_of(cfg.seed, 0, 3))
            available = sorted(int(v) for v in rng0.choice(n, size=self.n_available, replace=False))
            history, counters = [], {"cum_bytes_up": 0, "cum_bytes_down": 0, "failures": 0,
                                     "co_mb_to_target": None, "co_round": None}
        bar = tqdm(range(start if resume else 1, cfg.rounds + 1), desc=f"{algo.name} rounds",
                   disable=not self.progress, initial=(start - 1) if resume else 0, total=cfg.rounds)
        last_eval: tuple[dict, dict] | None = None
        for rnd in bar:
            t0 = time.perf_counter()
            times = RoundTimes()
            rng = np.random.default_rng(seed_of(cfg.seed, rnd, 1))
            if cfg.sporadic_rate > 0 and rnd > 1:
                available = sporadic_update(available, n, cfg.sporadic_rate, rng)
            sampled = sample_clients(available, self.n_sampled, rng)
            failed = [cid for cid, u in zip(sampled, rng.random(len(sampled))) if u < cfg.dropout]
            bytes_up = bytes_down = 0
            uploads: list[Payload] = []
            shared_nbytes: int | None = None  # the common broadcast is serialized once per round
            jobs: list[tuple[int, Payload]] = []
            limits: dict[int, int] = {}  # the largest upload the server accepts, per client
            for cid in sampled:
                down = algo.client_broadcast(broadcast, fed.clients[cid])
                if down is broadcast:
                    shared_nbytes = broadcast.nbytes() if shared_nbytes is None else shared_nbytes
                    down_bytes = shared_nbytes
                else:
                    down_bytes = down.nbytes()
                bytes_down += down_bytes
                if cid not in failed:
                    jobs.append((cid, down))
                    limits[cid] = self.policy.byte_limit(algo.upload_spec(server_state, fed.clients[cid]), down_bytes)
            if hasattr(self.clients, "upload_limits"):  # a runner that receives wire bytes checks them unparsed
                self.clients.upload_limits = limits
            report("round", round=rnd, rounds=cfg.rounds, clients=len(jobs))
            results, lost, times.client_update = self.clients.train(rnd, jobs)
            report("trained", done=len(results))
            failed = failed + sorted(lost)
            # the sender names the client's model: a NaN upload usually means that model diverged
            screened = screen_uploads(
                results, algo, server_state, fed.clients, fed.server.n_classes, self.policy, limits=limits,
                sender=lambda c: f"client {c} (model {fed.clients[c].model_key}){self.clients.where(c)}",
                nonfinite_hint=DIVERGED_UPLOAD)
            uploads, bytes_up = screened.accepted, screened.bytes_up
            for cid, why in screened.rejected.items():
                self.store.pending.pop(cid, None)  # a rejected client's new state is not committed
                warn(f"round {rnd}: rejected the upload of {why}")
            round_failed = bool(results) and len(uploads) < self.policy.min_valid_uploads
            if round_failed:  # too few valid uploads: the round changes no server or client state
                self.store.pending.clear()
                warn(f"round {rnd} failed: {len(uploads)} valid upload(s), engine.min_valid_uploads is "
                     f"{self.policy.min_valid_uploads}; the server state is unchanged")
            else:
                torch.manual_seed(seed_of(cfg.seed, rnd, 7))
                ta = time.perf_counter()
                server_state, broadcast = algo.server_aggregate(uploads, server_state, self._server_ctx(rnd))
                times.aggregate = time.perf_counter() - ta
            del uploads
            counters["rejected"] = counters.get("rejected", 0) + len(screened.rejected)
            counters["failed_rounds"] = counters.get("failed_rounds", 0) + int(round_failed)
            counters["cum_bytes_up"] += bytes_up
            counters["cum_bytes_down"] += bytes_down
            counters["failures"] += len(failed)
            row: dict[str, Any] = {
                "round": rnd, "sampled": len(sampled), "failed": len(failed),
                "participated": len(sampled) - len(failed),
                "bytes_up": bytes_up, "bytes_down": bytes_down,
                "cum_bytes_up": counters["cum_bytes_up"], "cum_bytes_down": counters["cum_bytes_down"],
                "cum_mb": (counters["cum_bytes_up"] + counters["cum_bytes_down"]) / 1e6,
                "bytes_up_per_client": bytes_up / max(1, len(sampled) - len(failed)),
                "rejected": len(screened.rejected),
            }
            if screened.rejected:  # uploads the server refused, with the reason (rafl.federation.screening)
                row["rejected_reasons"] = {str(cid): why for cid, why in sorted(screened.rejected.items())}
                row["bytes_rejected"] = screened.bytes_rejected
            if screened.claims_overridden:  # clients whose own n_samples claim the registered count replaced
                row["n_samples_overridden"] = screened.claims_overridden
            if round_failed:
                row["round_failed"] = True
            if lost:  # clients a runner lost (a Flower node's error or timeout), with the reason
                row["lost"] = {str(cid): why for cid, why in sorted(lost.items())}
            if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
                self.store.commit()  # evaluation reads this round's states
                te = time.perf_counter()
                report("evaluate", clients=len(fed.clients) if cfg.eval_clients == "all" else len(self.store.committed))
                last_eval = self._evaluate(rnd, broadcast)
                times.evaluate = time.perf_counter() - te
                row.update(last_eval[0])
                acc = last_eval[0].get("model.acc_mean_over_clients")
                if (cfg.target_accuracy is not None and counters["co_mb_to_target"] is None
                        and acc is not None and acc >= cfg.target_accuracy):
                    counters["co_mb_to_target"] = row["cum_mb"]
                    counters["co_round"] = rnd
            self._count_wire(row, counters)
            times.total = time.perf_counter() - t0
            row.update({"time_s": times.total, "time_client_update_s": times.client_update,
                        "time_aggregate_s": times.aggregate, "time_evaluate_s": times.evaluate,
                        "time_engine_s": times.engine})
            history.append(row)
            tw = time.perf_counter()
            write_metrics(self.run_dir, history)
            self._checkpoint(rnd, server_state, broadcast, available, history, counters)
            times.total += time.perf_counter() - tw
            row["time_s"], row["time_engine_s"] = times.total, times.engine
            self.times.append(times)
            report("round_end", round=rnd)
            if "model.acc_mean_over_clients" in row:
                bar.set_postfix(acc=f"{row['model.acc_mean_over_clients']:.3f}", comm=fmt_bytes(row["cum_mb"] * 1e6))
        bar.close()
        if last_eval is None:  # resumed after the final round: re-evaluate from the checkpoint
            last_eval = self._evaluate(cfg.rounds, broadcast)
        summary = make_summary(algo.name, history, counters, last_eval[1], cfg)
        write_metrics(self.run_dir, history)
        atomic_write_json(self.run_dir / "summary.json", summary)
        plot_metrics(self.run_dir, history)
        return summary


# ---------------------------------------------------------------------- metrics
def summarize_eval(per_client: dict[int, dict[str, float]]) -> dict[str, float]:
    """Per model ``m`` (keys ``m.correct``/``m.total`` of the evaluation contract):
    ``m.acc_mean_over_clients`` (unweighted mean of per-client accuracies),
    ``m.acc_sample_weighted`` (sum correct / sum total) and ``m.acc_std_over_clients``
    (population std of per-client accuracies). Clients with an empty test split are skipped.
    Other numeric keys are averaged over clients as ``key.mean``."""
    out: dict[str, float] = {}
    models = sorted({k[:-len(".correct")] for r in per_client.values() for k in r if k.endswith(".correct")})
    for m in models:
        accs, correct, total = [], 0.0, 0.0
        for r in per_client.values():
            tot = r.get(f"{m}.total", 0.0)
            if tot > 0:
                accs.append(r[f"{m}.correct"] / tot)
                correct += r[f"{m}.correct"]
                total += tot
        if accs:
            out[f"{m}.acc_mean_over_clients"] = float(np.mean(accs))
            out[f"{m}.acc_sample_weighted"] = correct / total
            out[f"{m}.acc_std_over_clients"] = float(np.std(accs))
    extra = sorted({k for r in per_client.values() for k in r if not k.endswith((".correct", ".total"))})
    for k in extra:
        vals = [r[k] for r in per_client.values() if k in r]
        out[f"{k}.mean"] = float(np.mean(vals))
    return out


def write_metrics(run_dir: Path, history: list[dict]) -> None:
    """``metrics.jsonl`` (one JSON object per round) and ``metrics.csv`` (union of columns), atomically."""
    atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
    cols: list[str] = []
    for r in history:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, restval="")
    w.writeheader()
    w.writerows(history)
    atomic_write_text(run_dir / "metrics.csv", buf.getvalue())


def make_summary(algorithm: str, history: list[dict], counters: dict, per_client: dict[int, dict[str, float]],
                 cfg: EngineConfig) -> dict[str, Any]:
    """The run summary: final-round metrics (not best-round), best-round accuracy (named as such),
    communication totals, CO to target, failures, per-client final accuracies, timing."""
    evals = [r for r in history if "model.acc_mean_over_clients" in r]
    final = evals[-1] if evals else {}
    clients = {}
    for cid, r in sorted(per_client.items()):
        clients[str(cid)] = {k[:-len(".correct")] + ".acc": (r[k] / r[k[:-len(".correct")] + ".total"]
                                                              if r[k[:-len(".correct")] + ".total"] else None)
                             for k in r if k.endswith(".correct")}
        clients[str(cid)]["test_samples"] = next((v for k, v in r.items() if k.endswith(".total")), 0)
    part = [r["participated"] for r in history]
    tot = sum(r["time_s"] for r in history)
    eng = sum(r["time_engine_s"] for r in history)
    return {
        "algorithm": algorithm,
        "rounds": len(history),
        "final": {k: v for k, v in final.items() if ".acc_" in k},
        "best_round_model_acc_mean_over_clients": max((r["model.acc_mean_over_clients"] for r in evals), default=None),
        "cum_bytes_up": counters["cum_bytes_up"],
        "cum_bytes_down": counters["cum_bytes_down"],
        "cum_mb": (counters["cum_bytes_up"] + counters["cum_bytes_down"]) / 1e6,
        "mean_bytes_up_per_client_per_round": (counters["cum_bytes_up"] / sum(part)) if sum(part) else 0.0,
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
        "clients": clients,
        "time_s": tot,
        "engine_overhead_share": eng / tot if tot > 0 else 0.0,
        **({"eval_coverage": eval_coverage(final)} if "eval.untrained_clients" in final else {}),
    }


def eval_coverage(row: dict[str, Any]) -> dict[str, str]:
    """Which clients each figure of an evaluated ``row`` covers, in words (``summary.json``'s
    ``eval_coverage`` when some clients had not trained yet)."""
    trained, untrained = int(row.get("eval.trained_clients", 0)), int(row["eval.untrained_clients"])
    return {
        "m.acc_mean_over_clients, m.acc_std_over_clients, m.acc_sample_weighted, clients":
            f"the {trained} clients that have trained (their committed states, one evaluation each)",
        "m.acc_untrained_sample_weighted":
            f"the {untrained} clients that have not trained yet, pooled: one evaluation per architecture of the "
            "initial model of its first such client on all their test splits",
        "m.acc_all_sample_weighted": f"all {trained + untrained} clients' test samples (both of the above)",
    }


def plot_metrics(run_dir: Path, history: list[dict]) -> None:
    """``accuracy_vs_round.png`` and ``accuracy_vs_mb.png`` (every evaluated model, mean over
    clients with a +-std band), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in history if any(k.endswith(".acc_mean_over_clients") for k in r)]
    if not evals:
        return
    models = sorted({k.split(".acc_mean_over_clients")[0] for r in evals for k in r
                     if k.endswith(".acc_mean_over_clients")})
    for xkey, fname, xlabel in (("round", "accuracy_vs_round.png", "round"),
                                ("cum_mb", "accuracy_vs_mb.png", "cumulative communication (MB, up + down)")):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for m in models:
            pts = [(r[xkey], r[f"{m}.acc_mean_over_clients"], r[f"{m}.acc_std_over_clients"]) for r in evals
                   if f"{m}.acc_mean_over_clients" in r]
            x, y, s = (np.array(v, dtype=float) for v in zip(*pts))
            name = accuracy_name(m)  # the tables' name ("deployed model", "knowledge network", ...)
            ax.plot(x, y, marker="o", ms=3, label=f"{name} (mean over clients, band = std)")
            ax.fill_between(x, np.clip(y - s, 0, 1), np.clip(y + s, 0, 1), alpha=0.15)  # accuracy lives in [0, 1]
        ax.set_xlabel(xlabel)
        if xkey == "round":  # rounds are whole numbers: no 1.5 (or 0.96 for one round) ticks on short runs
            from matplotlib.ticker import MaxNLocator

            rounds = sorted({int(r["round"]) for r in evals})
            if len(rounds) <= 12:
                ax.set_xticks(rounds)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        from rafl.io import atomic_write_bytes

        atomic_write_bytes(run_dir / fname, buf.getvalue())


__all__ = ["Engine", "EngineConfig", "eval_coverage", "Federation", "participation", "RoundTimes", "InProcessClients", "client_context",
           "load_or_init", "naming_client", "train_client", "evaluate_client", "LoaderFactory", "summarize_eval",
           "write_metrics", "make_summary", "plot_metrics", "seed_of", "sample_clients", "sporadic_update"]
