"""Class-wise representations shared by the prototype family of HtFL methods.

Building blocks of FedGH (Yi et al., ACM MM 2023), FedProto (Tan et al., AAAI 2022), FedTGP
(Zhang et al., AAAI 2024) and FD (Jeong et al., 2018), written once:

* :func:`class_sums` / :func:`class_averages` -- running per-class sums (O(n), one pass) and
  the per-class averages of representations: FedGH's *local averaged representation* (LAR, Eq. 3
  of Yi et al.), FedProto's local prototype (Eq. 4 of Tan et al.), FD's per-class mean logits;
* :func:`local_class_averages` -- the same straight from a model and a loader (no ``drop_last``:
  every sample counts, also a client smaller than one batch);
* :func:`to_payload_tensors` / :func:`from_payload` -- the wire format ``<prefix>values (S, r)
  float32`` + ``<prefix>labels (S,) int32``: exactly ``(S + S*r) x 32`` bits of tensor data for
  S classes held and r-dimensional vectors (FedGH Sec. 4.3); :func:`check_class_upload` checks a
  received one (the server's side of the wire);
* :func:`safe_distance` / :func:`pairwise_distances` (defined in :mod:`rafl.federation.losses`,
  re-exported here) -- Euclidean distances whose gradient is finite at zero distance;
* :func:`adaptive_margin` -- FedTGP's adaptive margin delta(t) (Zhang et al., server side);
* :func:`nearest_prototype` -- prototype-based inference (FedProto Sec. 4.3; FedTGP).

Prototype dictionaries are always keyed by plain Python ``int`` class ids, never by tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.federation.losses import DIST_EPS, pairwise_distances, safe_distance, stack_targets, target_bank
from rafl.federation.training import deployed_statistics, evaluate_accuracy, hits
from rafl.models.split import features_then_head
from rafl.models.zoo import HeteroModel
from rafl.supernet.model import Subnet

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------- per-class averages
def class_sums(features: torch.Tensor, labels: torch.Tensor, n_classes: int,
               sums: torch.Tensor | None = None, counts: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one batch into running per-class sums (the O(n) pass of FedGH, Yi et al. Sec. 4.2).

    Args:
        features: (B, r) float representations (or logits).
        labels: (B,) int64 class ids in ``[0, n_classes)``.
        n_classes: number of classes K.
        sums / counts: the running ``(K, r)`` float64 sums and ``(K,)`` int64 counts so far, or
            None to start new ones.

    Returns:
        ``(sums (K, r) float64, counts (K,) int64)`` (updated in place when given).

    Raises:
        ValueError: a label outside ``[0, n_classes)`` or mismatched lengths.
    """
    if features.ndim != 2 or labels.ndim != 1 or len(features) != len(labels):
        raise ValueError(f"features (B, r) and labels (B,) expected, got {tuple(features.shape)} "
                         f"and {tuple(labels.shape)}")
    labels = labels.to(torch.long).cpu()
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise ValueError(f"labels must lie in [0, {n_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    feats = features.detach().to("cpu", torch.float64)
    if sums is None:
        sums = torch.zeros(n_classes, feats.shape[1], dtype=torch.float64)
    if counts is None:
        counts = torch.zeros(n_classes, dtype=torch.long)
    if len(labels):
        sums.index_add_(0, labels, feats)
        counts += torch.bincount(labels, minlength=n_classes)
    return sums, counts


def averages_from_sums(sums: torch.Tensor, counts: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{class id (int): sums[c] / counts[c] (r,) float32}`` for every class with ``counts > 0``.

    Classes a client does not hold get no entry (no division by zero, nothing uploaded for them)."""
    present = torch.nonzero(counts > 0).flatten().tolist()
    return {int(c): (sums[c] / counts[c]).to(torch.float32) for c in present}


def class_averages(features: torch.Tensor, labels: torch.Tensor, n_classes: int) -> dict[int, torch.Tensor]:
    """Per-class averages of ``features`` (N, r): FedGH's LAR ``bar R_k^s = 1/|D_k^s| sum R``
    (Yi et al., Eq. 3), FedProto's local prototype ``C_i^j`` (Tan et al., Eq. 4).

    Returns:
        ``{class id (int): (r,) float32}``, only for classes present in ``labels``.
    """
    return averages_from_sums(*class_sums(features, labels, n_classes))


class RunningClassMeans:
    """Per-class means of vectors seen a batch at a time (:func:`class_sums` in float64), e.g. the
    representations of the batches a training epoch runs anyway.

    Args:
        n_classes: K.

    ``add(vectors (B, r), labels (B,))`` adds one batch; :meth:`result` gives ``(averages
    {class: (r,) float32}, counts {class: n})`` of the classes seen (both empty before any batch).
    """

    def __init__(self, n_classes: int):
        self.n_classes = int(n_classes)
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, vectors: torch.Tensor, labels: torch.Tensor) -> None:
        self.sums, self.counts = class_sums(vectors, labels, self.n_classes, self.sums, self.counts)

    def result(self) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        if self.sums is None or self.counts is None:
            return {}, {}
        counts = self.counts
        return averages_from_sums(self.sums, counts), {int(c): int(counts[c]) for c in torch.nonzero(counts).flatten()}


@torch.no_grad()
def local_class_averages(model: nn.Module, loader: Iterable[Batch], n_classes: int, *,
                         output: str = "features", device: torch.device | str = "cpu"
                         ) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Per-class averages over a client's whole loader, in eval mode, with a running sum.

    Args:
        model: has ``features(x) -> (B, r)`` (``output="features"``) or maps ``x -> (B, K)``
            logits (``output="logits"``, FD).
        loader: yields ``(images (B, C, H, W), labels (B,))``; every batch counts (no drop_last).
        n_classes: K.
        output: ``"features"`` or ``"logits"``.
        device: where to compute.

    Returns:
        ``(averages {class: (r,) float32}, counts {class: n})``, present classes only.
    """
    was = model.training
    model.eval()
    means = RunningClassMeans(n_classes)
    for images, labels in loader:
        x = images.to(device)
        means.add(model.features(x) if output == "features" else model(x), labels)
    model.train(was)
    return means.result()


# ---------------------------------------------------------------------- wire format
def to_payload_tensors(protos: Mapping[int, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix+"values": (S, r) float32, prefix+"labels": (S,) int32}`` in ascending class order.

    The tensor data are exactly ``(S + S*r) * 4`` bytes = ``(S + S*r) x 32`` bits (FedGH Sec. 4.3).
    An empty dict gives ``(0, 0)`` / ``(0,)`` tensors."""
    keys = sorted(int(k) for k in protos)
    if keys:
        values = torch.stack([protos[k].detach().to("cpu", torch.float32).reshape(-1) for k in keys])
    else:
        values = torch.zeros(0, 0, dtype=torch.float32)
    return {prefix + "values": values, prefix + "labels": torch.tensor(keys, dtype=torch.int32)}


def from_payload(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[int, torch.Tensor]:
    """Inverse of :func:`to_payload_tensors`: ``{class id (plain int): (r,) float32}``.

    Raises:
        UserInputError: the two tensors are missing or their lengths differ.
    """
    try:
        values, labels = tensors[prefix + "values"], tensors[prefix + "labels"]
    except KeyError:
        raise UserInputError(f"payload lacks {prefix}values / {prefix}labels", field=prefix) from None
    if len(values) != len(labels):
        raise UserInputError(f"{len(values)} vectors but {len(labels)} labels", field=prefix + "labels")
    return {int(c): values[i].to(torch.float32) for i, c in enumerate(labels.tolist())}


def check_class_upload(tensors: Mapping[str, torch.Tensor], prefix: str, *, n_classes: int,
                       dim: int | None = None, counts: bool = False) -> None:
    """Check a client's per-class upload (LARs, prototypes, mean logits) before the server uses it.

    The engine has already checked finiteness; this checks the structure that shapes alone do not
    fix, since S (classes held) differs per client: exactly ``<prefix>values (S, dim)``,
    ``<prefix>labels (S,)`` of integer dtype with distinct class ids in ``0..n_classes-1``, and
    with ``counts`` also ``<prefix>counts (S,)`` of positive integers (FedProto's Eq. 6 weights).
    A malformed upload (a Flower node running another version, a hand-made payload) would otherwise
    be merged silently (a repeated class id), crash the server mid-round (a class id >= K is an
    index error in the header's cross-entropy) or add a class the run does not have.

    Args:
        tensors: the upload's tensors.
        prefix: the wire prefix (``"lar."``, ``"proto."``, ``"logit."``).
        n_classes: K.
        dim: the vector width r the server expects, or None (any).
        counts: whether ``<prefix>counts`` is part of the upload.

    Raises:
        UserInputError: naming the tensor (``field``) and what is allowed; the caller adds the sender.
    """
    names = [prefix + "values", prefix + "labels"] + ([prefix + "counts"] if counts else [])
    missing = [n for n in names if n not in tensors]
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise UserInputError(f"has tensors {sorted(tensors)}; allowed: exactly {names}", field=prefix)
    values, labels = tensors[prefix + "values"], tensors[prefix + "labels"]
    if labels.ndim != 1 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UserInputError(f"is a {labels.dtype} tensor of shape {list(labels.shape)}; allowed: a 1-D "
                             "integer tensor of class ids", field=prefix + "labels")
    n = len(labels)
    width = "r" if dim is None else str(dim)
    if values.ndim != 2 or values.shape[0] != n or (n and dim is not None and values.shape[1] != dim):
        raise UserInputError(f"has shape {list(values.shape)}; allowed: [{n}, {width}] (one vector per class id "
                             f"in {prefix}labels)", field=prefix + "values")
    ids = [int(c) for c in labels.tolist()]
    outside = sorted({c for c in ids if not 0 <= c < n_classes})
    if outside:
        raise UserInputError(f"has class id(s) {outside[:5]}; allowed: 0..{n_classes - 1}", field=prefix + "labels")
    if len(set(ids)) != n:
        repeated = sorted({c for c in ids if ids.count(c) > 1})
        raise UserInputError(f"repeats class id(s) {repeated[:5]}; allowed: each class at most once",
                             field=prefix + "labels")
    if counts:
        c = tensors[prefix + "counts"]
        if (c.shape != (n,) or c.is_floating_point() or c.is_complex() or c.dtype == torch.bool
                or bool((c <= 0).any())):
            raise UserInputError(f"is a {c.dtype} tensor of shape {list(c.shape)} with values "
                                 f"{c.flatten()[:5].tolist()}; allowed: [{n}] positive integers (samples per class)",
                                 field=prefix + "counts")


def payload_tensor_bits(n_classes_held: int, dim: int) -> int:
    """FedGH's upload size formula ``(S + S*r) x 32`` bits (Yi et al., Sec. 4.3)."""
    return (n_classes_held + n_classes_held * dim) * 32


# ---------------------------------------------------------------------- distances


def adaptive_margin(protos: Mapping[int, torch.Tensor], tau: float = 100.0) -> float:
    """FedTGP's adaptive margin ``delta(t)`` (Zhang et al., AAAI 2024, "Adaptive-margin-enhanced
    contrastive learning"; HtFLlib ``servertgp.py`` computes the same quantity).

    ``delta = min(max_c min_{c' != c} ||P_c - P_c'||_2, tau)`` over the classes ``c`` that have an
    averaged client prototype ``P_c`` this round. Fewer than two classes: there is no inter-class
    distance, and the margin is 0.

    Args:
        protos: ``{class id: (r,) averaged client prototype}``.
        tau: the margin threshold (paper: 100).

    Returns:
        the margin (float, >= 0).
    """
    keys = sorted(protos)
    if len(keys) < 2:
        return 0.0
    p = torch.stack([protos[k].detach().to(torch.float64) for k in keys])
    d = pairwise_distances(p, p)
    d.fill_diagonal_(float("inf"))
    return float(min(float(d.min(1).values.max()), float(tau)))


def nearest_prototype(features: torch.Tensor, protos: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Prototype-based prediction: the class whose prototype is nearest (Euclidean).

    Args:
        features: (B, r).
        protos: ``{class id: (r,)}`` (at least one).

    Returns:
        (B,) int64 class ids.
    """
    keys = sorted(protos)
    bank = torch.stack([protos[k].to(features.device, features.dtype) for k in keys])
    idx = pairwise_distances(features, bank).argmin(1)
    return torch.tensor(keys, dtype=torch.long, device=features.device)[idx]


@torch.no_grad()
def evaluate_prototype_accuracy(model: nn.Module, loader: Iterable[Batch], protos: Mapping[int, torch.Tensor], *,
                                device: torch.device | str = "cpu") -> tuple[int, int]:
    """``(correct, total)`` of nearest-prototype inference on ``model.features`` (eval mode).
    With no prototypes (no round has aggregated any yet, e.g. every client failed) the accuracy is
    not measured: ``(0, 0)``, which the engine's summary leaves out (no ``proto.acc_*`` that round)
    rather than report 0."""
    if not protos:
        return 0, 0
    deployed_statistics(model)
    was = model.training
    model.eval()
    correct = total = 0
    for images, labels in loader:
        pred = nearest_prototype(model.features(images.to(device)), protos).cpu()
        correct += int((pred == labels).sum())
        total += int(labels.numel())
    model.train(was)
    return correct, total


def forward_is_head_of_features(model: nn.Module) -> bool:
    """Whether ``model(x)`` is by definition ``model.head(model.features(x))``: rafl's supernet
    subnets, the model-group members and plug-ins without a ``forward`` of their own. Then one
    ``features`` pass gives both the head's and the prototypes' predictions, bit for bit."""
    known = (Subnet.forward, HeteroModel.forward, features_then_head)
    bound = model.__dict__.get("forward")  # a plug-in's forward bound to the instance
    forward = getattr(bound, "__func__", None) if bound is not None else type(model).forward
    return forward in known


@torch.no_grad()
def evaluate_head_and_prototypes(model: nn.Module, loader: Iterable[Batch], protos: Mapping[int, torch.Tensor], *,
                                 device: torch.device | str = "cpu") -> tuple[tuple[int, int], tuple[int, int]]:
    """``((correct, total) of the head, (correct, total) of nearest-prototype inference)`` in eval
    mode: :func:`~rafl.federation.training.evaluate_accuracy` and :func:`evaluate_prototype_accuracy`
    in one pass over ``loader`` (one ``features`` pass per batch feeds both) when
    :func:`forward_is_head_of_features`, else the two passes. No prototypes: ``(0, 0)`` for them."""
    if not forward_is_head_of_features(model):
        return (evaluate_accuracy(model, loader, device=device),
                evaluate_prototype_accuracy(model, loader, protos, device=device))
    deployed_statistics(model)
    was = model.training
    model.eval()
    head = proto = total = 0
    for images, labels in loader:
        feats = model.features(images.to(device))
        head += hits(model.head(feats), labels)
        if protos:
            proto += int((nearest_prototype(feats, protos).cpu() == labels).sum())
        total += int(labels.numel())
    model.train(was)
    return (head, total), ((proto, total) if protos else (0, 0))


def weighted_class_average(items: Iterable[tuple[Mapping[int, torch.Tensor], Mapping[int, int] | None]]
                           ) -> dict[int, torch.Tensor]:
    """Per-class weighted average of several clients' vectors (FedProto Eq. 6: weights = per-class
    sample counts; ``None`` counts = equal weights, as FedTGP's "averaged client prototype").

    Returns:
        ``{class id: (r,) float32}`` over the classes at least one client sent.
    """
    sums: dict[int, torch.Tensor] = {}
    weights: dict[int, float] = {}
    for protos, counts in items:
        for k, v in protos.items():
            w = float(counts[k]) if counts is not None else 1.0
            sums[int(k)] = sums.get(int(k), 0) + w * v.detach().to(torch.float64)
            weights[int(k)] = weights.get(int(k), 0.0) + w
    return {k: (sums[k] / weights[k]).to(torch.float32) for k in sorted(sums) if weights[k] > 0}


__all__ = ["check_class_upload", "class_sums", "RunningClassMeans",
           "averages_from_sums", "class_averages", "local_class_averages", "to_payload_tensors",
           "from_payload", "payload_tensor_bits", "safe_distance", "pairwise_distances", "adaptive_margin",
           "nearest_prototype", "evaluate_prototype_accuracy", "evaluate_head_and_prototypes", "forward_is_head_of_features",
           "target_bank", "stack_targets", "weighted_class_average",
           "DIST_EPS"]
