"""The seed tree of a run: every random stream of rafl is one named leaf (:data:`LEAVES`).

A leaf hangs from one of three roots and records how its seed is derived from it:

- ``seed``: the run seed (``seed`` of a run config; the partition's own ``partition.seed`` when
  set, ``rafl data --seed``, ``rafl search --seed``, a supernet's training seed, a latency LUT's
  seed): the partition, the engine, the search, the supernet's training;
- ``public_seed``: the server's public data (``partition.public_seed``, a supernet's
  ``public_seed``): the pool, the global test set, the server's splits;
- ``fixed``: no seed, the same stream in every run (the BN calibration images of a deployed
  subnet, the halves of the search's noise ceiling).

A NumPy leaf is a :class:`numpy.random.SeedSequence` (:func:`sequence`, :func:`generator`); a
leaf of torch's, NumPy's legacy or Python's generators is an ``int`` seed (:func:`int_seed`). The
engine's leaf is a subtree of its own (:class:`SeedTree`: run -> round -> sampling / server /
client). Consumers take their stream from their leaf and from nowhere else, so two consumers
share a stream only where :data:`KEPT_SHARED` says so: streams that shipped artefacts were made
with (the supernets' pools, their measurements) and that cannot be told apart without moving them.

Every leaf that existed before the tree keeps its stream bit for bit (``SeedSequence([s, tag])``
is what ``numpy.random.default_rng([s, tag])`` seeds); the leaves whose derivation reads
"63 bits of ..." were given their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the roots a leaf hangs from (the module docstring)
SEED, PUBLIC_SEED, FIXED = "seed", "public_seed", "fixed"
#: the generator families: two leaves share a stream only within one family
NUMPY, TORCH, NUMPY_LEGACY, PYTHON = "numpy", "torch", "numpy-legacy", "python"


@dataclass(frozen=True)
class Leaf:
    """One stream of the tree.

    Attributes:
        name: the leaf's name (the key of :data:`LEAVES`).
        root: :data:`SEED`, :data:`PUBLIC_SEED` or :data:`FIXED` (the root's value is 0).
        consumer: who draws from it.
        family: :data:`NUMPY` (a ``SeedSequence``), :data:`TORCH`, :data:`NUMPY_LEGACY` or
            :data:`PYTHON` (an ``int`` seed).
        tag: ``SeedSequence([root, tag])``; None: ``SeedSequence(root)``.
        spawn_key: ``SeedSequence(root, spawn_key=spawn_key)`` (the child that ``spawn`` gives).
        offset: an ``int`` leaf seeded ``root + offset`` (``% 2**32`` for NumPy's legacy
            generator); None: the first 63 bits of the leaf's ``SeedSequence``.
        subtree: a leaf that is a subtree of its own (the engine's, :class:`SeedTree`): how its
            nodes are derived, as text.
    """

    name: str
    root: str
    consumer: str
    family: str = NUMPY
    tag: int | None = None
    spawn_key: tuple[int, ...] = ()
    offset: int | None = None
    subtree: str | None = None

    def sequence(self, seed: int = 0) -> np.random.SeedSequence:
        """The leaf's ``SeedSequence`` for root value ``seed`` (ignored for a fixed leaf).

        Raises:
            ValueError: the leaf is a subtree (its nodes have seeds, it has none).
        """
        if self.subtree is not None:
            raise ValueError(f"seed-tree leaf {self.name!r} is a subtree: its nodes have seeds ({self.subtree})")
        root = 0 if self.root == FIXED else int(seed)
        return np.random.SeedSequence(root if self.tag is None else [root, self.tag], spawn_key=self.spawn_key)

    def int_seed(self, seed: int = 0) -> int:
        """The leaf's ``int`` seed for root value ``seed``."""
        root = 0 if self.root == FIXED else int(seed)
        if self.offset is not None:
            value = root + self.offset
            return value % 2**32 if self.family == NUMPY_LEGACY else value
        return int(self.sequence(seed).generate_state(2, np.uint64)[0] >> 1)

    def derivation(self) -> str:
        """How the leaf is derived from its root, as text (docs/design.md's table)."""
        if self.subtree is not None:
            return self.subtree
        root = "0" if self.root == FIXED else self.root
        if self.offset is not None:
            text = root if not self.offset else f"{root} + {self.offset}"
            return f"{text} % 2**32" if self.family == NUMPY_LEGACY else text
        ss = f"[{root}, {self.tag}]" if self.tag is not None else root
        ss = f"SeedSequence({ss}" + (f", spawn_key={self.spawn_key})" if self.spawn_key else ")")
        return ss if self.family == NUMPY else f"63 bits of {ss}"


#: the leaves, by name (docs/design.md, "The seed tree", prints this table)
LEAVES: dict[str, Leaf] = {leaf.name: leaf for leaf in (
    # the server's public data
    Leaf("pool", PUBLIC_SEED, "rafl.data.partition.carve_public_pool: the server's public pool"),
    Leaf("global-test", PUBLIC_SEED, "rafl.data.partition.carve_global_test: the balanced global test set", tag=5005),
    Leaf("server-val", PUBLIC_SEED, "rafl.supernet.server_data.server_split: pool-train / server-val", tag=9010),
    Leaf("server-test", PUBLIC_SEED, "rafl.supernet.server_data.server_split: the held-out test sample", tag=7357),
    # the clients' data
    Leaf("partition", SEED, "rafl.data.partition.make_partition: the clients' shares", spawn_key=(0,)),
    Leaf("client-split", SEED, "rafl.data.partition.split_client: each client's train / val / test",
         spawn_key=(1,)),
    Leaf("held-out", SEED, "rafl.federation.new_clients.held_out_clients: the held-out clients", tag=56),
    # the engine: SeedTree below
    Leaf("engine", SEED, "rafl.federation.engine, its runners and methods: SeedTree (run -> round -> "
         "sampling / server / client)", subtree="SeedSequence(seed, spawn_key=(t, k[, i]))"),
    # the search
    Leaf("search-split", SEED, "rafl.search.federation_search.search_split: the validation subset", tag=5),
    Leaf("search-probe", SEED, "rafl.search.evolution.check_satisfiable: the random archs of the feasibility "
         "probe", tag=31),
    Leaf("search-evolution", SEED, "rafl.search.evolution.evolve: the evolution (first population, "
         "mutation, crossover)"),
    Leaf("largest-feasible", SEED, "rafl.search.federation_search.largest_feasible: the random archs"),
    Leaf("predictor-samples", SEED, "rafl.search.estimators.sample_across_space: the predictor's measured archs"),
    Leaf("predictor-folds", SEED, "rafl.search.predictor.train_predictor: the cross-validation folds"),
    Leaf("predictor-init", SEED, "rafl.search.predictor.AccuracyPredictor.fit: the weights' initialization",
         family=TORCH, offset=0),
    Leaf("measurement-halves", FIXED, "rafl.search.estimators.MeasuredAccuracy: the halves of server-val "
         "(the split-half noise ceiling)"),
    Leaf("calibration", FIXED, "rafl.supernet.server_data.calibration_sample: the BN recalibration images of "
         "a deployed subnet and of the search", tag=84242),
    Leaf("export-input", FIXED, "rafl.stages.search.export_onnx: the sample input of the ONNX check",
         family=TORCH, tag=37),
    Leaf("profile-weights", FIXED, "rafl.reports.profile_report: the random weights of a profiled arch",
         family=TORCH, tag=38),
    # the supernet's training (seed: its training seed)
    Leaf("supernet-weights", SEED, "rafl.supernet.train.train_supernet: torch's global generator (the "
         "weights' initialization, dropout)", family=TORCH, offset=0),
    Leaf("supernet-numpy-global", SEED, "rafl.supernet.train.train_supernet: NumPy's global generator",
         family=NUMPY_LEGACY, offset=0),
    Leaf("supernet-python-random", SEED, "rafl.supernet.train.train_supernet: Python's random module",
         family=PYTHON, offset=0),
    Leaf("supernet-arch", SEED, "rafl.supernet.train.train_supernet: the subnets sampled at each step", tag=1),
    Leaf("supernet-loader", SEED, "rafl.supernet.train.train_supernet: the batch order, crop, flip and cutout",
         family=TORCH, offset=2),
    Leaf("supernet-calibration", SEED, "rafl.supernet.server_data.calibration_sample: the recalibration "
         "images of the training's validation", tag=84242),
    # a measured latency LUT (seed: the LUT's seed)
    Leaf("latency-archs", SEED, "rafl.search.latency.build_latency_lut: the whole subnets of the network correction",
         tag=35),
    Leaf("latency-layers", SEED, "rafl.search.latency.build_latency_lut: the layers' random weights and inputs",
         family=TORCH, tag=36),
)}

#: groups of leaves that draw one stream when their roots have the same value (``seed ==
#: public_seed``, a root equal to 0 beside a fixed leaf): the shipped supernets, their measurements and
#: the cited results were made with them, so they are kept as they are (docs/design.md, "The seed
#: tree", says what separating each would move)
KEPT_SHARED: tuple[frozenset[str], ...] = (
    # SeedSequence(root)
    frozenset({"pool", "search-evolution", "largest-feasible", "predictor-samples", "predictor-folds",
               "measurement-halves"}),
    # SeedSequence([root, 84242]): a deployed subnet's calibration images are those a supernet trained
    # with seed 0 recalibrated on
    frozenset({"calibration", "supernet-calibration"}),
    # torch's generator seeded with the root
    frozenset({"predictor-init", "supernet-weights"}),
)


def leaf(name: str) -> Leaf:
    """The leaf named ``name``.

    Raises:
        KeyError: no leaf has that name (naming the leaves).
    """
    try:
        return LEAVES[name]
    except KeyError:
        raise KeyError(f"no seed-tree leaf {name!r}; leaves: {', '.join(LEAVES)}") from None


def sequence(name: str, seed: int = 0) -> np.random.SeedSequence:
    """The ``SeedSequence`` of NumPy leaf ``name`` for its root's value ``seed``."""
    return leaf(name).sequence(seed)


def generator(name: str, seed: int = 0) -> np.random.Generator:
    """A fresh ``numpy.random.Generator`` on NumPy leaf ``name`` for its root's value ``seed``."""
    return np.random.default_rng(sequence(name, seed))


def int_seed(name: str, seed: int = 0) -> int:
    """The ``int`` seed of leaf ``name`` (for ``torch.manual_seed``, ``torch.Generator().manual_seed``,
    ``numpy.random.seed``, ``random.seed``) for its root's value ``seed``."""
    return leaf(name).int_seed(seed)


# --------------------------------------------------------------------------------------------
# the engine's subtree

#: the children of a round node
SAMPLING, SERVER, CLIENT = 0, 1, 2


@dataclass(frozen=True)
class SeedTree:
    """The engine's subtree of a run seeded ``seed``; every method returns a 63-bit ``int`` seed
    (for ``torch.manual_seed``, ``torch.Generator().manual_seed`` and ``numpy.random.default_rng``).

    ::

        run seed ─┬─ round 0 ─┬─ sampling    the initial available clients
                  │           └─ server      init_server
                  └─ round t ─┬─ sampling    sporadic swaps, the sampled clients, dropouts
                              ├─ server      server_aggregate (torch's RNG; ServerContext.seed)
                              └─ client i    client_update and evaluation (loaders' shuffle,
                                             torch's RNG; ClientContext.seed)

    A node is ``numpy.random.SeedSequence(seed, spawn_key=path)`` with ``path`` its place in the
    tree: ``(t, SAMPLING)``, ``(t, SERVER)``, ``(t, CLIENT, i)``, exactly the child that
    ``SeedSequence.spawn`` gives at those indices (NumPy's "Parallel random number generation"),
    so two nodes never share a seed. A client's initial state is seeded by its round-1 node
    (:meth:`client_init`), the same whichever round first builds it.

    Raises:
        ValueError: a negative round or client id (NumPy's spawn keys are non-negative).
    """

    seed: int

    def node(self, *path: int) -> int:
        """The seed of the node at ``path`` (spawn-key indices from the run's root)."""
        ss = np.random.SeedSequence(int(self.seed), spawn_key=tuple(int(p) for p in path))
        return int(ss.generate_state(2, np.uint64)[0] >> 1)

    def sampling(self, rnd: int) -> int:
        """Round ``rnd``'s participation draws (round 0: the initial available clients)."""
        return self.node(rnd, SAMPLING)

    def sampling_generator(self, rnd: int) -> np.random.Generator:
        """A NumPy generator seeded by :meth:`sampling`."""
        return np.random.default_rng(self.sampling(rnd))

    def server(self, rnd: int) -> int:
        """Round ``rnd``'s server step (round 0: ``init_server``)."""
        return self.node(rnd, SERVER)

    def client(self, rnd: int, cid: int) -> int:
        """Client ``cid``'s steps in round ``rnd``."""
        return self.node(rnd, CLIENT, cid)

    def client_init(self, cid: int) -> int:
        """Client ``cid``'s initial state: its round-1 seed."""
        return self.client(1, cid)


__all__ = ["CLIENT", "FIXED", "KEPT_SHARED", "LEAVES", "NUMPY", "NUMPY_LEGACY", "PUBLIC_SEED", "PYTHON", "SAMPLING",
           "SEED", "SERVER", "TORCH", "Leaf", "SeedTree", "generator", "int_seed", "leaf", "sequence"]
