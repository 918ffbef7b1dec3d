"""The algorithm interface every FL method implements, the contexts it receives, and the registry.

An FL method is two steps over :class:`~rafl.federation.payload.Payload` s (Flower-style: a
strategy configures and aggregates, the engine moves messages):

* ``client_update(state, broadcast, client) -> (state, upload)`` on every sampled client;
* ``server_aggregate(uploads, server_state, server) -> (server_state, broadcast)`` on the server.

Neither step knows about the engine (no algorithm imports ``rafl.federation.engine``), and the
engine knows no algorithm by name: it asks the registry (:func:`get_algorithm`).

State contract. Client and server *state* are plain nested containers (dict / list / tuple) of
tensors, Python numbers, strings and None -- exactly what ``torch.save`` writes and
``torch.load(..., weights_only=True)`` reads back (e.g. ``{"model": model.state_dict(),
"opt": optimizer.state_dict()}``). The engine stores them on disk between rounds (only sampled
clients are materialized), so a state must never hold an ``nn.Module``, optimizer object, or
generator. Models are rebuilt each round from ``client.make_model()`` and the stored weights.

Evaluation contract. :meth:`Algorithm.evaluate` returns, for every model ``m`` it evaluates on the
client's test split, ``"m.correct"`` and ``"m.total"`` (counts, floats); ``"model"`` is the model
the client deploys (for RaFL the specialized subnet), other names are extra (RaFL:
``"knowledge"``). The engine turns them into mean-over-clients accuracy, sample-weighted accuracy
(sum correct / sum total) and std. Other keys (e.g. ``"model.loss"``) are averaged over clients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from rafl.errors import UserInputError, allowed
from rafl.federation.aggregation import AggregationRule, ClipBounds
from rafl.federation.algorithms.hparams import Hyperparameters
from rafl.federation.metric_keys import DEPLOYED_MODEL
from rafl.federation.payload import Payload
from rafl.supernet.arch import ArchConfig, SearchSpace

#: A DataLoader-like iterable of ``(images (B, C, H, W) float32, labels (B,) int64)`` batches.
Loader = Iterable[tuple[torch.Tensor, torch.Tensor]]
#: Builds a fresh model: ``make_model()`` -> the client's own model; ``make_model(arch)`` -> the
#: subnet ``arch`` of the same supernet (e.g. RaFL's knowledge network). Weights come from the
#: supernet (or the factory's own init when no supernet is used), never from another client.
ModelFactory = Callable[..., nn.Module]
#: Weights-only-serializable nested container (see the module docstring).
State = Any


@dataclass(frozen=True)
class Accuracy:
    """An accuracy a method reports: its metric prefix (``<prefix>.correct`` / ``<prefix>.total``
    in :meth:`Algorithm.evaluate`, ``<prefix>.acc_*`` in the metrics), its one name in every table,
    plot and line rafl prints, and what it measures in a sentence's words.

    Attributes:
        prefix: e.g. ``"proto"``.
        name: e.g. ``"nearest prototype"`` (a table's column ``acc nearest prototype``).
        meaning: e.g. ``"nearest-prototype accuracy"``.
        short: the stem of its column in ``rafl compare``'s table (``"proto"``: ``proto acc``;
            empty: the prefix).
    """

    prefix: str
    name: str
    meaning: str
    short: str = ""

    @property
    def column(self) -> str:
        """Its column in ``rafl compare``'s table, e.g. ``"proto acc"``."""
        return f"{self.short or self.prefix} acc"


#: the accuracy of the model a client deploys (RaFL's specialized subnet, FedGH's extractor +
#: global header, ...): every method reports it, and a run's headline numbers are its.
DEPLOYED = Accuracy(DEPLOYED_MODEL, "deployed model", "deployed model accuracy")


