"""A :class:`~rafl.federation.engine.Federation` from its parts: a dataset, a partition, and the
clients' models (subnets of a supernet, one arch per client, or a heterogeneous model group)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rafl.data import make_loader
from rafl.errors import UserInputError
from rafl.federation.algorithms import ClientInfo, ServerContext
from rafl.federation.engine import Federation
from rafl.models import KNOWLEDGE_MODEL, make_member
from rafl.search.counting import model_macs_params
from rafl.supernet.arch import ArchConfig
from rafl.supernet.bank import ModelBank
from rafl.supernet.server_data import CALIBRATION_IMAGES, calibration_sample

#: batch size of the global test set's loader (evaluation only: BN in eval mode, so it changes no number)
GLOBAL_BATCH = 256


def global_test_loader(dataset, partition):
    """A loader over the partition's held-out balanced global test set (``partition.global_test``,
    in index order), or ``None`` when it has none."""
    held = np.asarray(getattr(partition, "global_test", ()), dtype=np.int64)
    return make_loader(dataset, held, GLOBAL_BATCH, shuffle=False, seed=0) if len(held) else None


def public_pool_images(dataset, public: np.ndarray, algorithm):
    """The server's ``public_images``: a view of ``dataset``'s images of the pool samples
    ``public`` (:meth:`rafl.data.Images.view`, no copy; normalized float32 ``(B, C, H, W)`` on
    indexing, the same values as a normalized copy), or None when the pool is empty or the method
    reads no pool (:meth:`~rafl.federation.algorithms.base.Algorithm.reads_public_pool`). A float32
    copy of CIFAR-10's 25,000-image pool was 307 MB held for the whole run."""
    if not len(public) or not algorithm.reads_public_pool():
        return None
    images = dataset.images
    return images.view(public) if hasattr(images, "view") else images[torch.as_tensor(public)]


def used_samples(partition, algorithm) -> np.ndarray:
    """Sorted int64 indices of the samples a federation of ``partition`` reads: every client's
    train / val / test split, the held-out global test set, and the public pool when the method
    reads it (:meth:`~rafl.federation.algorithms.base.Algorithm.reads_public_pool`)."""
    parts = [np.asarray(c.all(), dtype=np.int64) for c in partition.clients]
    parts.append(np.asarray(getattr(partition, "global_test", ()), dtype=np.int64))
    if algorithm.reads_public_pool():
        parts.append(np.asarray(partition.public, dtype=np.int64))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def client_loaders(dataset, partition, batch_size: int):
    """The federation's ``loaders(cid, split, seed)``: a DataLoader over client ``cid``'s ``split``
    (train shuffled with ``seed``; no ``drop_last``), or ``None`` for an empty ``val`` split."""
    def loaders(cid: int, split: str, seed: int):
        idx = getattr(partition.clients[cid], split)
        if split == "val" and len(idx) == 0:
            return None
        return make_loader(dataset, idx, batch_size, shuffle=(split == "train"), seed=seed % (2**63))

    return loaders


def build_federation(dataset, partition, supernet, archs: list[ArchConfig], algorithm, *,
                     profiles: list[str] | None = None, batch_size: int = 32,
                     device: torch.device | str = "cpu", seed: int = 0,
                     calib_images: torch.Tensor | None = None,
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
    pub_images = public_pool_images(dataset, public, algorithm)
    if calib_images is None and len(public):
        calib_images = dataset.images[torch.as_tensor(calibration_sample(public, CALIBRATION_IMAGES))]  # class-mixed
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

    server = ServerContext(clients=infos, make_model=server_model, public_images=pub_images,
                           n_classes=dataset.num_classes, space=supernet.space, supernet=supernet, device=device,
                           seed=seed)
    fed = Federation(algorithm=algorithm, clients=infos, loaders=loaders, client_model=client_model, server=server,
                     global_test=global_test_loader(dataset, partition),
                     n_classes=dataset.num_classes, device=device)
    algorithm.check_models(server)
    return fed, table


def build_group_federation(dataset, partition, members: list[str], algorithm, *, feature_dim: int = 128,
                           knowledge_model: str | None = None, batch_size: int = 32,
                           device: torch.device | str = "cpu", seed: int = 0
                           ) -> tuple[Federation, list[dict[str, Any]]]:
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

    Returns:
        ``(federation, table)``: one row per client (client, model, params_m, n_train, n_test).

    Raises:
        UserInputError: an unknown member, a plug-in that does not fit, or a population the
            algorithm rejects (e.g. FedAvg over different models).
    """
    if not members or "nas" in members:
        raise UserInputError("needs model-group members (nas goes through the federate pipeline)",
                             field="clients.models")
    n = len(partition.clients)
    device = torch.device(device)
    n_classes = dataset.num_classes
    channels, res = int(dataset.images.shape[1]), int(dataset.images.shape[-1])
    know = knowledge_model or KNOWLEDGE_MODEL
    names = [members[i % len(members)] for i in range(n)]
    if algorithm.one_model_for_all:  # uniform: the group's smallest member for everyone
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

    pub_images = public_pool_images(dataset, np.asarray(partition.public, dtype=np.int64), algorithm)
    server = ServerContext(clients=infos, make_model=server_model, public_images=pub_images, n_classes=n_classes,
                           space=None, supernet=None, device=device, seed=seed)
    fed = Federation(algorithm=algorithm, clients=infos, loaders=loaders, client_model=client_model, server=server,
                     global_test=global_test_loader(dataset, partition),
                     n_classes=n_classes, device=device)
    algorithm.check_models(server)
    return fed, table


__all__ = ["build_federation", "build_group_federation", "client_loaders", "global_test_loader", "public_pool_images",
           "used_samples"]
