"""The ``rafl federate`` pipeline: data -> partition -> supernet -> per-profile subnets -> engine.

:func:`prepare` does every check and every expensive preparation *before* anything is written
(bad input fails here with a UserInputError and no run dir); :func:`run` then creates the run dir
and hands a :class:`~rafl.federation.engine.Federation` to the engine.

No leakage (DESIGN.md): the supernet was trained on the server's public pool
(``carve_public_pool(labels, public_fraction, public_seed)``), the search validates and
BN-recalibrates on that pool only, and :func:`~rafl.federation.checks.check_disjoint` asserts that the pool and every
client's train/val/test index sets are pairwise disjoint before the run starts. The checks
themselves (leakage, same data, resume) live in :mod:`rafl.federation.checks`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rafl.config import RunConfig
from rafl.errors import UserInputError, warn
from rafl.federation.algorithms import ClientInfo, ServerContext, get_algorithm
from rafl.federation.checks import (DEPLOYMENT, check_clients_avoid_pool, check_disjoint, check_public_pool,
                                    check_resumable_here, check_resume_rounds, check_same_clients, check_same_data,
                                    completed_rounds)
from rafl.federation.engine import Engine, EngineConfig, Federation, participation
from rafl.io import atomic_write_json, atomic_write_yaml
from rafl.reports.run import RunReport
from rafl.supernet.arch import ArchConfig, SearchSpace

#: The public pool the quickstart supernet trained on (``carve_public_pool(labels, 0.3, seed=0)``).
QUICKSTART_POOL = (0.3, 0)
#: ``summary.json``'s ``backend``: this process, Flower's Simulation Runtime, or a Flower App on a
#: SuperLink (``rafl flower-app``), whose nodes keep the client states on their own disks.
BACKENDS = ("in-process", "flower-simulation", "flower-superlink")


# ---------------------------------------------------------------------- models
class ModelBank:
    """Builds client models from the supernet: one BN-recalibrated template per arch, deep-copied
    on every request (so extraction and recalibration happen once per arch, not per client/round).

    Args:
        supernet: a :class:`rafl.supernet.Supernet`.
        calib_images: ``(M, C, H, W)`` server public-pool images for BN recalibration (OFA Sec.
            3.2), or None to keep the supernet's statistics.
        calib_batches / batch_size: recalibration batches of ``batch_size`` images.
    """

    def __init__(self, supernet: nn.Module, calib_images: torch.Tensor | None, calib_batches: int = 8,
                 batch_size: int = 64):
        self.supernet = supernet
        self.calib = calib_images
        self.calib_batches = calib_batches
        self.batch_size = batch_size
        self._templates: dict[str, nn.Module] = {}

    def make(self, arch: ArchConfig) -> nn.Module:
        """A fresh :class:`rafl.supernet.Subnet` ``arch`` with the supernet's weights, train mode."""
        from rafl.supernet import extract_subnet, recalibrate_bn

        key = arch.to_string()
        if key not in self._templates:
            # fork the RNG: building a template (its BN recalibration runs forward passes through
            # dropout) must not shift the caller's random stream, or results would depend on when
            # an arch was first requested (e.g. after --resume)
            with torch.random.fork_rng(devices=[]):
                sub = extract_subnet(self.supernet, arch)
                if self.calib is not None and len(self.calib):
                    batches = [self.calib[i:i + self.batch_size]
                               for i in range(0, len(self.calib), self.batch_size)][: self.calib_batches]
                    recalibrate_bn(sub, batches, n_batches=len(batches))
            sub.eval()
            self._templates[key] = sub
        return fast_clone(self._templates[key]).train()


def fast_clone(module: nn.Module) -> nn.Module:
    """An independent copy of ``module``: new module objects, cloned parameters and buffers;
    other attributes shared shallowly (they are read-only configuration in static subnets).
    Equivalent to ``copy.deepcopy`` for rafl subnets (tested) and ~10x faster on ofa layers."""
    new = object.__new__(type(module))
    new.__dict__ = module.__dict__.copy()
    new._parameters = {k: (None if v is None else nn.Parameter(v.detach().clone(), requires_grad=v.requires_grad))
                       for k, v in module._parameters.items()}
    new._buffers = {k: (None if v is None else v.detach().clone()) for k, v in module._buffers.items()}
    new._modules = {k: (None if v is None else fast_clone(v)) for k, v in module._modules.items()}
    return new


MAC_OPS = ("conv", "linear", "matmul", "addmm", "bmm", "einsum")  # fvcore's names of multiply-add ops


