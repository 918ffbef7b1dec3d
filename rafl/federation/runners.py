"""The client side of a round: what a client runner runs for one client, and the in-process runner.

The :class:`~rafl.federation.engine.Engine` hands a *client runner* the round's jobs and gets the
uploads back; it never calls a method's client step itself. Every runner -- :class:`InProcessClients`
here (one client after the other, in this process), :class:`rafl.federation.workers.WorkerClients`
(forked processes), :class:`rafl.federation.flower_runner.FlowerClients` (Flower ClientApps on SuperNodes)
-- runs the same functions on the same seeded context (:func:`client_context`): :func:`train_client`
and :func:`evaluate_client`, and for clients that never trained the shared evaluation per
architecture (:func:`evaluate_untrained`). So the backends draw the same numbers.

Every runner is a :class:`ClientRunner`: ``train(rnd, jobs, limits)`` (``limits``: the round's
upload limits, which a runner that receives wire bytes checks unparsed) and ``evaluate(rnd, ids,
broadcast)``, plus hooks with defaults: ``evaluate_untrained`` (where
:attr:`ClientRunner.shares_initial_evaluation`), ``where(cid)``, ``take_traffic()`` (a runner
that sends messages) and ``close()``.
The engine gets one from a :data:`RunnerFactory`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.algorithms.base import Algorithm, ClientContext, ClientInfo, Loader, ServerContext
from rafl.federation.bn_statistics import deployment, overrides
from rafl.federation.events import report
from rafl.federation.metric_keys import GLOBAL_SUFFIX, global_count
from rafl.federation.payload import Payload
from rafl.federation.screening import ClientError
from rafl.federation.store import ClientStore
from rafl.seeds import SeedTree

#: Test samples per batch of the shared evaluation of never-trained clients.
POOLED_BATCH = 256

#: ``loaders(client_id, split, seed) -> Loader`` with split in {"train", "val", "test"}; train
#: loaders shuffle with ``seed``, val/test loaders do not; "val" may return None.
LoaderFactory = Callable[[int, str, int], Loader | None]
#: ``client_model(client_id, arch=None) -> nn.Module`` (see ``ClientContext.make_model``).
ClientModelFactory = Callable[..., torch.nn.Module]


@dataclass
class Federation:
    """Everything the engine needs for one run (built by :mod:`rafl.stages.prepare` or tests).

    Attributes:
        algorithm: the method instance.
        clients: the population's :class:`ClientInfo` (ids 0..n-1, in order).
        loaders: :data:`LoaderFactory`.
        client_model: :data:`ClientModelFactory`.
        server: the :class:`ServerContext` (its ``round`` and ``seed`` are set by the engine).
        n_classes: number of classes.
        device: torch device of local computation.
        global_test: a loader over the held-out balanced global test set (the same images for
            every client; :func:`rafl.federation.build.global_test_loader`), or None.
        bn_statistics: ``train.bn_statistics``: where the deployed models' BatchNorm statistics
            come from (:mod:`rafl.federation.bn_statistics`; None: the method's own rule).
    """

    algorithm: Algorithm
    clients: list[ClientInfo]
    loaders: LoaderFactory
    client_model: ClientModelFactory
    server: ServerContext
    n_classes: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    global_test: Loader | None = None
    bn_statistics: str | None = None


def client_context(fed: Federation, seed: int, cid: int, rnd: int) -> ClientContext:
    """The :class:`ClientContext` of client ``cid`` in round ``rnd`` of a run seeded ``seed``:
    loaders and ``seed`` from the run's seed tree (:meth:`~rafl.seeds.SeedTree.client`). Every runner (in this process, or a
    Flower ClientApp on a SuperNode) builds the same context, so the backends draw the same numbers."""
    tree = SeedTree(seed)
    cseed = tree.client(rnd, cid)
    info = fed.clients[cid]
    return ClientContext(
        info=info,
        make_model=lambda arch=None, _cid=cid: fed.client_model(_cid, arch),
        train_loader=fed.loaders(cid, "train", cseed),
        val_loader=fed.loaders(cid, "val", cseed),
        test_loader=fed.loaders(cid, "test", cseed),
        n_classes=fed.n_classes, device=fed.device, seed=cseed, init_seed=tree.client_init(cid),
        round=rnd, space=fed.server.space)


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


def deployed_fingerprint(fed: Federation, state: Any, ctx: ClientContext) -> tuple[str, str] | None:
    """``(model_key, SHA-256 of the prepared state's tensors and values)``: equal for two clients whose
    global-test-set counts are equal (:attr:`~rafl.federation.algorithms.base.Algorithm.evaluates_state_only`),
    or None where they may differ: a method that reads more than the state, BN statistics re-estimated on
    each client's own data (``train.bn_statistics: client``), or a state holding what is not a tensor,
    number, string or container of them."""
    algo = fed.algorithm
    if not algo.evaluates_state_only or (overrides(algo, fed.bn_statistics) and fed.bn_statistics == "client"):
        return None
    digest = hashlib.sha256()

    def feed(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return True
        if value is None or isinstance(value, (bool, int, float, str)):
            digest.update(f"V{type(value).__name__}{value!r}".encode())
            return True
        if isinstance(value, Mapping):
            digest.update(f"M{len(value)}".encode())
            return all(feed(k) and feed(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            return all(feed(v) for v in value)
        return False

    return (ctx.info.model_key, digest.hexdigest()) if feed(state) else None


def evaluate_state(fed: Federation, state: Any, ctx: ClientContext,
                   shared: dict[tuple[str, str], dict[str, float]] | None = None) -> dict[str, float]:
    """``evaluate`` of a prepared client state on the client's own test split, and, when the
    federation has a held-out global test set (``fed.global_test``), on it too, its models renamed
    ``m@global`` (:func:`rafl.federation.metric_keys.global_count`). The deployed models' BatchNorm
    statistics follow ``fed.bn_statistics`` (:func:`rafl.federation.bn_statistics.deployment`).

    ``shared``: the global-test-set counts already scored in this evaluation, by
    :func:`deployed_fingerprint`; a client whose deployed model is there reuses them (the same
    numbers: the same weights, statistics and images), one that is not adds its own. None: every
    client is scored."""
    algo = fed.algorithm
    with deployment(fed.bn_statistics, algo, ctx.train_loader, fed.server.public_images, ctx.device):
        out = dict(algo.evaluate(state, ctx))
    held = fed.global_test
    if held is not None:
        key = deployed_fingerprint(fed, state, ctx) if shared is not None else None
        counts = shared.get(key) if key is not None else None
        if counts is None:
            with deployment(fed.bn_statistics, algo, ctx.train_loader, fed.server.public_images, ctx.device):
                counts = algo.evaluate(state, dataclasses.replace(ctx, test_loader=held))
            if key is not None:
                shared[key] = dict(counts)
        for key_, value in counts.items():
            held_key = global_count(key_)
            if held_key is not None:
                out[held_key] = value
    return out


def evaluate_client(fed: Federation, store: ClientStore, ctx: ClientContext, broadcast: Payload,
                    shared: dict[tuple[str, str], dict[str, float]] | None = None) -> dict[str, float]:
    """Evaluate the client's committed state (``prepare_evaluation`` with its view of
    ``broadcast``, then ``evaluate``, :func:`evaluate_state`, ``shared`` as there): the evaluation
    contract's ``m.correct``/``m.total`` (and ``m@global.*`` with a global test set).

    Raises:
        UserInputError: from the method (e.g. a stored state that does not fit the model), naming
            the client.
    """
    algo = fed.algorithm
    with naming_client(ctx):
        state = load_or_init(fed, store, ctx)
        state = algo.prepare_evaluation(state, algo.client_broadcast(broadcast, ctx.info), ctx)
        return evaluate_state(fed, state, ctx, shared)


#: ``(client id, upload)`` pairs in job order, the clients lost with the reason, and the seconds of
#: client computation: what :meth:`ClientRunner.train` returns
Trained = tuple[list[tuple[int, Payload]], dict[int, str], float]
#: per-client evaluation counts (the evaluation contract) and the clients lost with the reason
Evaluated = tuple[dict[int, dict[str, float]], dict[int, str]]


class ClientRunner(ABC):
    """Whoever runs a round's client steps for the :class:`~rafl.federation.engine.Engine`: in this
    process (:class:`InProcessClients`), in forked processes
    (:class:`rafl.federation.workers.WorkerClients`) or as Flower ClientApps
    (:class:`rafl.federation.flower_runner.FlowerClients`). Each runs :func:`train_client` and
    :func:`evaluate_client` on :func:`client_context`, so every runner draws the same numbers.

    Class attributes:
        shares_initial_evaluation: :meth:`evaluate_untrained` evaluates clients that never trained
            together, one evaluation per model (else the engine evaluates them one by one).
    """

    shares_initial_evaluation: ClassVar[bool] = False

    @abstractmethod
    def train(self, rnd: int, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]) -> Trained:
        """``client_update`` of every ``(client_id, download)`` in ``jobs``; the new states are
        pending versions of round ``rnd`` in the store. ``limits``: ``client id -> largest upload in
        bytes`` the server accepts this round (a runner that receives wire bytes checks them before
        parsing; the engine's screening checks every upload again)."""

    @abstractmethod
    def evaluate(self, rnd: int, ids: list[int], broadcast: Payload) -> Evaluated:
        """The evaluation contract's counts of every client in ``ids`` (committed states)."""

    def evaluate_untrained(self, rnd: int, ids: list[int], broadcast: Payload
                           ) -> tuple[list[tuple[list[int], dict[str, float]]], dict[int, str]]:
        """The shared evaluation of clients without a state (:func:`evaluate_untrained`); only
        called where :attr:`shares_initial_evaluation`.

        Raises:
            NotImplementedError: a runner that does not share it."""
        raise NotImplementedError(f"{type(self).__name__} evaluates untrained clients one by one")

    def where(self, cid: int) -> str:
        """Where client ``cid`` computes, as errors append it ("" here; Flower: " on node ...")."""
        return ""

    def take_traffic(self) -> dict[str, int] | None:
        """The payload bytes this runner's messages carried since the last call (``down``, ``up``,
        ``eval_down``), or None for a runner that sends no messages."""
        return None

    def close(self) -> None:
        """Release what the runner holds (worker processes); idempotent."""


#: ``factory(fed, store, seed) -> ClientRunner``: how the engine gets its runner
RunnerFactory = Callable[[Federation, ClientStore, int], ClientRunner]


class InProcessClients(ClientRunner):
    """Runs the client steps in this process, one client after the other (the default runner).

    Client states live in the engine's :class:`ClientStore` (``run_dir/clients``), written in the
    background while the next client computes (on disk before the round's commit)."""

    shares_initial_evaluation: ClassVar[bool] = True

    def __init__(self, fed: Federation, store: ClientStore, seed: int):
        self.fed, self.store, self.seed = fed, store, seed
        store.background = True

    def train(self, rnd: int, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]
              ) -> tuple[list[tuple[int, Payload]], dict[int, str], float]:
        """Run ``client_update`` for every ``(client_id, broadcast)`` in ``jobs`` (``limits``: unused
        here, the uploads are objects in this process, which the engine's screening checks).

        Returns:
            ``(uploads, failed, seconds)``: ``(client_id, upload)`` in job order (a
            :class:`~rafl.federation.screening.ClientError` in place of the upload of a client whose
            step raised a :class:`UserInputError`: that client's failure, the others go on), the
            clients lost with their reason (never any here), and the seconds of client computation."""
        uploads: list[tuple[int, Payload | ClientError]] = []
        seconds = 0.0
        for cid, down in jobs:
            try:
                upload, sec = train_client(self.fed, self.store, client_context(self.fed, self.seed, cid, rnd), down)
            except UserInputError as err:  # no state of it was saved: its failure, not the run's
                uploads.append((cid, ClientError.of(err)))
                continue
            uploads.append((cid, upload))
            seconds += sec
        return uploads, {}, seconds

    def evaluate(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
        """The evaluation contract's counts of every client in ``ids`` (committed states), and the
        clients that could not be evaluated with the reason (never any here)."""
        shared: dict[tuple[str, str], dict[str, float]] = {}  # one global-set scoring per deployed model
        return {cid: evaluate_client(self.fed, self.store, client_context(self.fed, self.seed, cid, rnd), broadcast,
                                     shared) for cid in ids}, {}

    def evaluate_untrained(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[list, dict[int, str]]:
        """The shared evaluation of clients without a state (:func:`evaluate_untrained`)."""
        return evaluate_untrained(self.fed, self.store, self.seed, rnd, ids, broadcast), {}


# ---------------------------------------------------------------------- shared evaluation
class PooledLoader:
    """The test splits of several clients as one loader: their batches, in client order, joined
    into batches of up to ``batch_size`` samples (``images (B, C, H, W)``, ``labels (B,)``)."""

    def __init__(self, loaders: list[Any], batch_size: int = POOLED_BATCH):
        self.loaders = loaders
        self.batch_size = batch_size

    @property
    def dataset(self) -> range:
        """A sized stand-in: ``len(loader.dataset)`` is the number of pooled samples."""
        return range(sum(len(ld.dataset) for ld in self.loaders))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        images: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        held = 0
        for loader in self.loaders:
            for x, y in loader:
                images.append(x)
                labels.append(y)
                held += len(y)
                if held >= self.batch_size:
                    yield torch.cat(images), torch.cat(labels)
                    images, labels, held = [], [], 0
        if held:
            yield torch.cat(images), torch.cat(labels)


def initial_groups(fed, ids: list[int]) -> list[list[int]]:
    """``ids`` (clients without a state) grouped by model (``ClientInfo.model_key``), each group
    sorted, groups ordered by their first client. Every client alone when its deployed model's BN
    statistics are re-estimated on its own data (``fed.bn_statistics: client`` over another rule)."""
    if getattr(fed, "bn_statistics", None) == "client" and overrides(fed.algorithm, "client"):
        return [[cid] for cid in sorted(ids)]
    groups: dict[str, list[int]] = {}
    for cid in sorted(ids):
        groups.setdefault(fed.clients[cid].model_key, []).append(cid)
    return sorted(groups.values(), key=lambda g: g[0])


def evaluate_group(fed, store: ClientStore, seed: int, rnd: int, group: list[int], broadcast: Payload) -> dict[str, float]:
    """One evaluation of the initial model of ``group[0]`` (``init_client``, seeded by its
    ``init_seed``; then ``prepare_evaluation`` with its view of ``broadcast``) on the pooled test
    splits of every client in ``group`` (clients with one model and no state): the evaluation
    contract's summed ``m.correct``/``m.total``."""
    ctx = client_context(fed, seed, group[0], rnd)
    loaders = [ctx.test_loader] + [fed.loaders(cid, "test", seed) for cid in group[1:]]
    counts = evaluate_client(fed, store, dataclasses.replace(ctx, test_loader=PooledLoader(loaders)), broadcast)
    # one model for the whole group: its global-test counts stand for each of the group's clients
    return {k: v * len(group) if GLOBAL_SUFFIX in k else v for k, v in counts.items()}


def evaluate_untrained(fed, store: ClientStore, seed: int, rnd: int, ids: list[int], broadcast: Payload
                     ) -> list[tuple[list[int], dict[str, float]]]:
    """The shared evaluation of clients that never trained, in this process: ``[(group, counts)]``
    (:func:`initial_groups`, :func:`evaluate_group`)."""
    return [(g, evaluate_group(fed, store, seed, rnd, g, broadcast)) for g in initial_groups(fed, ids)]


__all__ = ["Federation", "LoaderFactory", "ClientModelFactory", "client_context", "naming_client",
           "load_or_init", "train_client", "evaluate_client", "InProcessClients", "PooledLoader", "initial_groups",
           "evaluate_group", "evaluate_untrained", "POOLED_BATCH", "evaluate_state"]
