"""Local-training loops of the HtFL methods that add a term to cross-entropy.

One loop, :func:`train_regularized`, serves every method whose client loss is
``CE(model(x), y) + extra(features, logits, labels)``:

* FedProto (Tan et al., AAAI 2022, Eq. 5): ``extra = lambda * ||f(x) - C_y||^2`` (mean squared
  error to the global prototype, as in the official code) -- :func:`prototype_regularizer`;
* FedTGP (Zhang et al., AAAI 2024, client loss): ``extra = lambda * ||f(x) - P_y||_2``
  (Euclidean) or the squared-distance variant -- :func:`prototype_regularizer`;
* FD / FedDistill (Jeong et al., 2018): ``extra = gamma * MSE(logits, bar z_y)`` with the global
  per-class mean logits -- :func:`logit_regularizer`.

:func:`train_mutual` is the two-model loop of RaFL (Yu et al., Eqs. 3-6: deep mutual learning with
KL weight alpha), FML (Shen et al., 2020, Eqs. 1-2) and FedKD (Wu et al., Nature Communications
2022, Eqs. 1-4): a private model and a shared model learn from each other with per-model CE/KL
weights, optional adaptive (loss-normalised) distillation and a hidden representation loss.

Conventions are those of :mod:`rafl.federation.training` (loaders yield ``(images (B, C, H, W),
labels (B,))``; losses are batch means; no ``drop_last``: a client smaller than one batch still
trains on all its samples; a trailing 1-sample batch is merged into the previous one,
:func:`no_singleton_batches`, so BatchNorm never sees one value per channel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from rafl.federation.progress import report
from rafl.federation.prototypes import safe_distance, stack_targets, target_bank
from rafl.federation.training import (
    TrainStats,
    check_finite_loss,
    kl_soft,
    no_singleton_batches,
    recalibrate_local_bn,
    train_ce,
    train_mode,
)

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``extra(features (B, r), logits (B, K), labels (B,)) -> scalar`` added to the CE loss.
Regularizer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Distance names of the prototype regularizer.
DISTANCES = ("euclidean", "squared", "mse")


class NoSingletonBatches:
    """A re-iterable view of a loader through :func:`no_singleton_batches` (use it once per epoch)."""

    def __init__(self, loader: Iterable[Batch]):
        self.loader = loader

    @property
    def dataset(self):
        """The wrapped loader's dataset (what :func:`~rafl.federation.training.loader_size` counts)."""
        return self.loader.dataset

    def __iter__(self):
        return no_singleton_batches(self.loader)