def model_macs_params(model: nn.Module, resolution: int, channels: int = 3) -> tuple[float, float]:
    """``(MACs in millions, parameters in millions)`` of ``model`` for one image of
    ``resolution`` px: fvcore's ``conv`` + ``linear`` counts on a deep copy (one multiply-add
    counts one), the quantity the cost model and the device budgets use (``macs_m``,
    :mod:`rafl.search.cost`); BatchNorm, activations, pooling and the SE gating multiply, which
    fvcore also counts, are left out as there."""
    from rafl.reports.profile_report import count_fvcore

    m = copy.deepcopy(model).eval()
    x = torch.zeros(1, channels, resolution, resolution)
    with torch.no_grad():
        _, per_op = count_fvcore(m, x)
    macs = sum(v for op, v in per_op.items() if op in MAC_OPS)
    params = sum(p.numel() for p in model.parameters())
    return macs / 1e6, params / 1e6


# ---------------------------------------------------------------------- subnets per profile
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
    from rafl.search.cost import CostModel

    cm = CostModel(space, profile)
    rng = np.random.default_rng(seed)
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
    import math

    from rafl.search.cost import CostModel, check_budgets
    from rafl.search.evolution import binding_text

    cost = CostModel(space, profile).cost(arch)
    checks = check_budgets(cost, profile)
    use = sorted(({"budget": c.budget, "value": float(c.value), "limit": float(c.limit),
                   "use": float(c.value) / float(c.limit) if c.limit else math.inf} for c in checks),
                 key=lambda r: -r["use"])
    return {**{k: float(v) for k, v in cost.to_dict().items()}, "use": use,
            "fits": all(c.passed for c in checks), "binding": binding_text(use)}