@dataclass(frozen=True)
class ClientInfo:
    """What the server may know about a client (no data): id, profile, architecture, size.

    Attributes:
        client_id: position in the population (0..n_clients-1).
        profile: device profile name (e.g. ``"pi4"``), or ``"custom"``.
        arch: the client's subnet, or None when the model is not a supernet subnet.
        model_key: a string identifying the model architecture (``arch.to_string()`` by default);
            clients with equal keys have identical models (FedAvg/FedProx/FedNova require this).
        n_samples: number of training samples (``n_l`` in RaFL Eq. 7).
    """

    client_id: int
    profile: str
    arch: ArchConfig | None
    model_key: str
    n_samples: int


@dataclass
class ClientContext:
    """Everything a client step may use. Built by the engine for one client and one round.

    Attributes:
        info: the client's :class:`ClientInfo`.
        make_model: :data:`ModelFactory` (``make_model()`` = own model, ``make_model(arch)`` = a
            subnet of the same supernet).
        train_loader / val_loader / test_loader: the client's own splits (:data:`Loader`); the
            test split is used only by :meth:`Algorithm.evaluate`.
        n_classes: number of classes.
        device: torch device for local computation.
        seed: per-(run, client, round) seed (torch's global RNG is seeded with it before
            :meth:`Algorithm.client_update`; the train loader shuffles with it).
        init_seed: per-(run, client) seed of the client's initial state (torch is seeded with it
            before :meth:`Algorithm.init_client`): the same in every round, so a client that has
            not trained yet (not sampled, or failed) keeps one initial model, whichever round
            first builds it. It equals round 1's ``seed``.
        round: current round (1-based).
        space: the supernet's search space (to resolve archs such as RaFL's knowledge network),
            or None when the models are not supernet subnets.
    """

    info: ClientInfo
    make_model: ModelFactory
    train_loader: Loader
    val_loader: Loader | None
    test_loader: Loader
    n_classes: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    init_seed: int = 0
    round: int = 0
    space: SearchSpace | None = None

    @property
    def client_id(self) -> int:
        return self.info.client_id

    @property
    def n_samples(self) -> int:
        return self.info.n_samples

    @property
    def arch(self) -> ArchConfig | None:
        return self.info.arch

    @property
    def profile(self) -> str:
        return self.info.profile


@dataclass
class ServerContext:
    """Everything a server step may use.

    Attributes:
        clients: every client's :class:`ClientInfo` (the whole population), by id.
        make_model: ``make_model(arch)`` -> a fresh subnet ``arch`` of the supernet with the
            supernet's weights; ``make_model(client_id=i)`` -> client ``i``'s own model.
        public_images: the server's unlabeled public pool, ``(N_pub, C, H, W)`` float32 normalized
            like client data (labels are withheld), or None when the run has none.
        n_classes: number of classes.
        space: the supernet's search space, or None.
        supernet: the supernet (read-only for algorithms), or None.
        device: torch device for server computation.
        seed: this round's server seed (:meth:`rafl.seeds.SeedTree.server`: run ->
            round -> server); torch's global RNG is seeded with it before the server step, and a
            method's own generators (shuffles, distillation batches) start from it.
        round: the round whose uploads are being aggregated (0 during ``init_server``).
        aggregation: the run's rule for merging weights (``engine.aggregation``: the mean or a
            robust rule), used through :func:`rafl.federation.aggregation.server_average`.
        clip_bounds: the ``norm_clip`` bounds carried from earlier rounds
            (:class:`rafl.federation.aggregation.ClipBounds`; set by the engine every round), or
            None (a round's own bound alone).
    """

    clients: list[ClientInfo]
    make_model: ModelFactory
    public_images: torch.Tensor | None
    n_classes: int
    space: SearchSpace | None = None
    supernet: nn.Module | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    round: int = 0
    aggregation: AggregationRule = field(default_factory=AggregationRule)
    clip_bounds: ClipBounds | None = None


