"""Multi-constraint evolutionary search of subnets (OFA's regularized evolution, vectorized).

The algorithm is Once-for-All's (Cai et al., ICLR 2020, Sec. 3.4; ``ofa/nas/search_algorithm/
evolution.py``): a population of ``population`` feasible archs; every generation keeps the best
``parent_ratio`` as parents and adds ``mutation_ratio * population`` mutated children of random
parents (per-block / per-stage mutation probability ``mutate_prob``, resolution mutation
probability ``resolution_mutate_prob``) and the rest as crossovers of two random parents.

What differs from OFA's ``EvolutionFinder``:

- *several constraints at once*: a child is feasible when every budget of the device profile is
  met (:meth:`DeviceProfile.effective_budgets` against :meth:`CostModel.batch`), not one scalar;
- *never hangs*: infeasible children are redrawn at most ``max_resample_rounds`` times (then the
  parent is kept), the initial population is drawn from at most ``max_init_samples`` random archs
  (then filled with mutants of the feasible ones found), and when no arch of the space meets the
  budgets the search stops at once with a :class:`UserInputError` naming every violated budget and
  the smallest value the space reaches for it (OFA's finder loops forever);
- *vectorized*: a generation is a :class:`~rafl.search.genome.Population` of integer arrays, priced
  by one cost-table call and scored by one predictor call;
- a generation budget or a wall-clock budget (``time_budget_s``), deterministic for a seed.

:func:`search_subnets` is the library entry point (the default pipeline's search step): one
accuracy predictor and one pass over the supernet shared by all profiles, evolution per profile,
then the final top-k of every profile re-measured; each profile returns the best measured
finalist of *any* profile that meets its own budgets (:func:`pick_shared`), so a looser profile
never ends with a lower measured accuracy than a subnet another profile found and it could run.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from rafl import seeds
from rafl.errors import UserInputError
from rafl.search.cost import CostModel, energy_per_epoch_j
from rafl.search.estimators import MeasuredAccuracy, PredictedAccuracy, measurement_cache_dir, sample_across_space
from rafl.search.genome import Population
from rafl.search.profile import load_profile, profiles_dir
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.threads import torch_threads

CostFn = Callable[[Population], dict[str, np.ndarray]]
ScoreFn = Callable[[Population], np.ndarray]


class SearchConfig(BaseModel):
    """Hyper-parameters of the search (defaults: OFA's evolution, Cai et al. 2020, Sec. 3.4).

    Raises:
        UserInputError: via :meth:`from_dict` for unknown keys or out-of-range values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    population: int = Field(100, ge=2, description="an integer >= 2 (archs per generation)")
    generations: int = Field(500, ge=0, description="an integer >= 0 (OFA's max_time_budget)")
    time_budget_s: float | None = Field(None, gt=0, description="seconds > 0, or null (no wall-clock limit)")
    parent_ratio: float = Field(0.25, gt=0, le=1, description="a fraction in (0, 1]")
    mutation_ratio: float = Field(0.5, ge=0, le=1, description="a fraction in [0, 1]")
    mutate_prob: float = Field(0.1, ge=0, le=1, description="a probability in [0, 1] (per block / stage)")
    resolution_mutate_prob: float = Field(0.5, ge=0, le=1, description="a probability in [0, 1]")
    estimator: Literal["predictor", "measured"] = Field("predictor", description="'predictor' or 'measured'")
    predictor_samples: int = Field(500, ge=4, description="an integer >= 4 (measured subnets to train the predictor; OFA-style: >= 500)")
    predictor_folds: int = Field(4, ge=0, description="an integer >= 0 (cross-validation folds for the predictor's Kendall tau; 0/1 = none)")
    predictor_hidden: int = Field(128, ge=1, description="an integer >= 1")
    predictor_epochs: int = Field(400, ge=1, description="an integer >= 1")
    top_k: int = Field(5, ge=1, description="an integer >= 1 (final archs re-measured per profile)")
    max_resample_rounds: int = Field(10, ge=0, description="an integer >= 0 (redraws of infeasible children)")
    max_init_samples: int = Field(20000, ge=1, description="an integer >= 1 (random archs tried for the initial population)")
    calib_batches: int = Field(2, ge=1, description="an integer >= 1 (BN recalibration batches)")
    batch_size: int = Field(128, ge=1, description="an integer >= 1 (images per forward pass)")
    seed: int = Field(0, description="an integer (everything is deterministic for it)")
    threads: int | None = Field(1, ge=1, description="an integer >= 1 (torch threads during the search), or null (unchanged)")
    workers: int | None = Field(None, ge=1, description="an integer >= 1 (processes measuring subnets, one torch "
                                "thread each; the same accuracies for every value) or null (the CPU cores)")
    progress: bool = Field(True, description="true/false (progress bars)")
    cache_measurements: bool = Field(True, description="true/false (keep measured accuracies on disk, per supernet "
                                                       "and validation split, under $RAFL_CACHE_DIR/search-measurements)")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> SearchConfig:
        """Validate a mapping; one :class:`UserInputError` naming the field and allowed values."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            name = ".".join(str(p) for p in first.get("loc", ()))
            info = cls.model_fields.get(name)
            allowed_text = info.description if info is not None else f"keys {', '.join(cls.model_fields)}"
            raise UserInputError(f"{first.get('msg', 'invalid')} (got {first.get('input')!r}); allowed: "
                                 f"{allowed_text}", source=source, field=f"search.{name}") from None


@dataclass
class EvolutionOutcome:
    """What one evolution run produced (arrays over the final population, best first).

    Attributes:
        population: final population (parents + last children), sorted by score, best first.
        scores: (P,) estimated accuracy (fraction 0..1) of ``population``.
        costs: cost arrays of ``population`` (keys of the cost function, e.g. ``latency_ms``).
        history: one dict per generation (see :func:`evolve`).
        archive: every distinct arch evaluated (a :class:`Population`), with ``archive_scores``
            (N,) and ``archive_costs`` (key -> (N,)), for the Pareto front.
        n_cost_queries: archs priced; n_score_queries: archs scored.
    """

    population: Population
    scores: np.ndarray
    costs: dict[str, np.ndarray]
    history: list[dict[str, Any]]
    archive: Population
    archive_scores: np.ndarray
    archive_costs: dict[str, np.ndarray]
    n_cost_queries: int = 0
    n_score_queries: int = 0


def feasible_mask(costs: dict[str, np.ndarray], limits: dict[str, float]) -> np.ndarray:
    """``(P,)`` bool: every budget met (``cost <= limit`` for every key of ``limits``)."""
    n = len(next(iter(costs.values()))) if costs else 0
    ok = np.ones(n, dtype=bool)
    for key, limit in limits.items():
        ok &= costs[key] <= limit
    return ok


def _take_costs(costs: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in costs.items()}


def _cat_costs(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class _Counter:
    """Wraps the cost function to count the archs it prices."""

    def __init__(self, fn: CostFn):
        self.fn, self.n = fn, 0

    def __call__(self, pop: Population) -> dict[str, np.ndarray]:
        self.n += len(pop)
        return self.fn(pop)


def infeasibility_error(space: SearchSpace, cost_fn: CostFn, limits: dict[str, float], profile_name: str,
                        probe: tuple[Population, dict[str, np.ndarray]] | None = None) -> UserInputError:
    """The error raised when no arch meets every budget.

    Names each budget that no probed arch meets, with the smallest value the space reaches for it
    (the minimum over the smallest arch and the probed random archs: exact for costs that grow
    with kernel size, expand ratio, depth and resolution, as MACs, parameters, memory, latency and
    energy do).
    """
    small = Population.from_archs(space, [space.smallest()])
    pops, costs = [small], [cost_fn(small)]
    if probe is not None:
        pops.append(probe[0])
        costs.append(probe[1])
    allc = _cat_costs(costs)
    parts = []
    for key, limit in limits.items():
        lowest = float(np.min(allc[key]))
        if lowest > limit:
            parts.append(f"{key} <= {_fmt(limit)} is unreachable (the smallest value this search space "
                         f"reaches is {_fmt(lowest)})")
    unreachable = [key for key, limit in limits.items() if float(np.min(allc[key])) > limit]
    if not parts:  # every budget reachable alone, never together
        parts = [f"{key} <= {_fmt(limit)} (smallest reachable alone: {_fmt(float(np.min(allc[key])))})"
                 for key, limit in limits.items()]
        err = UserInputError("no subnet of the search space meets all budgets together: " + "; ".join(parts)
                             + "; relax at least one of them", field=f"{profile_name}.budgets")
        err.budget_keys = list(limits)
        return err
    err = UserInputError("no subnet of the search space meets the budgets: " + "; ".join(parts)
                         + "; relax these budgets (or use a smaller search space)", field=f"{profile_name}.budgets")
    err.budget_keys = unreachable  # the budgets to relax (the caller may name where they were set)
    return err


def check_satisfiable(space: SearchSpace, cost_fn: CostFn, limits: dict[str, float], profile_name: str,
                      n_probe: int = 256, seed: int = 0) -> None:
    """Raise :func:`infeasibility_error` unless the smallest arch or one of ``n_probe`` random
    archs meets every budget (milliseconds; no search, no measurement).

    Raises:
        UserInputError: no probed arch meets the budgets (names each violated budget and the
            smallest value the space reaches for it).
    """
    if not limits:
        return
    probe = Population.sample(space, n_probe, seeds.generator("search-probe", seed))
    c = cost_fn(Population.concat([Population.from_archs(space, [space.smallest()]), probe]))
    missing = [k for k in limits if k not in c]
    if missing:
        raise UserInputError(f"budget(s) {missing} cannot be checked; the cost model provides {sorted(c)}",
                             field=f"{profile_name}.budgets")
    if not feasible_mask(c, limits).any():
        raise infeasibility_error(space, cost_fn, limits, profile_name, (probe, {k: v[1:] for k, v in c.items()}))


def _initial_population(space: SearchSpace, n: int, cost_fn: CostFn, limits: dict[str, float],
                        rng: np.random.Generator, cfg: SearchConfig, profile_name: str
                        ) -> tuple[Population, dict[str, np.ndarray]]:
    """``n`` feasible archs: random ones (bounded number of tries), topped up with mutants."""
    # The smallest arch first: if it fails a budget that only grows with the arch, nothing fits.
    small = Population.from_archs(space, [space.smallest()])
    small_cost = cost_fn(small)
    found: list[Population] = []
    found_costs: list[dict[str, np.ndarray]] = []
    n_found, tried = 0, 0
    batch = max(n, 64)
    probe: tuple[Population, dict[str, np.ndarray]] | None = None
    while n_found < n and tried < cfg.max_init_samples:
        m = min(batch, cfg.max_init_samples - tried)
        cand = Population.sample(space, m, rng)
        c = cost_fn(cand)
        tried += m
        if probe is None:
            probe = (cand, c)
        ok = np.flatnonzero(feasible_mask(c, limits))
        if len(ok):
            ok = ok[: n - n_found]
            found.append(cand.take(ok))
            found_costs.append(_take_costs(c, ok))
            n_found += len(ok)
        if not feasible_mask(small_cost, limits)[0] and n_found == 0 and tried >= batch:
            # the smallest arch fails: stop at once unless a random arch was luckier (non-monotone cost)
            break
    if n_found == 0:
        if feasible_mask(small_cost, limits)[0]:
            found, found_costs, n_found = [small], [small_cost], 1
        else:
            raise infeasibility_error(space, cost_fn, limits, profile_name, probe)
    pop, costs = Population.concat(found), _cat_costs(found_costs)
    if n_found < n:  # top up with mutants of the feasible archs found (bounded)
        idx = rng.integers(0, n_found, n - n_found)
        kids, kid_costs = _feasible_children(
            lambda sel: pop.take(idx[sel]).mutate(rng, max(cfg.mutate_prob, 0.3), cfg.resolution_mutate_prob),
            lambda sel: (pop.take(idx[sel]), _take_costs(costs, idx[sel])),
            n - n_found, cost_fn, limits, cfg.max_resample_rounds)
        pop, costs = Population.concat([pop, kids]), _cat_costs([costs, kid_costs])
    return pop, costs


def _feasible_children(make: Callable[[np.ndarray], Population],
                       fallback: Callable[[np.ndarray], tuple[Population, dict[str, np.ndarray]]],
                       n: int, cost_fn: CostFn, limits: dict[str, float], rounds: int, oversample: int = 4
                       ) -> tuple[Population, dict[str, np.ndarray]]:
    """``n`` feasible children: ``make(slots)`` draws one child per entry of ``slots`` (same
    parents for the same slot); infeasible slots are redrawn at most ``rounds`` times, each round
    drawing ``oversample`` (more when few children were feasible: ``6 / feasible rate``, at most
    16) candidates per slot in one batch and keeping the first feasible one
    (the same distribution as OFA's redraw-until-feasible loop, with fewer cost calls); slots still
    infeasible get ``fallback(slots)`` (a feasible parent). Returns children and costs in slot order."""
    kids = make(np.arange(n))
    costs = cost_fn(kids)
    bad = np.flatnonzero(~feasible_mask(costs, limits))
    # candidates per infeasible slot: enough that one round usually finds a feasible one for all
    rate = max(1.0 - len(bad) / max(n, 1), 1.0 / 16)
    oversample = int(min(16, max(oversample, np.ceil(6.0 / rate))))
    for _ in range(rounds):
        if not len(bad):
            break
        cand_slots = np.repeat(bad, oversample)
        redo = make(cand_slots)
        redo_cost = cost_fn(redo)
        ok = feasible_mask(redo_cost, limits).reshape(len(bad), oversample)
        hit = ok.any(axis=1)
        if hit.any():
            pick = np.flatnonzero(hit) * oversample + ok[hit].argmax(axis=1)  # first feasible candidate
            good = bad[hit]
            for f in ("ks", "e", "d", "r"):
                getattr(kids, f)[good] = getattr(redo, f)[pick]
            for k in costs:
                costs[k][good] = redo_cost[k][pick]
        bad = bad[~hit]
    if len(bad):
        par, par_cost = fallback(bad)
        for f in ("ks", "e", "d", "r"):
            getattr(kids, f)[bad] = getattr(par, f)
        for k in costs:
            costs[k][bad] = par_cost[k]
    return kids, costs


def evolve(space: SearchSpace, score_fn: ScoreFn, cost_fn: CostFn, limits: dict[str, float],
           config: SearchConfig, *, profile_name: str = "profile", seed: int | None = None) -> EvolutionOutcome:
    """Run OFA's evolution under several budgets at once.

    Args:
        space: the search space.
        score_fn: ``Population -> (P,)`` estimated accuracy (higher is better).
        cost_fn: ``Population -> {key: (P,) array}``, with every key of ``limits``
            (e.g. :meth:`CostModel.batch` keys ``macs_m``, ``latency_ms``...).
        limits: budget per cost key (``cost <= limit``), e.g. from
            :meth:`DeviceProfile.effective_budgets`.
        config: :class:`SearchConfig` (population, generations, time budget, ratios, probs).
        profile_name: used in messages and the progress bar.
        seed: overrides ``config.seed``.

    Returns:
        :class:`EvolutionOutcome`; ``history`` has per generation ``generation``,
        ``best_accuracy`` (best feasible so far), ``mean_parent_accuracy``, ``best_arch``,
        ``candidates_redrawn`` (extra candidates drawn for infeasible children) and ``elapsed_s``.

    Raises:
        UserInputError: no arch of the space meets the budgets (names each violated budget and
            the smallest value the space reaches for it), or a budget key the cost function
            does not provide.
    """
    def checked_cost_fn(pop: Population) -> dict[str, np.ndarray]:  # a wrong shape was an IndexError deep inside
        costs = cost_fn(pop)
        for key, value in costs.items():
            if np.shape(value) != (len(pop),):
                raise ValueError(f"cost_fn returned {key!r} of shape {np.shape(value)} for a population of {len(pop)}; "
                                 f"it must return one value per arch, shape ({len(pop)},)")
        return costs

    with _single_threaded_blas():
        return _evolve(space, score_fn, checked_cost_fn, limits, config, profile_name,
                       config.seed if seed is None else seed)


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """numpy's BLAS on one thread for the block: the search's matrices are tiny (an MLP on ~100
    encodings), and extra BLAS threads only add overhead (many times more on a shared machine)."""
    with threadpool_limits(1, user_api="blas"):
        yield


def _evolve(space: SearchSpace, score_fn: ScoreFn, cost_fn: CostFn, limits: dict[str, float],
            config: SearchConfig, profile_name: str, seed: int) -> EvolutionOutcome:
    rng = seeds.generator("search-evolution", seed)
    counter = _Counter(cost_fn)
    probe_keys = counter(Population.from_archs(space, [space.smallest()]))
    missing = [k for k in limits if k not in probe_keys]
    if missing:
        raise UserInputError(f"budget(s) {missing} cannot be checked; the cost model provides "
                             f"{sorted(probe_keys)}", field=f"{profile_name}.budgets")
    n_pop = config.population
    n_par = max(1, int(round(config.parent_ratio * n_pop)))
    n_mut = int(round(config.mutation_ratio * n_pop))
    n_cross = n_pop - n_mut

    t0 = time.perf_counter()
    pop, costs = _initial_population(space, n_pop, counter, limits, rng, config, profile_name)
    scores = _scores(score_fn, pop)
    n_scored = len(pop)
    arch_pops, arch_scores, arch_costs = [pop], [scores], [costs]
    history: list[dict[str, Any]] = []
    best = -math.inf
    bar = tqdm(total=config.generations, desc=f"search {profile_name}", disable=not config.progress,
               leave=False)
    for gen in range(config.generations):
        order = np.argsort(-scores, kind="stable")[:n_par]
        pop, scores, costs = pop.take(order), scores[order], _take_costs(costs, order)
        best = max(best, float(scores[0]))
        redrawn_before = counter.n

        # slots [0, n_mut) are mutants of parent im[slot]; [n_mut, n_pop) crossovers of i1 x i2
        im = rng.integers(0, n_par, n_mut)
        i1, i2 = rng.integers(0, n_par, n_cross), rng.integers(0, n_par, n_cross)
        first_parent = np.concatenate([im, i1])

        def children(sel: np.ndarray) -> Population:
            is_mut = sel < n_mut
            out = pop.take(first_parent[sel])
            if is_mut.any():
                m = out.take(np.flatnonzero(is_mut)).mutate(rng, config.mutate_prob, config.resolution_mutate_prob)
                for f in ("ks", "e", "d", "r"):
                    getattr(out, f)[is_mut] = getattr(m, f)
            if (~is_mut).any():
                c_sel = sel[~is_mut] - n_mut
                x = Population.crossover(pop.take(i1[c_sel]), pop.take(i2[c_sel]), rng)
                for f in ("ks", "e", "d", "r"):
                    getattr(out, f)[~is_mut] = getattr(x, f)
            return out

        def parents_of(sel: np.ndarray) -> tuple[Population, dict[str, np.ndarray]]:
            return pop.take(first_parent[sel]), _take_costs(costs, first_parent[sel])

        kids, kid_costs = _feasible_children(children, parents_of, n_pop, counter, limits,
                                             config.max_resample_rounds)
        kid_scores = _scores(score_fn, kids)
        n_scored += len(kids)
        arch_pops.append(kids)
        arch_scores.append(kid_scores)
        arch_costs.append(kid_costs)
        pop = Population.concat([pop, kids])
        scores = np.concatenate([scores, kid_scores])
        costs = _cat_costs([costs, kid_costs])
        elapsed = time.perf_counter() - t0
        history.append({
            "generation": gen,
            "best_accuracy": best,
            "mean_parent_accuracy": float(np.mean(scores[:n_par])),
            "best_arch": pop.arch(0).to_string(),
            "candidates_redrawn": int(counter.n - redrawn_before - n_pop),
            "elapsed_s": round(elapsed, 4),
        })
        if config.progress:
            bar.set_postfix(best_acc=f"{best:.4f}", refresh=False)
            bar.update(1)
        if config.time_budget_s is not None and elapsed >= config.time_budget_s:
            break
    bar.close()
    order = np.argsort(-scores, kind="stable")
    pop, scores, costs = pop.take(order), scores[order], _take_costs(costs, order)

    archive = Population.concat(arch_pops)
    a_scores = np.concatenate(arch_scores)
    a_costs = _cat_costs(arch_costs)
    genes = np.ascontiguousarray(archive.genes())
    _, first = np.unique(genes.view(np.dtype((np.void, genes.shape[1]))).ravel(), return_index=True)
    first = np.sort(first)
    return EvolutionOutcome(pop, scores, costs, history, archive.take(first), a_scores[first],
                            _take_costs(a_costs, first), n_cost_queries=counter.n, n_score_queries=n_scored)


# ---------------------------------------------------------------------- library entry point
@dataclass
class SearchResult:
    """The subnet found for one device profile.

    Attributes:
        arch: the chosen subnet.
        accuracy: its measured top-1 accuracy on the server's validation split (fraction 0..1),
            after BN recalibration.
        cost: its :class:`rafl.search.cost.Cost` on the profile's device.
        profile: the profile's name.
        predicted_accuracy: the estimator's value for ``arch`` during the evolution.
        estimator: ``"predictor"`` or ``"measured"``.
        predictor_fit: cross-validated Kendall tau / RMSE of the shared predictor (or None).
        top_k: this profile's re-measured finalists, ``[{"arch", "predicted_accuracy", "accuracy"}]``.
        history: per-generation records of :func:`evolve`.
        outcome: the raw :class:`EvolutionOutcome` (archive for the Pareto front).
        budgets: the limits searched under, ``{key: limit}``.
        found_for: the profile whose evolution found ``arch`` (this profile, or another profile
            of the same call whose finalist is feasible here and measured better; see
            :func:`pick_shared`).
        shared_candidates: the other profiles' finalists this profile considered,
            ``[{"arch", "accuracy", "predicted_accuracy", "found_for", "feasible", "violates"}]``
            (``violates``: the budget keys of this profile it exceeds).
        budget_use: :func:`budget_use` of ``arch`` on this profile (most used budget first).
        binding: the budget that binds the pick (:func:`binding_budget`: used to >= 90%), or None.
        accuracy_source: ``"measured"``, or ``"predicted"`` when ``accuracy`` is the predictor's
            (a search on known measurements with no data to measure a finalist on).
        n_measured: subnets this search measured (known and cached accuracies excluded).
    """

    arch: ArchConfig
    accuracy: float
    cost: Any
    profile: str
    predicted_accuracy: float | None = None
    estimator: str = "predictor"
    predictor_fit: dict[str, float | int] | None = None
    top_k: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    outcome: EvolutionOutcome | None = None
    budgets: dict[str, float] = field(default_factory=dict)
    found_for: str = ""
    shared_candidates: list[dict[str, Any]] = field(default_factory=list)
    budget_use: list[dict[str, Any]] = field(default_factory=list)
    binding: dict[str, Any] | None = None
    accuracy_source: str = "measured"
    n_measured: int = 0

    def __post_init__(self) -> None:
        if not self.found_for:
            self.found_for = self.profile


@dataclass(frozen=True)
class Finalist:
    """One re-measured finalist of a profile's evolution.

    Attributes:
        arch: the subnet (canonical). accuracy: its measured accuracy (fraction 0..1).
        predicted_accuracy: the (shared) estimator's value for it.
        found_for: the profile whose evolution found it.
    """

    arch: ArchConfig
    accuracy: float
    predicted_accuracy: float
    found_for: str


@dataclass
class SharedPick:
    """What :func:`pick_shared` chose for one profile: ``pick`` and every other profile's
    finalist it considered (``considered``: dicts as in :attr:`SearchResult.shared_candidates`)."""

    pick: Finalist
    considered: list[dict[str, Any]]


#: :attr:`Finalist.found_for` of a subnet measured before the evolution (:func:`pick_shared`'s ``earlier``)
MEASURED_BEFORE = "(measured before)"


def pick_shared(space: SearchSpace, finalists: dict[str, list[Finalist]], cost_fns: dict[str, CostFn],
                limits: dict[str, dict[str, float]], earlier: Sequence[Finalist] = ()) -> dict[str, SharedPick]:
    """The final pick of every profile among the measured finalists of *all* profiles and the
    subnets measured before on the same validation split.

    Profile ``p`` picks, among its own finalists, every other profile's finalist and every subnet
    of ``earlier`` that meets all of ``p``'s budgets (re-checked with ``cost_fns[p]`` against
    ``limits[p]``), the one with the highest measured accuracy; ties go to ``p``'s own finalists,
    then to the higher predicted accuracy, then to the earlier candidate (own finalists in rank
    order, then the others in profile order, then ``earlier`` in its order). So a profile never
    ends with a lower measured accuracy than a subnet it could run whose accuracy the search
    knows, and a profile alone (or one whose own pick is best) keeps exactly the pick of its own
    top-k.

    Args:
        space: the search space of every arch.
        finalists: ``{profile: [Finalist, ...]}``, each profile's re-measured top-k (own finalists
            are feasible for their profile by construction), in profile order.
        cost_fns: ``{profile: Population -> {key: (P,) array}}`` (see :func:`cost_fn_for`).
        limits: ``{profile: {key: limit}}``.
        earlier: subnets measured before with the same measurement (the predictor's measured
            subnets, the measurements shipped beside the supernet), ``found_for`` =
            :data:`MEASURED_BEFORE`. Only the feasible ones measured above the profile's best own
            finalist are listed in :attr:`SharedPick.considered`.

    Returns:
        ``{profile: SharedPick}`` in the order of ``finalists``.
    """
    pool: dict[ArchConfig, Finalist] = {}
    for cands in finalists.values():
        for c in cands:
            pool.setdefault(c.arch, c)  # an arch found by several profiles: the first one names it
    for c in earlier:
        pool.setdefault(c.arch, c)
    out: dict[str, SharedPick] = {}
    for name, own in finalists.items():
        if not own:
            raise ValueError(f"profile {name!r} has no finalist")
        own_archs = {c.arch for c in own}
        foreign = [c for c in pool.values() if c.arch not in own_archs]
        considered: list[dict[str, Any]] = []
        usable: list[Finalist] = []
        if foreign:
            costs = cost_fns[name](Population.from_archs(space, [c.arch for c in foreign]))
            lim = limits[name]
            ok = feasible_mask(costs, lim)
            own_best = max(c.accuracy for c in own)
            for i, c in enumerate(foreign):
                if c.found_for == MEASURED_BEFORE and not (ok[i] and c.accuracy > own_best):
                    continue
                considered.append({
                    "arch": c.arch.to_string(), "accuracy": float(c.accuracy),
                    "predicted_accuracy": float(c.predicted_accuracy), "found_for": c.found_for,
                    "feasible": bool(ok[i]),
                    "violates": [k for k, v in lim.items() if not costs[k][i] <= v]})
            usable = [c for i, c in enumerate(foreign) if ok[i]]
        cands = [(c, True) for c in own] + [(c, False) for c in usable]
        best = max(range(len(cands)), key=lambda j: (cands[j][0].accuracy, cands[j][1],
                                                     cands[j][0].predicted_accuracy, -j))
        pick = cands[best][0]
        if cands[best][1] and pick.found_for != name:
            pick = Finalist(pick.arch, pick.accuracy, pick.predicted_accuracy, name)
        out[name] = SharedPick(pick, considered)
    return out


def profile_limits(profile) -> dict[str, float]:
    """``{cost key: limit}`` of a :class:`DeviceProfile` (its effective budgets)."""
    return {k: float(v) for k, v in profile.effective_budgets()}


#: A pick whose cost is at least this share of a budget is said to be bound by it.
BINDING_USE = 0.9


def budget_use(values: dict[str, float], limits: dict[str, float]) -> list[dict[str, Any]]:
    """How much of every budget a subnet uses, most used first.

    Args:
        values: the subnet's cost per key (e.g. one row of :func:`cost_fn_for`'s arrays).
        limits: ``{key: limit}``.
    Returns:
        ``[{"budget", "value", "limit", "use"}]`` with ``use = value / limit`` (1.0 = at the limit),
        sorted by ``use`` descending (ties in ``limits`` order).
    """
    rows = [{"budget": k, "value": float(values[k]), "limit": float(v), "use": float(values[k]) / float(v)}
            for k, v in limits.items()]
    return sorted(rows, key=lambda r: -r["use"])


def binding_budget(use: list[dict[str, Any]], threshold: float = BINDING_USE) -> dict[str, Any] | None:
    """The budget that binds a pick: the most used one, if it is used to ``>= threshold``
    (within 10% of its limit by default); None when no budget does (the pick is not limited
    by the device but by the search space or the accuracy landscape)."""
    return dict(use[0]) if use and use[0]["use"] >= threshold else None


def binding_text(use: list[dict[str, Any]], threshold: float = BINDING_USE) -> str:
    """One phrase naming what limits a pick, e.g. ``latency_ms 1.49 of 1.5 (99%)`` or
    ``no budget binds (most used: latency_ms at 62%)``."""
    b = binding_budget(use, threshold)
    if b is not None:
        return f"{b['budget']} {b['value']:.4g} of {b['limit']:.4g} ({100 * b['use']:.0f}%)"
    if not use:
        return "no budgets"
    return f"no budget binds (most used: {use[0]['budget']} at {100 * use[0]['use']:.0f}%)"


class _ArchRows:
    """Read-only ``ks``/``e``/``d``/``r`` views of one population member: what
    :meth:`CostModel.batch` reads from an arch, without building (and re-validating) an
    :class:`ArchConfig` per candidate (population members are valid by construction)."""

    __slots__ = ("ks", "e", "d", "r")

    def __init__(self, ks, e, d, r):
        self.ks, self.e, self.d, self.r = ks, e, d, r

    @classmethod
    def of(cls, pop: Population) -> list[_ArchRows]:
        v = pop.values()
        return [cls(k, e, d, r) for k, e, d, r in zip(v["ks"], v["e"], v["d"], v["r"].tolist())]


def cost_fn_for(cost_model) -> CostFn:
    """Adapt a :class:`rafl.search.cost.CostModel` to ``Population -> {key: (P,) float64 array}``.

    Prices a whole generation with one :meth:`CostModel.batch` call (its vectorized table lookup).
    Adds ``energy_per_epoch_j`` when the model's profile has that budget.
    """
    fast = [True]
    profile = getattr(cost_model, "profile", None)
    per_epoch = profile is not None and "energy_per_epoch_j" in dict(profile.effective_budgets())

    def fn(pop: Population) -> dict[str, np.ndarray]:
        out = None
        if fast[0]:
            try:
                out = cost_model.batch(_ArchRows.of(pop))
            except (AttributeError, TypeError):  # a cost model that needs real ArchConfigs
                fast[0] = False
        if out is None:
            out = cost_model.batch(pop.archs())
        out = {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}
        if per_epoch:
            out["energy_per_epoch_j"] = energy_per_epoch_j(out["energy_mj"], profile)
        return out

    return fn


def _scores(score_fn: ScoreFn, pop: Population) -> np.ndarray:
    """``score_fn(pop)`` as float64 ``(P,)``.

    Raises:
        ValueError: another shape (a per-arch scalar is required; it crashed with an IndexError)."""
    scores = np.asarray(score_fn(pop), dtype=np.float64)
    if scores.shape != (len(pop),):
        raise ValueError(f"score_fn returned shape {scores.shape} for a population of {len(pop)}; it must return "
                         f"one score per arch, shape ({len(pop)},)")
    return scores


def search_subnets(supernet, profiles: Sequence, val_data, calib_data, config: SearchConfig | None = None,
                   *, cost_models: dict[str, Any] | None = None, known: dict[str, float] | None = None,
                   data_fn: Callable[[], tuple[Any, Any]] | None = None, common: bool = False) -> dict[str, SearchResult]:
    """Find, for every device profile, the subnet of ``supernet`` with the best estimated accuracy
    that meets every budget of the profile (Once-for-All's specialization step, Cai et al. 2020,
    Sec. 3.4, with several constraints at once).

    One :class:`MeasuredAccuracy` cache and (for ``estimator="predictor"``) one accuracy predictor
    trained on ``config.predictor_samples`` measured subnets are shared by all profiles; each
    profile then runs :func:`evolve` and its final top-k are measured. After all profiles, each
    profile returns the best measured finalist of *any* profile that meets its own budgets
    (re-checked with its cost model; :func:`pick_shared`); :attr:`SearchResult.found_for` names
    the profile whose evolution found it.

    Args:
        supernet: a trained :class:`rafl.supernet.Supernet`.
        profiles: :class:`rafl.search.profile.DeviceProfile` objects (or names / paths).
        val_data: ``(images (N, C, H, W) float32, labels (N,) int64)``, the server's validation
            split; None with ``data_fn``: loaded only when an arch is not in ``known``.
        calib_data: ``(M, C, H, W)`` float32 server images for BN recalibration (None with ``val_data``).
        config: :class:`SearchConfig` (defaults: OFA's evolution, population 100 x 500 generations).
        cost_models: optional prebuilt ``{profile name: CostModel}``.
        known: accuracies measured before on the same validation split with the same measurement
            (canonical arch string -> fraction; e.g. the measurements shipped with a pretrained
            supernet); these archs are not measured again.
        data_fn: ``() -> (val_data, calib_data)`` for ``val_data=None``; when it raises
            :class:`UserInputError` (no dataset here), finalists not in ``known`` keep their
            predicted accuracy (``SearchResult.accuracy_source`` says which).
        common: also search the one subnet that meets every budget of every profile at once (one
            evolution under all profiles' budgets, each priced by its own cost model, with the
            same predictor; its measured top-k decide), returned under :data:`COMMON`: what one
            model for all devices gets when the budgets are not nested (no profile's subnet fits
            every other device). Its ``cost`` is on the first profile's device.

    Returns:
        ``{profile name: SearchResult}`` in the order of ``profiles`` (and ``COMMON`` with ``common``).

    Raises:
        UserInputError: empty validation split or calibration set, duplicate profile names, a
            profile whose budgets no subnet of the space meets (naming each violated budget and
            the smallest value reachable), or predictor samples to measure with no data.
    """
    config = config or SearchConfig()
    if val_data is None and data_fn is None:
        raise ValueError("search_subnets needs val_data and calib_data, or data_fn")
    if val_data is not None:
        # numpy arrays are as good as tensors here ("float32 arrays"): they crashed in .numel()
        val_data = tuple(torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in val_data)
        if not isinstance(calib_data, torch.Tensor):
            calib_data = torch.as_tensor(np.asarray(calib_data, dtype=np.float32))
    with torch_threads(config.threads):
        return _search_subnets(supernet, profiles, val_data, calib_data, config, cost_models, known or {}, data_fn,
                               common)


class _Measurements:
    """The accuracies a search knows (``known``) and a :class:`MeasuredAccuracy` built on first
    need (its data loaded then by ``data_fn``)."""

    def __init__(self, supernet, val_data, calib_data, config: SearchConfig, known: dict[str, float], data_fn):
        self.supernet, self.config, self.known, self.data_fn = supernet, config, known, data_fn
        self.space = supernet.space
        self.data = None if val_data is None else (val_data, calib_data)
        self._measured: MeasuredAccuracy | None = None
        self.no_data: UserInputError | None = None  # why there is nothing to measure on
        self.n_measured_before = 0

    def measured(self) -> MeasuredAccuracy | None:
        if self._measured is None and self.no_data is None:
            if self.data is None:
                try:
                    self.data = self.data_fn()
                except UserInputError as err:
                    self.no_data = err
                    return None
            cfg = self.config
            self._measured = MeasuredAccuracy(
                self.supernet, self.data[0], self.data[1], batch_size=cfg.batch_size, calib_batches=cfg.calib_batches,
                cache_dir=measurement_cache_dir() if cfg.cache_measurements else None, workers=cfg.workers)
            for k, v in self.known.items():
                self._measured.cache.setdefault(k, float(v))
        return self._measured

    def lookup(self, archs: Sequence[ArchConfig]) -> tuple[np.ndarray, list[bool]]:
        """``(accuracy (len(archs),) with nan for unknown, known flags)`` without measuring."""
        keys = [a.canonical(self.space).to_string() for a in archs]
        cache = self._measured.cache if self._measured is not None else {}
        acc = [self.known.get(k, cache.get(k, math.nan)) for k in keys]
        return np.asarray(acc, dtype=np.float64), [not math.isnan(a) for a in acc]

    def measure_available(self, archs: Sequence[ArchConfig], **kw) -> tuple[np.ndarray, list[bool]]:
        """``(accuracy (len(archs),), measured flags)``: known ones looked up, the others measured
        when there is data (else nan, flag False)."""
        acc, have = self.lookup(archs)
        if all(have):
            return acc, have
        m = self.measured()
        if m is None:
            return acc, have
        return m.measure(archs, **kw), [True] * len(archs)

    def measure(self, archs: Sequence[ArchConfig], **kw) -> np.ndarray:
        """:meth:`measure_available`, raising :class:`UserInputError` when some arch cannot be measured."""
        acc, have = self.measure_available(archs, **kw)
        if not all(have):
            raise UserInputError(f"{sum(not h for h in have)} subnets have to be measured and there is no data "
                                 f"to measure them on: {self.no_data.message}", source=self.no_data.source,
                                 field=self.no_data.field)
        return acc


def _measured_before(space: SearchSpace, measurements: _Measurements, score_fn: ScoreFn,
                     config: SearchConfig) -> list[Finalist]:
    """The subnets whose accuracy the search knows before its evolution: ``known`` (the
    measurements shipped beside the supernet) and the predictor's measured subnets, in that
    order, with their predicted accuracy. The same set on every machine: never the disk cache
    of earlier searches."""
    archs = {k: ArchConfig.from_string(k, space) for k in measurements.known}
    if config.estimator == "predictor":
        for a in sample_across_space(space, config.predictor_samples, config.seed):
            archs.setdefault(a.canonical(space).to_string(), a.canonical(space))
    if not archs:
        return []
    arch_list = list(archs.values())
    acc, have = measurements.lookup(arch_list)
    arch_list = [a for a, h in zip(arch_list, have) if h]
    acc = acc[np.asarray(have, dtype=bool)]
    if not arch_list:
        return []
    predicted = score_fn(Population.from_archs(space, arch_list))
    return [Finalist(a, float(m), float(p), MEASURED_BEFORE) for a, m, p in zip(arch_list, acc, predicted)]


#: the key of :func:`search_subnets`' result under ``common=True``: the one subnet meeting every profile
COMMON = "(every profile)"


def _search_subnets(supernet, profiles, val_data, calib_data, config: SearchConfig, cost_models,
                    known: dict[str, float], data_fn, common: bool = False) -> dict[str, SearchResult]:
    profs = [load_profile(p) for p in profiles]
    if not profs:
        raise UserInputError("give at least one device profile", field="device_profile")
    names = [p.name for p in profs]
    if len(set(names)) != len(names):
        raise UserInputError(f"duplicate profile names {names}", field="device_profile")
    space: SearchSpace = supernet.space

    measurements = _Measurements(supernet, val_data, calib_data, config, known, data_fn)
    if val_data is not None:
        measurements.measured()  # checks the data at once
    models = dict(cost_models or {})
    for p in profs:
        if p.name not in models:
            models[p.name] = CostModel(space, p)
    cost_fns = {p.name: cost_fn_for(models[p.name]) for p in profs}
    # Fail fast: every profile must be satisfiable before any expensive measurement.
    for p in profs:
        try:
            check_satisfiable(space, cost_fns[p.name], profile_limits(p), p.name, seed=config.seed)
        except UserInputError as err:  # the user's profile file: name it (a copy of pi4.yaml keeps the name pi4)
            keys = getattr(err, "budget_keys", None) or []
            fields = [p.budget_field(k) for k in keys]
            if keys and all(fields):  # every budget to relax was set by a run config (clients.budgets), not the file
                raise UserInputError(err.message, field=fields[0] if len(fields) == 1 else
                                     ", ".join(fields)) from None
            own = p.source is not None and Path(p.source).resolve().parent != profiles_dir().resolve()
            if err.source is None and own:
                raise UserInputError(err.message, source=p.source, field=f"{p.name}.budgets") from None
            raise

    fit = None
    if config.estimator == "predictor":
        est = PredictedAccuracy.from_measurements(
            measurements, config.predictor_samples, seed=config.seed, folds=config.predictor_folds,
            hidden=config.predictor_hidden, epochs=config.predictor_epochs, progress=config.progress)
        score_fn: ScoreFn = est
        fit = est.fit.to_dict() if est.fit is not None else None
    else:
        m = measurements.measured()
        if m is None:
            raise UserInputError(f"estimator 'measured' measures every subnet and there is no data: "
                                 f"{measurements.no_data.message}", source=measurements.no_data.source,
                                 field=measurements.no_data.field)
        score_fn = m

    evolved: dict[str, EvolutionOutcome] = {}
    finalists: dict[str, list[Finalist]] = {}
    unmeasured: set[ArchConfig] = set()  # finalists with only a predicted accuracy (no data to measure them)
    limits = {p.name: profile_limits(p) for p in profs}
    searched = [p.name for p in profs]
    if common:  # every profile's budgets at once, "profile:key" -> limit, each priced by its own cost model
        def joint_cost(pop: Population) -> dict[str, np.ndarray]:
            return {f"{p.name}:{k}": v for p in profs for k, v in cost_fns[p.name](pop).items()}

        cost_fns[COMMON] = joint_cost
        limits[COMMON] = {f"{p.name}:{k}": v for p in profs for k, v in limits[p.name].items()}
        searched.append(COMMON)
    for name in searched:
        out = evolve(space, score_fn, cost_fns[name], limits[name], config, profile_name=name)
        # the top-k distinct finalists, re-measured
        keys, idx = set(), []
        for i, key in enumerate(out.population.keys()):
            if key not in keys:
                keys.add(key)
                idx.append(i)
            if len(idx) >= config.top_k:
                break
        archs = [out.population.arch(i) for i in idx]
        acc, have = measurements.measure_available(archs, progress=config.progress,
                                         desc=f"re-measuring top-{len(archs)} for {name}")
        acc = np.where(have, acc, out.scores[idx])
        unmeasured.update(a for a, h in zip(archs, have) if not h)
        evolved[name] = out
        finalists[name] = [Finalist(a, float(m), float(out.scores[i]), name)
                             for a, i, m in zip(archs, idx, acc)]
    # every profile picks the best measured finalist of any profile that meets its own budgets
    # (ties: its own finalists, then the estimate)
    # the profiles' picks are those of a search without the common one (its finalists are not theirs)
    earlier = _measured_before(space, measurements, score_fn, config)
    picks = pick_shared(space, {p.name: finalists[p.name] for p in profs}, cost_fns, limits, earlier)
    if common:
        picks[COMMON] = pick_shared(space, finalists, cost_fns, limits, earlier)[COMMON]

    results: dict[str, SearchResult] = {}
    for name in searched:
        out = evolved[name]
        pick = picks[name].pick
        row = {k: float(v[0]) for k, v in cost_fns[name](Population.from_archs(space, [pick.arch])).items()}
        use = budget_use(row, limits[name])
        results[name] = SearchResult(
            arch=pick.arch, accuracy=pick.accuracy, cost=models[name if name != COMMON else profs[0].name].cost(pick.arch), profile=name,
            predicted_accuracy=pick.predicted_accuracy, estimator=config.estimator,
            predictor_fit=fit,
            top_k=[{"arch": f.arch.to_string(), "predicted_accuracy": f.predicted_accuracy, "accuracy": f.accuracy,
                    "measured": f.arch not in unmeasured}
                   for f in finalists[name]],
            history=out.history, outcome=out, budgets=limits[name], found_for=pick.found_for,
            shared_candidates=picks[name].considered, budget_use=use, binding=binding_budget(use),
            accuracy_source="predicted" if pick.arch in unmeasured else "measured",
            n_measured=measurements._measured.n_measured if measurements._measured is not None else 0)
    return results


__all__ = ["COMMON", "SearchConfig", "SearchResult", "EvolutionOutcome", "evolve", "search_subnets", "feasible_mask",
           "Finalist", "SharedPick", "pick_shared", "MEASURED_BEFORE",
           "check_satisfiable",
           "infeasibility_error", "profile_limits", "cost_fn_for", "budget_use", "binding_budget", "binding_text",
           "BINDING_USE"]