def search_split(cfg: RunConfig, ds, public: np.ndarray, pool: tuple[float, int] | None,
                 supernet_config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(validation indices, calibration indices)`` into ``ds`` for the per-profile search.

    A supernet that records the public pool it trained on (``pool`` = its public fraction and
    seed) is searched as ``rafl search`` does it: accuracy on its own server-val split (pool
    images it did not train on, :func:`rafl.supernet.server_data.server_split` with its
    ``val_fraction``), at most ``search.val_samples`` of them (a fixed random subset), and BN
    recalibration on its pool-train part in a fixed random order; so the two commands share the
    measurement cache. Otherwise: ``search.val_samples`` random public-pool images, and the
    calibration on the public pool.
    """
    from rafl.supernet.server_data import calibration_sample, server_split

    rng = np.random.default_rng([cfg.seed, 5])
    if pool is not None:
        conf = supernet_config.get("data", supernet_config) if isinstance(supernet_config.get("data"), dict) \
            else supernet_config
        split = server_split(ds, public_fraction=pool[0], public_seed=pool[1],
                             val_fraction=float(conf.get("val_fraction", 0.1)), test_samples=None)
        if len(split.pool_val):
            val = split.pool_val
            if len(val) > cfg.search.val_samples:
                val = np.sort(rng.permutation(val)[: cfg.search.val_samples])
            # the order rafl search uses (all of pool-train, shuffled); the search reads only its first
            # calib_batches x batch_size images, so the first 2,048 of them are enough
            return val, calibration_sample(split.pool_train, len(split.pool_train))[:2048]
    val = np.sort(rng.permutation(public)[: min(cfg.search.val_samples, len(public))])
    return val, calibration_sample(public, 512)


def subnets_for_profiles(cfg: RunConfig, supernet, profiles: list, val: tuple[torch.Tensor, torch.Tensor],
                         calib: torch.Tensor, supernet_id: str, progress: bool = True) -> dict[str, dict[str, Any]]:
    """One subnet per device profile: fixed archs from the config, else the search
    (:func:`rafl.search.evolution.search_subnets`, or ``largest-feasible``). Search results are
    cached under the rafl cache dir, keyed by the supernet, the profiles and the search config.

    Returns:
        ``{profile name: {"arch": ArchConfig, "source": str, "search_accuracy": float | None}}``.

    Raises:
        UserInputError: a malformed fixed arch, or a profile no subnet fits.
    """
    from rafl.errors import warn
    from rafl.search.cost import CostModel

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
    # "picks": 2 = every profile picks among all profiles' measured finalists (search_subnets'
    # shared pick); results cached before it are searched again
    key_src = json.dumps({"picks": 2, "supernet": supernet_id, "profiles": [p.model_dump(mode="json") for p in todo],
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
        from rafl.search.evolution import SearchConfig, search_subnets

        scfg = SearchConfig(population=s.population, generations=s.generations, estimator=s.estimator,
                            predictor_samples=s.predictor_samples, top_k=s.top_k, seed=cfg.seed, progress=progress)
        res = search_subnets(supernet, todo, val, calib, scfg)
        for name, r in res.items():
            found[name] = {"arch": r.arch, "source": f"search (evolution, {s.estimator})",
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


# ---------------------------------------------------------------------- federation from parts
def uniform_arch(space: SearchSpace, arch_of: dict[str, dict[str, Any]], profiles: list) -> dict[str, Any]:
    """The one subnet of ``uniform`` (one size fits all): among the per-profile subnets ``arch_of``
    (:func:`subnets_for_profiles`), the one with the best search accuracy (ties: fewer MACs, then
    the arch string) that meets every budget of every profile in ``profiles`` (each profile's cost
    model); with nested budgets, the weakest device's own subnet.

    Returns:
        ``{"arch", "source"}`` (source ``uniform: <profile>'s subnet``).

    Raises:
        UserInputError: no candidate meets every profile's budgets (naming each candidate's violations).
    """
    from rafl.search.cost import CostModel

    models = {p.name: CostModel(space, p) for p in profiles}
    fits, why = [], []
    for name, v in sorted(arch_of.items()):
        arch = v["arch"]
        viol = [f"{p.name}: {x}" for p in profiles for x in models[p.name].violations(models[p.name].cost(arch), p)]
        if viol:
            why.append(f"{name}'s subnet violates {'; '.join(viol[:2])}")
        else:
            acc = v.get("search_accuracy")
            fits.append((-(acc if acc is not None else -1.0), models[profiles[0].name].cost(arch).macs_m,
                         arch.to_string(), name, arch))
    if not fits:
        raise UserInputError("uniform gives every client the largest subnet that fits the weakest device, but no "
                             f"searched subnet meets every profile's budgets ({'; '.join(why)}); allowed: profiles "
                             "whose budgets some subnet meets at once", field="clients.profiles")
    best = min(fits, key=lambda t: t[:3])
    return {"arch": best[4], "source": f"uniform: {best[3]}'s subnet"}


def client_loaders(dataset, partition, batch_size: int):
    """The federation's ``loaders(cid, split, seed)``: a DataLoader over client ``cid``'s ``split``
    (train shuffled with ``seed``; no ``drop_last``), or ``None`` for an empty ``val`` split."""
    from rafl.data import make_loader

    def loaders(cid: int, split: str, seed: int):
        idx = getattr(partition.clients[cid], split)
        if split == "val" and len(idx) == 0:
            return None
        return make_loader(dataset, idx, batch_size, shuffle=(split == "train"), seed=seed % (2**63))

    return loaders


def build_federation(dataset, partition, supernet, archs: list[ArchConfig], algorithm, *,
                     profiles: list[str] | None = None, batch_size: int = 32,
                     device: torch.device | str = "cpu", seed: int = 0,
                     calib_images: torch.Tensor | None = None, hparams: dict[str, Any] | None = None,
                     count_macs: bool = True) -> tuple[Federation, list[dict[str, Any]]]:
    """A :class:`Federation` from a dataset, a partition, a supernet and one arch per client.

    Args:
        dataset: :class:`rafl.data.Dataset` (images ``(N, C, H, W)``).
        partition: :class:`rafl.data.Partition` (its public pool becomes the server's unlabeled
            ``public_images``).
        supernet: :class:`rafl.supernet.Supernet`; client models are subnets cut from it.
        archs: the subnet of every client (length = number of clients).
        algorithm: an :class:`~rafl.federation.algorithms.Algorithm` instance.
        profiles: device profile name of every client (default ``"custom"``).
        batch_size: local mini-batch size.
        device: torch device.
        seed: run seed (server context).
        calib_images: public-pool images for BN recalibration of extracted subnets (default: the
            first 512 public images; None/empty = keep the supernet's statistics).
        hparams: the algorithm's hyperparameters (default ``algorithm.hparams``).
        count_macs: fill ``macs_m``/``params_m`` of the table with fvcore (one count per arch).

    Returns:
        ``(federation, table)`` with one table row per client (client, profile, arch, macs_m,
        params_m, n_train, n_test).

    Raises:
        UserInputError: ``len(archs)`` differs from the number of clients, or the algorithm
            rejects the population (e.g. FedAvg with heterogeneous archs).
    """
    n = len(partition.clients)
    if len(archs) != n:
        raise UserInputError(f"{len(archs)} archs for {n} clients", field="clients")
    profiles = list(profiles) if profiles is not None else ["custom"] * n
    device = torch.device(device)
    public = np.asarray(partition.public, dtype=np.int64)
    pub_images = dataset.images[torch.as_tensor(public)] if len(public) else None
    if calib_images is None and pub_images is not None:
        from rafl.supernet.server_data import calibration_sample

        calib_images = dataset.images[torch.as_tensor(calibration_sample(public, 512))]  # class-mixed
    bank = ModelBank(supernet, calib_images)
    infos, table = [], []
    macs_cache: dict[str, tuple[float, float]] = {}
    for cid, split in enumerate(partition.clients):
        arch = archs[cid]
        key = arch.to_string()
        if count_macs and key not in macs_cache:
            macs_cache[key] = model_macs_params(bank.make(arch), arch.r, dataset.images.shape[1])
        infos.append(ClientInfo(client_id=cid, profile=profiles[cid], arch=arch, model_key=key,
                                n_samples=len(split.train)))
        macs, params = macs_cache.get(key, (None, None))
        table.append({"client": cid, "profile": profiles[cid], "arch": key, "macs_m": macs, "params_m": params,
                      "n_train": len(split.train), "n_test": len(split.test)})
    algorithm.check_population(infos)

    loaders = client_loaders(dataset, partition, batch_size)

    def client_model(cid: int, arch=None):
        return bank.make(infos[cid].arch if arch is None else arch)

    def server_model(arch=None, client_id=None):
        if arch is None:
            arch = infos[0 if client_id is None else client_id].arch
        return bank.make(arch)

    hp = dict(algorithm.hparams if hparams is None else hparams)
    server = ServerContext(clients=infos, make_model=server_model, public_images=pub_images,
                           n_classes=dataset.num_classes, space=supernet.space, supernet=supernet, device=device,
                           seed=seed, hparams=hp)
    fed = Federation(algorithm=algorithm, clients=infos, loaders=loaders, client_model=client_model, server=server,
                     n_classes=dataset.num_classes, hparams=hp, device=device)
    algorithm.check_models(server)
    return fed, table


def build_group_federation(dataset, partition, members: list[str], algorithm, *, feature_dim: int = 128,
                           knowledge_model: str | None = None, batch_size: int = 32,
                           device: torch.device | str = "cpu", seed: int = 0,
                           hparams: dict[str, Any] | None = None) -> tuple[Federation, list[dict[str, Any]]]:
    """A :class:`Federation` whose clients use models of a heterogeneous group (round-robin).

    Args:
        dataset: :class:`rafl.data.Dataset` (images ``(N, C, H, W)``).
        partition: :class:`rafl.data.Partition`; its public pool becomes the server's unlabeled
            ``public_images``.
        members: model names / plug-in specs (:func:`rafl.models.resolve_models`); client ``i``
            gets ``members[i % len(members)]``.
        algorithm: an Algorithm instance.
        feature_dim: the common representation width D.
        knowledge_model: the shared model of RaFL/FML/FedKD (``make_model("knowledge")``);
            default :data:`rafl.models.KNOWLEDGE_MODEL`.
        batch_size: local mini-batch size (no drop_last).
        device, seed: as named.
        hparams: the algorithm's hyperparameters (default ``algorithm.hparams``).

    Returns:
        ``(federation, table)``: one row per client (client, model, params_m, n_train, n_test).

    Raises:
        UserInputError: an unknown member, a plug-in that does not fit, or a population the
            algorithm rejects (e.g. FedAvg over different models).
    """
    from rafl.models import KNOWLEDGE_MODEL, make_member

    if not members or "nas" in members:
        raise UserInputError("needs model-group members (nas goes through the federate pipeline)",
                             field="clients.models")
    n = len(partition.clients)
    device = torch.device(device)
    n_classes = dataset.num_classes
    channels, res = int(dataset.images.shape[1]), int(dataset.images.shape[-1])
    know = knowledge_model or KNOWLEDGE_MODEL
    names = [members[i % len(members)] for i in range(n)]
    if getattr(algorithm, "one_model_for_all", False):  # uniform: the group's smallest member for everyone
        sizes = {m: sum(p.numel() for p in make_member(m, n_classes, feature_dim, channels, res).parameters())
                 for m in sorted(set(names))}
        names = [min(sizes, key=lambda m: (sizes[m], m))] * n
    used = sorted(set(names))
    if algorithm.requires_homogeneous and len(used) > 1:
        raise UserInputError(f"gives the clients {len(used)} different architectures ({', '.join(used)}), but "
                             f"{algorithm.name} averages whole models; allowed for it: one architecture (e.g. "
                             "cnn4-small)", field="clients.models")

    def make(name: str) -> torch.nn.Module:
        return make_member(name, n_classes, feature_dim, channels, res)

    params: dict[str, float] = {}
    for name in sorted(set(names)):
        params[name] = sum(p.numel() for p in make(name).parameters()) / 1e6   # also checks plug-ins now
    infos = [ClientInfo(client_id=cid, profile="custom", arch=None, model_key=names[cid],
                        n_samples=len(partition.clients[cid].train)) for cid in range(n)]
    algorithm.check_population(infos)
    table = [{"client": cid, "model": names[cid], "params_m": params[names[cid]],
              "n_train": len(partition.clients[cid].train), "n_test": len(partition.clients[cid].test)}
             for cid in range(n)]

    loaders = client_loaders(dataset, partition, batch_size)

    def client_model(cid: int, arch=None):
        if arch is None:
            return make(names[cid]).train()
        if arch == "knowledge":
            return make(know).train()
        raise UserInputError(f"model group clients have no subnet {arch!r}; the shared model is 'knowledge'",
                             field="algorithm.knowledge_arch")

    def server_model(arch=None, client_id=None):
        if arch is None:
            return make(names[0 if client_id is None else client_id]).train()
        return client_model(0, arch)

    public = np.asarray(partition.public, dtype=np.int64)
    pub_images = dataset.images[torch.as_tensor(public)] if len(public) else None
    hp = dict(algorithm.hparams if hparams is None else hparams)
    server = ServerContext(clients=infos, make_model=server_model, public_images=pub_images, n_classes=n_classes,
                           space=None, supernet=None, device=device, seed=seed, hparams=hp)
    fed = Federation(algorithm=algorithm, clients=infos, loaders=loaders, client_model=client_model, server=server,
                     n_classes=n_classes, hparams=hp, device=device)
    algorithm.check_models(server)
    return fed, table


def engine_config(cfg: RunConfig) -> EngineConfig:
    """The :class:`EngineConfig` of a run config's ``engine`` section and seed (the workers checked
    against the device)."""
    from rafl.federation.workers import resolve_workers

    e = cfg.engine
    resolve_workers(e.workers, 1, torch.device(cfg.train.device))  # workers > 1 on CUDA: an error before writing
    return EngineConfig.of(cfg)


# ---------------------------------------------------------------------- prepare / run
@dataclass
class Prepared:
    """Everything validated and built before the run dir exists."""

    cfg: RunConfig
    federation: Federation
    engine_config: EngineConfig
    clients_table: list[dict[str, Any]]
    partition: Any
    extra: dict[str, Any] = field(default_factory=dict)
    #: the supernet's ``supernet.json`` (NAS runs): the config and metrics a federated supernet keeps
    supernet_meta: dict[str, Any] | None = None


def _load_supernet(cfg: RunConfig, dataset, progress: bool):
    """``(supernet, id string, (public_fraction, public_seed) it trained on or None)``.

    Raises:
        UserInputError: a supernet trained on another sample of the data (``data.dataset``,
            ``data.limit_per_class``): the same pool fraction and seed then carve other images,
            and client data would hold the supernet's training images.
    """
    if cfg.supernet.path is None:
        if cfg.data.dataset != "digits":
            raise UserInputError("the quickstart supernet is for digits; give supernet.path for "
                                 f"{cfg.data.dataset!r}", field="supernet.path")
        from rafl.supernet import quickstart_supernet
        from rafl.supernet.quickstart import quickstart_config

        check_same_data(cfg, quickstart_config().model_dump(), "the quickstart supernet")
        supernet, path = quickstart_supernet(progress=progress)
        return supernet, f"quickstart:{path}", QUICKSTART_POOL
    from rafl.supernet import load_supernet
    from rafl.supernet.checkpoint import load_meta

    supernet = load_supernet(cfg.supernet.path)
    meta = load_meta(cfg.supernet.path)
    conf = meta.get("config", {}) or {}
    pool = None
    frac = conf.get("public_fraction", conf.get("data", {}).get("public_fraction") if isinstance(conf.get("data"), dict) else None)
    seed = conf.get("public_seed", conf.get("data", {}).get("public_seed") if isinstance(conf.get("data"), dict) else None)
    if frac is not None:
        pool = (float(frac), int(seed or 0))
        check_same_data(cfg, conf, f"the supernet in {cfg.supernet.path}")
    return supernet, f"{cfg.supernet.path}:{meta.get('weights_sha256', '')}", pool


def load_data_and_partition(cfg: RunConfig, progress: bool = True):
    """``(dataset, partition)`` of a run config's ``data``, ``partition`` and ``clients.n``, the
    partition checked for leakage (disjoint index sets) and warned about clients without test data.
    ``progress``: show the bars of reading a dataset source (a cache miss).

    Raises:
        UserInputError: an unknown/missing dataset, or an impossible or malformed partition.
    """
    from rafl.data import load_dataset, make_partition

    ds = load_dataset(cfg.data.dataset, root=cfg.data.root, resolution=cfg.data.resolution,
                      limit_per_class=cfg.data.limit_per_class, progress=progress)
    labels = ds.labels.numpy()
    p = cfg.partition
    try:
        part = make_partition(labels, p.scheme, cfg.clients.n, cfg.seed if p.seed is None else p.seed,
                              k=p.k, alpha=p.alpha if p.scheme == "dirichlet" else None, min_samples=p.min_samples,
                              public_fraction=p.public_fraction, public_seed=p.public_seed, writers=ds.writers,
                              split=tuple(p.split), dataset=ds.name, origin=ds.origin)
    except UserInputError as err:
        from rafl.config import partition_error

        mapped = partition_error(err)
        if mapped.source is not None:  # a partition file that is missing or malformed: not an impossible split
            inner = f"{mapped.field}: " if mapped.field and mapped.field != "partition.scheme" else ""
            raise UserInputError(inner + mapped.message, source=mapped.source, field="partition.scheme") from None
        if mapped.field and mapped.message.startswith("is required"):  # a missing setting (partition.k), not a split
            raise UserInputError(mapped.message, field=mapped.field) from None
        raise UserInputError(f"impossible partition of {ds.name} ({len(labels)} samples) over clients.n="
                             f"{cfg.clients.n} clients: {mapped.message}", source=mapped.source,
                             field=mapped.field or "partition") from None
    if len(part.clients) != cfg.clients.n:
        raise UserInputError(f"the partition has {len(part.clients)} clients, clients.n is {cfg.clients.n}",
                             field="clients.n")
    check_disjoint(part)
    from rafl.config import warn_about_test_data

    warn_about_test_data(cfg, part)
    return ds, part


def _group_members(cfg: RunConfig) -> list[str] | None:
    """The model group of ``clients.models`` (:func:`rafl.models.resolve_models`), ``None`` for nas."""
    from rafl.models import resolve_models

    members = resolve_models(cfg.clients.models)
    if members == ["nas"]:
        if cfg.clients.feature_dim != type(cfg.clients).model_fields["feature_dim"].default:
            warn(f"clients.feature_dim ({cfg.clients.feature_dim}) applies to model groups only; the subnets of "
                 "clients.models: nas keep the supernet's representation width")
        return None
    for key, value in (("clients.arch", cfg.clients.arch), ("clients.archs", cfg.clients.archs),
                       ("supernet.path", cfg.supernet.path)):
        if value:
            warn(f"{key} applies to clients.models: nas (supernet subnets) only; ignored with clients.models: "
                 f"{cfg.clients.models}")
    return members


def _prepare_group(cfg: RunConfig, ds, part, members: list[str], algorithm, device: torch.device) -> Prepared:
    """:func:`prepare` for a model group: client ``i`` gets ``members[i % len(members)]``."""
    fed, table = build_group_federation(ds, part, members, algorithm, feature_dim=cfg.clients.feature_dim,
                                        batch_size=cfg.train.batch_size, device=device, seed=cfg.seed,
                                        hparams=cfg.algorithm.hparams())
    ecfg = engine_config(cfg)
    participation(ecfg, len(part.clients))  # a count larger than the population is an error before writing
    return Prepared(cfg, fed, ecfg, table, part, {"models": cfg.clients.models, "feature_dim": cfg.clients.feature_dim})


def prepare(cfg: RunConfig, progress: bool = True) -> Prepared:
    """Validate ``cfg`` against the data, profiles and supernet and build the federation: one
    searched (or given) subnet per device profile, or with ``clients.models`` other than ``nas`` a
    heterogeneous model group (:func:`build_group_federation`; no supernet, profile or search).

    Raises:
        UserInputError: unknown algorithm/hyperparameter, unknown profile, an impossible
            partition, a profile no subnet fits, a public pool that differs from the one the
            supernet trained on (leakage), FedAvg-like methods with heterogeneous models, ...
    """
    from rafl.search.profile import list_profiles, load_profile

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    algo_cls = get_algorithm(cfg.algorithm.name)
    algorithm = algo_cls(**cfg.algorithm.hparams())
    device = torch.device(cfg.train.device)  # validated by the run config (TrainSection)
    members = _group_members(cfg)  # None: nas
    profiles = []
    for name in cfg.clients.profiles if members is None else ():
        try:
            profile = load_profile(name)
        except UserInputError as err:
            if err.source is not None:  # a profile file: name it and its field
                raise UserInputError(err.message, source=err.source, field=err.field) from None
            raise UserInputError(err.message, field="clients.profiles") from None
        if name in cfg.clients.budgets or profile.name in cfg.clients.budgets:
            overrides = cfg.clients.budgets.get(name, cfg.clients.budgets.get(profile.name, {}))
            profile = profile.with_budgets(overrides, source=f"clients.budgets.{name}")
        profiles.append(profile)
    # Budgets or archs for shipped profiles that this run does not use are fine (the defaults name
    # pi4 and jetson-nano); any other name is a typo.
    known = set(cfg.clients.profiles) | {pr.name for pr in profiles} | set(list_profiles())
    for key, named in (("clients.budgets", cfg.clients.budgets), ("clients.archs", cfg.clients.archs)):
        if members is None and set(named) - known:
            raise UserInputError(f"names profile(s) {sorted(set(named) - known)} that no client uses; "
                                 f"clients.profiles is {cfg.clients.profiles}", field=key)
    ds, part = load_data_and_partition(cfg, progress)
    check_public_pool(algorithm, cfg.algorithm.hparams(), part)
    if members is not None:
        return _prepare_group(cfg, ds, part, members, algorithm, device)
    supernet, supernet_id, pool = _load_supernet(cfg, ds, progress)
    p = cfg.partition
    if pool is not None and p.scheme.startswith("file:"):  # a saved split: check its clients' indices themselves
        check_clients_avoid_pool(part, ds.labels.numpy(), pool, p.scheme[len("file:"):], ds.origin)
    elif pool is not None and (abs(pool[0] - p.public_fraction) > 1e-12 or pool[1] != p.public_seed):
        raise UserInputError(
            f"the supernet trained on the public pool carve_public_pool(labels, {pool[0]}, seed={pool[1]}); "
            f"the partition carves ({p.public_fraction}, seed={p.public_seed}), so client data would "
            f"overlap the supernet's training data; set partition.public_fraction={pool[0]} and "
            f"partition.public_seed={pool[1]}", field="partition.public_fraction")
    if supernet.space.n_classes != ds.num_classes:
        raise UserInputError(f"the supernet has {supernet.space.n_classes} classes, {ds.name} has "
                             f"{ds.num_classes}", field="supernet.path")
    supernet.eval()
    public = np.asarray(part.public, dtype=np.int64)
    if len(public) == 0:
        raise UserInputError("the search and BN recalibration need the server's public pool; set "
                             "partition.public_fraction > 0", field="partition.public_fraction")
    from rafl.supernet.checkpoint import load_meta
    from rafl.supernet.server_data import calibration_sample

    meta_dir = supernet_id.split(":", 1)[1] if supernet_id.startswith("quickstart:") else cfg.supernet.path
    meta = load_meta(meta_dir)
    val_idx, search_calib_idx = search_split(cfg, ds, public, pool, meta.get("config") or {})
    val = (ds.images[torch.as_tensor(val_idx)], ds.labels[torch.as_tensor(val_idx)])
    search_calib = ds.images[torch.as_tensor(search_calib_idx)]
    calib = ds.images[torch.as_tensor(calibration_sample(public, 512))]  # class-mixed, whatever the data's order
    arch_of = subnets_for_profiles(cfg, supernet, profiles, val, search_calib, supernet_id, progress=progress)
    del search_calib
    names = [pr.name for pr in profiles]
    prof_of = [names[cid % len(names)] if len(names) != cfg.clients.n else names[cid]
               for cid in range(len(part.clients))]
    if getattr(algo_cls, "one_model_for_all", False):  # uniform: the weakest device's subnet for everyone
        one = uniform_arch(supernet.space, arch_of, [p for p in profiles if p.name in set(prof_of)])
        arch_of = {name: {**v, "arch": one["arch"], "source": one["source"]} for name, v in arch_of.items()}
    fed, table = build_federation(ds, part, supernet, [arch_of[pr]["arch"] for pr in prof_of], algorithm,
                                  profiles=prof_of, batch_size=cfg.train.batch_size, device=device, seed=cfg.seed,
                                  calib_images=calib, hparams=cfg.algorithm.hparams())
    for row in table:
        row["subnet_source"] = arch_of[row["profile"]]["source"]
    used = {pr.name: pr for pr in profiles if pr.name in set(prof_of)}
    budgets = {name: subnet_budgets(supernet.space, arch_of[name]["arch"], pr) for name, pr in used.items()}
    ecfg = engine_config(cfg)
    participation(ecfg, len(part.clients))  # a count larger than the population is an error before writing
    return Prepared(cfg, fed, ecfg, table, part, {"profiles": {n: {"arch": v["arch"].to_string(), "source": v["source"],
                                                                   "search_accuracy": v["search_accuracy"],
                                                                   **({"budgets": budgets[n]} if n in budgets else {})}
                                                               for n, v in arch_of.items()},
                                                  "supernet": supernet_id},
                    supernet_meta=meta)


def run(prep: Prepared, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
        clients: Any = None, backend: str = "in-process", deployment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the prepared federation in ``run_dir`` (created here unless resuming); returns the
    summary extended with the per-client table (``summary["table"]``), the means and the
    ``backend`` that ran this session (:data:`BACKENDS`).

    ``clients``: the engine's client runner factory (:class:`~rafl.federation.engine.Engine`);
    None runs the clients in this process, or, with ``engine.backend: flower``, on Flower's
    Simulation Runtime (:func:`rafl.federation.flower.simulate`, which comes back here with its
    runner). ``backend``: what the runner is, as ``summary.json`` names it. ``deployment``: the
    runner keeps client states outside the run dir (a SuperLink's nodes); a new run records it in
    ``clients.json`` (:data:`~rafl.federation.checks.DEPLOYMENT`), so ``rafl federate --resume``
    refuses the run dir (:func:`~rafl.federation.checks.check_resumable_here`).

    Raises:
        UserInputError: resuming on other clients than the run started with (:func:`check_same_clients`)."""
    if resume:
        if deployment is None:  # this process or the Simulation Runtime: the states must be in the run dir
            check_resumable_here(run_dir, "resume")
        check_same_clients(run_dir, prep.clients_table, prep.cfg.partition.scheme)
    if clients is None and prep.cfg.engine.backend == "flower":
        from rafl.federation import flower

        return flower.simulate(prep, Path(run_dir), resume=resume, progress=progress)
    run_dir = Path(run_dir)
    if not resume:
        if run_dir.exists() and any(run_dir.iterdir()):
            raise UserInputError("already exists and is not empty (use --resume to continue it, or "
                                 "another --out / name)", source=run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_yaml(run_dir / "config.yaml", prep.cfg.resolved())
        atomic_write_json(run_dir / "clients.json", {"clients": prep.clients_table, **prep.extra,
                                                     **({DEPLOYMENT: deployment} if deployment else {})})
    engine = Engine(prep.federation, prep.engine_config, run_dir, progress=progress, clients=clients,
                    observers=[RunReport(run_dir)])
    t0 = time.perf_counter()
    from rafl.reports.progress import round_progress

    with round_progress(progress):  # clients done / sampled and the local epoch, inside each round
        summary = engine.run(resume=resume)
    summary["wall_s"] = time.perf_counter() - t0
    summary["backend"] = backend
    rows = []
    for row in prep.clients_table:
        accs = summary["clients"].get(str(row["client"]), {})
        rows.append({**row, **{k: v for k, v in accs.items() if k.endswith(".acc")}})
    summary["table"] = rows
    acc_keys = sorted({k for r in rows for k in r if k.endswith(".acc")})  # model.acc, proto.acc, knowledge.acc, ...
    summary["means"] = {k: float(np.mean([r[k] for r in rows if r.get(k) is not None]))
                        for k in ("macs_m", "params_m", *acc_keys)
                        if any(r.get(k) is not None for r in rows)}
    atomic_write_json(run_dir / "summary.json", summary)
    export_federated_supernet(prep, run_dir, summary)
    return summary


def export_federated_supernet(prep: Prepared, run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """Write the server's final global model as a supernet (``run_dir/supernet.safetensors`` +
    ``supernet.json``, :func:`rafl.supernet.save_supernet`) when the method keeps one (HeteroFL and
    FedRolex over NAS subnets: ``federated_supernet``); ``rafl search --supernet RUN_DIR`` and
    ``supernet.path: RUN_DIR`` then use it. It keeps the original supernet's training config (its
    data and public pool) and metrics, plus ``metrics.federated`` (method, rounds, source supernet).
    Returns the JSON path, or None."""
    from rafl.federation.engine import CHECKPOINT
    from rafl.federation.store import load_state
    from rafl.supernet.checkpoint import save_supernet

    export = getattr(prep.federation.algorithm, "federated_supernet", None)
    if export is None or prep.supernet_meta is None:
        return None
    ck = load_state(Path(run_dir) / CHECKPOINT)
    net = export(ck["server_state"], prep.federation.server)
    if net is None:
        return None
    meta = prep.supernet_meta
    metrics = {**meta.get("metrics", {}), "federated": {"algorithm": prep.federation.algorithm.name,
                                                        "rounds": int(ck["round"]),
                                                        "supernet": prep.extra.get("supernet"),
                                                        "acc_mean_over_clients": summary.get("final", {}).get(
                                                            "model.acc_mean_over_clients")}}
    return save_supernet(run_dir, net, config=meta.get("config", {}), metrics=metrics)


__all__ = ["prepare", "run", "check_resume_rounds", "build_federation", "build_group_federation",
           "load_data_and_partition", "engine_config", "check_public_pool", "Prepared", "ModelBank", "check_disjoint", "subnets_for_profiles",
           "largest_feasible", "uniform_arch", "export_federated_supernet", "model_macs_params", "completed_rounds", "fast_clone",
           "QUICKSTART_POOL", "BACKENDS"]
