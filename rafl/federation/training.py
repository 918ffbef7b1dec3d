"""Shared local-training building blocks, written once and used by every FL method.

* :func:`train_ce` -- cross-entropy epochs (optionally FedProx's proximal term);
* :func:`train_regularized` -- cross-entropy plus a method's term (FedProto, FedTGP, FD: the terms
  are in :mod:`rafl.federation.losses`);
* :func:`train_mutual` -- the two-model loop of RaFL (Yu et al., Eqs. 3-6: deep mutual learning with
  KL weight alpha), FML (Shen et al., 2020, Eqs. 1-2) and FedKD (Wu et al., Nature Communications
  2022, Eqs. 1-4): a private and a shared model learn from each other with per-model CE/KL weights,
  optional adaptive (loss-normalised) distillation and a hidden representation loss;
* :func:`recalibrate_local_bn` -- BN statistics re-estimated on a client's data after local training;
* :func:`train_sgd` -- plain SGD epochs on server-held data (FedGH's header, FedTGP's prototypes);
* :func:`distill_kl` -- KL distillation of a student into given soft targets (RaFL Eq. 9, FedDF);
* :func:`predict_logits` -- logits of a model on a tensor of images, batched;
* :func:`evaluate_accuracy` -- ``(correct, total)`` on a loader (every scoring helper first calls
  :func:`deployed_statistics`: the run's ``train.bn_statistics``, :mod:`rafl.federation.bn_statistics`);
* :func:`extract_representations` -- ``(features (N, D), labels (N,))`` from ``model.features``
  (FedGH's LARs, FedProto/FedTGP prototypes).

Conventions: a *loader* yields ``(images (B, C, H, W) float32, labels (B,) int64)``; every function
moves batches to ``device`` and leaves the model in the mode it found it in only for the eval
helpers (training helpers leave it in train mode). Losses are batch means. Temperatures follow
Hinton et al. ("Distilling the Knowledge in a Neural Network", 2015): soft targets at temperature
``T`` and the KL term multiplied by ``T**2`` so its gradient scale does not depend on ``T``.
Loaders keep ``drop_last=False`` and no sample is left out: a trailing 1-sample mini-batch is merged
into the previous one (:func:`no_singleton_batches`), since train-mode BatchNorm cannot normalize
one sample whose feature map is 1x1 (and a batch of 2-3 samples there diverges).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rafl.errors import DivergedError
from rafl.federation.events import report
from rafl.federation.losses import Regularizer, kl_soft
from rafl.supernet.model import recalibrate_bn

Batch = tuple[torch.Tensor, torch.Tensor]


#: A mini-batch smaller than this joins the one before it (see :func:`no_singleton_batches`).
MIN_BATCH = 8


def no_singleton_batches(loader: Iterable[Batch], min_size: int = MIN_BATCH) -> Iterable[Batch]:
    """The batches of ``loader``, except that a batch of fewer than ``min_size`` samples that is
    also smaller than the batch before it (in practice the last one of an epoch) is merged into
    that batch; a client whose whole split is a single sample gets it twice in its one batch.

    Train-mode BatchNorm cannot normalize one value per channel (a 1-sample batch whose feature map
    is 1x1, as in the last stages of OFA subnets and small-image networks), and a batch of 2-3
    samples there gives near-zero variances whose gradients blow up: on the default digits run a
    client with 34 samples (batches of 32 + 2) diverged. Merging keeps every sample (no
    ``drop_last``); the CE mean of a duplicated single sample equals its own loss."""
    held: Batch | None = None
    for images, labels in loader:
        if held is not None and len(labels) < min(min_size, len(held[1])):
            held = (torch.cat([held[0], images]), torch.cat([held[1], labels]))
            continue
        if held is not None:
            yield held
        held = (images, labels)
    if held is not None:
        if len(held[1]) == 1:
            held = (held[0].repeat(2, *([1] * (held[0].ndim - 1))), held[1].repeat(2))
        yield held


def loader_size(loader: Iterable[Batch]) -> int | None:
    """The number of samples behind ``loader`` (``len(loader.dataset)``), or None if unknown."""
    try:
        return len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return None


def train_mode(model: nn.Module, loader: Iterable[Batch]) -> nn.Module:
    """``model.train()``, except that its BatchNorm layers stay in eval mode (running statistics
    used and kept) when ``loader`` holds a single sample.

    One sample has no variance: on the 1x1 feature maps of the last stages the batch variance is
    0, train mode maps the sample to the BN bias whatever its input, and the running variance
    heads to 0, so in eval mode tiny train/eval differences upstream are divided by sqrt(eps)
    in every such layer. A ShuffleNetV2 client holding one CIFAR-10 image uploaded NaN logits in
    FD's round 2 that way. With frozen statistics, training and evaluation compute the same
    function. Returns ``model``."""
    model.train()
    if loader_size(loader) == 1:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return model


def check_finite_loss(loss: torch.Tensor, *, what: str = "local training", field: str = "algorithm.lr",
                      also: str | None = None) -> None:
    """Stop training whose loss became NaN or Inf (a diverged model would otherwise train on
    silently, and a method without an upload to validate, e.g. Standalone, reports the accuracy of
    NaN weights). The engine adds which client and model.

    Args:
        loss: the step's loss (any shape).
        what / field: the training that diverged and the key to blame (its learning rate, or a
            regularizer weight the user raised: :func:`rafl.federation.algorithms._common.divergence_keys`).
        also: another key that may be the cause, named in the message (None: the learning rate
            is ``field``).

    Raises:
        DivergedError: (a UserInputError) naming ``field`` (the usual cause) and what to try.
    """
    if not bool(torch.isfinite(loss.detach()).all()):
        smaller = "learning rate" if also is None else f"value of it or of {also}"
        raise DivergedError(f"{what} diverged (loss {float(loss.detach().sum())}); allowed: a smaller "
                             f"{smaller}, or a model whose features stay finite", field=field)


def check_finite_params(model: nn.Module, *, what: str, field: str) -> None:
    """Stop when training left NaN/Inf weights in ``model`` although each loss was finite (a
    learning rate so large that one step overflows the weights).

    Raises:
        DivergedError: (a UserInputError) naming ``field`` (the learning rate to lower).
    """
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise DivergedError(f"{what} diverged (NaN/Inf weights); allowed: a smaller learning rate", field=field)


def train_sgd(model: nn.Module, batches: Callable[[], Iterable[Any]], loss_of: Callable[[Any], torch.Tensor], *,
              epochs: int, lr: float, max_grad_norm: float = 0.0, what: str, field: str) -> list[list[float]]:
    """Plain SGD (``torch.optim.SGD``: no momentum, no weight decay) on ``model`` for ``epochs``
    passes: per batch of ``batches()`` (called once per epoch) the loss ``loss_of(batch)``,
    backward, the gradient clipped to L2 norm ``max_grad_norm`` (0 = no clipping;
    ``torch.nn.utils.clip_grad_norm_``), a step. The server-side training of FedGH's global header
    (Yi et al. 2023, Algorithm 1) and of FedTGP's prototype network (Zhang et al. 2024, Eq. 5);
    the module's mode is the caller's.

    Returns:
        per epoch, the loss of every step (floats, in order).

    Raises:
        UserInputError: a NaN/Inf loss, or NaN/Inf weights after training, as ``what`` diverging
            (naming ``field``, the learning rate to lower).
    """
    opt = torch.optim.SGD(model.parameters(), lr=float(lr))
    history: list[list[float]] = []
    for _ in range(int(epochs)):
        losses: list[float] = []
        for batch in batches():
            loss = loss_of(batch)
            check_finite_loss(loss, what=what, field=field)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(max_grad_norm))
            opt.step()
            losses.append(float(loss.detach()))
        history.append(losses)
    check_finite_params(model, what=what, field=field)
    return history


@dataclass
class TrainStats:
    """What a local training call did.

    Attributes:
        loss: mean training loss over the steps (0.0 when no step ran).
        steps: number of optimizer steps (FedNova's tau).
        samples: number of training samples seen (summed over epochs).
        correct: training samples classified correctly (on the fly, before each step).
    """

    loss: float = 0.0
    steps: int = 0
    samples: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else 0.0


def _proximal(model: nn.Module, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``sum ||w - w_ref||^2`` over the model's trainable parameters (FedProx, Li et al. 2020, Eq. 2)."""
    total = torch.zeros(())
    for name, p in model.named_parameters():
        if p.requires_grad and name in reference:
            total = total + (p - reference[name].to(p.device)).pow(2).sum()
    return total


def train_ce(model: nn.Module, loader: Iterable[Batch], optimizer: torch.optim.Optimizer, *,
             epochs: int = 1, device: torch.device | str = "cpu", prox_mu: float = 0.0,
             prox_reference: Mapping[str, torch.Tensor] | None = None,
             max_steps: int | None = None,
             extra: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             bn_recalibration: bool = True,
             diverged: tuple[str, str | None] = ("algorithm.lr", None),
             last_epoch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> TrainStats:
    """Cross-entropy training for ``epochs`` passes over ``loader``, plus optional terms.

    With ``prox_mu > 0`` adds FedProx's proximal term ``mu/2 * ||w - w_global||^2`` (Li et al.,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020, Eq. 2) against
    ``prox_reference`` (a ``named_parameters`` mapping of the global model). With ``extra`` the
    model is run as ``head(features(x))`` and ``extra(features (B, D), logits (B, K), labels (B,))``
    is added to the loss (the prototype / logit regularizers of FedProto, FedTGP, FD:
    :mod:`rafl.federation.losses`).

    Args:
        model: maps (B, C, H, W) -> (B, K) logits (with ``extra``: has ``features`` and ``head``).
        loader: yields (images, labels).
        optimizer: over ``model``'s parameters.
        epochs: passes over the loader (>= 0).
        device: where to compute.
        prox_mu: FedProx mu (0 = plain CE).
        prox_reference: required when ``prox_mu > 0``.
        max_steps: stop after this many optimizer steps (None = no limit).
        extra: a regularizer on (features, logits, labels), or None.
        bn_recalibration: end with :func:`recalibrate_local_bn` on ``loader`` (after at least one step).
        diverged: ``(field, also)`` of :func:`check_finite_loss` when the loss turns NaN/Inf.
        last_epoch: called with ``(features (B, D), logits (B, K), labels (B,))`` of every batch
            of the last epoch, detached, before that batch's step (needs ``extra``): what the
            training pass saw, e.g. to average per class without another pass over the data.

    Returns:
        :class:`TrainStats` (``steps`` is FedNova's local step count tau; ``loss`` the mean total loss).

    Raises:
        ValueError: ``prox_mu > 0`` without ``prox_reference``.
    """
    if prox_mu > 0 and prox_reference is None:
        raise ValueError("prox_mu > 0 needs prox_reference")
    if last_epoch is not None and extra is None:
        raise ValueError("last_epoch needs extra (the model run as head(features(x)))")
    train_mode(model, loader)
    stats = TrainStats()
    loss_sum = 0.0
    batches = len(loader) if hasattr(loader, "__len__") else None
    for epoch in range(int(epochs)):
        report("epoch", epoch=epoch + 1, epochs=int(epochs))
        for b, (images, labels) in enumerate(no_singleton_batches(loader)):
            if max_steps is not None and stats.steps >= max_steps:
                break
            report("batch", batch=b + 1, batches=batches, epoch=epoch + 1, epochs=int(epochs))
            images, labels = images.to(device), labels.to(device)
            if extra is None:
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            else:
                feats = model.features(images)
                logits = model.head(feats)
                loss = F.cross_entropy(logits, labels) + extra(feats, logits, labels)
                if last_epoch is not None and epoch == int(epochs) - 1:
                    last_epoch(feats.detach(), logits.detach(), labels)
            if prox_mu > 0:
                loss = loss + 0.5 * prox_mu * _proximal(model, prox_reference)
            check_finite_loss(loss, field=diverged[0], also=diverged[1])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats.steps += 1
            stats.samples += int(labels.numel())
            stats.correct += int((logits.detach().argmax(1) == labels).sum())
            loss_sum += float(loss.detach())
    stats.loss = loss_sum / stats.steps if stats.steps else 0.0
    if bn_recalibration and stats.steps:
        recalibrate_local_bn(model, loader, device=device)
    return stats


def recalibrate_local_bn(model: nn.Module, loader: Iterable[Batch], *, device: torch.device | str = "cpu") -> int:
    """BN recalibration at the end of local training (:func:`rafl.supernet.model.recalibrate_bn`,
    OFA's ``set_running_statistics``, Cai et al. ICLR 2020, Sec. 3.2): the running statistics of
    every BatchNorm layer re-estimated for the model's current weights by one no-grad pass over the
    whole of the client's ``loader`` in train mode (batches through :func:`no_singleton_batches`:
    BatchNorm needs >= 2 values per channel), in the caller's random stream.

    Why: the running statistics are an exponential average over the last few batches of training,
    taken while the weights moved. On small clients they can be far from the data's statistics
    for the final weights: a ShuffleNetV2 client on CIFAR-10 had eval-mode representations of
    norm 817 vs 40 in train mode, and its prototypes then made FedProto diverge to NaN on another
    client. After recalibration the norm was 40.

    Only models that stay on the client are recalibrated (the specialized/private model; in
    :func:`train_ce` unless ``bn_recalibration=False``, which FedAvg-style methods pass). A model
    whose BN statistics the server averages (RaFL's knowledge network, FML's meme model, FedAvg's
    global model) keeps its running estimates: averaging purely local statistics measured worse
    (RaFL knowledge network on the CIFAR-10 subset of ``bench/federate_rafl.py``, 3 seeds: 0.23
    vs 0.29 mean accuracy), since an average of within-client variances misses the variance
    between clients.

    Args:
        model: any module; models without BatchNorm are left untouched.
        loader: yields ``(images (B, C, H, W), labels)``.
        device: where to compute.

    Returns:
        the number of batches used (0: no BatchNorm, no data or a single sample -- the statistics
        are then unchanged).
    """
    if loader_size(loader) == 1:  # one sample: no statistics to estimate (see train_mode)
        return 0
    return recalibrate_bn(model, no_singleton_batches(loader), n_batches=None, device=device, fork_rng=False)


@torch.no_grad()
def predict_logits(model: nn.Module, images: torch.Tensor, *, batch_size: int = 256,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Logits (N, K) of ``model`` in eval mode on ``images`` (N, C, H, W), on CPU."""
    was_training = model.training
    model.eval()
    out = [model(images[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 0)


def distill_kl(student: nn.Module, images: torch.Tensor, teacher_logits: torch.Tensor,
               optimizer: torch.optim.Optimizer, *, temperature: float = 1.0, epochs: int = 1,
               batch_size: int = 64, generator: torch.Generator | None = None,
               device: torch.device | str = "cpu") -> TrainStats:
    """Distil soft targets into ``student`` with KL (RaFL Eq. 9; FedDF, Lin et al. NeurIPS 2020).

    Minimizes ``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` over shuffled mini-batches of
    the unlabeled ``images``.

    Args:
        student: (B, C, H, W) -> (B, K).
        images: (N, C, H, W) unlabeled images (the server's public pool).
        teacher_logits: (N, K) targets (e.g. the ensemble average of RaFL Eq. 8).
        optimizer: over the student's parameters.
        temperature, epochs, batch_size: as named.
        generator: torch Generator for the shuffling (deterministic runs).
        device: where to compute.

    Returns:
        :class:`TrainStats` (``correct`` counts agreement with the teacher's argmax).

    Raises:
        ValueError: ``images`` and ``teacher_logits`` differ in length.
    """
    if len(images) != len(teacher_logits):
        raise ValueError(f"{len(images)} images but {len(teacher_logits)} teacher logits")
    student.train()
    stats = TrainStats()
    loss_sum = 0.0
    n = len(images)
    for _ in range(int(epochs)):
        order = torch.randperm(n, generator=generator)
        starts = list(range(0, n, batch_size))
        if len(starts) > 1 and n - starts[-1] < MIN_BATCH:
            starts.pop()  # a small trailing batch joins the previous one (BatchNorm)
        for j, i in enumerate(starts):
            idx = order[i:starts[j + 1] if j + 1 < len(starts) else n]
            if len(idx) < 2:
                continue  # a pool of one image cannot be distilled with train-mode BatchNorm
            x, t = images[idx].to(device), teacher_logits[idx].to(device)
            logits = student(x)
            loss = kl_soft(logits, t, temperature)
            check_finite_loss(loss, what="server distillation", field="algorithm.distill_lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats.steps += 1
            stats.samples += len(idx)
            stats.correct += int((logits.detach().argmax(1) == t.argmax(1)).sum())
            loss_sum += float(loss.detach())
    stats.loss = loss_sum / stats.steps if stats.steps else 0.0
    return stats


def hits(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """How many rows of ``logits`` (B, K) predict ``labels`` (B,) by their argmax and are all finite:
    the argmax of a NaN row is an arbitrary class (torch gives the first NaN's index), so a model
    that outputs NaN would otherwise score the share of that class."""
    right = (logits.argmax(1) == labels.to(logits.device)) & torch.isfinite(logits).all(1)
    return int(right.sum())


#: what a deployed model's BatchNorm statistics become before it is scored: set by
#: :func:`rafl.federation.bn_statistics.deployment` around a client's evaluation (None: as the method
#: left them). Every scoring helper (:func:`evaluate_accuracy`, :func:`evaluate_header_rules`,
#: :func:`rafl.federation.prototypes.evaluate_prototype_accuracy`) calls :func:`deployed_statistics`.
DEPLOYED_STATISTICS: ContextVar[Callable[[nn.Module], None] | None] = ContextVar("rafl_deployed_statistics",
                                                                                  default=None)


def deployed_statistics(model: nn.Module) -> None:
    """Apply the deployment's BatchNorm statistics policy to ``model`` (in place) when one is set
    (:data:`DEPLOYED_STATISTICS`); a model already handled in this evaluation is left as it is."""
    apply = DEPLOYED_STATISTICS.get()
    if apply is not None:
        apply(model)


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, loader: Iterable[Batch], *,
                      device: torch.device | str = "cpu") -> tuple[int, int]:
    """``(correct, total)`` of ``model`` (eval mode; logits (B, K)) over ``loader``; the model's mode
    is restored. A sample whose logits are not all finite is never correct (:func:`hits`)."""
    deployed_statistics(model)
    was_training = model.training
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += hits(model(images.to(device)), labels)
        total += int(labels.numel())
    model.train(was_training)
    return correct, total


@torch.no_grad()
def evaluate_header_rules(model: nn.Module, loader: Iterable[Batch],
                          rules: Mapping[str, tuple[nn.Module, torch.Tensor | None]], *,
                          device: torch.device | str = "cpu") -> dict[str, tuple[int, int]]:
    """``{name: (correct, total)}`` of several headers on one feature extractor: per batch the
    representation ``model.features(x)`` (B, D) is computed once and each rule predicts
    ``argmax(header(features) + offset)`` (e.g. FedGH's global header, the same with the client's
    log label prior, and the header the client fine-tuned in local training).

    Args:
        model: has ``features(x) -> (B, D)``; run in eval mode, its mode is restored.
        loader: ``(images, labels)`` batches.
        rules: name -> ``(header (B, D) -> (B, K), offset (K,) or None)``; headers run in eval mode
            and get their modes restored too.
    """
    deployed_statistics(model)
    modules = [model, *(h for h, _ in rules.values())]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    correct = dict.fromkeys(rules, 0)
    total = 0
    for images, labels in loader:
        feats = model.features(images.to(device))
        for name, (header, offset) in rules.items():
            logits = header(feats)
            if offset is not None:
                logits = logits + offset.to(logits.device)
            correct[name] += hits(logits, labels)
        total += int(labels.numel())
    for m, was_training in zip(modules, modes):
        m.train(was_training)
    return {name: (c, total) for name, c in correct.items()}


@torch.no_grad()
def extract_representations(model: nn.Module, loader: Iterable[Batch], *,
                            device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Representations from ``model.features`` (eval mode): ``(features (N, D) float32, labels (N,) int64)``.

    ``model`` must have ``features(x) -> (B, D)`` (every rafl Subnet does; D is the same for all
    subnets of a supernet), as FedGH's LARs and FedProto/FedTGP's prototypes need.
    """
    was_training = model.training
    model.eval()
    feats, labs = [], []
    for images, labels in loader:
        feats.append(model.features(images.to(device)).float().cpu())
        labs.append(labels.cpu())
    model.train(was_training)
    if not feats:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.cat(feats), torch.cat(labs)


def class_means(features: torch.Tensor, labels: torch.Tensor, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean of ``features`` (N, D): ``(means (n_classes, D), counts (n_classes,) int64)``.

    Classes without samples get a zero row and count 0 (FedGH's LAR, Yi et al. Eq. 3; FedProto's
    local prototype, Tan et al. AAAI 2022, Eq. 4)."""
    d = features.shape[1] if features.ndim == 2 else 0
    sums = torch.zeros(n_classes, d, dtype=features.dtype)
    counts = torch.bincount(labels, minlength=n_classes)[:n_classes]
    if len(labels):
        sums.index_add_(0, labels, features)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(features.dtype)
    return means, counts


def make_optimizer(model: nn.Module, name: str = "sgd", *, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The local optimizer: ``"sgd"`` (with momentum) or ``"adam"``, at learning rate ``lr`` (the
    method's hyperparameter; its default is :class:`rafl.federation.algorithms.hparams.LocalTraining`'s).

    Raises:
        ValueError: unknown name (configs validate this earlier with a UserInputError).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; allowed: sgd, adam")


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
    learning (Yu et al., Eqs. 3-6; :func:`~rafl.federation.losses.dml_losses`): ``ce_a = ce_b = 1``,
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
    batches = len(loader) if hasattr(loader, "__len__") else None
    for epoch in range(int(epochs)):
        report("epoch", epoch=epoch + 1, epochs=int(epochs))
        for b, (images, labels) in enumerate(no_singleton_batches(loader)):
            report("batch", batch=b + 1, batches=batches, epoch=epoch + 1, epochs=int(epochs))
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


__all__ = ["TrainStats", "NoSingletonBatches", "train_regularized", "train_mutual", "train_ce", "train_mode",
           "loader_size", "evaluate_header_rules", "check_finite_loss", "check_finite_params", "train_sgd",
           "recalibrate_local_bn", "predict_logits", "distill_kl", "evaluate_accuracy", "DEPLOYED_STATISTICS",
           "deployed_statistics",
           "extract_representations", "class_means", "make_optimizer"]
