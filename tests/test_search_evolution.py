"""Vectorized genome, evolution with several budgets, predictor, Pareto front (cost-model-free).

These tests use an exact, additive analytic cost (MACs of the inverted-residual blocks computed
from the arch) so that they check the search's logic independently of the cost model; the
end-to-end tests with the real supernet and cost model are in test_search_pipeline.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from rafl.errors import UserInputError
from rafl.search.evolution import SearchConfig, evolve, feasible_mask
from rafl.search.genome import Population
from rafl.search.pareto import pareto_front, save_fronts
from rafl.search.predictor import AccuracyPredictor, kendall_tau, train_predictor
from rafl.supernet.arch import ArchConfig, SearchSpace

SPACE = SearchSpace()


def analytic_cost(pop: Population) -> dict[str, np.ndarray]:
    """MACs-like and params-like costs that grow with ks, e, d and r (monotone, additive)."""
    v = pop.values()
    act = pop.active()
    block = (v["ks"] ** 2 + 8 * v["e"]) * act  # (P, n_blocks)
    stage_res = np.array([1.0, 0.5, 0.25, 0.125, 0.125])
    per_stage = block.reshape(len(pop), SPACE.n_stages, SPACE.max_depth).sum(2)
    macs = (per_stage * stage_res).sum(1) * (v["r"] / 32.0) ** 2
    params = per_stage.sum(1) / 10.0
    return {"macs_m": macs, "params_m": params}


def synthetic_accuracy(pop: Population) -> np.ndarray:
    """A stand-in for the predictor: capacity helps, late stages far more than early ones (whose
    MACs are the most expensive), so the best feasible archs are rare under random sampling."""
    v = pop.values()
    gain = (v["ks"] + 2 * v["e"]) * pop.active()  # (P, n_blocks)
    stage_weight = np.repeat([0.05, 0.1, 0.4, 1.0, 2.0], SPACE.max_depth)
    value = (gain * stage_weight).sum(1) + 0.2 * v["r"]
    return 1.0 - np.exp(-value / 60.0)


def test_population_matches_archconfig():
    rng = np.random.default_rng(0)
    archs = [SPACE.sample(rng) for _ in range(20)] + [SPACE.smallest(), SPACE.largest()]
    pop = Population.from_archs(SPACE, archs)
    assert pop.archs() == [a.canonical(SPACE) for a in archs]
    enc = pop.encode()
    assert enc.shape == (22, SPACE.encoding_size)
    np.testing.assert_array_equal(enc, np.stack([a.encode(SPACE) for a in archs]))
    keys = pop.keys()
    assert keys[-1] != keys[-2] and len(set(keys)) == len({a.to_string() for a in archs})


def test_operators_keep_semantics():
    rng = np.random.default_rng(1)
    pop = Population.sample(SPACE, 500, rng)
    for a in pop.archs()[:50]:
        assert a.validate(SPACE) == a.canonical(SPACE)
    same = pop.mutate(rng, prob=0.0, resolution_prob=0.0)
    np.testing.assert_array_equal(same.genes(), pop.genes())
    # per-gene mutation rate ~ prob * (1 - 1/n_choices) on active genes
    mut = pop.mutate(rng, prob=0.1, resolution_prob=0.5)
    d_changed = np.mean(mut.d != pop.d)
    r_changed = np.mean(mut.r != pop.r)
    assert 0.04 < d_changed < 0.1 and 0.25 < r_changed < 0.42
    # crossover: every gene comes from one of the parents (before canonicalization of slots)
    other = Population.sample(SPACE, 500, rng)
    kid = Population.crossover(pop, other, rng)
    assert np.all((kid.d == pop.d) | (kid.d == other.d))
    assert np.all((kid.r == pop.r) | (kid.r == other.r))
    act = kid.active()
    assert np.all(((kid.ks == pop.ks) | (kid.ks == other.ks))[act])
    assert 0.4 < np.mean(kid.r == pop.r) < 0.75


def _cfg(**kw) -> SearchConfig:
    base = dict(population=40, generations=30, progress=False, seed=0)
    base.update(kw)
    return SearchConfig(**base)


def test_evolution_meets_every_budget_and_beats_random():
    limits = {"macs_m": 300.0, "params_m": 100.0}
    out = evolve(SPACE, synthetic_accuracy, analytic_cost, limits, _cfg(), profile_name="toy")
    assert feasible_mask(out.costs, limits).all()
    assert feasible_mask(out.archive_costs, limits).all()
    # the best found beats the best of as many random archs as the evolution scored
    rng = np.random.default_rng(5)
    rand = Population.sample(SPACE, out.n_score_queries, rng)
    ok = feasible_mask(analytic_cost(rand), limits)
    assert out.scores[0] >= synthetic_accuracy(rand.take(np.flatnonzero(ok))).max()
    # the best is near the budget frontier of at least one constraint
    assert out.costs["macs_m"][0] > 0.8 * limits["macs_m"] or out.costs["params_m"][0] > 0.8 * limits["params_m"]
    hist = out.history
    assert len(hist) == 30 and all(hist[i]["best_accuracy"] <= hist[i + 1]["best_accuracy"] for i in range(29))
    assert np.isclose(hist[-1]["best_accuracy"], out.scores[0]) or hist[-1]["best_accuracy"] <= out.scores[0]


def test_evolution_is_deterministic_for_a_seed():
    limits = {"macs_m": 250.0}
    a = evolve(SPACE, synthetic_accuracy, analytic_cost, limits, _cfg(generations=10))
    b = evolve(SPACE, synthetic_accuracy, analytic_cost, limits, _cfg(generations=10))
    c = evolve(SPACE, synthetic_accuracy, analytic_cost, limits, _cfg(generations=10, seed=1))
    np.testing.assert_array_equal(a.population.genes(), b.population.genes())
    assert [h["best_arch"] for h in a.history] == [h["best_arch"] for h in b.history]
    assert not np.array_equal(a.archive.genes()[:40], c.archive.genes()[:40])


def test_unreachable_budget_stops_at_once_naming_budget_and_minimum():
    smallest = analytic_cost(Population.from_archs(SPACE, [SPACE.smallest()]))
    limits = {"macs_m": 0.5 * float(smallest["macs_m"][0]), "params_m": 1e9}
    calls = []

    def counting_cost(pop):
        calls.append(len(pop))
        return analytic_cost(pop)

    with pytest.raises(UserInputError) as err:
        evolve(SPACE, synthetic_accuracy, counting_cost, limits, _cfg(), profile_name="tiny")
    msg = str(err.value)
    assert "tiny.budgets" in msg and "macs_m" in msg and "params_m" not in msg
    assert f"{float(smallest['macs_m'][0]):.4g}" in msg
    assert sum(calls) < 2000  # stopped at once, no endless resampling


def test_budgets_reachable_alone_but_not_together_is_an_error():
    # a made-up cost pair that trades off: no arch is both small in "a" and small in "b"
    def tradeoff(pop):
        m = analytic_cost(pop)["macs_m"]
        return {"a": m, "b": 1000.0 / m}

    small = float(analytic_cost(Population.from_archs(SPACE, [SPACE.smallest()]))["macs_m"][0])
    with pytest.raises(UserInputError, match="together"):
        evolve(SPACE, synthetic_accuracy, tradeoff, {"a": small * 1.01, "b": 1000.0 / (small * 5)},
               _cfg(max_init_samples=2000))


def test_tight_budget_still_fills_population_and_never_hangs():
    smallest = float(analytic_cost(Population.from_archs(SPACE, [SPACE.smallest()]))["macs_m"][0])
    limits = {"macs_m": smallest * 1.02}  # almost only the smallest arch fits
    out = evolve(SPACE, synthetic_accuracy, analytic_cost, limits, _cfg(generations=5, max_init_samples=500))
    assert len(out.population) == 40 + 10 and feasible_mask(out.costs, limits).all()


def test_missing_cost_key_and_time_budget():
    with pytest.raises(UserInputError, match="energy_mj"):
        evolve(SPACE, synthetic_accuracy, analytic_cost, {"energy_mj": 1.0}, _cfg())
    out = evolve(SPACE, synthetic_accuracy, analytic_cost, {"macs_m": 250.0},
                 _cfg(generations=100000, time_budget_s=0.3))
    assert 1 <= len(out.history) < 100000


def test_search_config_rejects_bad_values():
    with pytest.raises(UserInputError, match="search.population"):
        SearchConfig.from_dict({"population": 1})
    with pytest.raises(UserInputError, match="search.bogus"):
        SearchConfig.from_dict({"bogus": 3})
    assert SearchConfig().population == 100 and SearchConfig().parent_ratio == 0.25


@pytest.mark.slow
def test_predictor_ranks_held_out_archs(tmp_path):
    rng = np.random.default_rng(0)
    pop = Population.sample(SPACE, 120, rng)
    y = synthetic_accuracy(pop)
    model, fit = train_predictor(pop.encode(), y, folds=4, epochs=300, seed=0)
    assert fit.n_holdout == 120 and fit.n_train == 90 and fit.folds == 4 and fit.kendall_tau > 0.5
    again, fit2 = train_predictor(pop.encode(), y, folds=4, epochs=300, seed=0)
    assert fit2 == fit
    test = Population.sample(SPACE, 200, np.random.default_rng(9))
    assert kendall_tau(model.predict(test.encode()), synthetic_accuracy(test)) > 0.5
    model.save(tmp_path / "p.safetensors")
    loaded = AccuracyPredictor.load(tmp_path / "p.safetensors")
    np.testing.assert_allclose(loaded.predict(test.encode()), model.predict(test.encode()), rtol=1e-6)
    with pytest.raises(UserInputError):
        AccuracyPredictor.load(tmp_path / "missing.safetensors")


def test_pareto_front(tmp_path):
    acc = np.array([0.5, 0.6, 0.55, 0.9, 0.9, 0.7])
    cost = np.array([1.0, 2.0, 3.0, 5.0, 6.0, 2.0])
    idx = pareto_front(acc, cost)
    assert list(idx) == [0, 5, 3]
    rng = np.random.default_rng(0)
    a, c = rng.random(300), rng.random(300)
    front = set(pareto_front(a, c).tolist())
    for i in range(300):  # brute force: i is on the front iff nobody dominates it
        dominated = np.any((a >= a[i]) & (c <= c[i]) & ((a > a[i]) | (c < c[i])))
        assert (i in front) == (not dominated) or (not dominated and np.any((a == a[i]) & (c == c[i])))
    doc = save_fronts(tmp_path, a, {"latency_ms": c, "macs_m": c * 10}, [f"a{i}" for i in range(300)],
                      chosen={"accuracy": 0.5, "latency_ms": 0.5, "macs_m": 5.0}, budgets={"latency_ms": 0.8})
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    assert [r["arch"] for r in doc["accuracy_vs_latency_ms"]] == [f"a{i}" for i in pareto_front(a, c)]


def test_archconfig_roundtrip_through_population():
    a = ArchConfig.from_string("r28_k3e4.k5e6|k7e3.k3e3.k5e4|k3e6.k3e6|k5e4.k7e6.k3e3.k3e3|k5e6.k7e6", SPACE)
    pop = Population.from_archs(SPACE, [a])
    assert pop.arch(0) == a.canonical(SPACE)


def test_pick_shared_gives_a_looser_profile_the_tight_profiles_better_finalist():
    """The reviewer's case: pi4-like (tightest) measured 0.30, the looser profiles only 0.20 on
    their own finalists, although pi4's pick fits them: they must end with pi4's 0.30 pick."""
    from rafl.search.evolution import Finalist, pick_shared

    small, mid, big = SPACE.smallest(), SPACE.middle().canonical(SPACE), SPACE.largest()
    rng = np.random.default_rng(0)
    cost = {a: analytic_cost(Population.from_archs(SPACE, [a]))["macs_m"][0] for a in (small, mid, big)}
    assert cost[small] < cost[mid] < cost[big]
    other = next(a for a in (SPACE.sample(rng) for _ in range(1000))
                 if cost[small] < analytic_cost(Population.from_archs(SPACE, [a]))["macs_m"][0] <= cost[mid])
    limits = {"tight": {"macs_m": float(cost[small])}, "mid": {"macs_m": float(cost[mid])},
              "loose": {"macs_m": float(cost[big])}}
    fin = {"tight": [Finalist(small, 0.30, 0.50, "tight")],
           "mid": [Finalist(mid, 0.20, 0.60, "mid"), Finalist(other, 0.20, 0.55, "mid")],
           "loose": [Finalist(big, 0.20, 0.70, "loose"), Finalist(other, 0.25, 0.55, "loose")]}
    picks = pick_shared(SPACE, fin, {k: analytic_cost for k in fin}, limits)
    assert list(picks) == ["tight", "mid", "loose"]
    assert picks["tight"].pick == fin["tight"][0]  # nothing else fits the tightest profile
    for name in ("mid", "loose"):
        assert picks[name].pick.arch == small and picks[name].pick.accuracy == 0.30
        assert picks[name].pick.found_for == "tight"
    # what tight considered: every other finalist once (an arch found twice is named by the first
    # profile that found it), none feasible, each with the budget it violates
    considered = picks["tight"].considered
    assert [c["arch"] for c in considered] == [mid.to_string(), other.to_string(), big.to_string()]
    assert [c["found_for"] for c in considered] == ["mid", "mid", "loose"]
    assert all(not c["feasible"] and c["violates"] == ["macs_m"] for c in considered)
    loose_seen = {c["arch"]: c for c in picks["loose"].considered}
    assert loose_seen[small.to_string()]["feasible"] and loose_seen[mid.to_string()]["feasible"]
    # the invariant: no profile ends below a finalist of another profile that it can run
    for name, p in picks.items():
        for c in p.considered:
            assert not c["feasible"] or p.pick.accuracy >= c["accuracy"]
    # ties go to the profile's own finalist; a single profile keeps its own top-k pick
    fin["mid"][0] = Finalist(mid, 0.30, 0.10, "mid")
    picks = pick_shared(SPACE, fin, {k: analytic_cost for k in fin}, limits)
    assert picks["mid"].pick == fin["mid"][0] and picks["loose"].pick.found_for == "tight"
    alone = pick_shared(SPACE, {"loose": fin["loose"]}, {"loose": analytic_cost}, {"loose": limits["loose"]})
    assert alone["loose"].pick == fin["loose"][1] and alone["loose"].considered == []


def test_a_cost_models_batch_is_a_cost_fn_and_a_wrong_score_shape_is_named():
    """evolve's docstring points at CostModel.batch for cost_fn: it takes the Population evolve passes
    (it needed pop.archs()); a score_fn returning the wrong shape is one ValueError, not an IndexError."""
    from rafl.search.cost import CostModel

    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    cm = CostModel(space, "pi4")
    pop = Population.sample(space, 5, np.random.default_rng(0))
    assert np.allclose(cm.batch(pop)["macs_m"], cm.batch(pop.archs())["macs_m"])
    cfg = SearchConfig(population=4, generations=1, seed=0)
    out = evolve(space, lambda p: np.arange(len(p), dtype=float), cm.batch, {"macs_m": 1e9}, cfg)
    assert len(out.scores) and np.isfinite(out.scores).all()
    with pytest.raises(ValueError, match=r"score_fn returned shape \(3,\) for a population of 4; it must return "
                                         r"one score per arch"):
        evolve(space, lambda p: np.zeros(3), cm.batch, {"macs_m": 1e9}, cfg)
    with pytest.raises(ValueError, match=r"cost_fn returned 'macs_m' of shape \(2,\) for a population of "):
        evolve(space, lambda p: np.zeros(len(p)), lambda p: {"macs_m": np.zeros(2)}, {"macs_m": 1e9}, cfg)
