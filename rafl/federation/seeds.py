"""The seed tree of a federated run: every random stream spawned from the run seed, one node each.

::

    run seed ─┬─ round 0 ─┬─ sampling    the initial available clients
              │           └─ server      init_server
              └─ round t ─┬─ sampling    sporadic swaps, the sampled clients, dropouts
                          ├─ server      server_aggregate (torch's RNG; ServerContext.seed)
                          └─ client i    client_update and evaluation (loaders' shuffle, torch's
                                         RNG; ClientContext.seed)

A node is ``numpy.random.SeedSequence(run_seed, spawn_key=path)`` with ``path`` its place in the
tree: ``(t, SAMPLING)``, ``(t, SERVER)``, ``(t, CLIENT, i)`` -- exactly the child that
``SeedSequence.spawn`` gives at those indices (NumPy's "Parallel random number generation"), so
two streams never share a seed (tags on one flat level did: round 5's sampling drew the seed of
client 5's round 1). A client's initial state is seeded by its round-1 node
(:meth:`SeedTree.client_init`), the same whichever round first builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the children of a round node
SAMPLING, SERVER, CLIENT = 0, 1, 2


@dataclass(frozen=True)
class SeedTree:
    """The seed tree of a run seeded ``seed`` (the module docstring); every method returns a
    63-bit ``int`` seed (for ``torch.manual_seed``, ``torch.Generator().manual_seed`` and
    ``numpy.random.default_rng``).

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

    def server(self, rnd: int) -> int:
        """Round ``rnd``'s server step (round 0: ``init_server``)."""
        return self.node(rnd, SERVER)

    def client(self, rnd: int, cid: int) -> int:
        """Client ``cid``'s steps in round ``rnd``."""
        return self.node(rnd, CLIENT, cid)

    def client_init(self, cid: int) -> int:
        """Client ``cid``'s initial state: its round-1 seed."""
        return self.client(1, cid)


__all__ = ["CLIENT", "SAMPLING", "SERVER", "SeedTree"]
