"""The ``rafl federate`` stage before anything is written: data -> partition -> supernet ->
per-profile subnets -> a :class:`~rafl.federation.engine.Federation` and its engine config.

:func:`prepare` does every check and every expensive preparation *before* anything is written
(bad input fails here with a UserInputError and no run dir); :func:`rafl.stages.runs.run_prepared`
then runs it in a run dir.

No leakage (docs/design.md): the supernet was trained on the server's public pool
(``carve_public_pool(labels, public_fraction, public_seed)``), the search validates and
BN-recalibrates on that pool only, and :func:`~rafl.federation.checks.check_disjoint` asserts that the pool and every
client's train/val/test index sets are pairwise disjoint before the run starts. The checks
themselves (leakage, same data, resume) live in :mod:`rafl.federation.checks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rafl.config import RunConfig, participation, partition_error, warn_about_test_data
from rafl.data import load_dataset, make_partition
from rafl.errors import UserInputError, warn
from rafl.federation.algorithms import get_algorithm
from rafl.federation.bn_statistics import apply_policy
from rafl.federation.build import build_federation, build_group_federation, used_samples
from rafl.federation.checks import check_clients_avoid_pool, check_disjoint, check_public_pool, check_same_data
from rafl.federation.engine import EngineConfig, Federation
from rafl.federation.new_clients import held_out_clients
from rafl.federation.workers import resolve_workers
from rafl.models import resolve_models
from rafl.search.evolution import COMMON, SearchConfig
from rafl.search.federation_search import search_split, subnet_budgets, subnets_for_profiles, uniform_arch
from rafl.stages.checks import check_nas_config
from rafl.supernet import load_supernet, quickstart_supernet
from rafl.supernet.checkpoint import load_meta
from rafl.supernet.pretrained import measured_alike, resolve_supernet, supernet_measurements
from rafl.supernet.quickstart import quickstart_config
from rafl.supernet.server_data import CALIBRATION_IMAGES, calibration_sample

#: The public pool the quickstart supernet trained on (``carve_public_pool(labels, 0.3, seed=0)``).
QUICKSTART_POOL = (0.3, 0)


def engine_config(cfg: RunConfig) -> EngineConfig:
    """The :class:`EngineConfig` of a run config's ``engine`` section and seed (the workers checked
    against the device)."""
    e = cfg.engine
    resolve_workers(e.workers, 1, torch.device(cfg.train.device))  # workers > 1 on CUDA: an error before writing
    return EngineConfig.of(cfg)


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
    #: the loaded dataset (images ``(N, 3, R, R)`` float32): what another preparation of the same
    #: ``data`` / ``partition`` / ``clients.n`` may share (:func:`prepare`'s ``data``)
    dataset: Any = None
    #: the new-clients protocol (``clients.held_out_fraction`` > 0): the partition ids of the held-out
    #: clients, and those clients as a federation of their own (ids ``0..h-1``; never trained, scored
    #: at the end by :mod:`rafl.federation.new_clients`) with their clients table; the engine's
    #: ``federation`` then holds the other clients, renumbered ``0..m-1`` in partition order
    held_out: list[int] = field(default_factory=list)
    new_clients: Federation | None = None
    new_clients_table: list[dict[str, Any]] = field(default_factory=list)


def _load_supernet(cfg: RunConfig, dataset, progress: bool):
    """``(supernet, id string, (public_fraction, public_seed) it trained on or None)``.

    Raises:
        UserInputError: a supernet trained on another sample of the data (``data.dataset``,
            ``data.limit_per_class``): the same pool fraction and seed then carve other images,
            and client data would hold the supernet's training images.
    """
    if cfg.supernet.path is None:  # digits (rafl.stages.checks.check_nas_config)
        check_same_data(cfg, quickstart_config().model_dump(), "the quickstart supernet")
        supernet, path = quickstart_supernet(progress=progress)
        return supernet, f"quickstart:{path}", QUICKSTART_POOL
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
    ds = load_dataset(cfg.data.dataset, root=cfg.data.root, resolution=cfg.data.resolution,
                      limit_per_class=cfg.data.limit_per_class, progress=progress)
    labels = ds.labels.numpy()
    p = cfg.partition
    try:
        part = make_partition(labels, p.scheme, cfg.clients.n, cfg.seed if p.seed is None else p.seed,
                              k=p.k, alpha=p.alpha if p.scheme in ("dirichlet", "balanced-dirichlet") else None, min_samples=p.min_samples,
                              public_fraction=p.public_fraction, public_seed=p.public_seed, writers=ds.writers,
                              split=tuple(p.split), dataset=ds.name, origin=ds.origin,
                              global_test_per_class=p.global_test_per_class)
    except UserInputError as err:
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
    warn_about_test_data(cfg, part)
    return ds, part


def _group_members(cfg: RunConfig) -> list[str] | None:
    """The model group of ``clients.models`` (:func:`rafl.models.resolve_models`), ``None`` for nas."""
    members = resolve_models(cfg.clients.models)
    if members == ["nas"]:
        if cfg.clients.feature_dim != type(cfg.clients).model_fields["feature_dim"].default:
            warn(f"clients.feature_dim ({cfg.clients.feature_dim}) applies to model groups only; the subnets of "
                 "clients.models: nas keep the supernet's representation width")
        return None
    for key, value in (("clients.arch", cfg.clients.arch), ("clients.archs", cfg.clients.archs),
                       ("supernet.path", cfg.supernet.path),
                       ("clients.subnets", cfg.clients.subnets if cfg.clients.subnets != "per-device" else None)):
        if value:
            warn(f"{key} applies to clients.models: nas (supernet subnets) only; ignored with clients.models: "
                 f"{cfg.clients.models}")
    return members


def _prepare_group(cfg: RunConfig, ds, part, members: list[str], algorithm, device: torch.device) -> Prepared:
    """:func:`prepare` for a model group: client ``i`` gets ``members[i % len(members)]``."""
    fed, table = build_group_federation(ds, part, members, algorithm, feature_dim=cfg.clients.feature_dim,
                                        batch_size=cfg.train.batch_size, device=device, seed=cfg.seed)
    apply_policy(fed, cfg.train.bn_statistics)
    ecfg = engine_config(cfg)
    participation(ecfg, len(part.clients))  # a count larger than the population is an error before writing
    return Prepared(cfg, fed, ecfg, table, part, {"models": cfg.clients.models, "feature_dim": cfg.clients.feature_dim})


def prepare(cfg: RunConfig, progress: bool = True, data: tuple[Any, Any] | None = None,
            keep_all_images: bool = False) -> Prepared:
    """Validate ``cfg`` against the data, profiles and supernet and build the federation: one
    searched (or given) subnet per device profile, or with ``clients.models`` other than ``nas`` a
    heterogeneous model group (:func:`build_group_federation`; no supernet, profile or search).

    ``data``: ``(dataset, partition)`` of an earlier preparation whose ``data``, ``partition``,
    ``clients.n`` and ``seed`` are this config's (``rafl compare``'s methods share one copy of the
    images: CIFAR-10 is 737 MB of float32 per copy); None loads them, and then only the images
    the run reads stay in memory (:func:`~rafl.federation.build.used_samples`: the clients'
    splits, the global test set, the public pool when the method reads it; CIFAR-10's whole
    60,000 images are 184 MB of uint8) unless ``keep_all_images`` (a caller that hands the
    dataset to other preparations, whose methods may read more of it).

    Raises:
        UserInputError: unknown algorithm/hyperparameter, unknown profile, an impossible
            partition, a profile no subnet fits, a public pool that differs from the one the
            supernet trained on (leakage), FedAvg-like methods with heterogeneous models, ...
    """
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    algo_cls = get_algorithm(cfg.algorithm.name)
    algorithm = algo_cls(**cfg.algorithm.hparams())
    algorithm.bn_policy = cfg.train.bn_statistics  # before the images are trimmed: `server` reads the pool
    device = torch.device(cfg.train.device)  # validated by the run config (TrainSection)
    members = _group_members(cfg)  # None: nas
    profiles = check_nas_config(cfg) if members is None else []  # what needs no data or model, first
    ds, part = load_data_and_partition(cfg, progress) if data is None else data
    check_public_pool(algorithm, cfg.algorithm.hparams(), part)
    trim = data is None and not keep_all_images  # this preparation's own copy: keep what the run reads
    if members is not None:
        if cfg.clients.held_out_fraction > 0:
            raise UserInputError(f"holds out clients of a model group ({cfg.clients.models}); allowed: 0 with "
                                 "clients.models other than nas (the new-clients protocol deploys a tier's subnet)",
                                 field="clients.held_out_fraction")
        if trim:
            ds = ds.keep_only(used_samples(part, algorithm))
        prep = _prepare_group(cfg, ds, part, members, algorithm, device)
        prep.dataset = ds
        return prep
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
    meta_dir = supernet_id.split(":", 1)[1] if supernet_id.startswith("quickstart:") else cfg.supernet.path
    meta = load_meta(meta_dir)
    whole: list[bool] = []
    val_idx, search_calib_idx = search_split(cfg, ds, public, pool, meta.get("config") or {}, whole)
    known = None
    if whole and whole[0]:  # searched on the supernet's whole server-val: what was measured beside it holds
        table = supernet_measurements(resolve_supernet(meta_dir))
        default = SearchConfig()  # the measurement subnets_for_profiles' search does
        if table is not None and measured_alike(table, default.batch_size, default.calib_batches):
            known = table["accuracy"]
    val = (ds.images[torch.as_tensor(val_idx)], ds.labels[torch.as_tensor(val_idx)])
    search_calib = ds.images[torch.as_tensor(search_calib_idx)]
    calib = ds.images[torch.as_tensor(calibration_sample(public, CALIBRATION_IMAGES))]  # class-mixed, whatever the data's order
    one_for_all = algo_cls.one_model_for_all or cfg.clients.subnets == "weakest"
    arch_of = subnets_for_profiles(cfg, supernet, profiles, val, search_calib, supernet_id, progress=progress,
                                   common=one_for_all, known=known)
    del search_calib, val
    if trim:  # the search's images are copies: the run reads its clients', global test's and pool's
        ds = ds.keep_only(used_samples(part, algorithm))
    names = [pr.name for pr in profiles]
    prof_of = [names[cid % len(names)] if len(names) != cfg.clients.n else names[cid]
               for cid in range(len(part.clients))]
    if one_for_all:
        # uniform, or the tailoring ablation: one subnet every device runs (with nested budgets the
        # weakest device's own; else the one searched under every budget at once)
        one = uniform_arch(supernet.space, arch_of, [p for p in profiles if p.name in set(prof_of)])
        arch_of = {name: {**v, "arch": one["arch"], "source": one["source"]} for name, v in arch_of.items()
                   if name != COMMON}
    held = held_out_clients(prof_of, cfg.clients.held_out_count(), cfg.seed)
    kept = [cid for cid in range(len(part.clients)) if cid not in set(held)]
    fed, table = build_federation(ds, dataclasses.replace(part, clients=[part.clients[c] for c in kept]), supernet,
                                  [arch_of[prof_of[c]]["arch"] for c in kept], algorithm,
                                  profiles=[prof_of[c] for c in kept], batch_size=cfg.train.batch_size, device=device,
                                  seed=cfg.seed, calib_images=calib)
    apply_policy(fed, cfg.train.bn_statistics)
    new_fed, new_table = None, []
    if held:  # the new-clients protocol: the held-out clients as a federation of their own, never run by the engine
        new_fed, new_table = build_federation(ds, dataclasses.replace(part, clients=[part.clients[c] for c in held]),
                                              supernet, [arch_of[prof_of[c]]["arch"] for c in held], algorithm,
                                              profiles=[prof_of[c] for c in held], batch_size=cfg.train.batch_size,
                                              device=device, seed=cfg.seed, calib_images=calib, count_macs=False)
        apply_policy(new_fed, cfg.train.bn_statistics)
        new_fed.global_test = None  # scored on their own test splits (the global set is the trained clients' row)
        for rows, ids in ((table, kept), (new_table, held)):
            for row, cid in zip(rows, ids):
                row["partition_client"] = cid
        counted = {r["arch"]: (r["macs_m"], r["params_m"]) for r in table}
        for row in new_table:
            row["macs_m"], row["params_m"] = counted.get(row["arch"], (None, None))
    for row in [*table, *new_table]:
        row["subnet_source"] = arch_of[row["profile"]]["source"]
    used = {pr.name: pr for pr in profiles if pr.name in set(prof_of)}
    budgets = {name: subnet_budgets(supernet.space, arch_of[name]["arch"], pr) for name, pr in used.items()}
    ecfg = engine_config(cfg)
    participation(ecfg, len(kept))  # a count larger than the (trained) population is an error before writing
    return Prepared(cfg, fed, ecfg, table, part, {"profiles": {n: {"arch": v["arch"].to_string(), "source": v["source"],
                                                                   "search_accuracy": v["search_accuracy"],
                                                                   **({"budgets": budgets[n]} if n in budgets else {})}
                                                               for n, v in arch_of.items()},
                                                  "supernet": supernet_id},
                    supernet_meta=meta, dataset=ds, held_out=held, new_clients=new_fed, new_clients_table=new_table)


__all__ = ["QUICKSTART_POOL", "Prepared", "engine_config", "load_data_and_partition", "prepare"]
