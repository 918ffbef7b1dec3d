"""Where the BatchNorm statistics of a deployed model come from: one option for every method
(``train.bn_statistics``), decided here.

A deployed model normalizes with BatchNorm running statistics (mean and variance per channel). Where
they come from matters as much as the weights for small clients: clients with 15-185 training
images scored 31-40 points below the no-training floor on their own test split with statistics
re-estimated on their own data, and 3-11 points above it with the same weights and statistics
re-estimated on 512 pool images (issue 56's probe). The field's policies:

* ``client`` -- re-estimated on the client's own training split when the model is deployed (one
  no-grad pass in train mode, :func:`rafl.federation.training.recalibrate_local_bn`; OFA's
  ``set_running_statistics``, Cai et al., ICLR 2020, Sec. 3.2). What standalone, FedGH, FedTGP,
  FedProto and RaFL do by default (their private models end local training with it), and what
  HeteroFL's static BN does with ``sbn_statistics: local``.
* ``server`` -- re-estimated on the server's public pool when the model is deployed: the fixed
  class-mixed sample of :data:`~rafl.supernet.server_data.CALIBRATION_IMAGES` (512) pool images
  that the searched subnets and the no-training floor are recalibrated on
  (:func:`rafl.supernet.model.recalibrate_bn`). HeteroFL's static BN with ``sbn_statistics: server``
  (Diao et al., ICLR 2021, Sec. 3.2, with the pool standing in for the clients' union), the floor's
  default.
* ``local`` -- FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
  Normalization", ICLR 2021, Alg. 1): the BatchNorm layers (affine weight and bias, running mean
  and variance) of the model a client deploys are never replaced by the server's; each client keeps
  the ones its own training left, the rest of the model is the federation's. For the methods that
  average whole models or slices (``fedavg``, ``fedprox``, ``fednova``, ``uniform``, ``heterofl``,
  ``fedrolex``) the client keeps its BN layers in its state and puts them into every download (the
  server still averages the copies it receives, which no trained client deploys; a client that has
  never trained, such as a new client, deploys the server's). For the methods whose deployed model
  never leaves the client it is their own training's statistics, as by default.

A method's own rule (``train.bn_statistics: null``, the default) is kept bit for bit: the run then
reports it as :meth:`~rafl.federation.algorithms.base.Algorithm.deployed_bn_statistics` says
(``averaged``: FedAvg's rule, the running statistics averaged like every other weight, for the
whole-model and slice averaging methods without static BN). A policy that differs from it is applied
in one place: :func:`deployment`, around every evaluation of a deployed model (the personalized,
global, fine-tuned and new-client protocols alike), through
:data:`rafl.federation.training.DEPLOYED_STATISTICS` (``client`` / ``server``), and in the
averaging methods' client steps (``local``, :func:`with_own_bn`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rafl.errors import UserInputError, allowed
from rafl.federation.training import DEPLOYED_STATISTICS, recalibrate_local_bn
from rafl.supernet.model import recalibrate_bn
from rafl.supernet.server_data import CALIBRATION_BATCH, CALIBRATION_IMAGES, calibration_sample

#: the policies ``train.bn_statistics`` accepts (null: the method's own)
POLICIES: tuple[str, ...] = ("client", "server", "local")
#: what a method's own rule may be called in a summary: the policies, FedAvg's averaging, and the
#: centralized ceiling's statistics re-estimated on the pooled client data
RULES: tuple[str, ...] = (*POLICIES, "averaged", "pooled")


def check_policy(policy: Any) -> str | None:
    """``policy`` as given (None or one of :data:`POLICIES`).

    Raises:
        UserInputError: anything else, naming ``train.bn_statistics`` and the allowed values."""
    if policy is None or policy in POLICIES:
        return policy
    raise UserInputError(f"is {policy!r}, allowed: {allowed([*POLICIES, 'null'])}", field="train.bn_statistics")


def effective(algorithm: Any, policy: str | None) -> str:
    """The rule a run's deployed models follow: ``policy`` when set, else the method's own
    (:meth:`~rafl.federation.algorithms.base.Algorithm.deployed_bn_statistics`); one of :data:`RULES`."""
    return policy if policy is not None else algorithm.deployed_bn_statistics()


def overrides(algorithm: Any, policy: str | None) -> bool:
    """Whether ``policy`` changes what the method does by itself (None or the method's own rule: no)."""
    return policy is not None and policy != algorithm.deployed_bn_statistics()


def check_run(algorithm: Any, policy: str | None, public_images: torch.Tensor | None) -> None:
    """Refuse a policy the run cannot follow (before round 1).

    Raises:
        UserInputError: ``server`` without a public pool; ``local`` for a method that averages its
            deployed BN layers and keeps no client state for FedBN (FedDF); ``local`` with HeteroFL's
            static BN (statistics that are never sent cannot be kept apart). Each names
            ``train.bn_statistics`` and what is allowed."""
    policy = check_policy(policy)
    if not overrides(algorithm, policy):
        return
    if policy == "server" and (public_images is None or len(public_images) == 0):
        raise UserInputError("is server: statistics re-estimated on the server's public pool, and this run has none; "
                             "allowed: client or local, or partition.public_fraction > 0", field="train.bn_statistics")
    if policy == "local" and not algorithm.supports_local_bn():
        raise UserInputError(f"is local (FedBN: each client keeps its own BN layers), which {algorithm.name} does not "
                             "implement (it averages its deployed models' BN layers and keeps no client state); "
                             "allowed: client, server or null", field="train.bn_statistics")


def apply_policy(fed: Any, policy: str | None) -> None:
    """Give a built federation (and its method) the run's ``train.bn_statistics``, checked
    (:func:`check_run`); called by the stage that builds it, on the server and on every Flower node.

    Raises:
        UserInputError: as :func:`check_run`."""
    check_run(fed.algorithm, policy, fed.server.public_images)
    fed.bn_statistics = policy
    fed.algorithm.bn_policy = policy


def server_batches(public_images: torch.Tensor) -> list[torch.Tensor]:
    """The server's calibration images in batches of :data:`CALIBRATION_BATCH`: the fixed class-mixed
    sample of :data:`CALIBRATION_IMAGES` pool images (:func:`calibration_sample`), ``(B, C, H, W)`` each."""
    calib = public_images[torch.as_tensor(calibration_sample(torch.arange(len(public_images)).numpy(),
                                                             CALIBRATION_IMAGES))]
    return [calib[i:i + CALIBRATION_BATCH] for i in range(0, len(calib), CALIBRATION_BATCH)]


@contextlib.contextmanager
def deployment(policy: str | None, algorithm: Any, train_loader: Any, public_images: torch.Tensor | None,
               device: torch.device | str) -> Iterator[None]:
    """Within it, every model a scoring helper scores (:data:`DEPLOYED_STATISTICS`) first gets the
    ``policy``'s statistics: re-estimated on ``train_loader`` (``client``) or on the server's
    calibration images (``server``); nothing when the policy is the method's own or ``local``
    (FedBN acts in the client steps). Each model object is re-estimated once per context (the
    personalized and global protocols score the same model).

    Args:
        policy: ``train.bn_statistics`` (None: the method's own).
        algorithm: the run's method.
        train_loader: the client's training split (``(images (B, C, H, W), labels (B,))`` batches).
        public_images: the server's pool ``(N_pub, C, H, W)``, or None.
        device: where to compute.
    """
    if not overrides(algorithm, policy) or policy == "local":
        yield
        return
    done: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def apply(model: nn.Module) -> None:
        if model in done:
            return
        if policy == "client":
            recalibrate_local_bn(model, train_loader, device=device)
        else:
            recalibrate_bn(model, server_batches(public_images), n_batches=None, device=device)
        done.add(model)

    token = DEPLOYED_STATISTICS.set(apply)
    try:
        yield
    finally:
        DEPLOYED_STATISTICS.reset(token)


def bn_keys(model: nn.Module) -> list[str]:
    """The ``state_dict`` keys of every BatchNorm layer of ``model`` (affine weight and bias, running
    mean and variance, the batch counter), in state-dict order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            prefix = f"{name}." if name else ""
            out += [prefix + k for k in module.state_dict()]
    return out


def own_bn(model: nn.Module) -> dict[str, torch.Tensor]:
    """FedBN's client state: ``model``'s BatchNorm tensors (:func:`bn_keys`), detached CPU copies."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu").clone() for k in bn_keys(model)}


def with_own_bn(weights: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """A download with the client's own BN layers in place of the server's (FedBN, Li et al. 2021,
    Alg. 1): ``weights`` where ``own`` has no entry of the same key and shape, ``own``'s tensor where
    it has (a client that has not trained yet, ``own`` empty or None, gets ``weights`` as they are)."""
    out = dict(weights)
    for k, t in (own or {}).items():
        if k in out and tuple(out[k].shape) == tuple(t.shape):
            out[k] = t
    return out


__all__ = ["POLICIES", "RULES", "check_policy", "effective", "overrides", "check_run", "apply_policy", "server_batches", "deployment",
           "bn_keys", "own_bn", "with_own_bn"]