class Algorithm(ABC):
    """One FL method. Subclasses set :attr:`name`, are decorated with :func:`register`, and
    implement the five abstract methods. Instances hold only hyperparameters (never state).

    Args:
        **hparams: method hyperparameters (validated by :meth:`check_hparams`).

    Class attributes:
        name: registry name (lower case, e.g. ``"rafl"``, ``"fedavg"``).
        hparams_model: the method's :class:`~rafl.federation.algorithms.hparams.Hyperparameters`
            model (types, ranges, defaults); keys it does not declare are rejected.
        defaults: ``name -> default`` of ``hparams_model`` (derived, read-only).
        requires_homogeneous: True for methods that average whole models (FedAvg/FedProx/FedNova);
            :meth:`check_population` then rejects clients with different ``model_key``.
        uses_public_pool: True when :meth:`server_aggregate` needs ``ServerContext.public_images``.
        accuracies: the :class:`Accuracy` s :meth:`evaluate` may report, :data:`DEPLOYED` first
            (tables, plots and ``rafl federate``'s per-client table read them here).
        shared_initial_evaluation: True when :meth:`prepare_evaluation` and :meth:`evaluate` of
            an initial state depend on the client only through its model (``model_key``) and its
            test split; the engine then evaluates the clients that have not trained yet together,
            one evaluation per model (:mod:`rafl.federation.workers`). False: one by one.
        evaluates_state_only: True when :meth:`evaluate` of a prepared state depends on the client
            only through its model (``model_key``) and the loader it scores: clients whose deployed
            states are equal tensor for tensor get the same counts on the global test set, which the
            engine then scores once per distinct deployed model and round (:func:`rafl.federation.runners.evaluate_state`;
            not under ``train.bn_statistics: client``, whose statistics come from each client's data).
        static_models: True when no client's deployed model changes over the rounds (the
            no-training floor): the engine evaluates once, after the last round, whatever
            ``engine.eval_every`` says (its curve is flat; its last-3 figure is its final one).
        bn_statistics: where the BatchNorm statistics of the model a client deploys come from
            under the method's own rule (``train.bn_statistics: null``; :mod:`rafl.federation.bn_statistics`):
            ``client`` (re-estimated on the client's data at the end of local training: the private
            models), ``averaged`` (averaged by the server like every other weight: FedAvg's rule),
            ``server`` (re-estimated on the server's pool: the no-training floor).
        uploads_bn_statistics: True when an upload's ``*running_var`` / ``*running_mean`` tensors are
            BatchNorm statistics (the engine screens them as state: variances >= 0, near the round's
            median: :func:`rafl.federation.screening.check_bn_stats`); False when they are updates of
            them, which may be negative (FedKD's compressed deltas).
        bn_policy: the run's ``train.bn_statistics`` (None: the method's own rule), set on the
            instance by the stage that builds the federation; the methods that average their
            deployed model read it for FedBN (``local``).
        global_model: True when every client deploys the server's global model (or its slice)
            and keeps no client state; the fine-tuned variant (``<name>-ft``,
            :func:`rafl.federation.finetune.finetune_evaluate`) is then one more local step from
            the final broadcast, its upload evaluated as a broadcast.
        one_model_for_all: True when every client deploys the same model, the one the weakest
            client can run (Uniform): the pipeline searches one subnet that meets every profile's
            budgets (:mod:`rafl.stages.prepare`), a model group gives everyone its smallest member
            (:func:`rafl.federation.build.build_group_federation`).
        exports_supernet: True when the server's global model may be a supernet's weights (HeteroFL
            and FedRolex over NAS subnets): :meth:`federated_supernet` returns it, and the run writes
            it into its run dir (:func:`rafl.stages.runs.export_federated_supernet`).
    """

    name: ClassVar[str] = ""
    hparams_model: ClassVar[type[Hyperparameters]] = Hyperparameters
    defaults: ClassVar[dict[str, Any]] = {}
    requires_homogeneous: ClassVar[bool] = False
    uses_public_pool: ClassVar[bool] = False
    shared_initial_evaluation: ClassVar[bool] = True
    evaluates_state_only: ClassVar[bool] = False
    static_models: ClassVar[bool] = False
    accuracies: ClassVar[tuple[Accuracy, ...]] = (DEPLOYED,)
    global_model: ClassVar[bool] = False
    one_model_for_all: ClassVar[bool] = False
    exports_supernet: ClassVar[bool] = False
    bn_statistics: ClassVar[str] = "client"
    uploads_bn_statistics: ClassVar[bool] = True
    bn_policy: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.defaults = cls.hparams_model.defaults()

    def __init__(self, **hparams: Any) -> None:
        self.hparams = self.check_hparams(hparams)

    @classmethod
    def needs_public_pool(cls, hparams: dict[str, Any]) -> bool:
        """Whether the method with ``hparams`` distils on the server's unlabeled public pool: the
        class says so (:attr:`uses_public_pool`: FedDF) or its ``distill`` hyperparameter is on
        (RaFL Eqs. 8-9)."""
        return bool(cls.uses_public_pool or hparams.get("distill"))

    def reads_public_pool(self) -> bool:
        """Whether a server step of this instance reads ``ServerContext.public_images``: it distils
        on the pool (:meth:`needs_public_pool`), or the run re-estimates deployed BN statistics on the
        pool (:attr:`bn_policy` ``server``). A run whose method does not keeps no public-pool images
        in memory (``public_images`` None)."""
        return self.needs_public_pool(self.hparams) or self.bn_policy == "server"

    @classmethod
    def check_hparams(cls, hparams: dict[str, Any]) -> dict[str, Any]:
        """The defaults merged with ``hparams``, checked by :attr:`hparams_model`
        (:meth:`~rafl.federation.algorithms.hparams.Hyperparameters.check`).

        Raises:
            UserInputError: an unknown key, or a value of the wrong type or out of range, naming
                ``algorithm.<key>``.
        """
        return cls.hparams_model.check(hparams, cls.name)

    def deployed_bn_statistics(self) -> str:
        """The method's own rule for its deployed models' BatchNorm statistics (:attr:`bn_statistics`;
        a method whose rule depends on its hyperparameters, HeteroFL's static BN, overrides this)."""
        return self.bn_statistics

    def supports_local_bn(self) -> bool:
        """Whether ``train.bn_statistics: local`` (FedBN) can be followed: by default where the
        deployed model never leaves the client (its BN layers are its own already)."""
        return self.deployed_bn_statistics() != "averaged"

    def check_population(self, clients: list[ClientInfo]) -> None:
        """Reject populations this method cannot handle (called once before round 1).

        Raises:
            UserInputError: ``requires_homogeneous`` and the clients' models differ.
        """
        if self.requires_homogeneous:
            keys = sorted({c.model_key for c in clients})
            if len(keys) > 1:
                raise UserInputError(
                    f"{self.name} averages whole models and needs identical client models, got "
                    f"{len(keys)} different architectures (e.g. {keys[0]!r} and {keys[1]!r}); use a "
                    "heterogeneous method (e.g. rafl, fedgh, fedtgp, fedproto, feddf, standalone) or give every client "
                    "the same arch",
                    field="algorithm.name")

    def check_models(self, server: ServerContext) -> None:
        """Reject client models this method cannot handle, with the built server context (called
        once before round 1, when the federation is built; default: none). E.g. HeteroFL needs
        every model to be a slice of one global model.

        Raises:
            UserInputError: naming the clients or models at fault.
        """
        return None

    # ------------------------------------------------------------------ the five steps
    @abstractmethod
    def init_server(self, server: ServerContext) -> tuple[State, Payload]:
        """Initial server state and the first broadcast (round 1's download)."""

    @abstractmethod
    def init_client(self, client: ClientContext) -> State:
        """Initial state of a client (built when the client is first sampled)."""

    @abstractmethod
    def client_update(self, state: State, broadcast: Payload, client: ClientContext) -> tuple[State, Payload]:
        """Local step: consume the broadcast, train locally, return the new state and the upload."""

    @abstractmethod
    def server_aggregate(self, uploads: list[Payload], server_state: State,
                         server: ServerContext) -> tuple[State, Payload]:
        """Aggregate the round's uploads into a new server state and the next broadcast. Each upload
        is the server's view of what a client sent (:func:`rafl.federation.screening.screen_uploads`):
        the tensors and metadata the method's own :meth:`client_update` put there, with
        ``meta["client_id"]`` naming the sender and ``meta["n_samples"]`` its registered
        training-sample count (the FedAvg-style weights)."""

    @abstractmethod
    def evaluate(self, state: State, client: ClientContext) -> dict[str, float]:
        """Evaluate on ``client.test_loader``: ``"<model>.correct"``/``"<model>.total"`` per model."""

    # ------------------------------------------------------------------ optional hooks
    def client_broadcast(self, broadcast: Payload, client: ClientInfo) -> Payload:
        """What ``client`` actually downloads from the round's broadcast (default: all of it).

        Methods that send different things to different clients (e.g. FedDF's per-architecture
        models) select here; the engine counts the bytes of what this returns."""
        return broadcast

    def upload_spec(self, server_state: State, client: ClientInfo) -> dict[str, tuple[int, ...]] | None:
        """Expected ``name -> shape`` of ``client``'s upload for validation, or None (only
        finiteness is checked)."""
        return None

    def check_upload(self, upload: Payload, server_state: State, client: ClientInfo, n_classes: int) -> None:
        """Method-specific checks of ``client``'s upload, after :meth:`upload_spec`'s shapes and
        the finiteness check (default: none). For uploads whose shapes vary per client (e.g. one
        vector per class held: :func:`rafl.federation.prototypes.check_class_upload`).

        Raises:
            UserInputError: naming the tensor (``field``); the engine adds the sender.
        """
        return None

    def prepare_evaluation(self, state: State, broadcast: Payload, client: ClientContext) -> State:
        """Hook run before :meth:`evaluate` on clients (default: state unchanged). Methods whose
        evaluated model depends on the latest broadcast (e.g. a global header) apply it here."""
        return state

    def federated_supernet(self, server_state: State, server: ServerContext) -> nn.Module | None:
        """The server's global model in ``server_state`` as a supernet in eval mode, or None when it is
        not one (default; a method that can give one sets :attr:`exports_supernet`)."""
        return None


# ---------------------------------------------------------------------- registry
ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: add ``cls`` to :data:`ALGORITHMS` under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise TypeError(f"algorithm name {cls.name!r} registered twice")
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The registered class for ``name`` (case-insensitive).

    Raises:
        UserInputError: unknown name, listing the registered ones.
    """
    key = name.strip().lower()
    if key not in ALGORITHMS:
        raise UserInputError(f"unknown algorithm {name!r}; {allowed(sorted(ALGORITHMS))}",
                             field="algorithm.name")
    return ALGORITHMS[key]


def reported_accuracies() -> dict[str, Accuracy]:
    """``prefix -> Accuracy`` over every registered method (:data:`DEPLOYED` first, then in
    registration order): the names tables and plots print for a metric prefix."""
    out = {DEPLOYED.prefix: DEPLOYED}
    for cls in ALGORITHMS.values():
        for acc in cls.accuracies:
            out.setdefault(acc.prefix, acc)
    return out


__all__ = ["Accuracy", "DEPLOYED", "reported_accuracies", "Algorithm", "ClientContext", "ClientInfo", "ServerContext", "State", "Loader",
           "ModelFactory", "ALGORITHMS", "register", "get_algorithm"]
