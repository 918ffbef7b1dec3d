"""The subnet of every device profile of a federation: the given archs, or the search of
``rafl search`` (:func:`rafl.search.evolution.search_subnets`, or ``largest-feasible``) with its
results cached, and what each subnet costs against its profile's budgets.

``cfg`` below is a run config (:class:`rafl.config.RunConfig`); only its ``clients``, ``search``
and ``seed`` are read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rafl import seeds
from rafl.errors import UserInputError, warn
from rafl.io import atomic_write_json
from rafl.search.cost import CostModel, check_budgets
from rafl.search.evolution import COMMON, SearchConfig, binding_text, search_subnets
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.server_data import calibration_sample, server_split


def _cache_dir() -> Path:
    return Path(os.environ.get("RAFL_CACHE_DIR") or Path.home() / ".cache" / "rafl")


def _resolve_arch(text: str, space: SearchSpace, field_name: str) -> ArchConfig:
    p = Path(text)
    if p.suffix in (".yaml", ".yml", ".json") or p.is_file():
        return ArchConfig.load(p, space)
    try:
        return ArchConfig.from_string(text, space)
    except UserInputError as err:
        where = {"r": "resolution r"}.get(err.field or "", err.field)
        raise UserInputError(f"{where}: {err.message}" if where else err.message, field=field_name) from None


def largest_feasible(space: SearchSpace, profile, samples: int, seed: int) -> tuple[ArchConfig, Any]:
    """Fallback search (named ``largest-feasible``): the arch with the most MACs among
    ``samples`` random archs (plus the smallest) meeting every budget of ``profile``, priced by
    the cost model. Returns ``(arch, Cost)``.

    Raises:
        UserInputError: no sampled arch (not even the smallest) meets the profile's budgets.
    """
    cm = CostModel(space, profile)
    rng = seeds.generator("largest-feasible", seed)
    archs = [space.smallest()] + [space.sample(rng) for _ in range(samples)]
    costs = cm.batch(archs)
    ok = cm.feasible(archs, profile)
    if not ok.any():
        viol = "; ".join(cm.violations(cm.cost(space.smallest()), profile))
        raise UserInputError(f"no subnet of the search space fits profile {profile.name!r} (even the "
                             f"smallest violates: {viol})", field="clients.profiles")
    idx = np.flatnonzero(ok)
    best = int(idx[np.argmax(np.asarray(costs["macs_m"])[idx])])
    return archs[best], cm.cost(archs[best])


def subnet_budgets(space: SearchSpace, arch: ArchConfig, profile) -> dict[str, Any]:
    """What a client's subnet costs on its device and how much of each budget that uses.

    Returns:
        ``{"macs_m", "params_m", "latency_ms", "peak_memory_mb", "train_memory_mb", "energy_mj"}``
        (:class:`rafl.search.cost.Cost`: millions, ms per image at batch 1, MiB, mJ; latency is the
        profile's own estimate: its measured LUT or roofline) plus ``"use"``: one
        ``{"budget", "value", "limit", "use"}`` per budget of the profile, most used first
        (:func:`rafl.search.evolution.budget_use`), ``"fits"`` (every budget met) and ``"binding"``
        (:func:`rafl.search.evolution.binding_text`).
    """
    cost = CostModel(space, profile).cost(arch)
    checks = check_budgets(cost, profile)
    use = sorted(({"budget": c.budget, "value": float(c.value), "limit": float(c.limit),
                   "use": float(c.value) / float(c.limit) if c.limit else math.inf} for c in checks),
                 key=lambda r: -r["use"])
    return {**{k: float(v) for k, v in cost.to_dict().items()}, "use": use,
            "fits": all(c.passed for c in checks), "binding": binding_text(use)}


def search_split(cfg: Any, ds, public: np.ndarray, pool: tuple[float, int] | None,
                 supernet_config: dict[str, Any], whole: list[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(validation indices, calibration indices)`` into ``ds`` for the per-profile search.

    A supernet that records the public pool it trained on (``pool`` = its public fraction and
    seed) is searched as ``rafl search`` does it: accuracy on its own server-val split (pool
    images it did not train on, :func:`rafl.supernet.server_data.server_split` with its
    ``val_fraction``), at most ``search.val_samples`` of them (a fixed random subset), and BN
    recalibration on its pool-train part in a fixed random order; so the two commands share the
    measurement cache (and, when ``search.val_samples`` covers all of server-val, which ``whole``
    then receives as True, the measurements shipped beside the supernet). Otherwise: ``search.val_samples`` random public-pool images, and the
    calibration on the public pool.
    """
    rng = seeds.generator("search-split", cfg.seed)
    if pool is not None:
        conf = supernet_config.get("data", supernet_config) if isinstance(supernet_config.get("data"), dict) \
            else supernet_config
        split = server_split(ds, public_fraction=pool[0], public_seed=pool[1],
                             val_fraction=float(conf.get("val_fraction", 0.1)), test_samples=None)
        if len(split.pool_val):
            val = split.pool_val
            if whole is not None:
                whole.append(len(val) <= cfg.search.val_samples)
            if len(val) > cfg.search.val_samples:
                val = np.sort(rng.permutation(val)[: cfg.search.val_samples])
            # the order rafl search uses (all of pool-train, shuffled); the search reads only its first
            # calib_batches x batch_size images, so the first 2,048 of them are enough
            return val, calibration_sample(split.pool_train, len(split.pool_train))[:2048]
    val = np.sort(rng.permutation(public)[: min(cfg.search.val_samples, len(public))])
    return val, calibration_sample(public, 512)


def subnets_for_profiles(cfg: Any, supernet, profiles: list, val: tuple[torch.Tensor, torch.Tensor],
                         calib: torch.Tensor, supernet_id: str, progress: bool = True,
                         common: bool = False, known: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """One subnet per device profile: fixed archs from the config, else the search
    (:func:`rafl.search.evolution.search_subnets`, or ``largest-feasible``). Search results are
    cached under the rafl cache dir, keyed by the supernet, the profiles and the search config.
    ``common`` (one model for every device: ``uniform``, ``clients.subnets: weakest``): the
    evolution search also finds the one subnet meeting every searched profile's budgets at once,
    under the key :data:`rafl.search.evolution.COMMON` (the profiles' own subnets are unchanged).
    ``known``: accuracies measured before on the same ``val`` and ``calib`` (canonical arch ->
    fraction; the measurements shipped beside a pretrained supernet), not measured again.

    Returns:
        ``{profile name: {"arch": ArchConfig, "source": str, "search_accuracy": float | None}}``.

    Raises:
        UserInputError: a malformed fixed arch, or a profile no subnet fits.
    """
    space: SearchSpace = supernet.space
    out: dict[str, dict[str, Any]] = {}
    todo = []
    for p in profiles:
        if cfg.clients.arch is not None or p.name in cfg.clients.archs:
            where = "clients.arch" if cfg.clients.arch is not None else f"clients.archs.{p.name}"
            arch = _resolve_arch(cfg.clients.arch if cfg.clients.arch is not None else cfg.clients.archs[p.name],
                                 space, where)
            cm = CostModel(space, p)
            over = cm.violations(cm.cost(arch))
            if over:  # the user's choice (e.g. one model for every device): run it, but say so
                warn(f"{where} does not fit device profile {p.name!r} ({'; '.join(over)}); running it anyway "
                     "(clients.json records it)")
            out[p.name] = {"arch": arch, "source": "given" if not over else "given (over budget: "
                           + "; ".join(over) + ")", "search_accuracy": None}
        else:
            todo.append(p)
    if not todo:
        return out
    s = cfg.search
    # "picks": 3 = every profile picks the best measured subnet that fits among all profiles'
    # finalists and the subnets measured before (search_subnets' shared pick), predicted in float64;
    # results cached before it are searched again, and so are those of other known measurements
    common = common and s.method == "evolution" and len(todo) > 1
    known_id = hashlib.sha256(json.dumps(known or {}, sort_keys=True).encode()).hexdigest()[:16]
    key_src = json.dumps({"picks": 3, "known": known_id, **({"common": True} if common else {}), "supernet": supernet_id,
                          "profiles": [p.model_dump(mode="json") for p in todo],
                          "search": s.model_dump(mode="json"), "seed": cfg.seed}, sort_keys=True, default=str)
    cache = _cache_dir() / "federate-search" / (hashlib.sha256(key_src.encode()).hexdigest()[:20] + ".json")
    if cache.is_file():
        try:
            data = json.loads(cache.read_text())
            for name, rec in data.items():
                out[name] = {"arch": ArchConfig.from_dict(rec["arch"]).validate(space), "source": rec["source"] + " (cached)",
                             "search_accuracy": rec["search_accuracy"]}
            return out
        except (ValueError, KeyError, UserInputError):
            pass  # stale or corrupt cache entry: search again
    found: dict[str, dict[str, Any]] = {}
    if s.method == "evolution":
        scfg = SearchConfig(population=s.population, generations=s.generations, estimator=s.estimator,
                            predictor_samples=s.predictor_samples, top_k=s.top_k, seed=cfg.seed, progress=progress)
        res = search_subnets(supernet, todo, val, calib, scfg, common=common, known=known)
        for name, r in res.items():
            what = "one subnet for every profile's budgets: " if name == COMMON else ""
            found[name] = {"arch": r.arch, "source": f"{what}search (evolution, {s.estimator})",
                           "search_accuracy": float(r.accuracy)}
    else:
        for p in todo:
            arch, _ = largest_feasible(space, p, s.samples, cfg.seed)
            found[p.name] = {"arch": arch, "source": "largest-feasible (random sampling by MACs)",
                             "search_accuracy": None}
    atomic_write_json(cache, {k: {"arch": v["arch"].to_dict(), "source": v["source"],
                                  "search_accuracy": v["search_accuracy"]} for k, v in found.items()})
    out.update(found)
    return out


def uniform_arch(space: SearchSpace, arch_of: dict[str, dict[str, Any]], profiles: list) -> dict[str, Any]:
    """The one subnet of ``uniform`` (one size fits all): among the per-profile subnets ``arch_of``
    (:func:`subnets_for_profiles`), the one with the best search accuracy (ties: fewer MACs, then
    the arch string) that meets every budget of every profile in ``profiles`` (each profile's cost
    model); with nested budgets, the weakest device's own subnet. When no profile's subnet fits
    every other device (budgets that are not nested: a Pi 4 subnet over the Jetson Nano's latency
    budget and the reverse), the subnet searched under every budget at once (``arch_of[COMMON]``,
    ``subnets_for_profiles(common=True)``).

    Returns:
        ``{"arch", "source"}`` (source ``uniform: <profile>'s subnet``, or ``uniform: the subnet
        searched for every profile's budgets``).

    Raises:
        UserInputError: no candidate meets every profile's budgets (naming each candidate's violations).
    """
    models = {p.name: CostModel(space, p) for p in profiles}
    fits, why = [], []
    for name, v in sorted(arch_of.items()):
        if name == COMMON:
            continue
        arch = v["arch"]
        viol = [f"{p.name}: {x}" for p in profiles for x in models[p.name].violations(models[p.name].cost(arch), p)]
        if viol:
            why.append(f"{name}'s subnet violates {'; '.join(viol[:2])}")
        else:
            acc = v.get("search_accuracy")
            fits.append((-(acc if acc is not None else -1.0), models[profiles[0].name].cost(arch).macs_m,
                         arch.to_string(), name, arch))
    joint = arch_of.get(COMMON)
    if not fits and joint is not None and not any(models[p.name].violations(models[p.name].cost(joint["arch"]), p)
                                                   for p in profiles):
        return {"arch": joint["arch"], "source": "uniform: the subnet searched for every profile's budgets"}
    if not fits:
        raise UserInputError("uniform gives every client the largest subnet that fits the weakest device, but no "
                             f"searched subnet meets every profile's budgets ({'; '.join(why)}); allowed: profiles "
                             "whose budgets some subnet meets at once", field="clients.profiles")
    best = min(fits, key=lambda t: t[:3])
    return {"arch": best[4], "source": f"uniform: {best[3]}'s subnet"}


__all__ = ["largest_feasible", "search_split", "subnet_budgets", "subnets_for_profiles", "uniform_arch"]