def prototype_regularizer(protos: Mapping[int, torch.Tensor], lam: float, distance: str = "euclidean") -> Regularizer:
    """``lam * (1/B) sum_i d(f(x_i), P_{y_i})``: the sum over the samples whose class has a
    prototype, divided by the whole batch size B (a sample without one adds 0, as with HtFLlib's
    ``MSELoss`` over a target that equals the representation there).

    Args:
        protos: ``{class id: (r,)}`` global prototypes (constants).
        lam: the weight lambda.
        distance: ``"euclidean"`` (``||.||_2``, FedTGP's paper; NaN-free at 0 via
            :func:`~rafl.federation.prototypes.safe_distance`), ``"squared"`` (``||.||_2^2``) or
            ``"mse"`` (``||.||_2^2 / r``, PyTorch's ``MSELoss`` as in FedProto's/HtFLlib's code).

    Returns:
        a :data:`Regularizer` (zero when no prototype exists yet, e.g. round 1).

    Raises:
        ValueError: unknown distance.
    """
    if distance not in DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; allowed: {', '.join(DISTANCES)}")

    bank = target_bank(protos)  # once: the prototypes are constants of the round

    def extra(features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets, mask = stack_targets(bank, labels)
        if not bool(mask.any()) or lam == 0:
            return features.sum() * 0.0
        f, t = features[mask], targets[mask].to(features.dtype)
        if distance == "euclidean":
            d = safe_distance(f, t)
        elif distance == "squared":
            d = (f - t).pow(2).sum(-1)
        else:
            d = (f - t).pow(2).mean(-1)
        # mean over the whole batch (samples without a prototype contribute 0), as MSELoss over
        # the batch would for the samples that have one
        return lam * d.sum() / len(labels)

    return extra


def logit_regularizer(class_logits: Mapping[int, torch.Tensor], gamma: float) -> Regularizer:
    """FD's distillation term ``gamma * MSE(z(x), bar z_y)`` to the global mean logits of the
    sample's class (Jeong et al., 2018, Sec. 3; the MSE as in HtFLlib's ``clientdistill``)."""

    bank = target_bank(class_logits)

    def extra(features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets, mask = stack_targets(bank, labels)
        if not bool(mask.any()) or gamma == 0:
            return logits.sum() * 0.0
        d = (logits[mask] - targets[mask].to(logits.dtype)).pow(2).mean(-1)
        return gamma * d.sum() / len(labels)

    return extra


def train_regularized(model: nn.Module, loader: Iterable[Batch], optimizer: torch.optim.Optimizer,
                      extra: Regularizer | None = None, *, epochs: int = 1,
                      device: torch.device | str = "cpu",
                      diverged: tuple[str, str | None] = ("algorithm.lr", None),
                      last_epoch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
                      ) -> TrainStats:
    """``epochs`` passes of ``CE(head(f(x)), y) + extra(f(x), logits, y)``.

    Args:
        model: has ``features(x) -> (B, r)`` and ``head: (B, r) -> (B, K)``.
        loader: yields ``(images, labels)``.
        optimizer: over the trainable parameters.
        extra: a :data:`Regularizer` or None (plain CE).
        epochs: passes over the loader.
        device: where to compute.
        diverged: the keys a diverged loss names (:func:`~rafl.federation.training.check_finite_loss`).
        last_epoch: sees every batch of the last epoch (:func:`~rafl.federation.training.train_ce`).

    Returns:
        :class:`~rafl.federation.training.TrainStats` (``loss`` = mean total loss).

    Raises:
        UserInputError: the loss turned NaN/Inf (naming ``diverged``).
    """
    if extra is None:  # still run the model as head(features(x)): it may have no forward()
        def extra(feats, logits, labels):
            return logits.new_zeros(())
    return train_ce(model, loader, optimizer, epochs=epochs, device=device, extra=extra, diverged=diverged,
                    last_epoch=last_epoch)


def train_mutual(model_a: nn.Module, model_b: nn.Module, loader: Iterable[Batch],
                 opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer, *, epochs: int = 1,
                 ce_a: float = 1.0, kl_a: float = 1.0, ce_b: float = 1.0, kl_b: float = 1.0,
                 temperature: float = 1.0, adaptive: bool = False, hidden_weight: float = 0.0,
                 max_grad_norm: float = 0.0,
                 device: torch.device | str = "cpu") -> tuple[TrainStats, TrainStats]:
    """Mutual learning of a private model ``a`` and a shared model ``b``.

    ``L_a = ce_a * CE_a + kl_a * s * KL(p_b || p_a) + hidden_weight * s * MSE(h_a, h_b)`` and
    ``L_b = ce_b * CE_b + kl_b * s * KL(p_a || p_b) + hidden_weight * s * MSE(h_b, h_a)``, each KL
    / MSE with the other model's output as a constant target, ``s = 1`` or, with ``adaptive``,
    ``s = 1 / (CE_a + CE_b)`` (a constant: FedKD's adaptive mutual distillation, Wu et al. Eqs.
    1-4, which trusts the distillation more when both models predict well). FML (Shen et al. 2020,
    Eqs. 1-2): ``ce_a = alpha, kl_a = 1 - alpha, ce_b = beta, kl_b = 1 - beta``. RaFL's deep mutual
    learning (Yu et al., Eqs. 3-6; :func:`~rafl.federation.training.dml_losses`): ``ce_a = ce_b = 1``,
    ``kl_a = kl_b = alpha``. Only ``model_a`` ends with BN recalibration (:func:`recalibrate_local_bn`):
    ``model_b`` is averaged on the server with its running statistics.

    Args:
        model_a / model_b: ``(B, C, H, W) -> (B, K)`` models, run as ``head(features(x))`` when
            both have ``features`` and ``head`` (the same representation width when
            ``hidden_weight > 0``), else as ``model(x)``.
        loader: yields ``(images, labels)``.
        opt_a / opt_b: optimizers of the two models.
        epochs, temperature: as named.
        max_grad_norm: clip each model's gradient to this L2 norm before its step (0 = off). The
            adaptive scale grows without bound as both models fit their data; HtFLlib's FedKD
            client clips at 10.

    Returns:
        ``(stats_a, stats_b)``.

    Raises:
        ValueError: ``hidden_weight > 0`` and the two representations differ in width, or a model
            has no ``features`` / ``head``.
    """
    split = all(hasattr(m, "features") and hasattr(m, "head") for m in (model_a, model_b))
    if hidden_weight > 0 and not split:
        raise ValueError("hidden loss needs models with features and head")
    train_mode(model_a, loader)
    train_mode(model_b, loader)
    st_a, st_b = TrainStats(), TrainStats()
    sum_a = sum_b = 0.0
    for epoch in range(int(epochs)):
        report("epoch", epoch=epoch + 1, epochs=int(epochs))
        for images, labels in no_singleton_batches(loader):
            images, labels = images.to(device), labels.to(device)
            if split:
                h_a, h_b = model_a.features(images), model_b.features(images)
                z_a, z_b = model_a.head(h_a), model_b.head(h_b)
            else:
                z_a, z_b = model_a(images), model_b(images)
            ce_la, ce_lb = F.cross_entropy(z_a, labels), F.cross_entropy(z_b, labels)
            s = 1.0 / float((ce_la + ce_lb).detach().clamp_min(1e-8)) if adaptive else 1.0
            loss_a = ce_a * ce_la + kl_a * s * kl_soft(z_a, z_b, temperature)
            loss_b = ce_b * ce_lb + kl_b * s * kl_soft(z_b, z_a, temperature)
            if hidden_weight > 0:
                if h_a.shape != h_b.shape:
                    raise ValueError(f"hidden loss needs equal representation widths, got {tuple(h_a.shape)} "
                                     f"and {tuple(h_b.shape)}")
                loss_a = loss_a + hidden_weight * s * F.mse_loss(h_a, h_b.detach())
                loss_b = loss_b + hidden_weight * s * F.mse_loss(h_b, h_a.detach())
            check_finite_loss(loss_a + loss_b)
            opt_a.zero_grad(set_to_none=True)
            opt_b.zero_grad(set_to_none=True)
            (loss_a + loss_b).backward()  # disjoint parameters: each loss's targets are detached
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model_a.parameters(), max_grad_norm)
                torch.nn.utils.clip_grad_norm_(model_b.parameters(), max_grad_norm)
            opt_a.step()
            opt_b.step()
            n = int(labels.numel())
            for st, z in ((st_a, z_a), (st_b, z_b)):
                st.steps += 1
                st.samples += n
                st.correct += int((z.detach().argmax(1) == labels).sum())
            sum_a += float(loss_a.detach())
            sum_b += float(loss_b.detach())
    st_a.loss = sum_a / st_a.steps if st_a.steps else 0.0
    st_b.loss = sum_b / st_b.steps if st_b.steps else 0.0
    if st_a.steps:  # BN recalibration of the private model only (model_b is averaged on the server)
        recalibrate_local_bn(model_a, loader, device=device)
    return st_a, st_b


__all__ = ["Regularizer", "DISTANCES", "no_singleton_batches", "NoSingletonBatches", "prototype_regularizer",
           "logit_regularizer", "train_regularized", "train_mutual"]
