"""The loss terms of the HtFL methods: what a client's loss adds to cross-entropy, and the KL terms of distillation.

* :func:`kl_soft` -- ``T^2 KL(teacher || student)`` at temperature ``T`` (Hinton et al. 2015);
* :func:`dml_losses` -- the deep mutual learning losses of RaFL (Yu et al., Eqs. 3-6; the loop is
  :func:`rafl.federation.training.train_mutual`);
* FedProto (Tan et al., AAAI 2022, Eq. 5): ``lambda * ||f(x) - C_y||^2`` (mean squared error to the
  global prototype, as in the official code) -- :func:`prototype_regularizer`;
* FedTGP (Zhang et al., AAAI 2024, client loss): ``lambda * ||f(x) - P_y||_2`` (Euclidean) or the
  squared-distance variant -- :func:`prototype_regularizer`;
* FD / FedDistill (Jeong et al., 2018): ``gamma * MSE(logits, bar z_y)`` with the global per-class
  mean logits -- :func:`logit_regularizer`;
* :func:`safe_distance` / :func:`pairwise_distances` -- Euclidean distances with a finite gradient
  at zero, and :func:`target_bank` / :func:`stack_targets` -- each sample's class prototype as a
  target (used here and by :mod:`rafl.federation.prototypes`).

A :data:`Regularizer` is ``extra(features (B, r), logits (B, K), labels (B,)) -> scalar``, added to
the batch-mean cross-entropy by :func:`rafl.federation.training.train_regularized`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

#: ``extra(features (B, r), logits (B, K), labels (B,)) -> scalar`` added to the CE loss.
Regularizer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Distance names of the prototype regularizer.
DISTANCES = ("euclidean", "squared", "mse")
#: Squared distances below this are clamped before the square root (value ~1e-6, gradient 0).
DIST_EPS = 1e-12


def safe_distance(a: torch.Tensor, b: torch.Tensor, eps: float = DIST_EPS) -> torch.Tensor:
    """Row-wise Euclidean distance ``||a - b||_2`` with a finite gradient at zero distance.

    ``sqrt`` has an infinite derivative at 0 (and ``x/||x||`` is 0/0), so the squared distance
    is clamped at ``eps`` first: the value at zero is ``sqrt(eps)`` (1e-6) and the gradient 0.

    Args:
        a, b: (N, r) (or broadcastable) tensors.

    Returns:
        (N,) distances.
    """
    sq = (a - b).pow(2).sum(-1)
    return sq.clamp_min(eps).sqrt()


def pairwise_distances(x: torch.Tensor, y: torch.Tensor, eps: float = DIST_EPS) -> torch.Tensor:
    """Euclidean distance matrix ``D[i, j] = ||x_i - y_j||_2`` ((N, r), (M, r) -> (N, M)),
    computed from explicit differences (exact, no cancellation) and NaN-free at zero."""
    return safe_distance(x.unsqueeze(1), y.unsqueeze(0), eps)


def target_bank(protos: Mapping[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bank (C, r) float32, has (C,) bool)`` with ``C = max class id + 1``: row ``k`` holds the
    prototype of class ``k`` (zeros and ``has[k] = False`` for a class without one). Build it once
    per round and look targets up per batch (:func:`stack_targets`)."""
    if not protos:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.bool)
    dim = next(iter(protos.values())).numel()
    n_cls = max(protos) + 1
    bank = torch.zeros(n_cls, dim)
    has = torch.zeros(n_cls, dtype=torch.bool)
    for k, v in protos.items():
        bank[int(k)] = v.detach().to("cpu", torch.float32).reshape(-1)
        has[int(k)] = True
    return bank, has


def stack_targets(protos: Mapping[int, torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prototype of each sample's class: ``(targets (B, r), mask (B,) bool)``; samples whose
    class has no prototype get a zero row and ``mask=False`` (they add no prototype loss).
    ``protos``: ``{class id: (r,)}``, or the :func:`target_bank` of such a mapping."""
    bank, has = protos if isinstance(protos, tuple) else target_bank(protos)
    if not len(has):
        return torch.zeros(len(labels), 0), torch.zeros(len(labels), dtype=torch.bool)
    lab = labels.cpu()
    inside = lab < len(has)  # a class id beyond every prototype's: a zero row, no prototype
    if not bool(inside.all()):
        lab = torch.where(inside, lab, torch.zeros_like(lab))
        targets = torch.where(inside.unsqueeze(1), bank[lab], torch.zeros(()))
        return targets.to(labels.device), (has[lab] & inside).to(labels.device)
    return bank[lab].to(labels.device), has[lab].to(labels.device)


def kl_soft(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, mean over the batch.

    Args:
        student_logits: (B, K) logits of the model being trained.
        teacher_logits: (B, K) target logits (treated as constants: detached here).
        temperature: T > 0.

    Returns:
        scalar tensor. This is the KL term of RaFL Eqs. 4 and 6 (``D_KL(p_k || p_l)`` with
        ``p_k`` the target) and of Eq. 9.
    """
    t = float(temperature)
    log_p_student = F.log_softmax(student_logits / t, dim=1)
    p_teacher = F.softmax(teacher_logits.detach() / t, dim=1)
    return F.kl_div(log_p_student, p_teacher, reduction="batchmean") * (t * t)


def dml_losses(logits_l: torch.Tensor, logits_k: torch.Tensor, labels: torch.Tensor,
               temperature: float = 1.0, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deep mutual learning losses of RaFL (Yu et al., Eqs. 3-6; Zhang et al., CVPR 2018, Eq. 2).

    ``L(theta_l) = CE(p_l, y) + alpha * KL(p_k || p_l)`` (Eqs. 3-4) and
    ``L(theta_k) = CE(p_k, y) + alpha * KL(p_l || p_k)`` (Eqs. 5-6), where each KL treats the
    *other* model's distribution as a constant target (at temperature T, scaled by T^2).

    Args:
        logits_l: (B, K) logits of the local specialized model theta_l.
        logits_k: (B, K) logits of the knowledge network theta_k.
        labels: (B,) int64 class ids.
        temperature: softmax temperature of the KL terms (RaFL uses 1).
        alpha: weight of the KL terms.

    Returns:
        ``(loss_l, loss_k)``, two scalars; ``loss_l`` only has gradients into ``logits_l`` and
        ``loss_k`` only into ``logits_k``.
    """
    loss_l = F.cross_entropy(logits_l, labels) + alpha * kl_soft(logits_l, logits_k, temperature)
    loss_k = F.cross_entropy(logits_k, labels) + alpha * kl_soft(logits_k, logits_l, temperature)
    return loss_l, loss_k


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


__all__ = ["Regularizer", "DISTANCES", "DIST_EPS", "kl_soft", "dml_losses", "safe_distance", "pairwise_distances",
           "target_bank", "stack_targets", "prototype_regularizer", "logit_regularizer"]
