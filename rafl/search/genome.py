"""A whole population of architectures as integer arrays (vectorized evolutionary operators).

OFA's evolutionary search (Cai et al., ICLR 2020, Sec. 3.4; ``ofa/nas/search_algorithm/
evolution.py``) handles one Python dict per candidate and one predictor call per candidate list.
Here a population of ``P`` archs of a :class:`~rafl.supernet.arch.SearchSpace` is four integer
arrays of *choice indices*, so sampling, mutation, crossover, canonicalization, hashing and the
predictor encoding of a whole generation are a handful of numpy operations:

- ``ks``: ``(P, n_blocks)`` index into ``space.ks_choices``
- ``e``:  ``(P, n_blocks)`` index into ``space.e_choices``
- ``d``:  ``(P, n_stages)`` index into ``space.d_choices``
- ``r``:  ``(P,)`` index into ``space.resolutions``

The operators keep the semantics of :meth:`ArchConfig.sample`, :meth:`ArchConfig.mutate` and
:meth:`ArchConfig.crossover` (every gene uniform / resampled with its probability / taken from
either parent with p = 1/2, then the canonical form with inactive slots at the smallest choice);
only the order in which random numbers are drawn differs. Conversion to :class:`ArchConfig`
happens only for the few archs that leave the search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rafl.supernet.arch import ArchConfig, SearchSpace

_DT = np.int8


@dataclass
class Population:
    """``P`` archs as choice-index arrays (see module docstring). Always canonical."""

    space: SearchSpace
    ks: np.ndarray
    e: np.ndarray
    d: np.ndarray
    r: np.ndarray

    def __len__(self) -> int:
        return int(self.r.shape[0])

    # ------------------------------------------------------------------ construction
    @classmethod
    def sample(cls, space: SearchSpace, n: int, rng: np.random.Generator) -> Population:
        """``n`` uniformly random archs (every choice independently uniform), canonical."""
        return cls(
            space,
            rng.integers(0, len(space.ks_choices), (n, space.n_blocks), dtype=_DT),
            rng.integers(0, len(space.e_choices), (n, space.n_blocks), dtype=_DT),
            rng.integers(0, len(space.d_choices), (n, space.n_stages), dtype=_DT),
            rng.integers(0, len(space.resolutions), n, dtype=_DT),
        ).canonical()

    @classmethod
    def from_archs(cls, space: SearchSpace, archs: Sequence[ArchConfig]) -> Population:
        """Pack ArchConfigs (validated against ``space``) into arrays."""
        kmap = {v: i for i, v in enumerate(space.ks_choices)}
        emap = {v: i for i, v in enumerate(space.e_choices)}
        dmap = {v: i for i, v in enumerate(space.d_choices)}
        rmap = {v: i for i, v in enumerate(space.resolutions)}
        for a in archs:
            a.validate(space)
        return cls(
            space,
            np.array([[kmap[v] for v in a.ks] for a in archs], dtype=_DT).reshape(len(archs), space.n_blocks),
            np.array([[emap[v] for v in a.e] for a in archs], dtype=_DT).reshape(len(archs), space.n_blocks),
            np.array([[dmap[v] for v in a.d] for a in archs], dtype=_DT).reshape(len(archs), space.n_stages),
            np.array([rmap[a.r] for a in archs], dtype=_DT),
        ).canonical()

    @classmethod
    def concat(cls, parts: Sequence[Population]) -> Population:
        """Concatenate populations of the same space."""
        space = parts[0].space
        return cls(space, *(np.concatenate([getattr(p, f) for p in parts]) for f in ("ks", "e", "d", "r")))

    def take(self, index: np.ndarray | Sequence[int]) -> Population:
        """Sub-population (fancy indexing along the population axis; copies)."""
        idx = np.asarray(index, dtype=np.int64)
        return Population(self.space, self.ks[idx], self.e[idx], self.d[idx], self.r[idx])

    # ------------------------------------------------------------------ structure
    def depths(self) -> np.ndarray:
        """``(P, n_stages)`` int: active blocks per stage."""
        return np.asarray(self.space.d_choices)[self.d]

    def active(self) -> np.ndarray:
        """``(P, n_blocks)`` bool: which block slots are active (first ``d[s]`` of each stage)."""
        md = self.space.max_depth
        mask = np.arange(md)[None, None, :] < self.depths()[:, :, None]
        return mask.reshape(len(self), self.space.n_blocks)

    def canonical(self) -> Population:
        """Inactive slots set to the smallest choice (index 0), in place; returns self."""
        act = self.active()
        self.ks = np.where(act, self.ks, 0).astype(_DT)
        self.e = np.where(act, self.e, 0).astype(_DT)
        return self

    def values(self) -> dict[str, np.ndarray]:
        """Choice *values* (not indices): ``ks``/``e`` (P, n_blocks), ``d`` (P, n_stages), ``r`` (P,)."""
        s = self.space
        return {"ks": np.asarray(s.ks_choices)[self.ks], "e": np.asarray(s.e_choices)[self.e],
                "d": np.asarray(s.d_choices)[self.d], "r": np.asarray(s.resolutions)[self.r]}

    # ------------------------------------------------------------------ evolution operators
    def mutate(self, rng: np.random.Generator, prob: float, resolution_prob: float) -> Population:
        """OFA's mutation of every member (new population): each block's ks and e and each stage's
        d is resampled uniformly with probability ``prob``, the resolution with ``resolution_prob``
        (the semantics of :meth:`ArchConfig.mutate`)."""
        s = self.space

        def resample(genes: np.ndarray, n_choices: int, p: float) -> np.ndarray:
            hit = rng.random(genes.shape) < p
            new = rng.integers(0, n_choices, genes.shape, dtype=_DT)
            return np.where(hit, new, genes).astype(_DT)

        return Population(
            s,
            resample(self.ks, len(s.ks_choices), prob),
            resample(self.e, len(s.e_choices), prob),
            resample(self.d, len(s.d_choices), prob),
            resample(self.r, len(s.resolutions), resolution_prob),
        ).canonical()

    @staticmethod
    def crossover(a: Population, b: Population, rng: np.random.Generator) -> Population:
        """OFA's crossover, member-wise: every gene from ``a`` or ``b`` with p = 1/2
        (the semantics of :meth:`ArchConfig.crossover`)."""

        def pick(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return np.where(rng.random(x.shape) < 0.5, x, y).astype(_DT)

        return Population(a.space, pick(a.ks, b.ks), pick(a.e, b.e), pick(a.d, b.d), pick(a.r, b.r)).canonical()

    # ------------------------------------------------------------------ encodings
    def encode(self) -> np.ndarray:
        """``(P, space.encoding_size)`` float32, row i == ``self.arch(i).encode(space)``.

        Per block slot one-hot ks and one-hot e (zeros for inactive slots), then one-hot r: the
        encoding of OFA's accuracy predictor (``ofa/nas/accuracy_predictor/arch_encoder.py``).
        """
        s, n = self.space, len(self)
        nk, ne = len(s.ks_choices), len(s.e_choices)
        size = s.encoding_size
        enc = np.zeros(n * size, dtype=np.float32)
        row = (np.arange(n) * size)[:, None]
        base = row + (np.arange(s.n_blocks) * (nk + ne))[None, :]
        act = self.active()
        enc[(base + self.ks)[act]] = 1.0
        enc[(base + nk + self.e)[act]] = 1.0
        enc[row[:, 0] + s.n_blocks * (nk + ne) + self.r] = 1.0
        return enc.reshape(n, size)

    def genes(self) -> np.ndarray:
        """``(P, 2 * n_blocks + n_stages + 1)`` int8: all choice indices side by side."""
        return np.concatenate([self.ks, self.e, self.d, self.r[:, None]], axis=1).astype(_DT)

    def keys(self) -> list[bytes]:
        """One hashable key per member; equal keys <=> same (canonical) arch."""
        g = np.ascontiguousarray(self.genes())
        return [row.tobytes() for row in g]

    # ------------------------------------------------------------------ back to ArchConfig
    def arch(self, i: int) -> ArchConfig:
        """Member ``i`` as an :class:`ArchConfig` (canonical)."""
        s = self.space
        return ArchConfig(
            ks=tuple(s.ks_choices[int(v)] for v in self.ks[i]),
            e=tuple(s.e_choices[int(v)] for v in self.e[i]),
            d=tuple(s.d_choices[int(v)] for v in self.d[i]),
            r=s.resolutions[int(self.r[i])],
        )

    def archs(self) -> list[ArchConfig]:
        """All members as ArchConfigs (bulk conversion)."""
        v = self.values()
        return [ArchConfig(tuple(k), tuple(e), tuple(d), r)
                for k, e, d, r in zip(v["ks"].tolist(), v["e"].tolist(), v["d"].tolist(), v["r"].tolist())]


def smallest_population(space: SearchSpace) -> Population:
    """The one-member population holding ``space.smallest()``."""
    return Population.from_archs(space, [space.smallest()])


__all__ = ["Population", "smallest_population"]
